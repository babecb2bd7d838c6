// AdamW over every tensor in one launch (ops/adamw.hpp): AdamWMultiStep, one block of 256
// threads per kAdamWBlock indices, thread l indices l, l + 256, ...: its 8 elements
// loaded, then updated.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/core/error.hpp"
#include "tessera/ops/adamw.hpp"

namespace tessera::cuda::detail {

inline constexpr int kAdamWThreads = 256;

/// One block per kAdamWBlock indices (all one tensor's), thread l the indices l, l + 256,
/// ... of it: a warp's loads side by side, and each thread's 8 elements all loaded before
/// any is updated and stored, so 8 loads of each array are in flight per thread where
/// the per-index kernel has one (its stores may alias its next loads, so it waits). The
/// arithmetic is the functor's own (load, update_and_store).
template <class T, class M>
__global__ void __launch_bounds__(kAdamWThreads) adamw_multi_kernel(ops::AdamWMultiStep<T, M> f) {
  constexpr int kPerThread = static_cast<int>(ops::kAdamWBlock / kAdamWThreads);
  using Element = typename ops::AdamWMultiStep<T, M>::Element;
  ops::AdamWScalars<typename ops::AdamWMultiStep<T, M>::A> sc;
  if (!f.scalars(sc)) return;  // a NaN gradient scale: the step changes nothing
  const std::int64_t b = blockIdx.x;
  const ops::AdamWTensor<T, M> t = f.tensors[f.block_tensor[b]];
  const std::int64_t j0 = b * ops::kAdamWBlock - t.begin + threadIdx.x;
  Element e[kPerThread] = {};
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (const std::int64_t j = j0 + k * kAdamWThreads; j < t.numel) e[k] = f.load(t, j);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k)
    if (const std::int64_t j = j0 + k * kAdamWThreads; j < t.numel) f.update_and_store(t, j, e[k], sc);
}

/// OpKernel for AdamWMultiStep: a block per block of indices.
template <class T, class M>
struct AdamWMultiKernel {
  static void launch(std::int64_t n, const ops::AdamWMultiStep<T, M>& f, cudaStream_t stream) {
    static_assert(ops::kAdamWBlock % kAdamWThreads == 0);
    TESSERA_CHECK(n % ops::kAdamWBlock == 0, "AdamWMultiStep: ", n, " indices is not whole blocks of ",
                  ops::kAdamWBlock);
    const std::int64_t blocks = n / ops::kAdamWBlock;
    TESSERA_CHECK(blocks <= std::int64_t{0x7fffffff}, "AdamWMultiStep: ", blocks,
                  " blocks is past a grid's 2^31 - 1");
    adamw_multi_kernel<T, M><<<static_cast<unsigned>(blocks), kAdamWThreads, 0, stream>>>(f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace tessera::cuda::detail
