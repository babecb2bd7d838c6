// Flash attention as per-row functors: grouped-query attention, causal or full,
// computed one row at a time against tiles of the other side, with an online softmax,
// so no (T, T) score matrix is ever held.
//
// Layout as the CPU backend's (backend/cpu/attention.hpp): q and o are (B*T, H*hd), k
// and v (B*T, KV*hd), row-major, each with its own ld; head h reads kv head h / (H/KV);
// s_ij = scale * q_i . k_j with scale = 1/sqrt(hd). Causal, query i sees keys 0..i;
// full (AttentionShape::causal false), every key. Decoding after a KV cache's keys
// (AttentionShape::past, forward only), k and v hold past + T rows a sequence and causal
// query i sees keys 0..past + i; its keys are walked in runs merged at the end
// (kFlashSplitKeys, FlashMergeSplits), so that a call of a few queries still spreads
// over many blocks.
//
// The functors know no mask, only a bound: a query row sees the keys up to its
// `last_key`, a key row is seen by the queries from its `first_query` on. Causal, those
// are the row's own position; full, the sequence's last key (T - 1) and first query (0),
// so nothing is skipped. The drivers below and the kernels pick the bound and walk only
// the tiles it lets through.
//
// Packed documents (AttentionShape::documents) add the other bound of each row: a query
// sees keys from its document's first (`first_key`), a key is seen by queries up to its
// document's last (`last_query`); in a context-parallel ring block, the block's bounds
// (ops::BlockDocuments), under which a row may see no key or be seen by no query. Tiles
// wholly outside those bounds are skipped by the drivers and kernels as the causal
// bound's are.
//
// Forward (FlashForwardRow): a query row keeps the running max m of its scores, the
// running sum l = sum_j exp(s_ij - m) and acc = sum_j exp(s_ij - m) v_j over the keys
// seen so far; a key with a larger score rescales l and acc by exp(m_old - m_new).
// finish() writes o_i = acc / l and lse_i = m + log l (natural log).
//
// Backward recomputes p_ij = exp(s_ij - lse_i) and, with D_i = dO_i . O_i (FlashDelta),
//   dS_ij = p_ij (dO_i . v_j - D_i),   dv_j = sum_i p_ij dO_i,
//   dk_j = scale sum_i dS_ij q_i,      dq_i = scale sum_j dS_ij k_j.
// FlashBackwardKeyRow accumulates dk_j and dv_j over the query tiles that see key j (i >= j
// causal) of every q head of the key's group; FlashBackwardQueryRow accumulates dq_i over
// the key tiles query i sees (j <= i causal).
// They are two separate passes: every output row has one owner that adds its terms in
// a fixed order, so there are no atomics and results are deterministic. dq is
// overwritten; dk and dv are added into (callers pass zeros).
//
// The functors are TESSERA_HD. The CUDA backend (backend/cuda/flash_attention.cuh) runs
// one per thread over tiles staged in shared memory; flash_attention_forward_rows and
// flash_attention_backward_rows below loop over them on the host, tile by tile, which is
// how the tests check this arithmetic against the CPU backend. Tile rows are read
// through a pointer and an ld, so a tile may live in global or shared memory, in the
// storage type or already converted to float. Storage T is float, double or bf16; the
// arithmetic, lse and D are in accum_t<T> (core/dtype.hpp: float for bf16, T otherwise),
// and each stored output is rounded once. A row's HD values are arrays sized at compile
// time (registers on a device), so the head dim is a template parameter: 16, 32, 64 or
// 128 (the Llama flavors use 64 and 128; torchtitan's debug model 16).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/math.hpp"

// Loops over the HD values of a row are unrolled in device code, so that the row's
// arrays are indexed by constants and can stay in registers.
#if defined(__CUDA_ARCH__)
#define TESSERA_FLASH_UNROLL _Pragma("unroll")
#else
#define TESSERA_FLASH_UNROLL
#endif

