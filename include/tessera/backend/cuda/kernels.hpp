// The CUDA backend's kernels as host C++ sees them: the declarations of the three
// function templates that launch device code.
//
//   launch_op(n, f, stream)             an ops/ functor over [0, n): its own kernel
//                                       (row_kernels.cuh) or one index per thread
//                                       (launch.cuh)
//   flash_attention_forward / _backward the flash-attention kernels
//                                       (flash_attention.cuh)
//
// Everything else of the backend (memory, cuBLASLt GEMMs, the collectives' copies and
// reductions, tessera::Cuda itself: cuda.hpp) is host C++ that g++ compiles; only
// these definitions are CUDA. So a program chooses where its kernels are compiled:
//
//   - header-only, as ever: a .cu file that includes tessera/backend/cuda/cuda.cuh
//     sees the definitions, and nvcc instantiates every kernel the file launches;
//   - once per program: the trainer is C++ that includes cuda.hpp (g++ compiles it,
//     no CUDA front end parses it), and one .cu file includes cuda.cuh and instantiates
//     the kernels with explicit instantiation definitions, e.g.
//
//         template void tessera::cuda::launch_op(std::int64_t, const tessera::ops::Fill<float>&,
//                                                cudaStream_t);
//
//     A functor the trainer launches and that file leaves out is a link error naming
//     tessera::cuda::launch_op<F>. tessera's own build does this for the functors its
//     models launch (examples/instances/cuda_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tessera/backend/cuda/memory.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace tessera::cuda {

/// Calls f(i) for i in [0, n) on the device, on `stream`: F's own kernel where
/// row_kernels.cuh has one, else one index per thread. Returns once the work is issued.
template <class F>
void launch_op(std::int64_t n, const F& f, cudaStream_t stream = compute_stream());

/// Flash attention forward: o (B*T, H*hd) and lse (B, H, T) in float. T is float or bf16.
/// After a KV cache's keys (s.past > 0), `split_scratch` is a workspace of
/// ops::flash_split_scratch(s) floats.
template <class T>
void flash_attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                             TensorView<const T> v, TensorView<T> o, float* lse, cudaStream_t stream,
                             float* split_scratch = nullptr);

/// Flash attention backward: dq (B*T, H*hd) overwritten, dk and dv (B*T, KV*hd) added
/// into (pass zeros), from the forward's o and lse. `delta` is a workspace of B*H*T floats.
template <class T>
void flash_attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                              TensorView<const T> v, TensorView<const T> o, const float* lse,
                              TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv,
                              float* delta, cudaStream_t stream);

}  // namespace tessera::cuda
