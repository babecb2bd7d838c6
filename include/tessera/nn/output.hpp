// The output projection fused with the cross-entropy loss, in row chunks.
//
// logits = h W^T would be (rows, vocab): for a 128256-token vocabulary and 16k rows
// that is 8 GiB of fp32. Instead rows are taken in chunks of at most
// kChunkElements / vocab: each chunk's logits are made, turned in place into the
// loss gradient (ops::CrossEntropyRow), pushed through the projection's backward
// (dh rows and dW) and dropped before the next chunk. So training computes the
// head's backward during its forward, and the layer's backward only hands back the
// saved dh.
//
// Loss parallelism (parallel/tensor_parallel.hpp): with the weight split by
// vocabulary over the tensor-parallel ranks, each rank makes its columns of a chunk's
// logits and the cross-entropy is completed by two all-reduces per chunk (the row
// maximum, then the sum of exponentials with the target's logit), so no rank ever
// holds whole rows of logits. Each rank gets every row's loss and a partial dh (its
// columns' share), which the model reduce-scatters to rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/region.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/traffic.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

namespace detail {
/// Row r of (rows, parts * cols) from `parts` blocks of (rows, cols) laid end to end.
template <class T>
struct InterleaveColumns {
  const T* blocks;
  T* out;
  std::int64_t parts, rows, cols;
  TESSERA_HD void operator()(std::int64_t r) const {
    for (std::int64_t k = 0; k < parts; ++k)
      for (std::int64_t j = 0; j < cols; ++j) out[r * parts * cols + k * cols + j] = blocks[(k * rows + r) * cols + j];
  }
  // Rows [0, n) of the output: parts * cols elements each, read and written.
  ops::Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n) * static_cast<double>(parts) * static_cast<double>(cols);
    ops::Traffic t{e * sizeof(T), e * sizeof(T), 0, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};
}  // namespace detail

/// Elements of one chunk of logits (16 MiB of fp32).
inline constexpr std::int64_t kLossChunkElements = std::int64_t{1} << 22;

/// Rows per chunk of the head over a vocabulary (this rank's share of it) of `vocab`.
inline std::int64_t loss_chunk_rows(std::int64_t vocab, std::int64_t rows) {
  return std::clamp<std::int64_t>(kLossChunkElements / std::max<std::int64_t>(vocab, 1), 1,
                                  std::max<std::int64_t>(rows, 1));
}

template <class T, Backend B>
class ChunkedCrossEntropyHead {
 public:
  using A = accum_t<T>;  // logits, their statistics and the weight's gradient
  static constexpr std::int64_t kChunkElements = kLossChunkElements;

  /// `tp`: the group the weight is split over by vocabulary (loss parallelism), if it is.
  explicit ChunkedCrossEntropyHead(Parameter<T>* weight, parallel::TensorParallelGroup* tp = nullptr)
      : weight_(weight), tp_(tp) {}

  /// Whether dh from forward() is a partial sum over the tensor-parallel ranks.
  bool vocab_parallel() const { return parallel::active(tp_) && weight_->split.split(); }

  static std::int64_t chunk_rows(std::int64_t vocab, std::int64_t rows) { return loss_chunk_rows(vocab, rows); }

