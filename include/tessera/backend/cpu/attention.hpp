// Grouped-query attention on the CPU, causal or full, in blocks of query rows.
//
// Layout: q and o are (B*T, H*hd), k and v are (B*T, KV*hd), row-major; head h reads
// kv head h / (H/KV). Queries are taken kBlock rows at a time: causal, block [i0, i1)
// needs keys [0, i1) only, so the scores are a (i1 - i0, i1) GEMM -- the causal half of
// the (T, T) product, in a tile that stays in cache -- followed by the row softmax and a
// second GEMM against V; full, every block takes every key. Forward keeps o and the per-row log-sum-exp lse (B, H, T);
// backward recomputes each block's probabilities from q, k and lse, so no (T, T)
// matrix is ever held. One task per (batch, head) forward and per (batch, kv head)
// backward, the q heads of a group writing the same dk, dv in a fixed order.
//
// Packed documents (AttentionShape::documents): a query block's keys start at its first
// row's document (the keys before it are neither multiplied nor read) and each row's
// softmax starts at its own document's first key; the columns before it are zeros in P
// and dS, so the GEMMs over the tile add nothing for them. In a context-parallel ring
// block a row, or a whole query block, may see no key: its output is zero, its
// log-sum-exp -inf and its dq zero.
//
// After a KV cache (AttentionShape::past, decoding) k and v hold past + T rows a sequence
// and query block [i0, i1) is causal over keys [0, past + i1): the same tiles, with the
// diagonal moved `past` columns to the right. The backward takes none.
//
// Precision, for bf16 tensors as in the flash kernels: scores, dP and the softmax
// statistics are fp32 (accum_t<T>); the probabilities P and dS are rounded to T once,
// as the operands of the GEMMs that follow. For float everything is float and no copy
// is made.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/softmax.hpp"

namespace tessera::detail {

inline constexpr std::int64_t kAttentionBlock = 64;

/// A (rows, hd) slice of the columns of head `head` in a (B*T, heads*hd) matrix.
template <class T>
TensorView<T> head_rows(TensorView<T> m, std::int64_t row0, std::int64_t rows, std::int64_t head, std::int64_t hd) {
  return TensorView<T>(m.row(row0) + head * hd, Shape{rows, hd}, {m.ld(), 1});
}

/// `acc` (rows x cols, accum_t<T>) as a T operand for the next GEMM: itself when T is
/// its own accumulation type, else rounded once into `store`.
template <class T>
TensorView<const T> as_operand(std::vector<accum_t<T>>& acc, std::vector<T>& store, std::int64_t rows,
                               std::int64_t cols) {
  if constexpr (std::is_same_v<T, accum_t<T>>) {
    return TensorView<const T>(acc.data(), Shape{rows, cols});
  } else {
    for (std::int64_t i = 0; i < rows * cols; ++i)
      store[static_cast<std::size_t>(i)] = from_accum<T>(acc[static_cast<std::size_t>(i)]);
    return TensorView<const T>(store.data(), Shape{rows, cols});
  }
}

/// The keys query block [i0, i1) of sequence b sees, as a tile of columns [kb, ke):
/// causal, keys [0, i1); full, every key; from the block's first document on when the
/// rows are packed documents (a block wholly after a document skips its keys; none at
/// all: keys() 0). Row r's visible keys begin at tile column first(r) (its document's
/// start; 0 without documents; keys(): none) and its causal offset in the shifted row is
/// offset(r).
struct AttentionTile {
  const AttentionShape& s;
  std::int64_t b, i0, kb, ke;
  AttentionTile(const AttentionShape& shape, std::int64_t b_, std::int64_t i0_, std::int64_t i1)
      : s(shape), b(b_), i0(i0_), ke(shape.past + (shape.causal ? i1 : shape.seq_len)) {
    kb = shape.documents ? std::min<std::int64_t>(shape.documents[b_ * shape.seq_len + i0_].begin, ke) : 0;
  }
  std::int64_t keys() const { return ke - kb; }
  std::int64_t first(std::int64_t r) const {
    return s.documents ? std::min<std::int64_t>(s.documents[b * s.seq_len + i0 + r].begin, ke) - kb : 0;
  }
  /// The row functors' offset for row r read from column first(r) on (key_len: every key).
  std::int64_t offset(std::int64_t r) const { return s.causal ? s.past + i0 - kb - first(r) : s.key_len(); }
  /// Tile column 0's row in k and v (key_len rows a sequence).
  std::int64_t key_row() const { return b * s.key_len() + kb; }
};

/// Zeros columns [0, n) of a row (the keys before its document).
template <class A>
void zero_prefix(A* row, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) row[j] = A(0);
}

