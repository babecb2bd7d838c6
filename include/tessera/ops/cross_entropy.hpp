// Cross-entropy over a row of logits, fused with its gradient.
//
// For row r with target t (or ignore_index): loss_r = lse(z) - z_t. The row is
// overwritten in place with d loss / dz = scale * (softmax(z) - onehot(t)) when
// write_grad, so the logits of a chunk never need a second buffer; without write_grad
// the row is scratch (float and double rows are left holding exp(z - max z), bf16 rows
// their logits). An ignored row gets loss 0 and a zero gradient.
//
// The max, the sum of exponentials and the scale are accum_t<T> (float for bf16
// storage). A float or double row holds the exponentials between passes; a bf16 row
// cannot hold them unrounded, so they are summed and then computed again for the
// gradient, each gradient element rounded once.
//
// With `grad` set, the gradient goes there instead (rows of G, leading dimension
// grad_ld; a bf16 operand for the loss head's backward GEMMs, read from float logits):
// the logits are only read, the exponentials computed again for the gradient, each
// element rounded once to G, so a separate conversion pass is not needed. Its values are
// those the in-place gradient rounded to G would have, bit for bit.
//
// traffic(): the functor's passes over a row, each reading it from memory again (a
// vocabulary row of up to 128256 logits does not stay in a CPU core's nearest caches
// between them): the max; the exponentials and their sum (one pass: a float row writes
// them back); the gradient (read and written, the target's correction within it). Every
// row is counted as having a target (an ignored row only reads its target and writes
// zeros), and a shard as holding every row's target.
//
// cuda_traffic(): on sm_90 the CUDA kernel holds a row of kOneReadMinVocab to
// kOneReadMaxVocab logits in the registers of a cluster of blocks
// (backend/cuda/cross_entropy_kernels.cuh), so the row is read once and its output
// written once, whatever the passes; other vocabularies (and older GPUs) take the
// passes above.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

inline constexpr std::int32_t kIgnoreIndex = -100;

/// The vocabularies whose rows the CUDA kernel reads once on sm_90 (a cluster of 8 blocks
/// of 512 threads, 32 logits a thread at most); shorter rows stay in L2 between passes.
inline constexpr std::int64_t kOneReadMinVocab = 8193;
inline constexpr std::int64_t kOneReadMaxVocab = 8 * 512 * 32;

template <class T, class G = T>
struct CrossEntropyRow {
  T* logits;  // (rows, vocab), leading dimension ld; overwritten with the gradient (grad unset)
  std::int64_t ld;
  std::int64_t vocab;
  const std::int32_t* targets;
  accum_t<T> scale;  // d(total loss)/d(loss_r), e.g. 1 / number of target tokens
  bool write_grad;   // false: loss only
  double* loss;      // (rows) per-row loss, summed by the caller in order
  G* grad = nullptr;         // where the gradient goes, (rows, vocab) at leading dimension grad_ld; unset: the logits
  std::int64_t grad_ld = 0;
  /// Where the scale is read in the backend's memory, in place of `scale` (a step a graph
  /// replays: the scale changes with the batch's target count, the launch may not).
  const accum_t<T>* scale_at = nullptr;

  TESSERA_HD accum_t<T> loss_scale() const { return scale_at != nullptr ? *scale_at : scale; }