  /// Sum over rows of the cross-entropy of h W^T against targets. With `dh` given,
  /// also writes d(loss_scale * sum)/dh into it and accumulates dW.
  ///
  /// Logits, their statistics and their gradient are accum_t<T> (fp32 for bf16: the
  /// GEMM accumulates in fp32 and writes fp32 logits, so the loss never sees bf16
  /// logits); the gradient is rounded to T once, as the operand of the two backward
  /// GEMMs.
  double forward(const Tensor<T>& h, std::span<const std::int32_t> targets, A loss_scale, Tensor<T>* dh) {
    Region region(region::kLossHead);
    const std::int64_t rows = h.size(0), vocab = weight_->whole.dims[0];
    TESSERA_CHECK(static_cast<std::int64_t>(targets.size()) == rows, "loss: ", targets.size(), " targets for ", rows,
                  " rows");
    for (std::size_t i = 0; i < targets.size(); ++i)
      TESSERA_CHECK(targets[i] == ops::kIgnoreIndex || (targets[i] >= 0 && targets[i] < vocab), "loss: target id ",
                    targets[i], " at position ", i, " is outside the vocabulary of ", vocab);
    const std::int64_t local = weight_->value.size(0);  // this rank's vocabulary
    const std::int64_t step = chunk_rows(local, rows);
    const Tensor<std::int32_t> target_ids = upload<B>(targets);
    Tensor<double> row_loss = B::template empty<double>(Shape{rows});
    Tensor<A> logits = B::template empty<A>(Shape{std::min(step, rows), local});
    Tensor<T> logits_grad;  // the gradient rounded to T, when T is not A
    if constexpr (!std::is_same_v<T, A>)
      if (dh != nullptr) logits_grad = B::template empty<T>(logits.shape());
    Tensor<A> max, sums;
    if (vocab_parallel()) {
      max = B::template empty<A>(Shape{std::min(step, rows)});
      sums = B::template empty<A>(Shape{2 * std::min(step, rows)});
    }
    const std::int64_t lo = local * weight_->split.index;
    for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
      const std::int64_t r1 = std::min(rows, r0 + step), n = r1 - r0;
      TensorView<A> z = logits.view().slice_rows(0, n);
      TensorView<const T> hc = h.cview().slice_rows(r0, r1);
      B::gemm(Trans::no, Trans::yes, A(1), hc, weight_->value.cview(), A(0), z);
      if (vocab_parallel()) {
        const std::int32_t* t = target_ids.data() + r0;
        B::for_each(n, ops::CrossEntropyShardMax<A>{z.data(), local, local, t, max.data()});
        tp_->comm().all_reduce(std::span<A>(max.data(), static_cast<std::size_t>(n)), comm::ReduceOp::max);
        B::for_each(n, ops::CrossEntropyShardExp<A>{z.data(), local, local, lo, t, max.data(), sums.data()});
        tp_->comm().all_reduce(std::span<A>(sums.data(), static_cast<std::size_t>(2 * n)));
        B::for_each(n, ops::CrossEntropyShardGrad<A>{z.data(), local, local, lo, t, max.data(), sums.data(), loss_scale,
                                                     dh != nullptr, row_loss.data() + r0});
      } else {
        B::for_each(n, ops::CrossEntropyRow<A>{z.data(), local, local, target_ids.data() + r0, loss_scale, dh != nullptr,
                                               row_loss.data() + r0});
      }
      if (dh != nullptr) {
        TensorView<const T> dz;
        if constexpr (std::is_same_v<T, A>) {
          dz = z;
        } else {
          B::for_each(n * local, ops::Convert<A, T>{z.data(), logits_grad.data()});
          dz = logits_grad.cview().slice_rows(0, n);
        }
        B::gemm(Trans::no, Trans::no, A(1), dz, weight_->value.cview(), A(0), dh->view().slice_rows(r0, r1));
        B::gemm(Trans::yes, Trans::no, A(1), dz, hc, A(1), weight_->grad.view());
      }
    }
    // Summed on the host in row order: the same total on every backend.
    const Tensor<double> losses = download<B>(row_loss);
    double total = 0;
    for (std::int64_t r = 0; r < rows; ++r) total += losses[r];
    return total;
  }

  /// logits = h W^T for every row of h (use on few rows: generation), in accum_t<T>.
  /// Under loss parallelism every rank's columns are gathered (collective over the group).
  Tensor<A> logits(const Tensor<T>& h) const {
    Tensor<A> z = B::template empty<A>(Shape{h.size(0), weight_->value.size(0)});
    B::gemm(Trans::no, Trans::yes, A(1), h.cview(), weight_->value.cview(), A(0), z.view());
    if (!vocab_parallel()) return z;
    const std::int64_t parts = tp_->degree(), rows = z.size(0), local = z.size(1);
    Tensor<A> all = B::template empty<A>(Shape{parts * rows * local});
    tp_->comm().all_gather(std::span<const A>(z.data(), static_cast<std::size_t>(z.numel())),
                           std::span<A>(all.data(), static_cast<std::size_t>(all.numel())));
    Tensor<A> whole = B::template empty<A>(Shape{rows, parts * local});
    B::for_each(rows, detail::InterleaveColumns<A>{all.data(), whole.data(), parts, rows, local});
    return whole;
  }

 private:
  Parameter<T>* weight_;
  parallel::TensorParallelGroup* tp_ = nullptr;
};

}  // namespace tessera::nn
