// Causal softmax rows for attention and their backward.
//
// Row r of a scores tile holds s_rj = q_i . k_j for query i = r + offset (the tile
// covers queries [offset, offset + rows)) and keys j in [0, cols); only j <= i is kept
// (an offset of cols or more keeps every key: attention without a mask).
// Forward writes p_ij = exp(s_ij - lse_i) (zero above the
// diagonal) and lse_i, the row's log-sum-exp: backward recomputes p from the scores
// and lse instead of keeping the (T, T) matrix alive, as flash attention does.
//
// Scores and probabilities are stored as T; the max, sums, lse and D are accum_t<T>
// (float for bf16 storage), and each stored probability or gradient is rounded once.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

namespace detail {

/// The visible keys of rows [0, rows) summed: row r sees min(r + offset + 1, cols) keys,
/// the elements a causal row functor reads. Closed form, for traffic().
inline double causal_visible(std::int64_t rows, std::int64_t offset, std::int64_t cols) {
  // Row r sees k = r + offset + 1 keys, k over [first, last], until k reaches cols.
  const double first = static_cast<double>(offset) + 1, last = static_cast<double>(offset) + static_cast<double>(rows);
  const double c = static_cast<double>(cols);
  double sum = 0;
  const double below = last < c ? last : c;  // the largest k not capped
  if (below >= first) sum += (first + below) * (below - first + 1) / 2;
  const double capped = last - (first - 1 > c ? first - 1 : c);  // rows that see all cols keys
  if (capped > 0) sum += capped * c;
  return sum;
}

}  // namespace detail

/// In place on row r of `s` (ld): scores * scale -> probabilities; writes lse[r].
template <class T>
struct CausalSoftmaxForward {
  T* s;
  std::int64_t ld;
  std::int64_t cols;
  std::int64_t offset;
  accum_t<T> scale;
  accum_t<T>* lse;
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    T* row = s + r * ld;
    const std::int64_t i = r + offset;
    const std::int64_t end = i < cols - 1 ? i + 1 : cols;  // keys [0, end) are visible
    const A sc = scale;  // a local: stores to row[] could alias a member
    A m = to_accum(row[0]) * sc;
    for (std::int64_t j = 1; j < end; ++j) {
      const A x = to_accum(row[j]) * sc;
      m = x > m ? x : m;
    }
    A sum = 0;
    if constexpr (detail::accum_is_storage<T>) {
      for (std::int64_t j = 0; j < end; ++j) row[j] = exp_nonpositive(row[j] * sc - m);  // vectorises
      for (std::int64_t j = 0; j < end; ++j) sum += row[j];
      const A inv = A(1) / sum;
      for (std::int64_t j = 0; j < end; ++j) row[j] *= inv;
    } else {
      // The row cannot hold the unrounded exponentials: they are summed, then computed
      // again for the output, so that the sum and each probability see them unrounded.
      for (std::int64_t j = 0; j < end; ++j) sum += exp_nonpositive(to_accum(row[j]) * sc - m);
      const A inv = A(1) / sum;
      for (std::int64_t j = 0; j < end; ++j) row[j] = from_accum<T>(exp_nonpositive(to_accum(row[j]) * sc - m) * inv);
    }
    for (std::int64_t j = end; j < cols; ++j) row[j] = from_accum<T>(A(0));
    lse[r] = m + log_(sum);
  }
  // The visible scores read once and the whole row written once (a row kernel keeps a
  // row of scores on chip between the max, the sum and the scaling); a bf16 row computes
  // its exponentials twice (see above), a float row once.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), visible = detail::causal_visible(rows, offset, cols);
    constexpr double kExps = detail::accum_is_storage<T> ? 1 : 2;
    Traffic t{visible * sizeof(T), r * static_cast<double>(cols) * sizeof(T) + r * sizeof(accum_t<T>),
              (4 + 2 * kExps) * visible + r, kExps * visible + r};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// Recomputes probabilities from raw scores and the saved lse, in place on `s`.
template <class T>
struct CausalSoftmaxRecompute {
  T* s;
  std::int64_t ld;
  std::int64_t cols;
  std::int64_t offset;
  accum_t<T> scale;
  const accum_t<T>* lse;
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    T* row = s + r * ld;
    const std::int64_t i = r + offset;
    const std::int64_t end = i < cols - 1 ? i + 1 : cols;  // keys [0, end) are visible
    const A l = lse[r], sc = scale;
    for (std::int64_t j = 0; j < end; ++j)
      row[j] = from_accum<T>(exp_nonpositive(to_accum(row[j]) * sc - l));  // vectorises
    for (std::int64_t j = end; j < cols; ++j) row[j] = from_accum<T>(A(0));
  }
  // The visible scores and lse read, the whole row written; 2 flops and an exp a score.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), visible = detail::causal_visible(rows, offset, cols);
    Traffic t{visible * sizeof(T) + r * sizeof(accum_t<T>), r * static_cast<double>(cols) * sizeof(T), 2 * visible,
              visible};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// dS_ij = scale * p_ij * (dP_ij - D_i), D_i = sum_k dO_ik O_ik (= sum_j p_ij dP_ij),
/// in place on dP.
template <class T>
struct CausalSoftmaxBackward {
  const T* p;
  std::int64_t ldp;
  T* dp;  // in: dP, out: dS
  std::int64_t lddp;
  const accum_t<T>* d;  // (rows) D_i
  std::int64_t cols;
  std::int64_t offset;
  accum_t<T> scale;
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    const T* pr = p + r * ldp;
    T* dr = dp + r * lddp;
    const std::int64_t i = r + offset;
    const std::int64_t end = i < cols - 1 ? i + 1 : cols;  // keys [0, end) are visible
    const A dd = d[r], sc = scale;
    for (std::int64_t j = 0; j < end; ++j) dr[j] = from_accum<T>(sc * to_accum(pr[j]) * (to_accum(dr[j]) - dd));
    for (std::int64_t j = end; j < cols; ++j) dr[j] = from_accum<T>(A(0));
  }
  // The visible p and dP read with D, the whole row of dP written; 3 flops a visible key.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), visible = detail::causal_visible(rows, offset, cols);
    Traffic t{2 * visible * sizeof(T) + r * sizeof(accum_t<T>), r * static_cast<double>(cols) * sizeof(T),
              3 * visible, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// D_i = sum_k dO_ik * O_ik over a head's columns.
template <class T>
struct RowDot {
  const T* a;
  std::int64_t lda;
  const T* b;
  std::int64_t ldb;
  std::int64_t n;
  accum_t<T>* out;
  TESSERA_HD void operator()(std::int64_t i) const {
    accum_t<T> s = 0;
    for (std::int64_t k = 0; k < n; ++k) s += to_accum(a[i * lda + k]) * to_accum(b[i * ldb + k]);
    out[i] = s;
  }
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(n);
    Traffic t{2 * e * sizeof(T), r * sizeof(accum_t<T>), 2 * e, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

}  // namespace tessera::ops
