// The output projection fused with the cross-entropy loss, in row chunks.
//
// logits = h W^T would be (rows, vocab): for a 128256-token vocabulary and 16k rows
// that is 8 GiB of fp32. Instead rows are taken in chunks of at most
// kChunkElements / vocab: each chunk's logits are made, turned in place into the
// loss gradient (ops::CrossEntropyRow), pushed through the projection's backward
// (dh rows and dW) and dropped before the next chunk. So training computes the
// head's backward during its forward, and the layer's backward only hands back the
// saved dh.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/cross_entropy.hpp"

namespace tessera::nn {

template <class T, Backend B>
class ChunkedCrossEntropyHead {
 public:
  /// Elements of one chunk of logits (16 MiB of fp32).
  static constexpr std::int64_t kChunkElements = std::int64_t{1} << 22;

  explicit ChunkedCrossEntropyHead(Parameter<T>* weight) : weight_(weight) {}

  static std::int64_t chunk_rows(std::int64_t vocab, std::int64_t rows) {
    return std::clamp<std::int64_t>(kChunkElements / std::max<std::int64_t>(vocab, 1), 1, std::max<std::int64_t>(rows, 1));
  }

  /// Sum over rows of the cross-entropy of h W^T against targets. With `dh` given,
  /// also writes d(loss_scale * sum)/dh into it and accumulates dW.
  double forward(const Tensor<T>& h, std::span<const std::int32_t> targets, T loss_scale, Tensor<T>* dh) {
    const std::int64_t rows = h.size(0), vocab = weight_->value.size(0);
    TESSERA_CHECK(static_cast<std::int64_t>(targets.size()) == rows, "loss: ", targets.size(), " targets for ", rows,
                  " rows");
    for (std::size_t i = 0; i < targets.size(); ++i)
      TESSERA_CHECK(targets[i] == ops::kIgnoreIndex || (targets[i] >= 0 && targets[i] < vocab), "loss: target id ",
                    targets[i], " at position ", i, " is outside the vocabulary of ", vocab);
    const std::int64_t step = chunk_rows(vocab, rows);
    std::vector<double> row_loss(static_cast<std::size_t>(rows));
    Tensor<T> logits = B::template empty<T>(Shape{std::min(step, rows), vocab});
    for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
      const std::int64_t r1 = std::min(rows, r0 + step);
      TensorView<T> z = logits.view().slice_rows(0, r1 - r0);
      TensorView<const T> hc = h.cview().slice_rows(r0, r1);
      B::gemm(Trans::no, Trans::yes, T(1), hc, weight_->value.cview(), T(0), z);
      B::for_each(r1 - r0, ops::CrossEntropyRow<T>{z.data(), vocab, vocab, targets.data() + r0, loss_scale,
                                                   dh != nullptr, row_loss.data() + r0});
      if (dh != nullptr) {
        B::gemm(Trans::no, Trans::no, T(1), TensorView<const T>(z), weight_->value.cview(), T(0),
                dh->view().slice_rows(r0, r1));
        B::gemm(Trans::yes, Trans::no, T(1), TensorView<const T>(z), hc, T(1), weight_->grad.view());
      }
    }
    double total = 0;
    for (double l : row_loss) total += l;
    return total;
  }

  /// logits = h W^T for every row of h (use on few rows: generation).
  Tensor<T> logits(const Tensor<T>& h) const {
    Tensor<T> z = B::template empty<T>(Shape{h.size(0), weight_->value.size(0)});
    B::gemm(Trans::no, Trans::yes, T(1), h.cview(), weight_->value.cview(), T(0), z.view());
    return z;
  }

 private:
  Parameter<T>* weight_;
};

}  // namespace tessera::nn