  /// Whether the row holds the exponentials between passes: float and double logits
  /// written over by their own gradient.
  static constexpr bool kKeep(bool separate) { return detail::accum_is_storage<T> && !separate; }

  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    T* z = logits + r * ld;
    G* d = grad != nullptr ? grad + r * grad_ld : nullptr;
    const std::int32_t t = targets[r];
    if (t == kIgnoreIndex) {
      loss[r] = 0;
      if (write_grad) {
        if (d != nullptr)
          for (std::int64_t j = 0; j < vocab; ++j) d[j] = from_accum<G>(A(0));
        else
          for (std::int64_t j = 0; j < vocab; ++j) z[j] = from_accum<T>(A(0));
      }
      return;
    }
    const A zt = to_accum(z[t]);
    A m = to_accum(z[0]);
    for (std::int64_t j = 1; j < vocab; ++j) {
      const A x = to_accum(z[j]);
      m = x > m ? x : m;
    }
    A sum = 0;
    if constexpr (detail::accum_is_storage<T>) {
      if (d == nullptr) {
        for (std::int64_t j = 0; j < vocab; ++j) z[j] = exp_nonpositive(z[j] - m);  // vectorises
        for (std::int64_t j = 0; j < vocab; ++j) sum += z[j];
      } else {
        for (std::int64_t j = 0; j < vocab; ++j) sum += exp_nonpositive(z[j] - m);
      }
    } else {
      for (std::int64_t j = 0; j < vocab; ++j) sum += exp_nonpositive(to_accum(z[j]) - m);
    }
    loss[r] = static_cast<double>(m + log_(sum) - zt);
    if (!write_grad) return;
    const A scale = loss_scale();
    const A inv = scale / sum;
    if (d != nullptr) {
      for (std::int64_t j = 0; j < vocab; ++j) d[j] = from_accum<G>(exp_nonpositive(to_accum(z[j]) - m) * inv);
      d[t] = from_accum<G>(exp_nonpositive(zt - m) * inv - scale);
    } else if constexpr (detail::accum_is_storage<T>) {
      for (std::int64_t j = 0; j < vocab; ++j) z[j] *= inv;
      z[t] -= scale;
    } else {
      for (std::int64_t j = 0; j < vocab; ++j) z[j] = from_accum<T>(exp_nonpositive(to_accum(z[j]) - m) * inv);
      z[t] = from_accum<T>(exp_nonpositive(zt - m) * inv - scale);
    }
  }
  // Per row: the target and its logit, then the passes (see the top of this file); with
  // `grad` set the gradient pass reads the logits and writes G.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), v = static_cast<double>(vocab), g = write_grad ? 1 : 0;
    const bool separate = grad != nullptr;
    const bool keep = kKeep(separate);  // the row holds the exponentials
    const double out = separate ? static_cast<double>(sizeof(G)) : static_cast<double>(sizeof(T));
    const double read = r * (sizeof(std::int32_t) + sizeof(T) * (1 + (2 + g) * v));
    const double written = r * (sizeof(double) + v * ((keep ? sizeof(T) : 0) + g * out));
    // max: v - 1 comparisons; exponentials: a subtraction and an addition each; the
    // loss: 2; the gradient: the factor, then a multiplication each (without the
    // exponentials held: the exponential again) and the target's correction.
    const double flops = r * (3 * v + 1 + g * (keep ? v + 2 : 2 * v + 4));
    const double exps = r * (v + 1 + (keep ? 0 : g * (v + 1)));
    Traffic t{read, written, flops, exps};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
  // The CUDA kernel's: a row held on chip is read once; its gradient (or, for a float
  // row without the gradient, its exponentials) written once.
  Traffic cuda_traffic(std::int64_t rows) const {
    Traffic t = traffic(rows);
    if (vocab < kOneReadMinVocab || vocab > kOneReadMaxVocab) return t;
    const double r = static_cast<double>(rows), v = static_cast<double>(vocab);
    const bool keep = kKeep(grad != nullptr);
    const double out = grad != nullptr ? static_cast<double>(sizeof(G)) : static_cast<double>(sizeof(T));
    t.bytes_read = r * (sizeof(std::int32_t) + sizeof(T) * (1 + v));
    t.bytes_written = r * (sizeof(double) + v * (write_grad ? out : (keep ? sizeof(T) : 0)));
    t.walk_bytes = 0;  // a cluster's threads read the row side by side
    return t;
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
// The max and the sums are accum_t<T>. A bf16 row keeps its logits through pass 2 and
// pass 3 computes the exponentials again from them, so each gradient element is
// rounded once.

template <class T>
struct CrossEntropyShardMax {
  const T* logits;
  std::int64_t ld, vocab;
  const std::int32_t* targets;
  accum_t<T>* max;  // (rows)
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    const T* z = logits + r * ld;
    A m = to_accum(z[0]);
    for (std::int64_t j = 1; j < vocab; ++j) {
      const A x = to_accum(z[j]);
      m = x > m ? x : m;
    }
    max[r] = targets[r] == kIgnoreIndex ? A(0) : m;
  }
  // Every row's target and logits read (an ignored row's too: they are read before its
  // target is looked at), its max written; v - 1 comparisons a row.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), v = static_cast<double>(vocab);
    Traffic t{r * (sizeof(std::int32_t) + v * sizeof(T)), r * sizeof(accum_t<T>), r * (v - 1), 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

template <class T>
struct CrossEntropyShardExp {
  T* logits;
  std::int64_t ld, vocab, lo;
  const std::int32_t* targets;
  const accum_t<T>* max;  // (rows), over every rank
  accum_t<T>* sums;       // (rows, 2): sum of exponentials, target logit
  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    T* z = logits + r * ld;
    const std::int64_t t = targets[r];
    sums[2 * r] = 0;
    sums[2 * r + 1] = 0;
    if (t == kIgnoreIndex) return;
    if (t >= lo && t < lo + vocab) sums[2 * r + 1] = to_accum(z[t - lo]);
    const A m = max[r];
    A s = 0;
    if constexpr (detail::accum_is_storage<T>) {
      for (std::int64_t j = 0; j < vocab; ++j) z[j] = exp_nonpositive(z[j] - m);
      for (std::int64_t j = 0; j < vocab; ++j) s += z[j];
    } else {
      for (std::int64_t j = 0; j < vocab; ++j) s += exp_nonpositive(to_accum(z[j]) - m);
    }
    sums[2 * r] = s;
  }
  // Per row: the target, the max, the target's logit and the row read; the two sums
  // written, and a float row's exponentials; a subtraction, an addition and an exp a logit.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), v = static_cast<double>(vocab);
    constexpr double kKeep = detail::accum_is_storage<T> ? 1 : 0;
    Traffic t{r * (sizeof(std::int32_t) + sizeof(accum_t<T>) + sizeof(T) * (1 + v)),
              r * (2 * sizeof(accum_t<T>) + kKeep * v * sizeof(T)), 2 * r * v, r * v};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

template <class T>
struct CrossEntropyShardGrad {
  T* logits;
  std::int64_t ld, vocab, lo;
  const std::int32_t* targets;
  const accum_t<T>* max;   // (rows), over every rank
  const accum_t<T>* sums;  // (rows, 2), over every rank
  accum_t<T> scale;
  bool write_grad;
  double* loss;  // (rows)
  const accum_t<T>* scale_at = nullptr;  // where the scale is read, in place of `scale` (CrossEntropyRow's)

  TESSERA_HD accum_t<T> loss_scale() const { return scale_at != nullptr ? *scale_at : scale; }

  TESSERA_HD void operator()(std::int64_t r) const {
    using A = accum_t<T>;
    T* z = logits + r * ld;
    const std::int64_t t = targets[r];
    if (t == kIgnoreIndex) {
      loss[r] = 0;
      if (write_grad)
        for (std::int64_t j = 0; j < vocab; ++j) z[j] = from_accum<T>(A(0));
      return;
    }
    const A sum = sums[2 * r];
    loss[r] = static_cast<double>(max[r] + log_(sum) - sums[2 * r + 1]);
    if (!write_grad) return;
    const A scale = loss_scale();
    const A inv = scale / sum;
    if constexpr (detail::accum_is_storage<T>) {
      for (std::int64_t j = 0; j < vocab; ++j) z[j] *= inv;
      if (t >= lo && t < lo + vocab) z[t - lo] -= scale;
    } else {
      const bool holds_target = t >= lo && t < lo + vocab;
      const A m = max[r];
      const A zt = holds_target ? to_accum(z[t - lo]) : A(0);
      for (std::int64_t j = 0; j < vocab; ++j) z[j] = from_accum<T>(exp_nonpositive(to_accum(z[j]) - m) * inv);
      if (holds_target) z[t - lo] = from_accum<T>(exp_nonpositive(zt - m) * inv - scale);
    }
  }
  // Per row: the target, the max and the two sums read, the loss written (2 flops and a
  // log); with write_grad the gradient pass, as CrossEntropyRow's.
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), v = static_cast<double>(vocab), grad = write_grad ? 1 : 0;
    constexpr bool kKeep = detail::accum_is_storage<T>;
    Traffic t{r * (sizeof(std::int32_t) + 3 * sizeof(accum_t<T>) + grad * v * sizeof(T)),
              r * (sizeof(double) + grad * v * sizeof(T)), r * (2 + grad * (kKeep ? v + 2 : 2 * v + 4)),
              r * (1 + (kKeep ? 0 : grad * (v + 1)))};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

}  // namespace tessera::ops
