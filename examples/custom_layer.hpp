// The block of examples/custom_layer.cpp, a layer written outside the library:
// attention and feed-forward side by side from one norm (the GPT-J / PaLM layout)
// instead of one after the other:
//   y = x + attention(norm(x)) + feed_forward(norm(x))
// It satisfies tessera::nn::Layer (forward and backward over a Context, named
// parameters), so Transformer<float, Cpu, ParallelBlock<float, Cpu>> is a whole model,
// and it splits over tensor-parallel ranks the way the library's layers do: each of its
// layers takes BlockArgs::tp, takes this rank's rows and gives them back, so the
// residual sums stay row by row (docs/layers.md). tests/parallel/test_user_layer.cpp
// trains it under the policies against one rank.
#pragma once

#include "tessera/backend/backend.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/nn/feed_forward.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/ops/elementwise.hpp"

namespace tessera::examples {

template <class T, Backend B>
class ParallelBlock : public nn::LayerTypes<T, B> {
 public:
  /// It splits over tensor-parallel ranks: its layers take BlockArgs::tp (null at degree 1).
  static constexpr bool tensor_parallel = true;

  explicit ParallelBlock(const nn::BlockArgs<T, B>& b)
      : norm_(b.name + ".norm", b.model.dim, b.model.norm_eps, b.tp),
        attention_(b.name + ".attention", b.model, nn::output_init_std(b.model, b.layer_id), b.rope, b.tp),
        feed_forward_(b.name + ".feed_forward", b.model, nn::output_init_std(b.model, b.layer_id), b.tp) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> n = norm_.forward(ctx.child("norm"), x);
    Tensor<T> y = attention_.forward(ctx.child("attention"), n);
    Tensor<T> f = feed_forward_.forward(ctx.child("feed_forward"), n);
    B::for_each(y.numel(), ops::Axpy<T>{T(1), f.data(), y.data()});  // in place, on wo's output
    B::for_each(y.numel(), ops::Axpy<T>{T(1), x.data(), y.data()});
    return y;
  }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy) {
    // Both branches read norm(x): their input gradients add up before the norm.
    Tensor<T> dn = attention_.backward(ctx.child("attention"), dy);
    Tensor<T> df = feed_forward_.backward(ctx.child("feed_forward"), dy);
    B::for_each(dn.numel(), ops::Axpy<T>{T(1), df.data(), dn.data()});
    Tensor<T> dx = norm_.backward(ctx.child("norm"), dn);
    B::for_each(dx.numel(), ops::Axpy<T>{T(1), dy.data(), dx.data()});  // the residual
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    norm_.for_each_parameter(f);
    attention_.for_each_parameter(f);
    feed_forward_.for_each_parameter(f);
  }

 private:
  nn::RmsNorm<T, B> norm_;
  nn::Attention<T, B> attention_;
  nn::FeedForward<T, B> feed_forward_;
};

}  // namespace tessera::examples
