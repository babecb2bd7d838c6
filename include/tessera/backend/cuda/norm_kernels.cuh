// The gradient norm's kernel (ops/norm.hpp): SquaredNormChunks, one block of
// ops::kNormLanes threads per chunk, in the lane order ops/norm.hpp defines: the CPU
// backend's sum bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/core/error.hpp"
#include "tessera/ops/norm.hpp"

namespace tessera::cuda::detail {

/// One block per chunk, thread l its lane (ops/norm.hpp): elements l, l + kNormLanes, ...
/// loaded by the warp side by side and added in turn, then the lanes added by halves in
/// shared memory, the order SquaredNormChunks' operator() follows on the CPU.
template <class T>
__global__ void __launch_bounds__(ops::kNormLanes) squared_norm_chunks_kernel(ops::SquaredNormChunks<T> f) {
  __shared__ double lane[ops::kNormLanes];
  const std::int64_t c = blockIdx.x;
  const auto [x, n] = f.chunk(c);
  const int l = static_cast<int>(threadIdx.x);
  double s = 0;
#pragma unroll 8
  for (std::int64_t i = l; i < n; i += ops::kNormLanes) s += ops::SquaredNormChunks<T>::square(x[i]);
  lane[l] = s;
  __syncthreads();
  for (int h = ops::kNormLanes / 2; h >= 1; h /= 2) {
    if (l < h) lane[l] += lane[l + h];
    __syncthreads();
  }
  if (l == 0) f.partial[c] = lane[0];
}

/// OpKernel for SquaredNormChunks: a block per chunk.
template <class T>
struct SquaredNormChunksKernel {
  static void launch(std::int64_t chunks, const ops::SquaredNormChunks<T>& f, cudaStream_t stream) {
    TESSERA_CHECK(chunks <= std::int64_t{0x7fffffff}, "SquaredNormChunks: ", chunks,
                  " chunks is past a grid's 2^31 - 1 blocks");
    squared_norm_chunks_kernel<T><<<static_cast<unsigned>(chunks), ops::kNormLanes, 0, stream>>>(f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace tessera::cuda::detail
