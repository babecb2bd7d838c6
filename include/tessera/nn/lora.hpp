// A LoRA adapter: the two trainable weights beside a frozen linear layer, and their GEMMs
// (layer/lora.hpp says what LoRA is; nn::Linear and the loss head hold one each where
// the policy takes them).
//
// With x (rows, in), dy (rows, out) and s = alpha / rank:
//
//   forward    u = x A^T (rows, rank);  y += s u B^T        (the GEMM's beta 1: no pass of its own)
//   backward   du = s dy B (rows, rank);  dx += du A
//              dB (+)= s dy^T u  (u as the forward kept it, rows x rank; made again from x
//                                 where it was not kept)
//              dA (+)= du^T x
//
// Four skinny GEMMs of rank columns where the layer's own are rows x in x out: at rank 8
// on Llama 3 8B's projections, under 1% of the layer's arithmetic.
//
// Tensor parallelism, as torchtitan splits the adapters: beside a column-parallel
// weight (split by output rows: wq, wk, wv, w1, w3, the output under loss parallelism)
// A is whole on every rank and B is split as the weight is; du is then each rank's
// partial sum, and so is A's gradient, which is summed over the ranks (A's holders).
// Beside a row-parallel weight (split by input columns: wo, w2) A is split as the weight
// is and B is whole; u is then a partial sum, and s u B^T adds to the layer's partial
// output, which the layer sums over the ranks anyway; B's gradient is summed over them.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/lora.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

template <class T, Backend B>
class LoraAdapter {
 public:
  using A = accum_t<T>;

  /// The adapters of the layer `layer` ("layers.0.attention.wq"), `in` -> `out` features
  /// whole, whose weight lies over `tp` as `weight_split` says (whole: {}). `partial`:
  /// whether a gradient computed here beside a piece several ranks hold is a partial sum
  /// (a linear layer's) or the same on each of them (the loss head without loss
  /// parallelism, every rank computing it whole).
  LoraAdapter(const std::string& layer, std::int64_t in, std::int64_t out, const LoraPolicy& policy,
              parallel::TensorParallelGroup* tp, const TensorSplit& weight_split, bool partial = true)
      : a_(trainable(layer + ".lora_a.weight", Shape{policy.rank, in}, Init::linear_default(in))),
        b_(trainable(layer + ".lora_b.weight", Shape{out, policy.rank}, Init{})),
        scale_(policy.scaling()),
        tp_(tp),
        partial_(partial) {
    TESSERA_CHECK(policy.rank >= 1, layer, ": lora.rank = ", policy.rank, " (must be at least 1)");
    if (parallel::active(tp)) {
      const bool by_columns = weight_split.split() && weight_split.dim == 1;  // row-parallel
      if (by_columns) {
        a_.split = TensorSplit{1, weight_split.parts, weight_split.index, weight_split.holders, weight_split.owner};
        b_.split = tp->whole();
      } else {
        a_.split = tp->whole();
        b_.split = TensorSplit{0, weight_split.parts, weight_split.index, weight_split.holders, weight_split.owner};
      }
      parallel::check_split(a_);
      parallel::check_split(b_);
    }
  }

  /// y += s (x A^T) B^T: x (rows, in) and y (rows, out) as this rank holds them; returns
  /// u = x A^T, which the backward takes (weight_grads) rather than making it again.
  template <class Y>
  Tensor<T> add_forward(TensorView<const T> x, TensorView<Y> y) const {
    Tensor<T> u = down(x);
    B::gemm(Trans::no, Trans::yes, scale_, u.cview(), b_.value.cview(), static_cast<accum_t<Y>>(1), y);
    return u;
  }

  /// du = s dy B (rows, rank): what the input's and A's gradients take.
  Tensor<T> grad_down(TensorView<const T> dy) const {
    Tensor<T> du = B::template empty<T>(Shape{dy.size(0), rank()});
    B::gemm(Trans::no, Trans::no, scale_, dy, b_.value.cview(), A(0), du.view());
    return du;
  }