namespace tessera::ops {

/// The arithmetic type for storage type T, as the flash functors name it: accum_t<T>.
template <class T>
using acc_t = accum_t<T>;

/// The head dims the flash attention functors are instantiated for.
constexpr bool flash_head_dim_supported(std::int64_t hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 128; }

/// Calls f.template operator()<HD>() with HD = hd for a supported head dim; fails
/// naming any other.
template <class F>
decltype(auto) with_flash_head_dim(std::int64_t hd, F&& f) {
  if (hd == 16) return f.template operator()<16>();
  if (hd == 32) return f.template operator()<32>();
  if (hd == 64) return f.template operator()<64>();
  if (hd == 128) return f.template operator()<128>();
  fail("flash attention: head dim ", hd, " is not supported (16, 32, 64 or 128)");
}

namespace detail {

/// x . y over HD values; x already in the arithmetic type A.
template <class A, int HD, class U>
TESSERA_HD inline A flash_dot(const A* x, const U* y) {
  A s = 0;
  TESSERA_FLASH_UNROLL
  for (int d = 0; d < HD; ++d) s += x[d] * convert<A>(y[d]);
  return s;
}

/// The number of keys [key0, key0 + n) that a query seeing keys up to `last_key` sees
/// (0 when key0 > last_key).
TESSERA_HD inline std::int64_t flash_visible_keys(std::int64_t last_key, std::int64_t key0, std::int64_t n) {
  const std::int64_t end = last_key - key0 + 1;
  return end < 0 ? 0 : (end < n ? end : n);
}

/// The first of the queries [query0, query0 + n) that sees a key seen from `first_query`
/// on (n when none does).
TESSERA_HD inline std::int64_t flash_first_query(std::int64_t first_query, std::int64_t query0, std::int64_t n) {
  const std::int64_t begin = first_query - query0;
  return begin < 0 ? 0 : (begin < n ? begin : n);
}

/// The first of the keys [key0, key0 + n) that a query seeing keys from `first_key` on
/// sees, as an index into the tile (0 when first_key <= key0).
TESSERA_HD inline std::int64_t flash_first_visible_key(std::int64_t first_key, std::int64_t key0) {
  return first_key > key0 ? first_key - key0 : 0;
}

/// One past the last of the queries [query0, query0 + n) that sees a key seen up to
/// `last_query` (0 when none does).
TESSERA_HD inline std::int64_t flash_query_end(std::int64_t last_query, std::int64_t query0, std::int64_t n) {
  const std::int64_t end = last_query - query0 + 1;
  return end < 0 ? 0 : (end < n ? end : n);
}

/// The first key row `row` (of a call's rows) sees: its document's first, or the
/// sequence's (`sequence_start`) without documents.
TESSERA_HD inline std::int64_t flash_first_key(const DocumentSpan* documents, std::int64_t row,
                                               std::int64_t sequence_start) {
  return documents ? documents[row].begin : sequence_start;
}

/// The last query that sees key row `row` (of a call's rows): its document's last
/// (`otherwise` without documents).
TESSERA_HD inline std::int64_t flash_last_query(const DocumentSpan* documents, std::int64_t row,
                                                std::int64_t otherwise) {
  return documents ? documents[row].end - 1 : otherwise;
}

/// The last key query `query` of a call of `seq_len` queries sees: itself causal, the
/// sequence's last full; after `past` keys of a KV cache (AttentionShape::past), both
/// `past` further on.
TESSERA_HD inline std::int64_t flash_last_key(bool causal, std::int64_t query, std::int64_t seq_len,
                                              std::int64_t past = 0) {
  return past + (causal ? query : seq_len - 1);
}

/// The first query that sees key `key`: itself causal, the sequence's first full.
TESSERA_HD inline std::int64_t flash_first_query_of(bool causal, std::int64_t key) { return causal ? key : 0; }

}  // namespace detail

/// The forward state of one query row: start(), update() once per key tile, finish().
template <class T, int HD>
struct FlashForwardRow {
  static_assert(HD > 0 && HD % 8 == 0, "FlashForwardRow: HD must be a positive multiple of 8");
  using A = acc_t<T>;

