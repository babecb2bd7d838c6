// RoPE's kernel (ops/rope.hpp): RopeRotate grid-stride, 256 threads a block, one thread
// per V pairs (i, i + head_dim / 2) of one head of a row. Vectors when head_dim is a
// multiple of 2 V and the rows and tables are 16-byte aligned, else the same kernel with
// scalar loads. The kernel does not restate the arithmetic: it loads a vector into
// registers and points a copy of the functor at them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/row_launch.cuh"
#include "tessera/ops/rope.hpp"

namespace tessera::cuda::detail {

/// RopeRotate over rows [0, rows): one item per W pairs (i, i + half) of one head of
/// one row, i a multiple of W. The item's inputs and its cos and sin go to registers,
/// and a copy of f describing one head of 2 W elements at position 0 rotates them.
template <class T, int W>
__global__ void __launch_bounds__(kElementwiseThreads) rope_kernel(ops::RopeRotate<T> f, std::int64_t rows) {
  using C = pointee_t<decltype(f.cos)>;
  const std::int64_t half = f.head_dim / 2, per_head = half / W, per_row = f.n_heads * per_head;
  const std::int64_t items = rows * per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  // Each array is addressed from a 16-byte aligned start (a row's head, its half, the
  // table row of its position) at element iv * W.
  for (std::int64_t item = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; item < items;
       item += stride) {
    const std::int64_t r = item / per_row, h = (item % per_row) / per_head, iv = item % per_head;
    const std::int64_t pos = f.positions(r);
    T* out = f.x + r * f.ld + h * f.head_dim;
    const T* in = f.src ? f.src + r * f.ld + h * f.head_dim : out;
    T u[2 * W], v[2 * W];
    C c[W], s[W];
    load_elements<W>(in, iv * W, u);
    load_elements<W>(in + half, iv * W, u + W);
    load_elements<W>(f.cos + pos * half, iv * W, c);
    load_elements<W>(f.sin + pos * half, iv * W, s);
    ops::RopeRotate<T> l = f;
    l.x = v;
    l.ld = 0;
    l.n_heads = 1;
    l.head_dim = 2 * W;
    l.positions = ops::RowPositions{};
    l.cos = c;
    l.sin = s;
    l.src = u;
    l(0);
    store_elements<W>(out, iv * W, v);
    store_elements<W>(out + half, iv * W, v + W);
  }
}

/// OpKernel for RopeRotate: rope_kernel over the launch's rows.
template <class T>
struct RopeKernel {
  static void launch(std::int64_t rows, const ops::RopeRotate<T>& f, cudaStream_t stream) {
    using C = pointee_t<decltype(f.cos)>;
    constexpr int V = kVectorWidth<T>;
    const bool vectors = f.head_dim % (2 * V) == 0 && (V * sizeof(C)) % 16 == 0 && rows_aligned16(f.x, f.ld) &&
                         rows_aligned16(f.src, f.ld) && aligned16(f.cos) && aligned16(f.sin);
    const int w = vectors ? V : 1;
    const std::int64_t items = rows * f.n_heads * (f.head_dim / 2 / w);
    if (items <= 0) return;
    const auto blocks = static_cast<unsigned>(
        std::min<std::int64_t>((items + kElementwiseThreads - 1) / kElementwiseThreads, 65535));
    if (vectors) rope_kernel<T, V><<<blocks, kElementwiseThreads, 0, stream>>>(f, rows);
    else rope_kernel<T, 1><<<blocks, kElementwiseThreads, 0, stream>>>(f, rows);
    TESSERA_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace tessera::cuda::detail
