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
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/embedding.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

/// A micro-batch's ids in the backend's memory, checked against the vocabulary, with
/// their grouping for the backward (ops::EmbeddingSegments): Embedding::stage writes it
/// ahead of the forward and backward that read it. `fixed`: staged again into the same
/// tensors, the groups too, in their padded layout, so that every step launches the same
/// work over the same addresses (a step a graph replays). Otherwise the groups are made
/// and uploaded by the backward itself, from the host's ids, as a step's peak memory
/// has always been measured without them.
template <Backend B>
struct StagedIds {
  Tensor<std::int32_t> ids;               // (rows)
  Tensor<std::int32_t> segments;          // EmbeddingSegments::packed (fixed)
  ops::EmbeddingSegments layout;          // what `segments` holds, its packed array left empty
  std::span<const std::int32_t> host;     // the ids the backward groups (not fixed): the caller's, kept alive,
  std::shared_ptr<const std::vector<std::int32_t>> owned;  // or these, when the stager made them (keep())
  bool fixed = false;

  /// Keeps `ids` (made by the stager: a context-parallel rank's share of the batch) for
  /// the backward to group, with the staged ids, in place of the caller's.
  void keep(std::vector<std::int32_t> ids) {
    owned = std::make_shared<const std::vector<std::int32_t>>(std::move(ids));
    if (!fixed) host = *owned;
  }
};

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

  /// Checks `ids` against the vocabulary and writes them to `into` in B's memory, with
  /// their grouping by id when `for_backward` (the host holds the ids, so it groups them:
  /// ops/embedding.hpp). A fixed `into` keeps its tensors and their addresses.
  void stage(std::span<const std::int32_t> ids, StagedIds<B>& into, bool for_backward) const {
    const std::int64_t vocab = vocab_;
    for (std::size_t i = 0; i < ids.size(); ++i)
      TESSERA_CHECK(ids[i] >= 0 && ids[i] < vocab, weight_.name, ": token id ", ids[i], " at position ", i,
                    " is outside the vocabulary of ", vocab);
    upload_into<B>(into.ids, ids, into.fixed);
    if (!for_backward) return;
    if (!into.fixed) {
      into.host = ids;  // grouped by the backward
      return;
    }
    const auto [lo, hi] = range();
    into.layout = ops::embedding_segments(ids, lo, hi, into.fixed);
    upload_into<B>(into.segments, std::span<const std::int32_t>(into.layout.packed), into.fixed);
    into.layout.packed = {};
  }

  /// This rank's rows of the embedded ids.
  Tensor<T> forward(std::span<const std::int32_t> ids) {
    StagedIds<B> staged;
    stage(ids, staged, false);
    return forward(staged);
  }
  Tensor<T> forward(const StagedIds<B>& staged) {
    const std::int64_t dim = weight_.value.size(1), rows = staged.ids.numel();
    Tensor<T> y = B::template empty<T>(Shape{rows, dim});
    const auto [lo, hi] = range();
    B::for_each(rows * dim, ops::EmbeddingForward<T>{staged.ids.data(), weight_.value.data(), y.data(), dim, lo, hi});
    return parallel::summed_rows<B>(tp_, y);
  }

  /// `dy_rows`: the gradient of this rank's rows.
  void backward(std::span<const std::int32_t> ids, const Tensor<T>& dy_rows) {
    StagedIds<B> staged;
    staged.host = ids;  // checked by the forward
    backward(staged, dy_rows);
  }
  void backward(const StagedIds<B>& staged, const Tensor<T>& dy_rows) {
    if (weight_.frozen) return;  // nothing to write: its input, the ids, has no gradient
    TESSERA_CHECK(staged.fixed ? !staged.segments.empty() : staged.host.data() != nullptr, weight_.name,
                  ": the ids were staged without what the backward groups");
    const Tensor<T> dy = parallel::whole_rows<B>(tp_, dy_rows);
    const std::int64_t dim = weight_.grad.size(1);
    const auto [lo, hi] = range();
    // The positions grouped by id: staged (fixed), or here on the host, one upload.
    ops::EmbeddingSegments seg = staged.layout;
    Tensor<std::int32_t> packed = staged.segments;
    if (!staged.fixed) {
      seg = ops::embedding_segments(staged.host, lo, hi);
      if (seg.count > 0) packed = upload<B>(std::span<const std::int32_t>(seg.packed));
    }
    weight_.template zero_grad_if_unwritten<B>();  // rows no id reaches keep zero
    // Padded: every id's slot launched, the count read on the device.
    const std::int64_t slots = seg.capacity > 0 ? seg.capacity : seg.count;
    if (slots == 0) return;
    const std::int32_t* base = packed.data();
    B::for_each(slots * dim, ops::EmbeddingBackward<T>{seg.ids(base), seg.offsets(base), seg.order(base), dy.data(),
                                                       weight_.grad.data(), dim, lo,
                                                       seg.capacity > 0 ? seg.capacity : seg.positions,
                                                       seg.count_at(base)});
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
