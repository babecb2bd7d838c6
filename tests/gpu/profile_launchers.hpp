// Host-side declarations for the kernel profile's test (defined in profile_launchers.cpp):
// a small step of each class of work, run under cuda::KernelProfile. No CUDA header: g++
// reads it.
#pragma once

#include <string>
#include <vector>

#include "tessera/plan/measured.hpp"

namespace tessera::gpu_test {

/// Under one cuda::KernelProfile: a bf16 GEMM outside any region, a bf16 GEMM inside the
/// loss head's region, an elementwise kernel (Scale) inside the optimizer's, an Axpy
/// outside, and a download (a copy to the host); what the profile recorded.
std::vector<DeviceActivity> profiled_work_of_each_class();

/// Whether a second cuda::KernelProfile is refused while one records (and the first
/// still stops cleanly after), with the refusal's message in `why`.
bool second_profile_refused(std::string& why);

}  // namespace tessera::gpu_test
