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
#include "tessera/nn/layer.hpp"
#include "tessera/ops/norm.hpp"

namespace tessera::optim {

/// Sums of squares of many tensors (or pieces of tensors) in one launch and one
/// download: add() each, then sum(). The chunk table lives in B's memory and is
/// uploaded again only when the pieces change, so a model's gradient norm costs one
/// launch and one transfer per step. The total is each piece's sum (its chunks added
/// in order), added in the order the pieces came: the same value on every backend.
template <Backend B, class T>
class SquaredNorms {
 public:
  void add(const T* data, std::int64_t n) {
    if (n > 0) pieces_.push_back({data, n});
  }
  void add(const Tensor<T>& t) { add(t.data(), t.numel()); }

  /// The sum of squares of every element added since the last sum(); forgets them.
  double sum() {
    std::vector<ops::NormChunk<T>> chunks;
    std::vector<std::size_t> ends;  // one past each piece's last chunk
    for (const auto& p : pieces_) {
      for (std::int64_t i = 0; i < p.n; i += ops::kNormChunk)
        chunks.push_back({p.x + i, std::min(ops::kNormChunk, p.n - i)});
      ends.push_back(chunks.size());
    }
    pieces_.clear();
    if (chunks.empty()) return 0;
    if (chunks != host_chunks_) {
      table_ = upload<B>(std::span<const ops::NormChunk<T>>(chunks));
      partial_ = B::template empty<double>(Shape{static_cast<std::int64_t>(chunks.size())});
      host_chunks_ = std::move(chunks);
    }
    B::for_each(partial_.numel(), ops::SquaredNormChunks<T>{table_.data(), partial_.data()});
    const Tensor<double> partial = download<B>(partial_);
    double total = 0;
    std::size_t c = 0;
    for (const std::size_t end : ends) {
      double piece = 0;
      for (; c < end; ++c) piece += partial[static_cast<std::int64_t>(c)];
      total += piece;
    }
    return total;
  }

 private:
  std::vector<ops::NormChunk<T>> pieces_;     // what add() was given (n may exceed a chunk)
  std::vector<ops::NormChunk<T>> host_chunks_;  // what table_ holds
  Tensor<ops::NormChunk<T>> table_;
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
