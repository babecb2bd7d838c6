// Cross-entropy over a row of logits, fused with its gradient.
//
// For row r with target t (or ignore_index): loss_r = lse(z) - z_t. The row is
// overwritten in place: with d loss / dz = scale * (softmax(z) - onehot(t)) when
// write_grad, else with exp(z - max z). So the logits of a chunk never need a second
// buffer. An ignored row gets loss 0 and a zero gradient.
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"

namespace tessera::ops {

inline constexpr std::int32_t kIgnoreIndex = -100;

template <class T>
struct CrossEntropyRow {
  T* logits;  // (rows, vocab), leading dimension ld; overwritten with the gradient
  std::int64_t ld;
  std::int64_t vocab;
  const std::int32_t* targets;
  T scale;          // d(total loss)/d(loss_r), e.g. 1 / number of target tokens
  bool write_grad;  // false: loss only
  double* loss;     // (rows) per-row loss, summed by the caller in order
  TESSERA_HD void operator()(std::int64_t r) const {
    T* z = logits + r * ld;
    const std::int32_t t = targets[r];
    if (t == kIgnoreIndex) {
      loss[r] = 0;
      if (write_grad)
        for (std::int64_t j = 0; j < vocab; ++j) z[j] = 0;
      return;
    }
    const T zt = z[t];
    T m = z[0];
    for (std::int64_t j = 1; j < vocab; ++j) m = z[j] > m ? z[j] : m;
    for (std::int64_t j = 0; j < vocab; ++j) z[j] = exp_nonpositive(z[j] - m);  // vectorises
    T sum = 0;
    for (std::int64_t j = 0; j < vocab; ++j) sum += z[j];
    loss[r] = static_cast<double>(m + log_(sum) - zt);
    if (!write_grad) return;
    const T inv = scale / sum;
    for (std::int64_t j = 0; j < vocab; ++j) z[j] *= inv;
    z[t] -= scale;
  }
};

}  // namespace tessera::ops

namespace tessera::ops {

// Loss parallelism: a row's logits split by vocabulary over ranks, rank k holding the
// columns [lo, lo + vocab) of the whole vocabulary. Three passes over a chunk of rows,
// with an all-reduce after each of the first two:
//   1. CrossEntropyShardMax   stats[r] = max of this rank's logits  -> all-reduce max
//   2. CrossEntropyShardExp   z <- exp(z - max); stats2[2r] = their sum, stats2[2r+1] =
//                             the target's logit if this rank holds it, else 0
//                                                                   -> all-reduce sum
//   3. CrossEntropyShardGrad  loss_r = max + log(sum) - z_t; z <- scale * (softmax - onehot)
// Every rank ends with the same loss for every row and the gradient of its columns.

template <class T>
struct CrossEntropyShardMax {
  const T* logits;
  std::int64_t ld, vocab;
  const std::int32_t* targets;
  T* max;  // (rows)
  TESSERA_HD void operator()(std::int64_t r) const {
    const T* z = logits + r * ld;
    T m = z[0];
    for (std::int64_t j = 1; j < vocab; ++j) m = z[j] > m ? z[j] : m;
    max[r] = targets[r] == kIgnoreIndex ? T(0) : m;
  }
};

template <class T>
struct CrossEntropyShardExp {
  T* logits;
  std::int64_t ld, vocab, lo;
  const std::int32_t* targets;
  const T* max;  // (rows), over every rank
  T* sums;       // (rows, 2): sum of exponentials, target logit
  TESSERA_HD void operator()(std::int64_t r) const {
    T* z = logits + r * ld;
    const std::int64_t t = targets[r];
    sums[2 * r] = 0;
    sums[2 * r + 1] = 0;
    if (t == kIgnoreIndex) return;
    if (t >= lo && t < lo + vocab) sums[2 * r + 1] = z[t - lo];
    const T m = max[r];
    for (std::int64_t j = 0; j < vocab; ++j) z[j] = exp_nonpositive(z[j] - m);
    T s = 0;
    for (std::int64_t j = 0; j < vocab; ++j) s += z[j];
    sums[2 * r] = s;
  }
};

template <class T>
struct CrossEntropyShardGrad {
  T* logits;
  std::int64_t ld, vocab, lo;
  const std::int32_t* targets;
  const T* max;   // (rows), over every rank
  const T* sums;  // (rows, 2), over every rank
  T scale;
  bool write_grad;
  double* loss;  // (rows)
  TESSERA_HD void operator()(std::int64_t r) const {
    T* z = logits + r * ld;
    const std::int64_t t = targets[r];
    if (t == kIgnoreIndex) {
      loss[r] = 0;
      if (write_grad)
        for (std::int64_t j = 0; j < vocab; ++j) z[j] = 0;
      return;
    }
    const T sum = sums[2 * r];
    loss[r] = static_cast<double>(max[r] + log_(sum) - sums[2 * r + 1]);
    if (!write_grad) return;
    const T inv = scale / sum;
    for (std::int64_t j = 0; j < vocab; ++j) z[j] *= inv;
    if (t >= lo && t < lo + vocab) z[t - lo] -= scale;
  }
};

}  // namespace tessera::ops
