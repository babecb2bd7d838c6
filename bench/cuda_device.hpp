// The GPU a benchmark runs on, named as its rows print it. Host C++ over the CUDA runtime.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "tessera/backend/cuda/check.hpp"

namespace tessera::bench {

/// The current device's name ("NVIDIA H200").
inline std::string cuda_device_name() {
  int d = 0;
  TESSERA_CUDA_CHECK(cudaGetDevice(&d));
  cudaDeviceProp p{};
  TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&p, d));
  return p.name;
}

}  // namespace tessera::bench
