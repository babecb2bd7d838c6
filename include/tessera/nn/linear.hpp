// Linear layer without bias: y = x W^T, W of shape (out, in) as Hugging Face stores it.
//
// Saves its input; backward gives dx = dy W and accumulates dW += dy^T x.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/nn/layer.hpp"

namespace tessera::nn {

template <class T, Backend B>
class Linear {
 public:
  using scalar_type = T;
  using backend_type = B;

  Linear(std::string name, std::int64_t in, std::int64_t out, Init init)
      : weight_(std::move(name) + ".weight", Shape{out, in}, init) {}

  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> y = ctx.op("y", SaveKind::matmul, [&] {
      Tensor<T> out = B::template empty<T>(Shape{x.size(0), out_features()});
      B::gemm(Trans::no, Trans::yes, T(1), x.cview(), weight_.value.cview(), T(0), out.view());
      return out;
    });
    ctx.save("x", SaveKind::input, x);
    return y;
  }

  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy) {
    Tensor<T> dx = B::template empty<T>(Shape{dy.size(0), in_features()});
    backward_into(ctx, dy, dx, T(0));
    return dx;
  }

  /// dx = beta * dx + dy W, so several layers reading one input can sum into one dx.
  void backward_into(const Context<T>& ctx, const Tensor<T>& dy, const Tensor<T>& dx, T beta) {
    const Tensor<T>& x = ctx.saved("x");
    B::gemm(Trans::no, Trans::no, T(1), dy.cview(), weight_.value.cview(), beta, dx.view());
    B::gemm(Trans::yes, Trans::no, T(1), dy.cview(), x.cview(), T(1), weight_.grad.view());
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
  }

  Parameter<T>& weight() { return weight_; }
  std::int64_t in_features() const { return weight_.value.size(1); }
  std::int64_t out_features() const { return weight_.value.size(0); }

 private:
  Parameter<T> weight_;
};

}  // namespace tessera::nn
