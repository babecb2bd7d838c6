// Global gradient norm and clipping (torch.nn.utils.clip_grad_norm_'s arithmetic):
// norm = sqrt(sum of squares of every gradient); coefficient min(1, max_norm / (norm + 1e-6)).
// The sum runs in double over fixed chunks, and the chunks' sums are added in a fixed
// order (ops::LaneSum): the same result for any thread count or backend. Every tensor's
// chunks go in one launch and their total in a second, into the backend's memory: a
// training step leaves it there for the clip scale (ops::ClipScale) and reads it when
// the step ends (train/step_scalars.hpp); sum() reads it at once.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/norm.hpp"

namespace tessera::optim {

/// Sums of squares of many tensors (or pieces of tensors) in two launches: add() each,
/// then sum_into() (or sum()). The table of pieces lives in B's memory and is uploaded
/// again only when the pieces change, so a model's gradient norm costs two launches a
/// step. The total is the chunks' sums added in lane order (ops::LaneSum), the chunks
/// numbered piece after piece in the order the pieces came: the same value on every
/// backend.
template <Backend B, class T>
class SquaredNorms {
 public:
  void add(const T* data, std::int64_t n) {
    if (n <= 0) return;
    pieces_.push_back({data, n, chunks_});
    chunks_ += ops::norm_chunks(n);
  }
  void add(const Tensor<T>& t) { add(t.data(), t.numel()); }

  /// The first sum()'s one-time work without the sum: uploads the table of the pieces
  /// added since the last sum() (if they changed) and forgets them. A sum() of the same
  /// pieces then launches and downloads only.
  void prepare() {
    if (pieces_ != table_pieces_) build_table();
    pieces_.clear();
    chunks_ = 0;
  }

  /// Writes the sum of squares of every element added since the last sum() to *out (B's
  /// memory) without reading it: the chunks' sums (ops::SquaredNormChunks), then their
  /// total in lane order (ops::LaneSum). Forgets the pieces.
  void sum_into(double* out) {
    prepare();
    if (table_pieces_.empty()) {
      B::for_each(1, ops::LaneSum{nullptr, 0, out, false});
      return;
    }
    B::for_each(partial_.numel(), ops::SquaredNormChunks<T>{table_.data(), table_.numel(), partial_.data(), elements_});
    B::for_each(1, ops::LaneSum{partial_.data(), partial_.numel(), out, false});
  }

  /// The sum of squares of every element added since the last sum(), read by the host
  /// (a synchronisation); forgets them.
  double sum() {
    if (total_.empty()) total_ = B::template empty<double>(Shape{1});
    sum_into(total_.data());
    return download<B>(total_)[0];
  }

 private:
  /// Uploads the table of pieces: once, while the pieces stay the same from one sum()
  /// to the next (a model's gradients do), so a step's host work is a comparison of a
  /// few hundred pieces.
  void build_table() {
    table_pieces_ = pieces_;
    elements_ = 0;
    for (const auto& p : pieces_) elements_ += p.n;
    if (pieces_.empty()) return;
    table_ = upload<B>(std::span<const ops::NormPiece<T>>(pieces_));
    partial_ = B::template empty<double>(Shape{chunks_});
  }

  std::vector<ops::NormPiece<T>> pieces_;        // what add() was given since the last sum()
  std::int64_t chunks_ = 0;                      // their chunks
  std::vector<ops::NormPiece<T>> table_pieces_;  // the pieces in table_
  std::int64_t elements_ = 0;                    // their elements, summed
  Tensor<ops::NormPiece<T>> table_;
  Tensor<double> partial_;
  Tensor<double> total_;  // sum()'s result, before its copy to the host
};

/// Sum of squares of one tensor's elements.
template <Backend B, class T>
double squared_norm(const Tensor<T>& t) {
  SquaredNorms<B, T> norms;
  norms.add(t);
  return norms.sum();
}

/// The clipping coefficient for a gradient norm; max_norm <= 0 disables clipping
/// (ops::clip_coefficient, which the device's ops::ClipScale computes too).
inline double clip_coefficient(double norm, double max_norm) { return ops::clip_coefficient(norm, max_norm); }

/// The global L2 norm of every parameter's gradient.
template <Backend B, class Model>
double grad_norm(Model& model) {
  using T = typename Model::scalar_type;
  SquaredNorms<B, accum_t<T>> norms;
  model.for_each_parameter([&](nn::Parameter<T>& p) { norms.add(p.grad); });
  return std::sqrt(norms.sum());
}

}  // namespace tessera::optim
