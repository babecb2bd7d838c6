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
