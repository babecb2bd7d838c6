// The output projection fused with the cross-entropy loss, in row chunks.
//
// logits = h W^T would be (rows, vocab): for a 128256-token vocabulary and 16k rows
// that is 8 GiB of fp32. Instead rows are taken in chunks: each chunk's logits are made,
// turned into the loss gradient (ops::CrossEntropyRow: in place for a float model; for
// bf16, read from the fp32 logits and written as the bf16 operand of the backward GEMMs
// in the same pass), pushed through the projection's backward (dh rows and dW) and
// dropped before the next chunk. So training
// computes the head's backward during its forward, and the layer's backward only hands
// back the saved dh.
//
// Chunk size. Every chunk reads the weight twice and reads and writes its fp32 gradient
// once, so the number of chunks multiplies that traffic, and a chunk of few rows leaves
// most SMs idle in the cross-entropy kernel (one row per block) and makes skinny GEMMs.
// A chunk's logits (accum_t<T>) and their gradient rounded to T may take 1/64 of the
// device's memory, at most 4 GiB (loss_chunk_budget): on an 80 GB GPU with Llama 3's
// vocabulary and bf16 that is about 1600 rows, on a 141 GB one 2800, so a step of 8192
// rows makes 3 to 6 chunks where 16 MiB chunks made 256. On a host (device memory 0) a
// chunk takes 16 MiB, which keeps it near the CPU's caches. The budget follows the
// device's capacity, not what is free at the moment: it is fixed when the head is built,
// so a run's chunking (and the order its dW is summed in) is the same at every step and
// in every checkpoint mode, and the optimizer's state, which arrives after the first
// forward, is not counted on.
//
// Loss parallelism (parallel/tensor_parallel.hpp): with the weight split by
// vocabulary over the tensor-parallel ranks, each rank makes its columns of a chunk's
// logits and the cross-entropy is completed by two all-reduces per chunk (the row
// maximum, then the sum of exponentials with the target's logit), so no rank ever
// holds whole rows of logits. Each rank gets every row's loss and a partial dh (its
// columns' share), which the model reduce-scatters to rows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/region.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/lora.hpp"
#include "tessera/ops/cross_entropy.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/norm.hpp"
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

/// Bytes of one chunk on a host (device memory 0): 16 MiB.
inline constexpr std::size_t kHostLossChunkBytes = std::size_t{16} << 20;
/// The most one chunk takes on any device: 4 GiB.
inline constexpr std::size_t kMaxLossChunkBytes = std::size_t{4} << 30;

/// Bytes one chunk's logits and their gradient may take on a device of `device_bytes`
/// (0: the host): 1/64 of the device, between 16 MiB and 4 GiB.
inline std::size_t loss_chunk_budget(std::size_t device_bytes) {
  if (device_bytes == 0) return kHostLossChunkBytes;
  return std::clamp(device_bytes / 64, kHostLossChunkBytes, kMaxLossChunkBytes);
}

/// Bytes per logit a chunk holds for parameters of `dtype`: the fp32 logit, and for a
/// bf16 model its gradient rounded to bf16 (the backward GEMMs' operand).
inline std::size_t loss_chunk_bytes_per_logit(DType dtype) { return dtype == DType::bf16 ? 4 + 2 : 4; }

/// Rows per chunk of the head over a vocabulary (this rank's share of it) of `vocab`, for
/// `rows` rows, each logit taking `bytes_per_logit`, within `budget` bytes. The defaults
/// are an fp32 model on a host.
inline std::int64_t loss_chunk_rows(std::int64_t vocab, std::int64_t rows, std::size_t bytes_per_logit = 4,
                                    std::size_t budget = kHostLossChunkBytes) {
  const std::size_t row_bytes = static_cast<std::size_t>(std::max<std::int64_t>(vocab, 1)) * bytes_per_logit;
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(budget / row_bytes), 1, std::max<std::int64_t>(rows, 1));
}

template <class T, Backend B>
class ChunkedCrossEntropyHead {
 public:
  using A = accum_t<T>;  // logits, their statistics and the weight's gradient
  /// Bytes per logit in a chunk: A, and the gradient rounded to T when T is not A.
  static constexpr std::size_t kBytesPerLogit = sizeof(A) + (std::is_same_v<T, A> ? 0 : sizeof(T));