template <class Cpu, class T>
void cpu_attention_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                           TensorView<const T> v, TensorView<T> o, accum_t<T>* lse) {
  using A = accum_t<T>;
  TESSERA_CHECK(s.past == 0 || s.documents == nullptr, "attention: keys before the queries (a KV cache's) over "
                                                       "packed documents");
  const std::int64_t t = s.seq_len, hd = s.head_dim, bs = std::min(kAttentionBlock, t), keys_max = s.key_len();
  const A scale = A(1) / std::sqrt(static_cast<A>(hd));
  Cpu::for_each(s.batch * s.n_heads, [&](std::int64_t bh) {
    const std::int64_t b = bh / s.n_heads, h = bh % s.n_heads, kvh = h / s.group();
    std::vector<A> scores(static_cast<std::size_t>(bs * keys_max));
    std::vector<T> p(std::is_same_v<T, A> ? 0 : static_cast<std::size_t>(bs * keys_max));
    for (std::int64_t i0 = 0; i0 < t; i0 += bs) {
      const std::int64_t i1 = std::min(t, i0 + bs), rows = i1 - i0;
      const AttentionTile tile(s, b, i0, i1);
      const std::int64_t keys = tile.keys();
      if (keys == 0) {  // no row of the block sees a key
        const TensorView<T> ob = head_rows(o, b * t + i0, rows, h, hd);
        for (std::int64_t r = 0; r < rows; ++r) {
          std::fill(ob.row(r), ob.row(r) + hd, from_accum<T>(A(0)));
          lse[bh * t + i0 + r] = -std::numeric_limits<A>::infinity();
        }
        continue;
      }
      TensorView<A> sv(scores.data(), Shape{rows, keys});
      Cpu::gemm(Trans::no, Trans::yes, A(1), head_rows(q, b * t + i0, rows, h, hd),
                head_rows(k, tile.key_row(), keys, kvh, hd), A(0), sv);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t f = tile.first(r);
        if (f < keys) {
          ops::CausalSoftmaxForward<A> softmax{scores.data() + f, keys, keys - f, tile.offset(r), scale,
                                               lse + bh * t + i0};
          softmax(r);
        } else {  // the row sees none of the keys: a zero row of P
          lse[bh * t + i0 + r] = -std::numeric_limits<A>::infinity();
        }
        zero_prefix(scores.data() + r * keys, f);
      }
      Cpu::gemm(Trans::no, Trans::no, A(1), as_operand<T>(scores, p, rows, keys),
                head_rows(v, tile.key_row(), keys, kvh, hd), A(0), head_rows(o, b * t + i0, rows, h, hd));
    }
  });
}