  A q[HD];    // the query row times scale
  A acc[HD];  // sum_j exp(s_j - m) v_j
  A m;        // the largest score seen so far
  A l;        // sum_j exp(s_j - m)
  std::int64_t last_key;   // the last key the row sees (causal: the row's own position)
  std::int64_t first_key;  // the first key the row sees (its document's first; 0 without documents)

  template <class U>
  TESSERA_HD void start(const U* q_row, std::int64_t row_last_key, A scale, std::int64_t row_first_key = 0) {
    TESSERA_FLASH_UNROLL
    for (int d = 0; d < HD; ++d) {
      q[d] = scale * convert<A>(q_row[d]);
      acc[d] = A(0);
    }
    m = -std::numeric_limits<A>::infinity();
    l = A(0);
    last_key = row_last_key;
    first_key = row_first_key;
  }

  /// Keys [key0, key0 + n): key key0 + r is row r of k (ld ldk) and of v (ld ldv).
  /// Keys after last_key or before first_key are skipped (a tile wholly outside changes
  /// nothing).
  template <class U>
  TESSERA_HD void update(const U* k, std::int64_t ldk, const U* v, std::int64_t ldv, std::int64_t key0,
                         std::int64_t n) {
    const std::int64_t end = detail::flash_visible_keys(last_key, key0, n);
    for (std::int64_t r = detail::flash_first_visible_key(first_key, key0); r < end; ++r) {
      const A s = detail::flash_dot<A, HD>(q, k + r * ldk);
      if (s > m) {  // a new max: rescale what was summed under the old one
        const A c = exp_nonpositive(m - s);
        l *= c;
        TESSERA_FLASH_UNROLL
        for (int d = 0; d < HD; ++d) acc[d] *= c;
        m = s;
      }
      const A p = exp_nonpositive(s - m);
      l += p;
      const U* vr = v + r * ldv;
      TESSERA_FLASH_UNROLL
      for (int d = 0; d < HD; ++d) acc[d] += p * convert<A>(vr[d]);
    }
  }

  /// o_row = acc / l (HD values, rounded to U) and *lse_out = m + log l; a row that saw
  /// no key (a ring block wholly before its document) writes zeros and -inf.
  template <class U>
  TESSERA_HD void finish(U* o_row, A* lse_out) const {
    const bool seen = l > A(0);
    const A inv = seen ? A(1) / l : A(0);
    TESSERA_FLASH_UNROLL
    for (int d = 0; d < HD; ++d) o_row[d] = convert<U>(acc[d] * inv);
    *lse_out = seen ? m + log_(l) : -std::numeric_limits<A>::infinity();
  }
};

/// The backward state of one key row j of one kv head: dk_j and dv_j accumulated over
/// the query tiles that see it (queries i >= j causal) of every q head that reads this
/// kv head.
template <class T, int HD>
struct FlashBackwardKeyRow {
  static_assert(HD > 0 && HD % 8 == 0, "FlashBackwardKeyRow: HD must be a positive multiple of 8");
  using A = acc_t<T>;

  A k[HD];   // the key row times scale
  A v[HD];   // the value row
  A dk[HD];  // sum_i dS_ij q_i (times scale at finish)
  A dv[HD];  // sum_i p_ij dO_i
  A scale;
  std::int64_t first_query;  // the first query that sees the row (causal: the row's own position)
  std::int64_t last_query;   // the last query that sees the row (its document's last; unbounded without documents)

