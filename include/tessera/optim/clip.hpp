// Global gradient norm and clipping (torch.nn.utils.clip_grad_norm_'s arithmetic):
// norm = sqrt(sum of squares of every gradient); coefficient min(1, max_norm / (norm + 1e-6)).
// The sum runs in double over fixed chunks in a fixed order: the same result for any
// thread count or backend. Every tensor's chunks go in one launch (SquaredNorms), so a
// GPU pays one kernel and one device-to-host copy per step for the whole norm.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/norm.hpp"

namespace tessera::optim {

/// Sums of squares of many tensors (or pieces of tensors) in one launch and one
/// download: add() each, then sum(). The table of pieces lives in B's memory and is
/// uploaded again only when the pieces change, so a model's gradient norm costs one
/// launch and one transfer per step. The total is each piece's sum (its chunks added in
/// order), added in the order the pieces came: the same value on every backend.
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

  /// The sum of squares of every element added since the last sum(); forgets them.
  double sum() {
    prepare();
    if (table_pieces_.empty()) return 0;
    B::for_each(partial_.numel(), ops::SquaredNormChunks<T>{table_.data(), table_.numel(), partial_.data(), elements_});
    const Tensor<double> partial = download<B>(partial_);
    double total = 0;
    std::int64_t c = 0;
    for (const auto& p : table_pieces_) {
      double piece = 0;
      for (const std::int64_t end = p.first + ops::norm_chunks(p.n); c < end; ++c) piece += partial[c];
      total += piece;
    }
    return total;
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
};

/// Sum of squares of one tensor's elements.
template <Backend B, class T>
double squared_norm(const Tensor<T>& t) {
  SquaredNorms<B, T> norms;
  norms.add(t);
  return norms.sum();
}

/// The clipping coefficient for a gradient norm; max_norm <= 0 disables clipping.
inline double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

/// The global L2 norm of every parameter's gradient.
template <Backend B, class Model>
double grad_norm(Model& model) {
  using T = typename Model::scalar_type;
  SquaredNorms<B, accum_t<T>> norms;
  model.for_each_parameter([&](nn::Parameter<T>& p) { norms.add(p.grad); });
  return std::sqrt(norms.sum());
}

}  // namespace tessera::optim
