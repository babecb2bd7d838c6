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
#include "tessera/backend/host.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/norm.hpp"

namespace tessera::optim {

namespace detail {
/// The pieces of a SquaredNorms in one backend X's memory: their table in X's memory,
/// the chunks' sums (ops::SquaredNormChunks) and their total (ops::LaneSum) launched on X.
template <Backend X, class T>
class SquaredNormTable {
 public:
  void add(const T* data, std::int64_t n) {
    if (n <= 0) return;
    pieces_.push_back({data, n, chunks_});
    chunks_ += ops::norm_chunks(n);
  }
  bool empty() const { return pieces_.empty(); }

  void prepare() {
    if (pieces_ != table_pieces_) build_table();
    pieces_.clear();
    chunks_ = 0;
  }

  void sum_into(double* out) {
    prepare();
    if (table_pieces_.empty()) {
      X::for_each(1, ops::LaneSum{nullptr, 0, out, false});
      return;
    }
    X::for_each(partial_.numel(), ops::SquaredNormChunks<T>{table_.data(), table_.numel(), partial_.data(), elements_});
    X::for_each(1, ops::LaneSum{partial_.data(), partial_.numel(), out, false});
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
    table_ = upload<X>(std::span<const ops::NormPiece<T>>(pieces_));
    partial_ = X::template empty<double>(Shape{chunks_});
  }

  std::vector<ops::NormPiece<T>> pieces_;        // what add() was given since the last sum()
  std::int64_t chunks_ = 0;                      // their chunks
  std::vector<ops::NormPiece<T>> table_pieces_;  // the pieces in table_
  std::int64_t elements_ = 0;                    // their elements, summed
  Tensor<ops::NormPiece<T>> table_;
  Tensor<double> partial_;
};

/// B's host backend's table, where B names one (backend/host.hpp); else none.
template <class B, class T>
struct HostNormTable {
  struct None {
    bool empty() const { return true; }
  };
  using type = None;
};
template <class B, class T>
  requires(HasHostBackend<B> && !is_host_backend<B>)
struct HostNormTable<B, T> {
  using type = SquaredNormTable<host_backend_t<B>, T>;
};
}  // namespace detail

/// Sums of squares of many tensors (or pieces of tensors) in two launches: add() each,
/// then sum_into() (or sum()). The table of pieces lives in B's memory and is uploaded
/// again only when the pieces change, so a model's gradient norm costs two launches a
/// step. The total is the chunks' sums added in lane order (ops::LaneSum), the chunks
/// numbered piece after piece in the order the pieces came: the same value on every
/// backend.
///
/// Pieces in the host memory beside B (an offloaded shard's gradient, backend/host.hpp)
/// are summed by B's host backend, the same two loops on the host's cores, and the total
/// copied into B's memory: the same value again. The pieces of one sum are all in B's
/// memory or all in the host's.
template <Backend B, class T>
class SquaredNorms {
 public:
  /// `host`: the piece is in the host memory beside B's.
  void add(const T* data, std::int64_t n, bool host = false) {
    if (n <= 0) return;
    if (host) {
      if constexpr (requires { host_.add(data, n); }) {
        TESSERA_CHECK(device_.empty(), "gradient norm: pieces in host memory and in the device's in one sum");
        host_.add(data, n);
        return;
      }
      fail("gradient norm: a piece in host memory, on a backend that names no host backend");
    }
    TESSERA_CHECK(host_.empty(), "gradient norm: pieces in host memory and in the device's in one sum");
    device_.add(data, n);
  }
  void add(const Tensor<T>& t) { add(t.data(), t.numel(), on_host(t)); }

  /// The first sum()'s one-time work without the sum: uploads the table of the pieces
  /// added since the last sum() (if they changed) and forgets them. A sum() of the same
  /// pieces then launches and downloads only.
  void prepare() {
    if constexpr (requires { host_.prepare(); })
      if (!host_.empty()) return host_.prepare();
    device_.prepare();
  }

  /// Writes the sum of squares of every element added since the last sum() to *out (B's
  /// memory) without reading it: the chunks' sums (ops::SquaredNormChunks), then their
  /// total in lane order (ops::LaneSum). Forgets the pieces.
  void sum_into(double* out) {
    if constexpr (requires { host_.sum_into(out); }) {
      if (!host_.empty()) {
        using H = host_backend_t<B>;
        if (host_total_.empty()) host_total_ = H::template empty<double>(Shape{1});
        host_.sum_into(host_total_.data());
        copy_from_host_memory<B>(host_total_.data(), out, 1);
        return;
      }
    }
    device_.sum_into(out);
  }

  /// The sum of squares of every element added since the last sum(), read by the host
  /// (a synchronisation); forgets them.
  double sum() {
    if (total_.empty()) total_ = B::template empty<double>(Shape{1});
    sum_into(total_.data());
    return download<B>(total_)[0];
  }

 private:
  detail::SquaredNormTable<B, T> device_;
  typename detail::HostNormTable<B, T>::type host_;
  Tensor<double> host_total_;  // the host pieces' total, until B has copied it
  Tensor<double> total_;       // sum()'s result, before its copy to the host
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
  model.for_each_parameter([&](nn::Parameter<T>& p) {
    if (!p.frozen) norms.add(p.grad);
  });
  return std::sqrt(norms.sum());
}

}  // namespace tessera::optim
