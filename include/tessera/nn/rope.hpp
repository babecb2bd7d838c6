// Rotary tables: cos and sin of pos * inv_freq for positions [0, length), grown on
// demand and shared by every attention layer of a model.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/ops/rope.hpp"

namespace tessera::nn {

template <class T, Backend B>
class RopeTable {
 public:
  RopeTable(std::int64_t head_dim, double theta, RopeScaling scaling)
      : head_dim_(head_dim), inv_freq_(ops::rope_inv_freq(head_dim, theta, scaling)) {}

  /// Makes the tables cover positions [0, length).
  void ensure(std::int64_t length) {
    if (length <= length_) return;
    const std::int64_t half = head_dim_ / 2;
    // A dry run (the Meta backend) uploads the same bytes but never reads them: it skips
    // the sines and cosines, half of a small layout's trace (llama-plan --search), and
    // the host tables are left as allocated (every value is written below otherwise).
    constexpr bool values = B::device != Device::meta;
    Tensor<T> cos(Shape{length, half}, Uninitialized{});
    Tensor<T> sin(Shape{length, half}, Uninitialized{});
    if constexpr (values)
      for (std::int64_t p = 0; p < length; ++p)
        for (std::int64_t i = 0; i < half; ++i) {
          double angle = static_cast<double>(p) * inv_freq_[static_cast<std::size_t>(i)];
          cos[p * half + i] = static_cast<T>(std::cos(angle));
          sin[p * half + i] = static_cast<T>(std::sin(angle));
        }
    cos_ = upload<B>(cos);  // computed in double on the host, once per length
    sin_ = upload<B>(sin);
    length_ = length;
  }

  /// Rotates (rows, n_heads * head_dim) in place, rows x.ld() apart (a contiguous
  /// tensor, or columns of a wider one); row r sits at position positions(r).
  void rotate(TensorView<T> x, std::int64_t n_heads, ops::RowPositions positions, bool inverse) {
    ensure(positions.end());
    B::for_each(x.rows(), ops::RopeRotate<T>{x.data(), x.ld(), n_heads, head_dim_, positions, cos_.data(),
                                             sin_.data(), inverse});
  }

  /// x rotated into a new tensor; x is left as it is (it may be a kept op output).
  Tensor<T> rotated(const Tensor<T>& x, std::int64_t n_heads, ops::RowPositions positions) {
    ensure(positions.end());
    Tensor<T> y = B::template empty<T>(x.shape());
    B::for_each(x.size(0), ops::RopeRotate<T>{y.data(), x.size(1), n_heads, head_dim_, positions, cos_.data(),
                                              sin_.data(), false, x.data()});
    return y;
  }

 private:
  std::int64_t head_dim_;
  std::vector<double> inv_freq_;
  std::int64_t length_ = 0;
  Tensor<T> cos_, sin_;
};

}  // namespace tessera::nn
