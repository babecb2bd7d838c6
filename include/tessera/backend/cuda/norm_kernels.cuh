// The gradient norm's kernels (ops/norm.hpp): SquaredNormChunks, one block of
// ops::kNormLanes threads per chunk, and LaneSum, one block for its whole sum, each in
// the lane order ops/norm.hpp defines: the CPU backend's sums bit for bit.
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

/// LaneSum in one block, thread l its lane: x[l], x[l + kNormLanes], ... added in turn
/// (a warp's loads side by side), then the lanes by halves in shared memory. A template
/// (of F = ops::LaneSum) so that every file including this header may define it.
template <class F>
__global__ void __launch_bounds__(ops::kNormLanes) lane_sum_kernel(F f) {
  __shared__ double lane[ops::kNormLanes];
  const int l = static_cast<int>(threadIdx.x);
  double s = 0;
#pragma unroll 4
  for (std::int64_t i = l; i < f.n; i += ops::kNormLanes) s += f.x[i];
  lane[l] = s;
  __syncthreads();
  for (int h = ops::kNormLanes / 2; h >= 1; h /= 2) {
    if (l < h) lane[l] += lane[l + h];
    __syncthreads();
  }
  if (l == 0) *f.out = f.accumulate ? *f.out + lane[0] : lane[0];
}

/// OpKernel for LaneSum: one block (its one index).
struct LaneSumKernel {
  static void launch(std::int64_t, const ops::LaneSum& f, cudaStream_t stream) {
    lane_sum_kernel<ops::LaneSum><<<1, ops::kNormLanes, 0, stream>>>(f);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace tessera::cuda::detail
