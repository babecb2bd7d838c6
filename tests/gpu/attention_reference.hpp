// The CPU backend's attention on a FlashRun's inputs: the reference every GPU attention
// path (tessera's flash kernels, cuDNN's SDPA) is held to. Host C++, for the test files.
#pragma once

#include <cstdint>
#include <vector>

#include "flash_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::gpu_test {

/// Attention's outputs on the host, dense: o, dq (B*T, H*hd), dk, dv (B*T, KV*hd), lse (B, H, T).
struct AttentionResult {
  std::vector<float> o, lse, dq, dk, dv;
};

/// Cpu::attention_forward and attention_backward in float on run.q, k, v and d_o (the
/// values the device was given, already rounded to bf16 for a bf16 run), causal or full
/// as run.shape says.
inline AttentionResult cpu_attention(const FlashRun& run) {
  AttentionShape s = run.shape;
  if (!run.documents.empty()) s.documents = run.documents.data();
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  Tensor<float> o(Shape{rows, qc}), dq(Shape{rows, qc}), dk(Shape{rows, kc}), dv(Shape{rows, kc});
  AttentionResult r;
  r.lse.resize(static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len));
  const TensorView<const float> q(run.q.data(), Shape{rows, qc}), k(run.k.data(), Shape{rows, kc});
  const TensorView<const float> v(run.v.data(), Shape{rows, kc}), d_o(run.d_o.data(), Shape{rows, qc});
  Cpu::attention_forward<float>(s, q, k, v, o, r.lse.data());
  Cpu::attention_backward<float>(s, q, k, v, o, r.lse.data(), d_o, dq, dk, dv);
  auto vec = [](const Tensor<float>& t) { return std::vector<float>(t.data(), t.data() + t.numel()); };
  r.o = vec(o);
  r.dq = vec(dq);
  r.dk = vec(dk);
  r.dv = vec(dv);
  return r;
}

/// Cpu::attention_forward alone in float on run.q, k and v, after run.shape.past keys
/// of a KV cache where it says so: o and lse.
inline AttentionResult cpu_attention_forward(const FlashRun& run) {
  const AttentionShape s = run.shape;
  const std::int64_t rows = s.rows(), keys = s.batch * s.key_len(), qc = s.n_heads * s.head_dim;
  const std::int64_t kc = s.n_kv_heads * s.head_dim;
  Tensor<float> o(Shape{rows, qc});
  AttentionResult r;
  r.lse.resize(static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len));
  Cpu::attention_forward<float>(s, TensorView<const float>(run.q.data(), Shape{rows, qc}),
                                TensorView<const float>(run.k.data(), Shape{keys, kc}),
                                TensorView<const float>(run.v.data(), Shape{keys, kc}), o, r.lse.data());
  r.o.assign(o.data(), o.data() + o.numel());
  return r;
}

}  // namespace tessera::gpu_test
