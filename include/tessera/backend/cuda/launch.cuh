// The generic kernel: an ops/ functor run on a CUDA device one index per thread.
//
// The same functor structs the CPU backend loops over run here one index per thread.
// Functors whose index is a whole row (and the elementwise ones, for vector loads) have
// kernels of their own in row_kernels.cuh; cuda::launch_op there (and Cuda::for_each)
// picks that kernel where one exists and falls back to for_each below. CUDA code: a
// translation unit compiled by nvcc includes it (kernels.hpp says how host C++ reaches
// these kernels without it).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "tessera/backend/cuda/check.hpp"

namespace tessera::cuda {

namespace detail {
/// Threads per block of the per-index kernel.
inline constexpr int kForEachThreads = 256;

template <class F>
__global__ void __launch_bounds__(kForEachThreads) for_each_kernel(std::int64_t n, F f) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    f(i);
}
}  // namespace detail

/// Calls f(i) for i in [0, n) on the device, one index per thread (grid-stride): the
/// generic kernel, for any functor (cuda::launch_op lowers the ones that have their own).
template <class F>
void for_each(std::int64_t n, const F& f, cudaStream_t stream = nullptr) {
  if (n <= 0) return;
  constexpr int threads = detail::kForEachThreads;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
  detail::for_each_kernel<<<blocks, threads, 0, stream>>>(n, f);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tessera::cuda
