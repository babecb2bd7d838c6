// SwiGLU feed-forward: y = W2 (silu(W1 x) * (W3 x)).
//
// Under tensor parallelism x arrives as this rank's rows and is gathered; w1 and w3
// are column-parallel (this rank's hidden units), w2 row-parallel, its partial sums
// reduce-scattered back to rows (parallel/tensor_parallel.hpp).
//
// The backward reads W1 x and W3 x (kept) and w2's input, the SwiGLU output g. With
// `recompute_swiglu` (activation_checkpoint.recompute_swiglu) g is not kept: the backward
// makes it again from the two it keeps, the same functor on the same values, so the same
// bits, for one elementwise pass a block; the activations held fall by a hidden size a
// token a block (Llama 3 8B at 8,192 tokens: 7 GiB, what lets it train on one H200
// without recomputing blocks).
//
// w1 and w3 run as one (nn::stacked_forward): stored side by side (a ParameterStack), one GEMM
// writes x [W1; W3]^T, (rows, 2 hidden), a and b side by side in each row, which SwiGLU
// reads as they lie (ops::SwiGluForwardPaired); its backward writes da and db the same
// way, and one GEMM gives dx, one both weights' gradients. Not under float8 (w1, w3, or w2
// casting g by its rows' amaxes), selective checkpointing's op stash, or
// `fuse_projections` false: there they run one by one, as before.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/linear.hpp"
#include "tessera/ops/swiglu.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