  /// `tp`: the group the weight is split over by vocabulary (loss parallelism), if it is.
  /// The chunks' budget is fixed here, from the memory of the device B runs on.
  /// `lora`: the projection's LoRA adapter, if it has one (its weight then frozen).
  explicit ChunkedCrossEntropyHead(Parameter<T>* weight, parallel::TensorParallelGroup* tp = nullptr,
                                   LoraAdapter<T, B>* lora = nullptr)
      : weight_(weight), tp_(tp), lora_(lora), budget_(loss_chunk_budget(device_memory_bytes<B>())) {}

  /// Whether dh from forward() is a partial sum over the tensor-parallel ranks.
  bool vocab_parallel() const { return parallel::active(tp_) && weight_->split.split(); }

  /// Rows per chunk over a vocabulary share of `vocab`, for `rows` rows.
  std::int64_t chunk_rows(std::int64_t vocab, std::int64_t rows) const {
    return loss_chunk_rows(vocab, rows, kBytesPerLogit, budget_);
  }
  /// Bytes a chunk's logits and their gradient may take.
  std::size_t chunk_budget() const { return budget_; }

  /// Sum over rows of the cross-entropy of h W^T against targets, read by the host (the
  /// overload below, then a copy to the host). With `dh` given, also writes
  /// d(loss_scale * sum)/dh into it and accumulates dW.
  double forward(const Tensor<T>& h, std::span<const std::int32_t> targets, A loss_scale, Tensor<T>* dh) {
    const Tensor<double> sum = B::template zeros<double>(Shape{1});
    forward(h, targets, loss_scale, dh, sum.data());
    return download<B>(sum)[0];
  }

  /// As above, the sum added to *loss_sum in B's memory, which the host does not read:
  /// the rows' losses added in lane order (ops::LaneSum), the same sum on every backend.
  ///
  /// Logits and their statistics are accum_t<T> (fp32 for bf16: the GEMM accumulates in
  /// fp32 and writes fp32 logits, so the loss never sees bf16 logits); the gradient is
  /// computed in accum_t<T> and rounded to T once, as the operand of the two backward
  /// GEMMs (by the cross-entropy kernel itself, or, under loss parallelism, after it).
  void forward(const Tensor<T>& h, std::span<const std::int32_t> targets, A loss_scale, Tensor<T>* dh,
               double* loss_sum) {
    Region region(region::kLossHead);
    check_targets(targets, h.size(0));
    const Tensor<std::int32_t> target_ids = upload<B>(targets);
    forward(h, target_ids, LossScale{loss_scale, nullptr}, dh, loss_sum);
  }

  /// Each target a vocabulary id or ops::kIgnoreIndex, one per row of `rows`; else an
  /// error naming the first that is not.
  void check_targets(std::span<const std::int32_t> targets, std::int64_t rows) const {
    const std::int64_t vocab = weight_->whole.dims[0];
    TESSERA_CHECK(static_cast<std::int64_t>(targets.size()) == rows, "loss: ", targets.size(), " targets for ", rows,
                  " rows");
    for (std::size_t i = 0; i < targets.size(); ++i)
      TESSERA_CHECK(targets[i] == ops::kIgnoreIndex || (targets[i] >= 0 && targets[i] < vocab), "loss: target id ",
                    targets[i], " at position ", i, " is outside the vocabulary of ", vocab);
  }

  /// d(total loss)/d(a row's loss): a value, or (`at` set) the value in B's memory there.
  struct LossScale {
    A value = 0;
    const A* at = nullptr;
  };

