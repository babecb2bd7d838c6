// Causal grouped-query attention on the CPU, one (batch, head) tile per task.
//
// Layout: q and o are (B*T, H*hd), k and v are (B*T, KV*hd), row-major; head h reads
// kv head h / (H/KV). Forward keeps only o and the per-row log-sum-exp lse
// (B, H, T); backward recomputes the probabilities from q, k and lse, so no (T, T)
// matrix outlives its tile. Scores are computed as full (T, T) GEMMs and masked: the
// simple form, twice the FLOPs of a causal-blocked one.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/backend/attention_shape.hpp"
#include "tessera/backend/backend.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/softmax.hpp"

namespace tessera::detail {

template <class Cpu, class T>
void cpu_attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                           TensorView<const T> v, TensorView<T> o, T* lse) {
  const std::int64_t t = s.seq_len, hd = s.head_dim;
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  Cpu::for_each(s.batch * s.n_heads, [&](std::int64_t bh) {
    const std::int64_t b = bh / s.n_heads, h = bh % s.n_heads, kvh = h / s.group();
    std::vector<T> scores(static_cast<std::size_t>(t * t));
    TensorView<T> sv(scores.data(), Shape{t, t});
    TensorView<const T> qh(q.row(b * t) + h * hd, Shape{t, hd}, {q.ld(), 1});
    TensorView<const T> kh(k.row(b * t) + kvh * hd, Shape{t, hd}, {k.ld(), 1});
    TensorView<const T> vh(v.row(b * t) + kvh * hd, Shape{t, hd}, {v.ld(), 1});
    TensorView<T> oh(o.row(b * t) + h * hd, Shape{t, hd}, {o.ld(), 1});
    Cpu::gemm(Trans::no, Trans::yes, T(1), qh, kh, T(0), sv);
    ops::CausalSoftmaxForward<T> softmax{scores.data(), t, t, scale, lse + bh * t};
    for (std::int64_t i = 0; i < t; ++i) softmax(i);
    Cpu::gemm(Trans::no, Trans::no, T(1), TensorView<const T>(sv), vh, T(0), oh);
  });
}

/// dq is overwritten; dk and dv are accumulated into (pass zeros).
template <class Cpu, class T>
void cpu_attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                            TensorView<const T> v, TensorView<const T> o, const T* lse, TensorView<const T> d_o,
                            TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
  const std::int64_t t = s.seq_len, hd = s.head_dim;
  const T scale = T(1) / std::sqrt(static_cast<T>(hd));
  // One task per (batch, kv head): the q heads of a group write the same dk, dv.
  Cpu::for_each(s.batch * s.n_kv_heads, [&](std::int64_t bk) {
    const std::int64_t b = bk / s.n_kv_heads, kvh = bk % s.n_kv_heads;
    std::vector<T> p(static_cast<std::size_t>(t * t)), dp(static_cast<std::size_t>(t * t));
    std::vector<T> d(static_cast<std::size_t>(t));
    TensorView<T> pv(p.data(), Shape{t, t}), dpv(dp.data(), Shape{t, t});
    TensorView<const T> kh(k.row(b * t) + kvh * hd, Shape{t, hd}, {k.ld(), 1});
    TensorView<const T> vh(v.row(b * t) + kvh * hd, Shape{t, hd}, {v.ld(), 1});
    TensorView<T> dkh(dk.row(b * t) + kvh * hd, Shape{t, hd}, {dk.ld(), 1});
    TensorView<T> dvh(dv.row(b * t) + kvh * hd, Shape{t, hd}, {dv.ld(), 1});
    for (std::int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h) {
      const std::int64_t bh = b * s.n_heads + h;
      TensorView<const T> qh(q.row(b * t) + h * hd, Shape{t, hd}, {q.ld(), 1});
      TensorView<const T> oh(o.row(b * t) + h * hd, Shape{t, hd}, {o.ld(), 1});
      TensorView<const T> doh(d_o.row(b * t) + h * hd, Shape{t, hd}, {d_o.ld(), 1});
      TensorView<T> dqh(dq.row(b * t) + h * hd, Shape{t, hd}, {dq.ld(), 1});
      Cpu::gemm(Trans::no, Trans::yes, T(1), qh, kh, T(0), pv);
      ops::CausalSoftmaxRecompute<T> recompute{p.data(), t, t, scale, lse + bh * t};
      ops::RowDot<T> rowdot{doh.data(), doh.ld(), oh.data(), oh.ld(), hd, d.data()};
      for (std::int64_t i = 0; i < t; ++i) {
        recompute(i);
        rowdot(i);
      }
      Cpu::gemm(Trans::yes, Trans::no, T(1), TensorView<const T>(pv), doh, T(1), dvh);  // dV += P^T dO
      Cpu::gemm(Trans::no, Trans::yes, T(1), doh, vh, T(0), dpv);                        // dP = dO V^T
      ops::CausalSoftmaxBackward<T> softmax_back{p.data(), t, dp.data(), t, d.data(), t, scale};
      for (std::int64_t i = 0; i < t; ++i) softmax_back(i);
      Cpu::gemm(Trans::no, Trans::no, T(1), TensorView<const T>(dpv), kh, T(0), dqh);  // dQ = dS K
      Cpu::gemm(Trans::yes, Trans::no, T(1), TensorView<const T>(dpv), qh, T(1), dkh);  // dK += dS^T Q
    }
  });
}

}  // namespace tessera::detail
