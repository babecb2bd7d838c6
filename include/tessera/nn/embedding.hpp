// Token embedding: ids (rows) -> (rows, dim). Token ids are checked against the
// vocabulary before any gather, so a bad id is an error naming it, not a wild read.
//
// Under tensor parallelism the table is split by vocabulary (row-parallel): each
// rank looks up every id in its range (zeros elsewhere) and the rows' sum is
// reduce-scattered, so the output is this rank's rows (sequence parallel); the
// backward gathers the rows' gradient and accumulates the ids in its range.
//
// Both directions launch over elements (ops/embedding.hpp): the forward one index per
// output element, the backward one per (id present, column) after the host has grouped
// the batch's positions by id, so each gradient element is summed in position order,
// bitwise the same on every backend.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/embedding.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

template <class T, Backend B>
class Embedding : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;  // layer.hpp's first-write rule
  /// `tp`: the tensor-parallel group the vocabulary is split over (nullptr: whole).
  Embedding(std::string name, std::int64_t vocab, std::int64_t dim, Init init,
            parallel::TensorParallelGroup* tp = nullptr)
      : weight_(Parameter<T>::template on<B>(std::move(name) + ".weight", Shape{vocab, dim}, init)), vocab_(vocab), tp_(tp) {
    if (tp) weight_.split = tp->split(0);
  }

  /// This rank's rows of the embedded ids.
  Tensor<T> forward(std::span<const std::int32_t> ids) {
    const std::int64_t vocab = vocab_, dim = weight_.value.size(1);
    for (std::size_t i = 0; i < ids.size(); ++i)
      TESSERA_CHECK(ids[i] >= 0 && ids[i] < vocab, weight_.name, ": token id ", ids[i], " at position ", i,
                    " is outside the vocabulary of ", vocab);
    const auto rows = static_cast<std::int64_t>(ids.size());
    Tensor<T> y = B::template empty<T>(Shape{rows, dim});
    const auto [lo, hi] = range();
    const Tensor<std::int32_t> on_backend = upload<B>(ids);
    B::for_each(rows * dim, ops::EmbeddingForward<T>{on_backend.data(), weight_.value.data(), y.data(), dim, lo, hi});
    return parallel::summed_rows<B>(tp_, y);
  }

  /// `dy_rows`: the gradient of this rank's rows.
  void backward(std::span<const std::int32_t> ids, const Tensor<T>& dy_rows) {
    const Tensor<T> dy = parallel::whole_rows<B>(tp_, dy_rows);
    const std::int64_t dim = weight_.grad.size(1);
    const auto [lo, hi] = range();
    // The positions grouped by id on the host (the ids are host data), one upload.
    const ops::EmbeddingSegments seg = ops::embedding_segments(ids, lo, hi);
    weight_.template zero_grad_if_unwritten<B>();  // rows no id reaches keep zero
    if (seg.count == 0) return;
    const Tensor<std::int32_t> packed = upload<B>(std::span<const std::int32_t>(seg.packed));
    const std::int32_t* base = packed.data();
    B::for_each(seg.count * dim, ops::EmbeddingBackward<T>{seg.ids(base), seg.offsets(base), seg.order(base), dy.data(),
                                                           weight_.grad.data(), dim, lo, seg.positions});
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
  }

  Parameter<T>& weight() { return weight_; }

 private:
  /// The ids this rank's table holds.
  std::pair<std::int64_t, std::int64_t> range() const {
    const std::int64_t per = vocab_ / weight_.split.parts;
    return {per * weight_.split.index, per * (weight_.split.index + 1)};
  }

  Parameter<T> weight_;
  std::int64_t vocab_;
  parallel::TensorParallelGroup* tp_;
};

}  // namespace tessera::nn
