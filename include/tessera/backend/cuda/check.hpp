// Every CUDA runtime return code checked: TESSERA_CUDA_CHECK(expr) throws a
// tessera::Error naming the call, CUDA's error name and its text. Host C++; the only
// CUDA header it needs is the runtime's.
#pragma once

#include <cuda_runtime.h>

#include "tessera/core/error.hpp"

#define TESSERA_CUDA_CHECK(expr)                                                               \
  do {                                                                                         \
    cudaError_t tessera_status_ = (expr);                                                      \
    if (tessera_status_ != cudaSuccess)                                                        \
      ::tessera::fail(#expr, ": ", cudaGetErrorName(tessera_status_), ": ",                  \
                      cudaGetErrorString(tessera_status_));                                    \
  } while (0)
