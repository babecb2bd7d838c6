// The Llama transformer block: pre-norm attention and feed-forward with residuals.
//
//   h = x + attention(attention_norm(x));  y = h + feed_forward(ffn_norm(h))
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/nn/feed_forward.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/nn/rope.hpp"

namespace tessera::nn {

template <class T, Backend B>
class LlamaBlock : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;  // layer.hpp's first-write rule
  /// Splits over tensor-parallel ranks (BlockArgs::tp).
  static constexpr bool tensor_parallel = true;
  /// Runs on a context-parallel rank's share of each sequence (BlockArgs::cp).
  static constexpr bool context_parallel = true;
  /// Decodes one new row at a time through a KV cache (its attention reads it).
  static constexpr bool decodes_with_kv_cache = true;

  /// What a tensor-parallel degree must divide here beyond what the model checks (the
  /// head counts): the feed-forward's hidden size. Its attention term of the FLOP count
  /// is the model's default (nn::DescribesAttentionFlops), its parameters are counted.
  static void check_tensor_parallel(const ModelArgs& a, const NoBlockOptions&, const TensorParallelDegree& tp) {
    FeedForward<T, B>::check_tensor_parallel(a, tp);
  }

  explicit LlamaBlock(const BlockArgs<T, B>& b)
      : attention_norm_(b.name + ".attention_norm", b.model.dim, b.model.norm_eps, b.tp),
        attention_(b.name + ".attention", b.model, output_init_std(b.model, b.layer_id), b.rope, b.tp,
                   b.plan ? &b.plan->float8 : nullptr, b.cp, b.plan == nullptr || b.plan->fuse_projections,
                   b.plan ? &b.plan->lora : nullptr),
        ffn_norm_(b.name + ".ffn_norm", b.model.dim, b.model.norm_eps, b.tp),
        feed_forward_(b.name + ".feed_forward", b.model, output_init_std(b.model, b.layer_id), b.tp,
                      b.plan ? &b.plan->float8 : nullptr, b.plan != nullptr && b.plan->recompute_swiglu,
                      b.plan == nullptr || b.plan->fuse_projections, b.plan ? &b.plan->lora : nullptr) {}

  /// Each norm's output goes to a layer that may cast it to float8 by its rows' amaxes:
  /// the norm then writes them in its own pass (Float8RowAmaxes). Each residual is added
  /// by the layer it goes round, in its output projection's GEMM where it can be.
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> h;
    {
      Float8RowAmaxes<B> amaxes;
      h = attention_.forward(ctx.child("attention"),
                             normed(attention_norm_, ctx.child("attention_norm"), x,
                                    attention_.float8_input_by_rows() ? &amaxes : nullptr),
                             &x);
    }
    Float8RowAmaxes<B> amaxes;
    return feed_forward_.forward(
        ctx.child("feed_forward"),
        normed(ffn_norm_, ctx.child("ffn_norm"), h, feed_forward_.float8_input_by_rows() ? &amaxes : nullptr), &h);
  }

  /// The residuals' gradients (dy into dh, dh into dx) are added by the norms' backward
  /// kernels as they write, not by passes of their own.
  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy) {
    Tensor<T> dh =
        ffn_norm_.backward(ctx.child("ffn_norm"), feed_forward_.backward(ctx.child("feed_forward"), dy), &dy);
    return attention_norm_.backward(ctx.child("attention_norm"), attention_.backward(ctx.child("attention"), dh), &dh);
  }

  template <class F>
  void for_each_parameter(F&& f) {
    attention_norm_.for_each_parameter(f);
    attention_.for_each_parameter(f);
    ffn_norm_.for_each_parameter(f);
    feed_forward_.for_each_parameter(f);
  }

 private:
  /// norm(x), its rows' amaxes kept in `amaxes` where given.
  static Tensor<T> normed(RmsNorm<T, B>& norm, const Context<T>& ctx, const Tensor<T>& x, Float8RowAmaxes<B>* amaxes) {
    if (amaxes == nullptr) return norm.forward(ctx, x);
    const Tensor<float> y_amax = B::template empty<float>(Shape{x.size(0)});
    Tensor<T> y = norm.forward(ctx, x, &y_amax);
    amaxes->keep(y.cview(), y_amax);
    return y;
  }

  RmsNorm<T, B> attention_norm_;
  Attention<T, B> attention_;
  RmsNorm<T, B> ffn_norm_;
  FeedForward<T, B> feed_forward_;
};

}  // namespace tessera::nn
