// Launchers for the kernel profile's test: work of each class under cuda::KernelProfile
// (backend/cuda/kernel_profile.hpp). The checks are in test_gpu_profile.cpp.
#include <exception>
#include <string>
#include <vector>

#include "profile_launchers.hpp"
#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/backend/cuda/kernel_profile.hpp"
#include "tessera/core/region.hpp"
#include "tessera/ops/ops.hpp"

namespace tessera::gpu_test {

std::vector<DeviceActivity> profiled_work_of_each_class() {
  const Tensor<bf16> a = Cuda::zeros<bf16>({256, 512}), b = Cuda::zeros<bf16>({512, 384});
  const Tensor<bf16> c = Cuda::zeros<bf16>({256, 384});
  const Tensor<float> x = Cuda::zeros<float>({1 << 16}), y = Cuda::zeros<float>({1 << 16});
  Cuda::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 0.0f, c.view());  // the plan cached, outside
  Cuda::synchronize();
  cuda::KernelProfile profile;
  Cuda::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 0.0f, c.view());
  {
    Region head(region::kLossHead);
    Cuda::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 0.0f, c.view());
  }
  {
    Region optimizer(region::kOptimizer);
    Cuda::for_each(x.numel(), ops::Scale<float>{0.5f, x.data()});
  }
  Cuda::for_each(y.numel(), ops::Axpy<float>{2.0f, x.data(), y.data()});
  (void)download<Cuda>(y);
  return profile.stop();
}

bool second_profile_refused(std::string& why) {
  cuda::KernelProfile first;
  bool refused = false;
  try {
    cuda::KernelProfile second;
  } catch (const std::exception& e) {
    refused = true;
    why = e.what();
  }
  (void)first.stop();
  return refused;
}

}  // namespace tessera::gpu_test
