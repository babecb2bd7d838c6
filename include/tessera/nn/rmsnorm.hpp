// RMSNorm layer over the last dimension; the arithmetic is ops::RmsNorm*. The
// statistics (rstd per row), eps and the weight's gradient are accum_t<T> (fp32 for bf16).
//
// Under sequence parallelism (parallel/tensor_parallel.hpp) each rank normalises its
// own rows with the whole weight, so each computes part of the weight's gradient:
// the parts are summed over the tensor-parallel group.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/rmsnorm.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

template <class T, Backend B>
class RmsNorm : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;  // layer.hpp's first-write rule
  using A = accum_t<T>;  // statistics and gradients

  /// `tp`: the tensor-parallel group. Under sequence parallelism its ranks hold
  /// different rows and the weight's gradient is summed over them; without, each rank
  /// normalises every row and its gradient is already the whole one.
  RmsNorm(std::string name, std::int64_t dim, double eps, parallel::TensorParallelGroup* tp = nullptr)
      : weight_(Parameter<T>::template on<B>(std::move(name) + ".weight", Shape{dim}, Init::ones())),
        eps_(static_cast<A>(eps)),
        tp_(tp) {
    if (tp) weight_.split = tp->whole();
  }

  /// y = norm(x); with `y_amax` (one float a row), also the amax of each row of y as
  /// stored, written by the same pass (for a float8 cast of y: nn::Float8RowAmaxes).
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x, const Tensor<float>* y_amax = nullptr) {
    const std::int64_t rows = x.size(0), n = x.size(1);
    if (y_amax != nullptr)
      TESSERA_CHECK(y_amax->numel() == rows, weight_.name, ": ", y_amax->numel(), " row amaxes for ", rows, " rows");
    Tensor<T> y = B::template empty<T>(x.shape());
    Tensor<A> rstd = B::template empty<A>(Shape{rows});
    B::for_each(rows, ops::RmsNormForward<T>{x.data(), n, weight_.value.data(), y.data(), n, rstd.data(), n, eps_,
                                             y_amax != nullptr ? y_amax->data() : nullptr});
    ctx.save("x", SaveKind::input, x);
    ctx.save("rstd", SaveKind::norm, rstd);
    return y;
  }

  /// dx, plus `residual` when given (the gradient a residual connection carries past
  /// the norm, of dx's shape): added in the same pass, before dx is rounded.
  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy, const Tensor<T>* residual = nullptr) {
    const Tensor<T> x = ctx.saved("x");
    const Tensor<A> rstd = ctx.template saved<A>("rstd");
    const std::int64_t rows = x.size(0), n = x.size(1);
    if (residual != nullptr)
      TESSERA_CHECK(residual->shape() == x.shape(), weight_.name, ": a residual gradient of shape ",
                    residual->shape(), " beside an input of shape ", x.shape());
    Tensor<T> dx = B::template empty<T>(x.shape());
    const ops::RmsNormBackwardInput<T> input{x.data(),  n, weight_.value.data(), rstd.data(), dy.data(), n,
                                             dx.data(), n, n, residual != nullptr ? residual->data() : nullptr,
                                             n};
    if (weight_.frozen) {  // the input's gradient only
      B::for_each(rows, input);
      return dx;
    }
    if (ctx.weight_grad_queue() == nullptr && !parallel::splits_rows(tp_)) {
      // Both passes in one launch (x and dy read once on the GPU); the column sums
      // written, not added to zeros, on the step's first write (layer.hpp's rule).
      const bool add = weight_.grad_write_beta() != A(0);
      B::for_each(rows + n, ops::RmsNormBackward<T>{input, ops::RmsNormBackwardWeight<T>{
                                                               x.data(), n, rstd.data(), dy.data(), n,
                                                               weight_.grad.data(), rows, add}});
      return dx;
    }
    B::for_each(rows, input);
    ctx.weight_grad([this, x, rstd, dy, rows, n] {
      // The column sums written, not added to zeros: the step's first write (layer.hpp's rule).
      if (parallel::splits_rows(tp_)) {
        Tensor<A> dw = B::template empty<A>(weight_.grad.shape());
        B::for_each(n, ops::RmsNormBackwardWeight<T>{x.data(), n, rstd.data(), dy.data(), n, dw.data(), rows, false});
        parallel::accumulate_over_holders<B>(tp_, dw, weight_);
      } else {
        const bool add = weight_.grad_write_beta() != A(0);
        B::for_each(n,
                    ops::RmsNormBackwardWeight<T>{x.data(), n, rstd.data(), dy.data(), n, weight_.grad.data(), rows, add});
      }
    });
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
  }

  Parameter<T>& weight() { return weight_; }

 private:
  Parameter<T> weight_;
  A eps_;
  parallel::TensorParallelGroup* tp_;
};

}  // namespace tessera::nn