  /// As above, from targets already in B's memory (checked by check_targets) and the scale
  /// `scale`: what a staged micro-batch gives (Transformer::stage).
  void forward(const Tensor<T>& h, const Tensor<std::int32_t>& target_ids, LossScale scale, Tensor<T>* dh,
               double* loss_sum) {
    Region region(region::kLossHead);
    const std::int64_t rows = h.size(0);
    TESSERA_CHECK(target_ids.numel() == rows, "loss: ", target_ids.numel(), " targets for ", rows, " rows");
    const A loss_scale = scale.value;
    const std::int64_t local = weight_->value.size(0);  // this rank's vocabulary
    const std::int64_t step = chunk_rows(local, rows);
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
    // The adapter's gradients, summed over the chunks and finished once (LoraAdapter).
    Tensor<A> lora_a_sum, lora_b_sum;
    if (lora_ != nullptr && dh != nullptr) {
      lora_a_sum = B::template empty<A>(lora_->a().value.shape());
      lora_b_sum = B::template empty<A>(lora_->b().value.shape());
    }
    for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
      const std::int64_t r1 = std::min(rows, r0 + step), n = r1 - r0;
      TensorView<A> z = logits.view().slice_rows(0, n);
      TensorView<const T> hc = h.cview().slice_rows(r0, r1);
      B::gemm(Trans::no, Trans::yes, A(1), hc, weight_->value.cview(), A(0), z);
      Tensor<T> lora_u;  // the adapter's x A^T, for its gradients below
      if (lora_ != nullptr) lora_u = lora_->add_forward(hc, z);
      if (vocab_parallel()) {
        const std::int32_t* t = target_ids.data() + r0;
        B::for_each(n, ops::CrossEntropyShardMax<A>{z.data(), local, local, t, max.data()});
        tp_->comm().all_reduce(std::span<A>(max.data(), static_cast<std::size_t>(n)), comm::ReduceOp::max);
        B::for_each(n, ops::CrossEntropyShardExp<A>{z.data(), local, local, lo, t, max.data(), sums.data()});
        tp_->comm().all_reduce(std::span<A>(sums.data(), static_cast<std::size_t>(2 * n)));
        B::for_each(n, ops::CrossEntropyShardGrad<A>{z.data(), local, local, lo, t, max.data(), sums.data(), loss_scale,
                                                     dh != nullptr, row_loss.data() + r0, scale.at});
      } else if constexpr (std::is_same_v<T, A>) {
        B::for_each(n, ops::CrossEntropyRow<A>{z.data(), local, local, target_ids.data() + r0, loss_scale, dh != nullptr,
                                               row_loss.data() + r0, nullptr, 0, scale.at});
      } else {
        // The gradient straight into the T operand of the two GEMMs below (no pass of
        // its own to round it): the logits stay accum_t<T>, and are only read.
        B::for_each(n, ops::CrossEntropyRow<A, T>{z.data(), local, local, target_ids.data() + r0, loss_scale,
                                                  dh != nullptr, row_loss.data() + r0,
                                                  dh != nullptr ? logits_grad.data() : nullptr, local, scale.at});
      }
      if (dh != nullptr) {
        TensorView<const T> dz;
        if constexpr (std::is_same_v<T, A>) {
          dz = z;
        } else {
          if (vocab_parallel()) B::for_each(n * local, ops::Convert<A, T>{z.data(), logits_grad.data()});
          dz = logits_grad.cview().slice_rows(0, n);
        }
        B::gemm(Trans::no, Trans::no, A(1), dz, weight_->value.cview(), A(0), dh->view().slice_rows(r0, r1));
        if (!weight_->frozen)
          B::gemm(Trans::yes, Trans::no, A(1), dz, hc, weight_->grad_write_beta(), weight_->grad.view());
        if (lora_ != nullptr) {
          const Tensor<T> du = lora_->grad_down(dz);
          lora_->add_input_grad(du.cview(), dh->view().slice_rows(r0, r1));
          lora_->weight_grads_into(dz, hc, du.cview(), lora_u.cview(), r0 == 0 ? A(0) : A(1), lora_a_sum, lora_b_sum);
        }
      }
    }
    if (lora_ != nullptr && dh != nullptr) lora_->finish_grads(lora_a_sum, lora_b_sum);
    B::for_each(1, ops::LaneSum{row_loss.data(), rows, loss_sum, true});
  }

  /// logits = h W^T for every row of h (use on few rows: generation), in accum_t<T>.
  /// Under loss parallelism every rank's columns are gathered (collective over the group).
  Tensor<A> logits(const Tensor<T>& h) const {
    Tensor<A> z = B::template empty<A>(Shape{h.size(0), weight_->value.size(0)});
    B::gemm(Trans::no, Trans::yes, A(1), h.cview(), weight_->value.cview(), A(0), z.view());
    if (lora_ != nullptr) lora_->add_forward(h.cview(), z.view());
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
  LoraAdapter<T, B>* lora_ = nullptr;
  std::size_t budget_;
};

}  // namespace tessera::nn