/// dq, dk and dv are overwritten.
template <class Cpu, class T>
void cpu_attention_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                            TensorView<const T> v, TensorView<const T> o, const accum_t<T>* lse,
                            TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
  using A = accum_t<T>;
  TESSERA_CHECK(s.past == 0, "attention backward: keys before the queries (a KV cache's) are for decoding only");
  const std::int64_t t = s.seq_len, hd = s.head_dim, bs = std::min(kAttentionBlock, t);
  const A scale = A(1) / std::sqrt(static_cast<A>(hd));
  Cpu::for_each(s.batch * s.n_kv_heads, [&](std::int64_t bk) {
    const std::int64_t b = bk / s.n_kv_heads, kvh = bk % s.n_kv_heads;
    const std::size_t tile = static_cast<std::size_t>(bs * t), narrow = std::is_same_v<T, A> ? 0 : tile;
    std::vector<A> p(tile), dp(tile), d(static_cast<std::size_t>(bs));
    std::vector<T> p_store(narrow), ds_store(narrow);
    // This task owns its kv head's dk and dv rows, which the GEMMs below add into.
    for (std::int64_t r = b * t; r < (b + 1) * t; ++r)
      for (std::int64_t d = 0; d < hd; ++d) {
        dk.row(r)[kvh * hd + d] = from_accum<T>(A(0));
        dv.row(r)[kvh * hd + d] = from_accum<T>(A(0));
      }
    for (std::int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h) {
      const std::int64_t bh = b * s.n_heads + h;
      for (std::int64_t i0 = 0; i0 < t; i0 += bs) {
        const std::int64_t i1 = std::min(t, i0 + bs), rows = i1 - i0;
        const AttentionTile tile(s, b, i0, i1);
        const std::int64_t keys = tile.keys();
        if (keys == 0) {  // no row of the block sees a key: dq is zero
          const TensorView<T> dqb = head_rows(dq, b * t + i0, rows, h, hd);
          for (std::int64_t r = 0; r < rows; ++r) std::fill(dqb.row(r), dqb.row(r) + hd, from_accum<T>(A(0)));
          continue;
        }
        TensorView<A> pv(p.data(), Shape{rows, keys}), dpv(dp.data(), Shape{rows, keys});
        const auto qb = head_rows(q, b * t + i0, rows, h, hd), dob = head_rows(d_o, b * t + i0, rows, h, hd);
        const auto ob = head_rows(o, b * t + i0, rows, h, hd);
        const auto kp = head_rows(k, b * t + tile.kb, keys, kvh, hd);
        const auto vp = head_rows(v, b * t + tile.kb, keys, kvh, hd);
        Cpu::gemm(Trans::no, Trans::yes, A(1), qb, kp, A(0), pv);  // S = Q K^T
        ops::RowDot<T> rowdot{dob.data(), dob.ld(), ob.data(), ob.ld(), hd, d.data()};
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t f = tile.first(r);
          ops::CausalSoftmaxRecompute<A> recompute{p.data() + f, keys, keys - f, tile.offset(r), scale,
                                                   lse + bh * t + i0};
          recompute(r);
          zero_prefix(p.data() + r * keys, f);
          rowdot(r);
        }
        const TensorView<const T> p_operand = as_operand<T>(p, p_store, rows, keys);
        // dV += P^T dO
        Cpu::gemm(Trans::yes, Trans::no, A(1), p_operand, dob, A(1), head_rows(dv, b * t + tile.kb, keys, kvh, hd));
        Cpu::gemm(Trans::no, Trans::yes, A(1), dob, vp, A(0), dpv);  // dP = dO V^T
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t f = tile.first(r);
          ops::CausalSoftmaxBackward<A> softmax_back{
              p.data() + f, keys, dp.data() + f, keys, d.data(), keys - f, tile.offset(r), scale};
          softmax_back(r);
          zero_prefix(dp.data() + r * keys, f);
        }
        const TensorView<const T> ds = as_operand<T>(dp, ds_store, rows, keys);
        Cpu::gemm(Trans::no, Trans::no, A(1), ds, kp, A(0), head_rows(dq, b * t + i0, rows, h, hd));  // dQ = dS K
        // dK += dS^T Q
        Cpu::gemm(Trans::yes, Trans::no, A(1), ds, qb, A(1), head_rows(dk, b * t + tile.kb, keys, kvh, hd));
      }
    }
  });
}

}  // namespace tessera::detail
