// RMSNorm layer over the last dimension; the arithmetic is ops::RmsNorm*.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/rmsnorm.hpp"

namespace tessera::nn {

template <class T, Backend B>
class RmsNorm {
 public:
  using scalar_type = T;
  using backend_type = B;

  RmsNorm(std::string name, std::int64_t dim, double eps)
      : weight_(std::move(name) + ".weight", Shape{dim}, Init::ones()), eps_(static_cast<T>(eps)) {}

  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x) {
    const std::int64_t rows = x.size(0), n = x.size(1);
    Tensor<T> y = B::template empty<T>(x.shape());
    Tensor<T> rstd = B::template empty<T>(Shape{rows});
    B::for_each(rows, ops::RmsNormForward<T>{x.data(), n, weight_.value.data(), y.data(), n, rstd.data(), n, eps_});
    ctx.save("x", SaveKind::input, x);
    ctx.save("rstd", SaveKind::norm, rstd);
    return y;
  }

  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy) {
    const Tensor<T>& x = ctx.saved("x");
    const Tensor<T>& rstd = ctx.saved("rstd");
    const std::int64_t rows = x.size(0), n = x.size(1);
    Tensor<T> dx = B::template empty<T>(x.shape());
    B::for_each(rows, ops::RmsNormBackwardInput<T>{x.data(), n, weight_.value.data(), rstd.data(), dy.data(), n,
                                                   dx.data(), n, n});
    B::for_each(n, ops::RmsNormBackwardWeight<T>{x.data(), n, rstd.data(), dy.data(), n, weight_.grad.data(), rows});
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
  }

  Parameter<T>& weight() { return weight_; }

 private:
  Parameter<T> weight_;
  T eps_;
};

}  // namespace tessera::nn
