// Launchers for the cuDNN attention tests: host float data to padded bf16 device
// tensors, Cuda::attention_forward and attention_backward with the chosen engine,
// results back as float. The checks are in test_gpu_cudnn.cpp and test_gpu_model.cpp.
#include <cstdint>
#include <string>
#include <vector>

#include "cudnn_launchers.hpp"
#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/backend/cuda/cudnn_attention.hpp"
#include "tessera/ops/ragged_documents.hpp"

namespace tessera::gpu_test {

namespace {

/// A (rows, cols) bf16 device tensor with ld = cols + pad, as a view of a larger one.
struct PaddedMatrix {
  Tensor<bf16> storage;
  std::int64_t rows, cols, ld;

  PaddedMatrix(const std::vector<float>& host, std::int64_t r, std::int64_t c, std::int64_t pad)
      : storage(Cuda::empty<bf16>(Shape{r, c + pad})), rows(r), cols(c), ld(c + pad) {
    TESSERA_CHECK(static_cast<std::int64_t>(host.size()) == r * c, "cuDNN test: ", host.size(), " values for a (", r,
                  ", ", c, ") matrix");
    std::vector<bf16> padded(static_cast<std::size_t>(r * ld), convert<bf16>(0.0f));
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < c; ++j)
        padded[static_cast<std::size_t>(i * ld + j)] = convert<bf16>(host[static_cast<std::size_t>(i * c + j)]);
    Cuda::copy_from_host(padded.data(), storage.data(), r * ld);
  }

  TensorView<bf16> view() const { return TensorView<bf16>(storage.data(), Shape{rows, cols}, {ld, 1}); }
  TensorView<const bf16> cview() const { return view(); }

  std::vector<float> to_host() const {
    std::vector<bf16> padded(static_cast<std::size_t>(rows * ld));
    Cuda::copy_to_host(storage.data(), padded.data(), rows * ld);
    std::vector<float> out(static_cast<std::size_t>(rows * cols));
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j)
        out[static_cast<std::size_t>(i * cols + j)] = convert<float>(padded[static_cast<std::size_t>(i * ld + j)]);
    return out;
  }
};

}  // namespace

std::string cudnn_unavailable() {
  if (cuda::cudnn_frontend_version().empty()) return "this build has no cuDNN frontend headers";
  const cuda::CudnnAvailability a = cuda::cudnn_availability();
  return a.ok ? std::string() : a.why_not;
}

std::string cudnn_description() {
  const cuda::CudnnAvailability a = cuda::cudnn_availability();
  return (a.ok ? a.library : a.why_not) + ", frontend " + cuda::cudnn_frontend_version();
}

void use_attention(GpuAttention a) {
  cuda::set_attention_engine(a == GpuAttention::tessera ? nullptr
                                                        : cuda::cudnn_attention_engine(a == GpuAttention::cudnn_deterministic));
}

std::string cudnn_support(const AttentionShape& s, bool deterministic) {
  return cuda::cudnn_attention_support(s, deterministic);
}

void cuda_attention(FlashRun& run) {
  TESSERA_CHECK(run.bf16, "cuda_attention: the engines run bf16 tensors");
  AttentionShape s = run.shape;
  // Packed documents: the rows' spans and, over whole (causal) sequences, the document
  // table, staged as the model stages them (nn/transformer.hpp).
  Tensor<std::int32_t> documents;
  if (!run.documents.empty()) {
    const ops::DocumentTable table =
        s.causal ? ops::document_table(run.documents, s.batch, s.seq_len) : ops::DocumentTable{};
    const std::vector<std::int32_t> flat = ops::staged_documents(run.documents, table);
    documents = Cuda::empty<std::int32_t>(Shape{static_cast<std::int64_t>(flat.size())});
    Cuda::copy_from_host(flat.data(), documents.data(), documents.numel());
    const auto* staged = reinterpret_cast<const ops::DocumentSpan*>(documents.data());
    s.documents = staged;
    if (table.slots > 0) {
      s.document_table = staged + run.documents.size();
      s.document_slots = table.slots;
    }
  }
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  const PaddedMatrix q(run.q, rows, qc, run.pad), k(run.k, rows, kc, run.pad), v(run.v, rows, kc, run.pad);
  const PaddedMatrix d_o(run.d_o, rows, qc, run.pad);
  const PaddedMatrix o(std::vector<float>(static_cast<std::size_t>(rows * qc)), rows, qc, run.pad);
  const PaddedMatrix dq(run.dq, rows, qc, run.pad), dk(run.dk, rows, kc, run.pad), dv(run.dv, rows, kc, run.pad);
  Tensor<float> lse = Cuda::empty<float>(Shape{s.batch, s.n_heads, s.seq_len});
  Cuda::attention_forward<bf16>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  Cuda::attention_backward<bf16>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), d_o.cview(), dq.view(),
                                 dk.view(), dv.view());
  Cuda::synchronize();
  run.o = o.to_host();
  std::vector<float> l(static_cast<std::size_t>(lse.numel()));
  Cuda::copy_to_host(lse.data(), l.data(), lse.numel());
  run.lse = l;
  run.dq = dq.to_host();
  run.dk = dk.to_host();
  run.dv = dv.to_host();
}

}  // namespace tessera::gpu_test
