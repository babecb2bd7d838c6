// Two blocks written outside the library, each a whole model's block with the library's
// model, trainer and parallel policies.
//
// ParallelBlock, the block of examples/custom_layer.cpp: attention and feed-forward side
// by side from one norm (the GPT-J / PaLM layout) instead of one after the other:
//   y = x + attention(norm(x)) + feed_forward(norm(x))
// It satisfies tessera::nn::Layer (forward and backward over a Context, named
// parameters), so Transformer<float, Cpu, ParallelBlock<float, Cpu>> is a whole model,
// and it splits over tensor-parallel ranks the way the library's layers do: each of its
// layers takes BlockArgs::tp, takes this rank's rows and gives them back, so the
// residual sums stay row by row (docs/layers.md).
//
// ReluSquaredBlock: a block with settings of its own, an MLP of squared ReLUs of its own
// hidden width (not SwiGLU's, nor the model's ffn_hidden) and a scale on each branch
// before it joins the residual:
//   h = x + s attention(attention_norm(x));  y = h + s mlp(mlp_norm(h)),
//   mlp(z) = W2 relu(W1 z)^2
// It declares `using options_type = ReluSquaredOptions`, so the model takes a
// ReluSquaredOptions beside its ModelArgs and every block reads it from BlockArgs. The
// model counts its parameters as it makes them and its FLOPs with them; under tensor
// parallelism a degree its width does not divide is refused by nn::Linear, naming the
// weight.
//
// tests/parallel/test_user_layer.cpp trains both under the policies against one rank.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/nn/feed_forward.hpp"
#include "tessera/nn/linear.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

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

/// ReluSquaredBlock's own settings: what the model's ModelArgs does not say.
struct ReluSquaredOptions {
  std::int64_t hidden = 0;      // the MLP's hidden width; no default fits every model, so 0 is refused
  double residual_scale = 1.0;  // each branch's output is scaled by it before it joins the residual
};

/// r = relu(u)^2, element by element.
template <class T>
struct ReluSquaredForward {
  const T* u;
  T* r;
  TESSERA_HD void operator()(std::int64_t i) const {
    const auto v = to_accum(u[i]);
    r[i] = from_accum<T>(v > 0 ? v * v : decltype(v)(0));
  }
};

/// du = dr * 2 relu(u), element by element.
template <class T>
struct ReluSquaredBackward {
  const T* u;
  const T* dr;
  T* du;
  TESSERA_HD void operator()(std::int64_t i) const {
    const auto v = to_accum(u[i]);
    du[i] = from_accum<T>(v > 0 ? 2 * v * to_accum(dr[i]) : decltype(v)(0));
  }
};

/// y = W2 relu(W1 x)^2. Under tensor parallelism, as nn::FeedForward: x arrives as this
/// rank's rows and is gathered, w1 is column-parallel (this rank's hidden units), w2
/// row-parallel, its partial sums reduce-scattered back to rows.
template <class T, Backend B>
class ReluSquaredMlp : public nn::LayerTypes<T, B> {
 public:
  ReluSquaredMlp(const std::string& name, std::int64_t dim, std::int64_t hidden, double out_std,
                 parallel::TensorParallelGroup* tp)
      : w1_(name + ".w1", dim, hidden, nn::Init::truncated_normal(0.02), tp, split(tp, 0)),
        w2_(name + ".w2", hidden, dim, nn::Init::truncated_normal(out_std), tp, split(tp, 1)),
        tp_(tp) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x_rows) {
    Tensor<T> u = w1_.forward(ctx.child("w1"), parallel::whole_rows<B>(tp_, x_rows));
    Tensor<T> r = B::template empty<T>(u.shape());
    B::for_each(u.numel(), ReluSquaredForward<T>{u.data(), r.data()});
    ctx.save("u", nn::SaveKind::matmul, u);
    return parallel::summed_rows<B>(tp_, w2_.forward(ctx.child("w2"), r));
  }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy_rows) {
    const Tensor<T>& u = ctx.saved("u");
    Tensor<T> dr = w2_.backward(ctx.child("w2"), parallel::whole_rows<B>(tp_, dy_rows));
    Tensor<T> du = B::template empty<T>(u.shape());
    B::for_each(u.numel(), ReluSquaredBackward<T>{u.data(), dr.data(), du.data()});
    dr.release();
    return parallel::summed_rows<B>(tp_, w1_.backward(ctx.child("w1"), du));
  }

  template <class F>
  void for_each_parameter(F&& f) {
    w1_.for_each_parameter(f);
    w2_.for_each_parameter(f);
  }

 private:
  static nn::TensorSplit split(parallel::TensorParallelGroup* tp, int dim) {
    return tp ? tp->split(dim) : nn::TensorSplit{};
  }

  nn::Linear<T, B> w1_, w2_;
  parallel::TensorParallelGroup* tp_;
};