template <class T, Backend B>
class FeedForward : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;  // layer.hpp's first-write rule
  /// Whether `tp` splits the hidden units evenly (w1 and w3 by rows, w2 by columns): what
  /// a block holding this layer states of itself (nn::ChecksTensorParallel), so that the
  /// model refuses a bad degree, named as the user gave it, before it makes anything.
  static void check_tensor_parallel(const ModelArgs& a, const TensorParallelDegree& tp) {
    tp.check_divides(a.ffn_hidden_dim(), "the feed-forward hidden size");
  }

  /// `tp`: the tensor-parallel group (nullptr or degree 1: every hidden unit here); a
  /// degree the hidden size does not allow is refused before anything is made.
  /// `float8`: which of the projections multiply in float8 (ops::Float8Policy; none: none).
  /// `recompute_swiglu`: the SwiGLU output made again in the backward rather than kept.
  /// `fuse_projections`: w1 and w3 stored side by side and run as one GEMM each way where
  /// they can be (false: stored and run one by one).
  /// `lora`: which of the projections hold LoRA adapters (layer/lora.hpp; none: none).
  FeedForward(const std::string& name, const ModelArgs& a, double out_std, parallel::TensorParallelGroup* tp = nullptr,
              const ops::Float8Policy* float8 = nullptr, bool recompute_swiglu = false, bool fuse_projections = true,
              const LoraPolicy* lora = nullptr)
      : w13_(fuse_projections ? gate_up_stack(name, a, tp) : nullptr),
        w1_(name + ".w1", a.dim, hidden(name, a, tp), Init::truncated_normal(0.02), tp, split(tp, 0), float8, w13_, 0,
            lora),
        w2_(name + ".w2", a.ffn_hidden_dim(), a.dim, Init::truncated_normal(out_std), tp, split(tp, 1), float8, nullptr,
            0, lora),
        w3_(name + ".w3", a.dim, a.ffn_hidden_dim(), Init::truncated_normal(out_std), tp, split(tp, 0), float8, w13_,
            1, lora),
        tp_(tp),
        recompute_swiglu_(recompute_swiglu),
        fuse_(fuse_projections) {}

  /// The feed-forward's output (this rank's rows), plus `residual` where given (a block's
  /// h, the same rows): added in w2's GEMM where it can be (output_).
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x_rows, const Tensor<T>* residual = nullptr) {
    if (fuse_ && !w2_.float8_input_by_rows() && runs_stacked(ctx, w1_, w3_)) {
      const Tensor<T> ab = stacked_forward(ctx.child("w13"), tp_, x_rows, w1_, w3_);
      ctx.save("ab", SaveKind::matmul, ab);
      return output_(ctx, swiglu_paired(ab), residual);
    }
    // The rows cast here and gathered as float8, multiplied as gathered; else gathered (in
    // blocks multiplied as they arrive, where they can be) and multiplied.
    const std::array<Tensor<T>, 2> ab =
        gathers_float8_input() ? gathered_float8_forward(ctx, *tp_, x_rows, {"w1", "w3"}, as_made, w1_, w3_)
                               : gathered_forward(ctx, tp_, x_rows, {"w1", "w3"}, as_made, w1_, w3_);
    const Tensor<T>& a = ab[0];
    const Tensor<T>& b = ab[1];
    Float8RowAmaxes<B> amaxes;  // g's, where w2 casts it to float8 by them
    const Tensor<T> g = swiglu(a, b, &amaxes);
    ctx.save("a", SaveKind::matmul, a);
    ctx.save("b", SaveKind::matmul, b);
    return output_(ctx, g, residual);
  }

  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy_rows) {
    if (const Tensor<T>* ab = ctx.saved_if("ab")) return stacked_backward_(ctx, *ab, dy_rows);
    const Tensor<T>& a = ctx.saved("a");
    const Tensor<T>& b = ctx.saved("b");
    Tensor<T> dg;
    {
      // w2's input, made again where the forward did not keep it (by the forward's kernel:
      // the same bits; its amaxes unused, the backward's casts of g take the forward's scale
      // or, by columns, their own)
      Tensor<T> g;
      if (recompute_swiglu_) g = swiglu(a, b, nullptr);
      Float8SharedCasts<B> shared;  // float8 GEMMs (tensorwise): dy's amax once for both of w2's gradients
      dg = w2_backward_(ctx, dy_rows, recompute_swiglu_ ? &g : nullptr);
    }
    Tensor<T> da = B::template empty<T>(a.shape());
    Tensor<T> db = B::template empty<T>(b.shape());
    // Float8 GEMMs: da's and db's row amaxes written with them where w1 and w3 cast them
    // by rows; x^T cast once for the two weight gradients, and (tensorwise) da's and db's
    // scales each taken once for its input and weight gradients.
    Float8RowAmaxes<B> amaxes;
    if (w1_.float8_grad_output_by_rows() || w3_.float8_grad_output_by_rows()) {
      const std::int64_t rows = a.size(0), cols = a.size(1);
      const Tensor<float> da_amax = B::template empty<float>(Shape{rows}), db_amax = B::template empty<float>(Shape{rows});
      B::for_each(rows, ops::SwiGluBackwardRows<T>{{a.data(), b.data(), dg.data(), da.data(), db.data()}, cols,
                                                   da_amax.data(), db_amax.data()});
      amaxes.keep(da.cview(), da_amax);
      amaxes.keep(db.cview(), db_amax);
    } else {
      B::for_each(a.numel(), ops::SwiGluBackward<T>{a.data(), b.data(), dg.data(), da.data(), db.data()});
    }
    dg.release();
    Float8SharedCasts<B> shared;
    return summed_input_grads(ctx, tp_, {"w1", "w3"}, {&da, &db}, w1_, w3_);
  }

  /// Whether w1 and w3's float8 casts of the input take their scales from its rows'
  /// amaxes, the input as it arrives (not gathered over sequence-parallel ranks first, or
  /// cast before a float8 gather):
  /// the norm before it may write them (nn::Float8RowAmaxes, nn::LlamaBlock).
  bool float8_input_by_rows() const {
    return (!parallel::splits_rows(tp_) || gathers_float8_input()) &&
           (w1_.float8_input_by_rows() || w3_.float8_input_by_rows());
  }

  /// Whether the input's sequence-parallel gather carries float8 values (each rank's rows
  /// cast by the one scale w1 and w3 cast x by: Linear::forward_float8).
  bool gathers_float8_input() const {
    return parallel::splits_rows(tp_) && w1_.takes_float8_input() && w3_.takes_float8_input();
  }

  /// w1 and w3 next to each other, so that an FSDP unit's flat buffers (laid out in this
  /// order) hold them side by side too.
  template <class F>
  void for_each_parameter(F&& f) {
    w1_.for_each_parameter(f);
    w3_.for_each_parameter(f);
    w2_.for_each_parameter(f);
  }

 private:
  /// The stack w1 and w3 are stored in: their whole shapes and splits, as made below.
  static std::shared_ptr<ParameterStack<T>> gate_up_stack(const std::string& name, const ModelArgs& a,
                                                          parallel::TensorParallelGroup* tp) {
    const Shape w{hidden(name, a, tp), a.dim};
    return std::make_shared<ParameterStack<T>>(std::vector<Shape>{w, w}, std::vector<TensorSplit>{split(tp, 0), split(tp, 0)});
  }

  /// g W2^T summed over the tensor-parallel ranks (g kept for the backward unless the
  /// SwiGLU output is recomputed), plus `residual` where given.
  Tensor<T> output_(const Context<T>& ctx, const Tensor<T>& g, const Tensor<T>* residual) {
    return output_projection(w2_, ctx.child("w2"), g, residual, fuse_, tp_, /*keep_input=*/!recompute_swiglu_);
  }

  /// g = silu(a) * b from a and b side by side in the rows of ab.
  Tensor<T> swiglu_paired(const Tensor<T>& ab) const {
    const std::int64_t rows = ab.size(0), cols = ab.size(1) / 2;
    Tensor<T> g = B::template empty<T>(Shape{rows, cols});
    B::for_each(rows, ops::SwiGluForwardPaired<T>{ab.data(), g.data(), cols});
    return g;
  }

  Tensor<T> stacked_backward_(const Context<T>& ctx, const Tensor<T>& ab, const Tensor<T>& dy_rows) {
    Tensor<T> dg;
    {
      Tensor<T> g;  // w2's input, made again where the forward did not keep it: the same bits
      if (recompute_swiglu_) g = swiglu_paired(ab);
      Float8SharedCasts<B> shared;  // w2 in float8 (tensorwise): dy's amax once for both of its gradients
      dg = w2_backward_(ctx, dy_rows, recompute_swiglu_ ? &g : nullptr);
    }
    const Tensor<T> dab = B::template empty<T>(ab.shape());
    B::for_each(ab.size(0), ops::SwiGluBackwardPaired<T>{ab.data(), dg.data(), dab.data(), ab.size(1) / 2});
    dg.release();
    return stacked_backward(ctx.child("w13"), tp_, dab, w1_, w3_);
  }

  static TensorSplit split(parallel::TensorParallelGroup* tp, int dim) { return tp ? tp->split(dim) : TensorSplit{}; }

  /// w2's backward on the gradient of its (summed) output, whose rows arrive by a
  /// sequence-parallel gather: of float8 values where w2 takes them (its tensorwise cast
  /// of dy, on each rank's rows), else of the rows as they are. `g`: w2's input where the
  /// forward did not keep it.
  Tensor<T> w2_backward_(const Context<T>& ctx, const Tensor<T>& dy_rows, const Tensor<T>* g) {
    if (parallel::splits_rows(tp_) && w2_.takes_float8_grad_output())
      return w2_.backward_float8_gathering(ctx.child("w2"), *tp_, dy_rows, g);
    return w2_.backward_gathering(ctx.child("w2"), tp_, dy_rows, g);
  }

  /// g = silu(a) * b; with `amaxes`, by rows, g's row amaxes kept there (for w2's float8
  /// cast). The rows' kernel whenever w2 casts by rows, so that a g made again in the
  /// backward is the forward's bits whichever kernel made them.
  Tensor<T> swiglu(const Tensor<T>& a, const Tensor<T>& b, Float8RowAmaxes<B>* amaxes) const {
    Tensor<T> g = B::template empty<T>(a.shape());
    if (w2_.float8_input_by_rows()) {
      const std::int64_t rows = a.size(0), cols = a.size(1);
      const Tensor<float> g_amax = B::template empty<float>(Shape{rows});
      B::for_each(rows, ops::SwiGluForwardRows<T>{{a.data(), b.data(), g.data()}, cols, g_amax.data()});
      if (amaxes != nullptr) amaxes->keep(g.cview(), g_amax);
    } else {
      B::for_each(a.numel(), ops::SwiGluForward<T>{a.data(), b.data(), g.data()});
    }
    return g;
  }

  /// The hidden size, once the group's degree is checked against it.
  static std::int64_t hidden(const std::string& name, const ModelArgs& a, parallel::TensorParallelGroup* tp) {
    if (tp) check_tensor_parallel(a, parallel::layer_degree(name, *tp));
    return a.ffn_hidden_dim();
  }

  std::shared_ptr<ParameterStack<T>> w13_;  // w1 and w3 side by side (none: fuse_projections false)
  Linear<T, B> w1_, w2_, w3_;
  parallel::TensorParallelGroup* tp_;
  bool recompute_swiglu_ = false;
  bool fuse_ = true;
};

}  // namespace tessera::nn