  template <class U>
  TESSERA_HD void start(const U* k_row, const U* v_row, std::int64_t row_first_query, A softmax_scale,
                        std::int64_t row_last_query = std::numeric_limits<std::int64_t>::max() / 2) {
    TESSERA_FLASH_UNROLL
    for (int d = 0; d < HD; ++d) {
      k[d] = softmax_scale * convert<A>(k_row[d]);
      v[d] = convert<A>(v_row[d]);
      dk[d] = A(0);
      dv[d] = A(0);
    }
    scale = softmax_scale;
    first_query = row_first_query;
    last_query = row_last_query;
  }

  /// Queries [query0, query0 + n) of one q head: query query0 + r is row r of q (ld ldq)
  /// and of d_o (ld lddo), with log-sum-exp lse[r] and D delta[r]. Queries before
  /// first_query or after last_query are skipped.
  template <class U>
  TESSERA_HD void update(const U* q, std::int64_t ldq, const U* d_o, std::int64_t lddo, const A* lse,
                         const A* delta, std::int64_t query0, std::int64_t n) {
    const std::int64_t end = detail::flash_query_end(last_query, query0, n);
    for (std::int64_t r = detail::flash_first_query(first_query, query0, n); r < end; ++r) {
      const U* qr = q + r * ldq;
      const U* dor = d_o + r * lddo;
      const A p = exp_nonpositive(detail::flash_dot<A, HD>(k, qr) - lse[r]);
      const A ds = p * (detail::flash_dot<A, HD>(v, dor) - delta[r]);
      TESSERA_FLASH_UNROLL
      for (int d = 0; d < HD; ++d) {
        dv[d] += p * convert<A>(dor[d]);
        dk[d] += ds * convert<A>(qr[d]);
      }
    }
  }

  /// dk_row += scale * dk and dv_row += dv (HD values each, rounded to U).
  template <class U>
  TESSERA_HD void finish(U* dk_row, U* dv_row) const {
    TESSERA_FLASH_UNROLL
    for (int d = 0; d < HD; ++d) {
      dk_row[d] = convert<U>(convert<A>(dk_row[d]) + scale * dk[d]);
      dv_row[d] = convert<U>(convert<A>(dv_row[d]) + dv[d]);
    }
  }
};

/// The backward state of one query row i: dq_i accumulated over the key tiles it sees
/// (keys j <= i causal).
template <class T, int HD>
struct FlashBackwardQueryRow {
  static_assert(HD > 0 && HD % 8 == 0, "FlashBackwardQueryRow: HD must be a positive multiple of 8");
  using A = acc_t<T>;

  A q[HD];    // the query row times scale
  A d_o[HD];  // dO_i
  A dq[HD];   // sum_j dS_ij k_j (times scale at finish)
  A lse;      // the row's log-sum-exp
  A delta;    // D_i = dO_i . O_i
  A scale;
  std::int64_t last_key;   // the last key the row sees (causal: the row's own position)
  std::int64_t first_key;  // the first key the row sees (its document's first; 0 without documents)

  template <class U>
  TESSERA_HD void start(const U* q_row, const U* d_o_row, A row_lse, A row_delta, std::int64_t row_last_key,
                        A softmax_scale, std::int64_t row_first_key = 0) {
    TESSERA_FLASH_UNROLL
    for (int d = 0; d < HD; ++d) {
      q[d] = softmax_scale * convert<A>(q_row[d]);
      d_o[d] = convert<A>(d_o_row[d]);
      dq[d] = A(0);
    }
    lse = row_lse;
    delta = row_delta;
    scale = softmax_scale;
    last_key = row_last_key;
    first_key = row_first_key;
  }

