// Launchers for the GPU flash attention tests: host float data to device matrices
// (float or bf16, with padded rows), the CUDA forward and backward (or the forward alone
// after a KV cache's keys), results back as float. Kernels and launches only; the checks are in test_gpu_flash.cpp.
#include <vector>

#include "flash_launchers.hpp"
#include "tessera/backend/cuda/flash_attention.cuh"

namespace {

using tessera::TensorView;

/// A (rows, cols) matrix in device memory with ld = cols + pad.
template <class T>
struct DeviceMatrix {
  T* data = nullptr;
  std::int64_t rows = 0, cols = 0, ld = 0;

  DeviceMatrix(const std::vector<float>& host, std::int64_t r, std::int64_t c, std::int64_t pad)
      : rows(r), cols(c), ld(c + pad) {
    TESSERA_CHECK(static_cast<std::int64_t>(host.size()) == r * c, "flash test: ", host.size(), " values for a (",
                  r, ", ", c, ") matrix");
    TESSERA_CUDA_CHECK(cudaMalloc(&data, static_cast<std::size_t>(rows * ld + 1) * sizeof(T)));
    TESSERA_CUDA_CHECK(cudaMemset(data, 0, static_cast<std::size_t>(rows * ld + 1) * sizeof(T)));
    std::vector<T> stored(host.size());
    for (std::size_t i = 0; i < host.size(); ++i) stored[i] = tessera::convert<T>(host[i]);
    const std::size_t row_bytes = static_cast<std::size_t>(cols) * sizeof(T);
    TESSERA_CUDA_CHECK(cudaMemcpy2D(data, static_cast<std::size_t>(ld) * sizeof(T), stored.data(), row_bytes, row_bytes,
                                    static_cast<std::size_t>(rows), cudaMemcpyHostToDevice));
  }
  DeviceMatrix(const DeviceMatrix&) = delete;
  DeviceMatrix& operator=(const DeviceMatrix&) = delete;
  ~DeviceMatrix() { cudaFree(data); }

  TensorView<T> view() const { return TensorView<T>(data, tessera::Shape{rows, cols}, {ld, 1}); }
  TensorView<const T> cview() const { return view(); }

  std::vector<float> to_host() const {
    std::vector<T> stored(static_cast<std::size_t>(rows * cols));
    const std::size_t row_bytes = static_cast<std::size_t>(cols) * sizeof(T);
    TESSERA_CUDA_CHECK(cudaMemcpy2D(stored.data(), row_bytes, data, static_cast<std::size_t>(ld) * sizeof(T), row_bytes,
                                    static_cast<std::size_t>(rows), cudaMemcpyDeviceToHost));
    std::vector<float> out(stored.size());
    for (std::size_t i = 0; i < stored.size(); ++i) out[i] = tessera::convert<float>(stored[i]);
    return out;
  }
};

struct DeviceFloats {
  float* data = nullptr;
  std::size_t n = 0;
  explicit DeviceFloats(std::size_t count) : n(count) {
    TESSERA_CUDA_CHECK(cudaMalloc(&data, (n + 1) * sizeof(float)));
  }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  ~DeviceFloats() { cudaFree(data); }
  std::vector<float> to_host() const {
    std::vector<float> out(n);
    TESSERA_CUDA_CHECK(cudaMemcpy(out.data(), data, n * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  }
};

template <class T>
void run_flash(tessera::gpu_test::FlashRun& run) {
  tessera::AttentionShape s = run.shape;
  tessera::ops::DocumentSpan* documents = nullptr;
  if (!run.documents.empty()) {
    const std::size_t bytes = run.documents.size() * sizeof(tessera::ops::DocumentSpan);
    TESSERA_CUDA_CHECK(cudaMalloc(&documents, bytes));
    TESSERA_CUDA_CHECK(cudaMemcpy(documents, run.documents.data(), bytes, cudaMemcpyHostToDevice));
    s.documents = documents;
  }
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  const DeviceMatrix<T> q(run.q, rows, qc, run.pad), k(run.k, rows, kc, run.pad), v(run.v, rows, kc, run.pad);
  const DeviceMatrix<T> d_o(run.d_o, rows, qc, run.pad);
  const DeviceMatrix<T> o(std::vector<float>(static_cast<std::size_t>(rows * qc)), rows, qc, run.pad);
  const DeviceMatrix<T> dq(run.dq, rows, qc, run.pad), dk(run.dk, rows, kc, run.pad), dv(run.dv, rows, kc, run.pad);
  const auto heads_rows = static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len);
  DeviceFloats lse(heads_rows), delta(heads_rows);
  cudaStream_t stream = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreate(&stream));
  tessera::cuda::flash_attention_forward<T>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data, stream);
  tessera::cuda::flash_attention_backward<T>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data, d_o.cview(),
                                             dq.view(), dk.view(), dv.view(), delta.data, stream);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
  if (documents) TESSERA_CUDA_CHECK(cudaFree(documents));
  run.o = o.to_host();
  run.lse = lse.to_host();
  run.dq = dq.to_host();
  run.dk = dk.to_host();
  run.dv = dv.to_host();
}

template <class T>
void run_decode(tessera::gpu_test::FlashRun& run) {
  const tessera::AttentionShape s = run.shape;
  const std::int64_t rows = s.rows(), keys = s.batch * s.key_len(), qc = s.n_heads * s.head_dim;
  const std::int64_t kc = s.n_kv_heads * s.head_dim;
  const DeviceMatrix<T> q(run.q, rows, qc, run.pad), k(run.k, keys, kc, run.pad), v(run.v, keys, kc, run.pad);
  const DeviceMatrix<T> o(std::vector<float>(static_cast<std::size_t>(rows * qc)), rows, qc, run.pad);
  DeviceFloats lse(static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len));
  DeviceFloats scratch(static_cast<std::size_t>(tessera::ops::flash_split_scratch(s)));
  cudaStream_t stream = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreate(&stream));
  tessera::cuda::flash_attention_forward<T>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data, stream,
                                            scratch.data);
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  TESSERA_CUDA_CHECK(cudaStreamDestroy(stream));
  run.o = o.to_host();
  run.lse = lse.to_host();
}

}  // namespace

namespace tessera::gpu_test {

void flash_decode(FlashRun& run) {
  if (run.bf16) run_decode<tessera::bf16>(run);
  else run_decode<float>(run);
}


void flash_attention(FlashRun& run) {
  if (run.bf16) run_flash<tessera::bf16>(run);
  else run_flash<float>(run);
}

void flash_forward_without_data(const AttentionShape& s, bool float64) {
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  auto run = [&]<class T>(T*) {
    const TensorView<const T> q(nullptr, Shape{rows, qc}), k(nullptr, Shape{rows, kc});
    cuda::flash_attention_forward<T>(s, q, k, k, TensorView<T>(nullptr, Shape{rows, qc}), nullptr, nullptr);
  };
  if (float64) run(static_cast<double*>(nullptr));
  else run(static_cast<float*>(nullptr));
}

}  // namespace tessera::gpu_test