template <class T, Backend B>
class ReluSquaredBlock : public nn::LayerTypes<T, B> {
 public:
  /// Its own settings: nn::Transformer<T, B, ReluSquaredBlock<T, B>>(args, plan, options).
  using options_type = ReluSquaredOptions;
  /// It splits over tensor-parallel ranks: its layers take BlockArgs::tp (null at degree 1).
  static constexpr bool tensor_parallel = true;

  explicit ReluSquaredBlock(const nn::BlockArgs<T, B>& b)
      : scale_(static_cast<accum_t<T>>(options_of(b).residual_scale)),
        attention_norm_(b.name + ".attention_norm", b.model.dim, b.model.norm_eps, b.tp),
        attention_(b.name + ".attention", b.model, nn::output_init_std(b.model, b.layer_id), b.rope, b.tp),
        mlp_norm_(b.name + ".mlp_norm", b.model.dim, b.model.norm_eps, b.tp),
        mlp_(b.name + ".mlp", b.model.dim, options_of(b).hidden, nn::output_init_std(b.model, b.layer_id), b.tp) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> a = attention_.forward(ctx.child("attention"), attention_norm_.forward(ctx.child("attention_norm"), x));
    Tensor<T> h = scaled_sum(x, a);
    a.release();
    return scaled_sum(h, mlp_.forward(ctx.child("mlp"), mlp_norm_.forward(ctx.child("mlp_norm"), h)));
  }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy) {
    // Each branch's output was scaled: its gradient is too, before the branch's backward
    // (which accumulates its parameters' gradients from it).
    Tensor<T> dh = mlp_norm_.backward(ctx.child("mlp_norm"), mlp_.backward(ctx.child("mlp"), scaled(dy)));
    B::for_each(dh.numel(), ops::Axpy<T>{accum_t<T>(1), dy.data(), dh.data()});
    Tensor<T> dx = attention_norm_.backward(ctx.child("attention_norm"),
                                            attention_.backward(ctx.child("attention"), scaled(dh)));
    B::for_each(dx.numel(), ops::Axpy<T>{accum_t<T>(1), dh.data(), dx.data()});
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    attention_norm_.for_each_parameter(f);
    attention_.for_each_parameter(f);
    mlp_norm_.for_each_parameter(f);
    mlp_.for_each_parameter(f);
  }

 private:
  /// The block's options, refused when the MLP would have no width (the model was given
  /// none: the options' default).
  static const ReluSquaredOptions& options_of(const nn::BlockArgs<T, B>& b) {
    const ReluSquaredOptions& o = b.template options<ReluSquaredOptions>();
    TESSERA_CHECK(o.hidden > 0, b.name, ": ReluSquaredOptions::hidden must be positive, got ", o.hidden,
                  " (give the model the block's options: nn::Transformer<T, B, Block>(args, plan, options))");
    return o;
  }

  /// x + s f, into a new tensor: f may be an op output a checkpoint policy keeps.
  Tensor<T> scaled_sum(const Tensor<T>& x, const Tensor<T>& f) const {
    Tensor<T> y = B::template empty<T>(x.shape());
    B::for_each(y.numel(), ops::Copy<T>{x.data(), y.data()});
    B::for_each(y.numel(), ops::Axpy<T>{scale_, f.data(), y.data()});
    return y;
  }

  /// s g, into a new tensor.
  Tensor<T> scaled(const Tensor<T>& g) const {
    Tensor<T> y = B::template empty<T>(g.shape());
    B::for_each(y.numel(), ops::Copy<T>{g.data(), y.data()});
    B::for_each(y.numel(), ops::Scale<T>{scale_, y.data()});
    return y;
  }

  accum_t<T> scale_;
  nn::RmsNorm<T, B> attention_norm_;
  nn::Attention<T, B> attention_;
  nn::RmsNorm<T, B> mlp_norm_;
  ReluSquaredMlp<T, B> mlp_;
};

}  // namespace tessera::examples
