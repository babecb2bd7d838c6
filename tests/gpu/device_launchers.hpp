// Host-side declarations of the launchers for the work the training step does on the
// device (defined in device_launchers.cu): parameter initialisation, staged uploads, the
// embedding kernels and the GEMM plan cache. The checks are in test_gpu_device.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/ops/init.hpp"

namespace tessera::gpu_test {

/// ops::InitValues<T>{out, key, kind, std, lo, hi, where} over n elements, run by
/// Cuda::for_each and downloaded. T is float, bf16 or double.
template <class T>
std::vector<T> cuda_init_values(std::int64_t n, std::uint64_t key, ops::InitKind kind, double std, double lo,
                                double hi, ops::PieceIndex where);

/// `count` uploads of `elements` int32 each (upload<Cuda> of a span), issued back to back
/// behind a kernel that keeps the device busy for a while, from one host buffer that is
/// overwritten (with -1) as soon as each upload returns; then every tensor downloaded, in
/// order. Upload u should hold u * 1000003 + i at element i.
std::vector<std::vector<std::int32_t>> cuda_back_to_back_uploads(int count, std::int64_t elements);

/// Whether an upload issued behind a kernel that keeps the device busy returned while
/// that kernel still ran (the stream was not synchronised), with the right values.
bool upload_returns_before_the_device_is_done();

/// ops::EmbeddingForward<T> on device copies of ids and table: (rows, dim) downloaded.
template <class T>
std::vector<T> cuda_embedding_forward(std::span<const std::int32_t> ids, const std::vector<T>& table,
                                      std::int64_t dim, std::int64_t lo, std::int64_t hi);

/// ops::EmbeddingBackward<T> as nn::Embedding runs it (positions grouped by
/// ops::embedding_segments, one upload) into a device copy of dtable0, downloaded.
template <class T>
std::vector<accum_t<T>> cuda_embedding_backward(std::span<const std::int32_t> ids, const std::vector<T>& dout,
                                                const std::vector<accum_t<T>>& dtable0, std::int64_t dim,
                                                std::int64_t lo, std::int64_t hi);

/// optim::SquaredNorms<Cuda, T> over device copies of `data`: each piece (offset, n)
/// added in turn, then sum(), twice (the second from the cached table). T is float or bf16.
template <class T>
std::vector<double> cuda_squared_norms(const std::vector<T>& data,
                                       const std::vector<std::pair<std::int64_t, std::int64_t>>& pieces);

/// cuda::gemm_plans_cached() and cuda::clear_gemm_plans().
std::size_t gemm_plans_cached();
void clear_gemm_plans();

}  // namespace tessera::gpu_test
