// Linear layer without bias: y = x W^T, W of shape (out, in) as Hugging Face stores it.
//
// Saves its input; backward gives dx = dy W and accumulates dW += dy^T x (the latter
// through Context::weight_grad, so a zero-bubble schedule can run it later; the step's
// first write has beta 0, layer.hpp's first-write rule). For bf16 the GEMMs read bf16
// operands and accumulate in fp32; dW is accumulated in fp32.
//
// Under tensor parallelism the weight may be split (parallel/tensor_parallel.hpp):
// by output rows (column-parallel: y holds this rank's output features) or by input
// columns (row-parallel: x holds this rank's input features, y is a partial sum).
// The layer computes with whatever piece it holds. A piece several ranks hold (key
// and value heads replicated over more ranks than there are heads) gets its gradient
// summed over them.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

template <class T, Backend B>
class Linear : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;
  /// `tp` and `split`: the tensor-parallel group and how the weight lies over it
  /// (whole by default). A split its shape does not allow is refused here, naming the
  /// weight and its shape: a block that states no check of its own is checked this way.
  Linear(std::string name, std::int64_t in, std::int64_t out, Init init, parallel::TensorParallelGroup* tp = nullptr,
         TensorSplit split = {})
      : weight_(Parameter<T>::template on<B>(std::move(name) + ".weight", Shape{out, in}, init)), tp_(tp) {
    weight_.split = split;
    parallel::check_split(weight_);
  }

  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> y = ctx.op("y", SaveKind::matmul, [&] {
      Tensor<T> out = B::template empty<T>(Shape{x.size(0), out_features()});
      B::gemm(Trans::no, Trans::yes, 1.0f, x.cview(), weight_.value.cview(), 0.0f, out.view());
      return out;
    });
    ctx.save("x", SaveKind::input, x);
    return y;
  }

  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy) {
    Tensor<T> dx = B::template empty<T>(Shape{dy.size(0), in_features()});
    backward_into(ctx, dy, dx, 0.0f);
    return dx;
  }

  /// dx = beta * dx + dy W, so several layers reading one input can sum into one dx.
  void backward_into(const Context<T>& ctx, const Tensor<T>& dy, const Tensor<T>& dx, float beta) {
    B::gemm(Trans::no, Trans::no, 1.0f, dy.cview(), weight_.value.cview(), static_cast<accum_t<T>>(beta), dx.view());
    ctx.weight_grad([this, x = ctx.saved("x"), dy] {
      if (parallel::active(tp_) && weight_.split.holders > 1) {
        Tensor<accum_t<T>> dw = B::template empty<accum_t<T>>(weight_.grad.shape());
        B::gemm(Trans::yes, Trans::no, 1.0f, dy.cview(), x.cview(), 0.0f, dw.view());
        parallel::accumulate_over_holders<B>(tp_, dw, weight_);
      } else {
        B::gemm(Trans::yes, Trans::no, 1.0f, dy.cview(), x.cview(), weight_.grad_write_beta(), weight_.grad.view());
      }
    });
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
  parallel::TensorParallelGroup* tp_ = nullptr;
};

}  // namespace tessera::nn
