// Host-side declarations of the GPU op launchers (defined in ops_launchers.cu).
#pragma once

#include <cstdint>
#include <vector>

namespace tessera::gpu_test {
int device_count();
std::vector<float> rmsnorm_forward(const std::vector<float>& x, const std::vector<float>& w, std::int64_t rows,
                                   float eps);
std::vector<float> swiglu_forward(const std::vector<float>& a, const std::vector<float>& b);
std::vector<float> adamw_step(std::vector<float> p, const std::vector<float>& g, float lr);
}  // namespace tessera::gpu_test
