// Launchers for test_gpu_device.cpp: parameter initialisation, staged uploads, the
// embedding kernels, the gradient norm and the GEMM plan cache, on the CUDA backend.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "device_launchers.hpp"
#include "tessera/backend/cuda/cuda.cuh"
#include "tessera/ops/ops.hpp"
#include "tessera/optim/clip.hpp"

namespace tessera::gpu_test {

namespace {

/// Keeps one thread of the device busy for about `cycles` SM clocks.
__global__ void busy_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

/// About 0.1 s on the GPUs the suite runs on (1.5 to 2 GHz).
constexpr long long kBusyCycles = 200'000'000;

void keep_device_busy() {
  busy_kernel<<<1, 1, 0, Cuda::stream()>>>(kBusyCycles);
  TESSERA_CUDA_CHECK(cudaGetLastError());
}

template <class T>
std::vector<T> to_vector(const Tensor<T>& host) {
  return std::vector<T>(host.data(), host.data() + host.numel());
}

}  // namespace

template <class T>
std::vector<T> cuda_init_values(std::int64_t n, std::uint64_t key, ops::InitKind kind, double std, double lo,
                                double hi, ops::PieceIndex where) {
  const Tensor<T> out = Cuda::empty<T>(Shape{n});
  Cuda::for_each(n, ops::InitValues<T>{out.data(), key, kind, std, lo, hi, where});
  return to_vector(download<Cuda>(out));
}

template std::vector<float> cuda_init_values(std::int64_t, std::uint64_t, ops::InitKind, double, double, double,
                                             ops::PieceIndex);
template std::vector<bf16> cuda_init_values(std::int64_t, std::uint64_t, ops::InitKind, double, double, double,
                                            ops::PieceIndex);
template std::vector<double> cuda_init_values(std::int64_t, std::uint64_t, ops::InitKind, double, double, double,
                                              ops::PieceIndex);

template <class T>
std::vector<double> cuda_squared_norms(const std::vector<T>& data,
                                       const std::vector<std::pair<std::int64_t, std::int64_t>>& pieces) {
  const Tensor<T> d = upload<Cuda>(std::span<const T>(data));
  optim::SquaredNorms<Cuda, T> norms;
  std::vector<double> out;
  for (int round = 0; round < 2; ++round) {
    for (const auto& [offset, n] : pieces) norms.add(d.data() + offset, n);
    out.push_back(norms.sum());
  }
  return out;
}

template std::vector<double> cuda_squared_norms(const std::vector<float>&,
                                                const std::vector<std::pair<std::int64_t, std::int64_t>>&);
template std::vector<double> cuda_squared_norms(const std::vector<bf16>&,
                                                const std::vector<std::pair<std::int64_t, std::int64_t>>&);

std::vector<std::vector<std::int32_t>> cuda_back_to_back_uploads(int count, std::int64_t elements) {
  std::vector<std::int32_t> host(static_cast<std::size_t>(elements));
  std::vector<Tensor<std::int32_t>> uploaded;
  keep_device_busy();  // the host runs ahead: the ring wraps while its copies wait
  for (int u = 0; u < count; ++u) {
    for (std::int64_t i = 0; i < elements; ++i)
      host[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(u * 1000003 + i);
    uploaded.push_back(upload<Cuda>(std::span<const std::int32_t>(host)));
    std::fill(host.begin(), host.end(), -1);  // the caller may reuse its source at once
  }
  std::vector<std::vector<std::int32_t>> out;
  for (const auto& t : uploaded) out.push_back(to_vector(download<Cuda>(t)));
  return out;
}

bool upload_returns_before_the_device_is_done() {
  std::vector<std::int32_t> host(1000, 7);
  // Warm up: the staging ring and a cached block of this size exist before the timed
  // upload (allocating pinned or device memory may synchronise).
  (void)upload<Cuda>(std::span<const std::int32_t>(host));
  Cuda::synchronize();
  keep_device_busy();
  const Tensor<std::int32_t> t = upload<Cuda>(std::span<const std::int32_t>(host));
  const cudaError_t busy = cudaStreamQuery(Cuda::stream());
  (void)cudaGetLastError();  // cudaErrorNotReady is an answer, not a failure
  std::fill(host.begin(), host.end(), -1);
  const std::vector<std::int32_t> back = to_vector(download<Cuda>(t));
  return busy == cudaErrorNotReady && std::all_of(back.begin(), back.end(), [](std::int32_t x) { return x == 7; });
}

template <class T>
std::vector<T> cuda_embedding_forward(std::span<const std::int32_t> ids, const std::vector<T>& table,
                                      std::int64_t dim, std::int64_t lo, std::int64_t hi) {
  const auto rows = static_cast<std::int64_t>(ids.size());
  const Tensor<std::int32_t> d_ids = upload<Cuda>(ids);
  const Tensor<T> d_table = upload<Cuda>(std::span<const T>(table));
  const Tensor<T> out = Cuda::empty<T>(Shape{rows, dim});
  Cuda::for_each(rows * dim, ops::EmbeddingForward<T>{d_ids.data(), d_table.data(), out.data(), dim, lo, hi});
  return to_vector(download<Cuda>(out));
}

template std::vector<float> cuda_embedding_forward(std::span<const std::int32_t>, const std::vector<float>&,
                                                   std::int64_t, std::int64_t, std::int64_t);
template std::vector<bf16> cuda_embedding_forward(std::span<const std::int32_t>, const std::vector<bf16>&,
                                                  std::int64_t, std::int64_t, std::int64_t);

template <class T>
std::vector<accum_t<T>> cuda_embedding_backward(std::span<const std::int32_t> ids, const std::vector<T>& dout,
                                                const std::vector<accum_t<T>>& dtable0, std::int64_t dim,
                                                std::int64_t lo, std::int64_t hi) {
  const Tensor<accum_t<T>> d_table = upload<Cuda>(std::span<const accum_t<T>>(dtable0));
  const Tensor<T> d_dout = upload<Cuda>(std::span<const T>(dout));
  const ops::EmbeddingSegments seg = ops::embedding_segments(ids, lo, hi);
  if (seg.count > 0) {
    const Tensor<std::int32_t> packed = upload<Cuda>(std::span<const std::int32_t>(seg.packed));
    const std::int32_t* base = packed.data();
    Cuda::for_each(seg.count * dim, ops::EmbeddingBackward<T>{seg.ids(base), seg.offsets(base), seg.order(base),
                                                              d_dout.data(), d_table.data(), dim, lo,
                                                              seg.positions});
  }
  return to_vector(download<Cuda>(d_table));
}

template std::vector<float> cuda_embedding_backward(std::span<const std::int32_t>, const std::vector<float>&,
                                                    const std::vector<float>&, std::int64_t, std::int64_t,
                                                    std::int64_t);
template std::vector<float> cuda_embedding_backward(std::span<const std::int32_t>, const std::vector<bf16>&,
                                                    const std::vector<float>&, std::int64_t, std::int64_t,
                                                    std::int64_t);

std::size_t gemm_plans_cached() { return cuda::gemm_plans_cached(); }
void clear_gemm_plans() { cuda::clear_gemm_plans(); }

}  // namespace tessera::gpu_test