  /// Keys [key0, key0 + n), as FlashForwardRow::update takes them.
  template <class U>
  TESSERA_HD void update(const U* k, std::int64_t ldk, const U* v, std::int64_t ldv, std::int64_t key0,
                         std::int64_t n) {
    const std::int64_t end = detail::flash_visible_keys(last_key, key0, n);
    for (std::int64_t r = detail::flash_first_visible_key(first_key, key0); r < end; ++r) {
      const U* kr = k + r * ldk;
      const A p = exp_nonpositive(detail::flash_dot<A, HD>(q, kr) - lse);
      const A ds = p * (detail::flash_dot<A, HD>(d_o, v + r * ldv) - delta);
      TESSERA_FLASH_UNROLL
      for (int d = 0; d < HD; ++d) dq[d] += ds * convert<A>(kr[d]);
    }
  }

  /// dq_row = scale * dq (HD values, rounded to U): overwritten, not added to.
  template <class U>
  TESSERA_HD void finish(U* dq_row) const {
    TESSERA_FLASH_UNROLL
    for (int d = 0; d < HD; ++d) dq_row[d] = convert<U>(scale * dq[d]);
  }
};

/// Decoding (AttentionShape::past > 0) the keys of a row are many and its queries few:
/// the forward walks each row's keys in runs of kFlashSplitKeys, a run a block side by
/// side (each run's o and log-sum-exp, as FlashForwardRow::finish writes them, into
/// scratch in acc_t<T>), then FlashMergeSplits combines the runs. Training's calls (past
/// 0) walk every key in one run, as they always have.
inline constexpr std::int64_t kFlashSplitKeys = 128;  // a whole number of tiles at every head dim

/// The runs a forward walks each row's keys in: one, or for a call after a KV cache's
/// keys one per `split_keys` of them.
inline std::int64_t flash_key_splits(const AttentionShape& s, std::int64_t split_keys = kFlashSplitKeys) {
  return s.past > 0 ? (s.key_len() + split_keys - 1) / split_keys : 1;
}

/// The float scratch the runs' outputs take: for each run, as many o values and
/// log-sum-exps as the call has; 0 with one run (the kernel writes o and lse itself).
inline std::int64_t flash_split_scratch(const AttentionShape& s) {
  const std::int64_t splits = flash_key_splits(s);
  return splits > 1 ? splits * (s.rows() * s.n_heads * s.head_dim + s.batch * s.n_heads * s.seq_len) : 0;
}

/// Combines the key runs of one element of o: index ((b * H + h) * T + t) * hd + d reads
/// run r's o at o_parts + r * (B*T, H*hd) (dense) and its log-sum-exp at lse_parts + r *
/// (B, H, T) (lse's layout), and writes
///   o = sum_r exp(lse_r - m) o_r / sum_r exp(lse_r - m),  lse = m + log sum_r exp(lse_r - m)
/// (lse by the index with d = 0), m the largest lse_r, summed in run order and rounded to
/// T once. A run in which the row sees no key (lse_r -inf) adds nothing; a row that sees
/// none at all gets zeros and -inf, as FlashForwardRow::finish writes them.
template <class T>
struct FlashMergeSplits {
  using A = acc_t<T>;
  const A* o_parts;
  const A* lse_parts;
  T* o;
  std::int64_t ldo;
  A* lse;
  std::int64_t splits, batch, seq_len, n_heads, head_dim;
  TESSERA_HD void operator()(std::int64_t index) const {
    constexpr A kInfinity = std::numeric_limits<A>::infinity();
    const std::int64_t d = index % head_dim, stat = index / head_dim;  // stat: (b * H + h) * T + t
    const std::int64_t t = stat % seq_len, bh = stat / seq_len, h = bh % n_heads;
    const std::int64_t row = (bh / n_heads) * seq_len + t, cols = n_heads * head_dim;
    const std::int64_t o_stride = batch * seq_len * cols, lse_stride = batch * n_heads * seq_len;
    const A* part_lse = lse_parts + stat;
    const A* part_o = o_parts + row * cols + h * head_dim + d;
    A m = -kInfinity;
    for (std::int64_t r = 0; r < splits; ++r) m = part_lse[r * lse_stride] > m ? part_lse[r * lse_stride] : m;
    A sum = 0, acc = 0;
    if (m > -kInfinity)
      for (std::int64_t r = 0; r < splits; ++r) {
        const A l = part_lse[r * lse_stride];
        if (!(l > -kInfinity)) continue;
        const A w = exp_nonpositive(l - m);
        sum += w;
        acc += w * part_o[r * o_stride];
      }
    o[row * ldo + h * head_dim + d] = convert<T>(sum > A(0) ? acc / sum : A(0));
    if (d == 0) lse[stat] = sum > A(0) ? m + log_(sum) : -kInfinity;
  }
};

/// D (B, H, T) for the backward: index (b * H + h) * T + t gets dO . O over head h's
/// columns of row b * T + t.
template <class T>
struct FlashDelta {
  const T* o;
  std::int64_t ldo;
  const T* d_o;
  std::int64_t lddo;
  acc_t<T>* delta;
  std::int64_t seq_len;
  std::int64_t n_heads;
  std::int64_t head_dim;
  TESSERA_HD void operator()(std::int64_t index) const {
    using A = acc_t<T>;
    const std::int64_t t = index % seq_len, bh = index / seq_len;
    const std::int64_t row = (bh / n_heads) * seq_len + t, col = (bh % n_heads) * head_dim;
    const T* orow = o + row * ldo + col;
    const T* dorow = d_o + row * lddo + col;
    A s = 0;
    for (std::int64_t d = 0; d < head_dim; ++d) s += convert<A>(dorow[d]) * convert<A>(orow[d]);
    delta[index] = s;
  }
};

namespace detail {

template <class V>
void flash_check_matrix(const char* name, const V& m, std::int64_t rows, std::int64_t cols) {
  TESSERA_CHECK(m.rank() == 2 && m.rows() == rows && m.cols() == cols, "flash attention: ", name, " is ",
                m.shape().str(), ", expected (", rows, ", ", cols, ")");
  TESSERA_CHECK(m.stride(1) == 1 && m.ld() >= cols, "flash attention: ", name,
                " needs unit column stride and ld >= ", cols, " (ld ", m.ld(), ", column stride ", m.stride(1), ")");
}

}  // namespace detail

/// Checks an attention shape for the flash kernels: non-negative sizes, whole groups of
/// q heads per kv head, a supported head dim.
inline void flash_check_shape(const AttentionShape& s) {
  TESSERA_CHECK(s.batch >= 0 && s.seq_len >= 0, "flash attention: batch ", s.batch, " and seq_len ", s.seq_len,
                " must not be negative");
  TESSERA_CHECK(s.n_heads > 0 && s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0, "flash attention: n_heads ",
                s.n_heads, " is not a positive multiple of n_kv_heads ", s.n_kv_heads);
  TESSERA_CHECK(flash_head_dim_supported(s.head_dim), "flash attention: head dim ", s.head_dim,
                " is not supported (16, 32, 64 or 128)");
}

/// Checks the forward's operands against the shape (views in any memory: only their
/// shapes and strides are read).
template <class T>
void flash_check_forward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                         TensorView<const T> v, TensorView<const T> o) {
  flash_check_shape(s);
  TESSERA_CHECK(s.past >= 0, "flash attention: ", s.past, " keys before the queries");
  TESSERA_CHECK(s.past == 0 || s.documents == nullptr,
                "flash attention: keys before the queries (a KV cache's) over packed documents");
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  detail::flash_check_matrix("q", q, rows, qc);
  detail::flash_check_matrix("k", k, s.batch * s.key_len(), kc);
  detail::flash_check_matrix("v", v, s.batch * s.key_len(), kc);
  detail::flash_check_matrix("o", o, rows, qc);
}