  /// dx += du A.
  void add_input_grad(TensorView<const T> du, TensorView<T> dx) const {
    B::gemm(Trans::no, Trans::no, A(1), du, a_.value.cview(), A(1), dx);
  }

  /// dB (+)= s dy^T u and dA (+)= du^T x, u = x A^T as the forward kept it (`kept`), or
  /// made again; summed over the ranks holding each piece where those see parts of it (the
  /// comment at the top).
  void weight_grads(TensorView<const T> dy, TensorView<const T> x, TensorView<const T> du,
                    const Tensor<T>* kept = nullptr) {
    const Tensor<T> u = kept != nullptr ? *kept : down(x);
    write(b_, [&](A beta, TensorView<A> into) { B::gemm(Trans::yes, Trans::no, scale_, dy, u.cview(), beta, into); });
    write(a_, [&](A beta, TensorView<A> into) { B::gemm(Trans::yes, Trans::no, A(1), du, x, beta, into); });
  }

  /// The two GEMMs of weight_grads, each added into `a_sum` and `b_sum` (this rank's
  /// shapes, fp32) with the beta given: for a caller that sums several calls (the loss
  /// head's chunks) before finishing them once (finish_grads).
  /// `u`: x A^T as the forward made it.
  void weight_grads_into(TensorView<const T> dy, TensorView<const T> x, TensorView<const T> du,
                         TensorView<const T> u, A beta, const Tensor<A>& a_sum, const Tensor<A>& b_sum) const {
    B::gemm(Trans::yes, Trans::no, scale_, dy, u, beta, b_sum.view());
    B::gemm(Trans::yes, Trans::no, A(1), du, x, beta, a_sum.view());
  }
  /// Adds sums made by weight_grads_into to the gradients (summed over holders first).
  void finish_grads(Tensor<A>& a_sum, Tensor<A>& b_sum) {
    accumulate(a_, a_sum);
    accumulate(b_, b_sum);
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(a_);
    f(b_);
  }

  std::int64_t rank() const { return a_.whole.dims[0]; }
  float scale() const { return scale_; }
  Parameter<T>& a() { return a_; }
  Parameter<T>& b() { return b_; }
  const Parameter<T>& a() const { return a_; }
  const Parameter<T>& b() const { return b_; }

 private:
  static Parameter<T> trainable(std::string name, Shape shape, Init init) {
    FreezeParameters scope(false);
    return Parameter<T>::template on<B>(std::move(name), shape, init);
  }

  /// u = x A^T.
  Tensor<T> down(TensorView<const T> x) const {
    Tensor<T> u = B::template empty<T>(Shape{x.size(0), rank()});
    B::gemm(Trans::no, Trans::yes, A(1), x, a_.value.cview(), A(0), u.view());
    return u;
  }

  bool summed(const Parameter<T>& p) const { return partial_ && parallel::active(tp_) && p.split.holders > 1; }

  /// gemm(beta, into) writes p's gradient: into it where this rank's part is all of it,
  /// else into a sum over the holders first.
  template <class Gemm>
  void write(Parameter<T>& p, Gemm&& gemm) {
    if (!summed(p)) {
      gemm(p.grad_write_beta(), p.grad.view());
      return;
    }
    Tensor<A> part = B::template empty<A>(p.grad.shape());
    gemm(A(0), part.view());
    parallel::accumulate_over_holders<B>(tp_, part, p);
  }

  /// Adds `sum` to p's gradient (its first write copies it), summed over the holders
  /// first where the pieces are partial sums.
  void accumulate(Parameter<T>& p, Tensor<A>& sum) {
    parallel::accumulate_over_holders<B>(summed(p) ? tp_ : nullptr, sum, p);
  }

  Parameter<T> a_, b_;
  float scale_;
  parallel::TensorParallelGroup* tp_;
  bool partial_;
};

}  // namespace tessera::nn