/// Checks the backward's operands against the shape.
template <class T>
void flash_check_backward(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                          TensorView<const T> v, TensorView<const T> o, TensorView<const T> d_o,
                          TensorView<const T> dq, TensorView<const T> dk, TensorView<const T> dv) {
  TESSERA_CHECK(s.past == 0, "flash attention backward: keys before the queries (a KV cache's) are for decoding "
                             "only");
  flash_check_forward<T>(s, q, k, v, o);
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  detail::flash_check_matrix("dO", d_o, rows, qc);
  detail::flash_check_matrix("dq", dq, rows, qc);
  detail::flash_check_matrix("dk", dk, rows, kc);
  detail::flash_check_matrix("dv", dv, rows, kc);
}

namespace detail {

template <int HD>
void flash_check_driver(const AttentionShape& s, std::int64_t tile) {
  TESSERA_CHECK(s.head_dim == HD, "flash attention: the shape's head dim ", s.head_dim, " is not ", HD,
                ", the head dim the rows were instantiated for");
  TESSERA_CHECK(tile > 0, "flash attention: tiles of ", tile, " rows (at least 1)");
}

}  // namespace detail

/// The forward on the host, one FlashForwardRow per (b, h, query row) over key tiles
/// of `tile` rows (causal, tiles wholly after the query or before its document are
/// skipped, as the kernel skips them; full, every tile is visited): o (B*T, H*hd) and lse
/// (B, H, T). After a KV cache's keys (s.past) the keys of each row are walked in the
/// kernel's runs of `split_keys` (flash_key_splits: kFlashSplitKeys), each run's o and
/// lse kept in acc_t<T> (float, as the kernel's scratch, for float and bf16) and the runs
/// merged by FlashMergeSplits, as the kernel does. A reference driver for the functors,
/// not a fast path.
template <class T, int HD>
void flash_attention_forward_rows(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                  TensorView<const T> v, TensorView<T> o, acc_t<T>* lse, std::int64_t tile,
                                  std::int64_t split_keys = kFlashSplitKeys) {
  using A = acc_t<T>;
  flash_check_forward<T>(s, q, k, v, o);
  detail::flash_check_driver<HD>(s, tile);
  TESSERA_CHECK(split_keys > 0, "flash attention: runs of ", split_keys, " keys");
  const std::int64_t t = s.seq_len, key_len = s.key_len();
  const std::int64_t splits = flash_key_splits(s, split_keys);
  const std::int64_t run_keys = splits > 1 ? split_keys : key_len;
  const A scale = A(1) / sqrt_(static_cast<A>(HD));
  const std::int64_t cols = s.n_heads * HD, stats = s.batch * s.n_heads * t;
  std::vector<A> o_parts(splits > 1 ? static_cast<std::size_t>(splits * s.rows() * cols) : 0);
  std::vector<A> lse_parts(splits > 1 ? static_cast<std::size_t>(splits * stats) : 0);
  FlashForwardRow<T, HD> row;
  for (std::int64_t split = 0; split < splits; ++split) {
    const std::int64_t run_begin = split * run_keys, run_end = std::min(key_len, run_begin + run_keys);
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < s.n_heads; ++h) {
        const std::int64_t kvh = h / s.group(), bh = b * s.n_heads + h;
        for (std::int64_t i = 0; i < t; ++i) {
          const std::int64_t last = std::min(detail::flash_last_key(s.causal, i, t, s.past), run_end - 1);
          const std::int64_t first = std::max(detail::flash_first_key(s.documents, b * t + i, 0), run_begin);
          row.start(q.row(b * t + i) + h * HD, last, scale, first);
          for (std::int64_t key0 = first / tile * tile; key0 <= last; key0 += tile) {
            const std::int64_t n = tile < key_len - key0 ? tile : key_len - key0;
            row.update(k.row(b * key_len + key0) + kvh * HD, k.ld(), v.row(b * key_len + key0) + kvh * HD, v.ld(),
                       key0, n);
          }
          if (splits == 1)
            row.finish(o.row(b * t + i) + h * HD, lse + bh * t + i);
          else
            row.finish(o_parts.data() + (split * s.rows() + b * t + i) * cols + h * HD,
                       lse_parts.data() + split * stats + bh * t + i);
        }
      }
  }
  if (splits == 1) return;
  const FlashMergeSplits<T> merge{o_parts.data(), lse_parts.data(), o.data(), o.ld(), lse,
                                  splits,         s.batch,          t,        s.n_heads, HD};
  for (std::int64_t index = 0; index < stats * HD; ++index) merge(index);
}

/// The backward on the host: D from FlashDelta, then the key-row pass (dk, dv added
/// into) and the query-row pass (dq overwritten), tiles of `tile` rows aligned to
/// multiples of `tile` as the kernel's blocks align them.
template <class T, int HD>
void flash_attention_backward_rows(const AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                   TensorView<const T> v, TensorView<const T> o, const acc_t<T>* lse,
                                   TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv,
                                   std::int64_t tile) {
  using A = acc_t<T>;
  flash_check_backward<T>(s, q, k, v, o, d_o, dq, dk, dv);
  detail::flash_check_driver<HD>(s, tile);
  const std::int64_t t = s.seq_len;
  const A scale = A(1) / sqrt_(static_cast<A>(HD));
  std::vector<A> delta(static_cast<std::size_t>(s.batch * s.n_heads * t));
  const FlashDelta<T> rowdot{o.data(), o.ld(), d_o.data(), d_o.ld(), delta.data(), t, s.n_heads, HD};
  for (std::int64_t idx = 0; idx < static_cast<std::int64_t>(delta.size()); ++idx) rowdot(idx);

  FlashBackwardKeyRow<T, HD> key_row;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t kvh = 0; kvh < s.n_kv_heads; ++kvh)
      for (std::int64_t j = 0; j < t; ++j) {
        const std::int64_t first = detail::flash_first_query_of(s.causal, j);
        const std::int64_t last = detail::flash_last_query(s.documents, b * t + j, t - 1);
        key_row.start(k.row(b * t + j) + kvh * HD, v.row(b * t + j) + kvh * HD, first, scale, last);
        for (std::int64_t h = kvh * s.group(); h < (kvh + 1) * s.group(); ++h) {
          const std::int64_t bh = b * s.n_heads + h;
          for (std::int64_t query0 = first / tile * tile; query0 <= last; query0 += tile) {
            const std::int64_t n = tile < t - query0 ? tile : t - query0;
            key_row.update(q.row(b * t + query0) + h * HD, q.ld(), d_o.row(b * t + query0) + h * HD, d_o.ld(),
                           lse + bh * t + query0, delta.data() + bh * t + query0, query0, n);
          }
        }
        key_row.finish(dk.row(b * t + j) + kvh * HD, dv.row(b * t + j) + kvh * HD);
      }

  FlashBackwardQueryRow<T, HD> query_row;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.n_heads; ++h) {
      const std::int64_t kvh = h / s.group(), bh = b * s.n_heads + h;
      for (std::int64_t i = 0; i < t; ++i) {
        const std::int64_t last = detail::flash_last_key(s.causal, i, t);
        const std::int64_t first = detail::flash_first_key(s.documents, b * t + i, 0);
        query_row.start(q.row(b * t + i) + h * HD, d_o.row(b * t + i) + h * HD, lse[bh * t + i],
                        delta[static_cast<std::size_t>(bh * t + i)], last, scale, first);
        for (std::int64_t key0 = first / tile * tile; key0 <= last; key0 += tile) {
          const std::int64_t n = tile < t - key0 ? tile : t - key0;
          query_row.update(k.row(b * t + key0) + kvh * HD, k.ld(), v.row(b * t + key0) + kvh * HD, v.ld(), key0,
                           n);
        }
        query_row.finish(dq.row(b * t + i) + h * HD);
      }
    }
}

}  // namespace tessera::ops
