// Linear layer without bias: y = x W^T, W of shape (out, in) as Hugging Face stores it.
//
// Saves its input; backward gives dx = dy W and accumulates dW += dy^T x (the latter
// through Context::weight_grad, so a zero-bubble schedule can run it later; the step's
// first write has beta 0, layer.hpp's first-write rule). For bf16 the GEMMs read bf16
// operands and accumulate in fp32; dW is accumulated in fp32. A caller that can make the
// input again in the backward (nn::FeedForward's SwiGLU output) may have the forward keep
// nothing and hand the input to the backward itself.
//
// Under tensor parallelism the weight may be split (parallel/tensor_parallel.hpp):
// by output rows (column-parallel: y holds this rank's output features) or by input
// columns (row-parallel: x holds this rank's input features, y is a partial sum).
// The layer computes with whatever piece it holds. A piece several ranks hold (key
// and value heads replicated over more ranks than there are heads) gets its gradient
// summed over them.
//
// Under a float8 policy that takes this layer (ops::Float8Policy: model.converters =
// ["float8"], [float8]), its three GEMMs cast their operands to float8 by the policy's
// recipe (nn/float8.hpp); the weight's gradient stays in the accumulation type. They run
// on the backend's float8 GEMM (cuBLASLt's) unless the policy emulates them; a backend
// without one (the CPU) is refused here unless it does, as is a layer whose sizes a
// float8 GEMM cannot take. Under FSDP's float8 all-gather (tensorwise) the weight arrives
// already in float8 (Parameter::float8_value, parallel/sharding.hpp) and the forward and
// input-gradient GEMMs multiply it as it is. Under tensor parallelism each cast of a
// piece (the weight; x of a row-parallel layer; dy of a column-parallel one) takes the
// scales of the whole tensor (nn::Float8Split), so every rank multiplies its piece of
// what one rank would; a piece several ranks hold is refused, since its gradient dy is
// then each rank's part of a sum, which one rank casts whole. Under sequence parallelism
// with tensorwise scaling the layer may take its input (forward_float8) or its output
// gradient (backward_float8) already in float8, gathered so over the ranks.
//
// Under LoRA (layer/lora.hpp: model.converters = ["lora"], [lora]) the weight is frozen
// (no gradient, no GEMM for one) and a layer the policy takes holds an adapter
// (nn/lora.hpp) whose output its forward adds into y, in the model's precision whatever
// the layer's GEMMs run in.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/lora.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

/// a + b as a new tensor (out of place: either may be an output a checkpoint policy keeps).
template <Backend B, class T>
Tensor<T> sum_of(const Tensor<T>& a, const Tensor<T>& b) {
  TESSERA_CHECK(a.shape() == b.shape(), "sum_of: ", a.shape().str(), " and ", b.shape().str());
  Tensor<T> y = B::template empty<T>(a.shape());
  B::for_each(y.numel(), ops::Add<T>{a.data(), b.data(), y.data()});
  return y;
}

/// gather_float8_rows over a tensor-parallel group, with `consume(whole, begin, end)`
/// called on each rank's rows of the gathered operand as they are there (this rank's
/// first, then rank r + 1's, ...), each while the rows after it are on their way, where
/// the group overlaps its collectives (asynchronous tensor parallelism:
/// parallel::whole_rows_overlapped); else gathered whole, then consume(whole, 0, rows).
/// `whole` holds every row's storage from the start; a block's rows are set once it is
/// consumed.
template <Backend B, class T, class F>
Float8Operand<B> gather_float8_rows(parallel::TensorParallelGroup& tp, TensorView<const T> x, Float8Cast cast,
                                    F&& consume) {
  if (!parallel::overlaps(&tp)) {
    const Float8Operand<B> whole = gather_float8_rows<B>(tp.comm(), x, cast);
    consume(whole, std::int64_t{0}, whole.rows);
    return whole;
  }
  TESSERA_CHECK(cast.axis == ops::Float8Axis::tensor, "gather_float8_rows: one scale a tensor (tensorwise), so that "
                "the rows of every rank share it");
  const Float8Operand<B> local = cast_to_float8<B>(x, cast, false, Float8Split::rows(tp.comm()));
  Float8Operand<B> whole = local;
  whole.rows = local.rows * tp.degree();
  const auto gather = [&](const auto& values, auto& into) {
    using V = typename std::remove_cvref_t<decltype(values)>::value_type;
    parallel::whole_rows_overlapped<B>(&tp, values, [&](const Tensor<V>& y, std::int64_t begin, std::int64_t end) {
      into = y;
      consume(std::as_const(whole), begin, end);
    });
  };
  if (cast.format == DType::f8e4m3)
    gather(local.e4m3, whole.e4m3);
  else
    gather(local.e5m2, whole.e5m2);
  return whole;
}

template <class T, Backend B>
class Linear : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;
  /// `tp` and `split`: the tensor-parallel group and how the weight lies over it
  /// (whole by default). A split its shape does not allow is refused here, naming the
  /// weight and its shape: a block that states no check of its own is checked this way.
  /// `float8`: the policy deciding whether this layer's GEMMs run in float8 (by its name
  /// and whole shape; none: they do not).
  /// `stack`: the ParameterStack the weight is member `stack_index` of (stored beside
  /// the layers it runs with as one: nn::stacked_forward), with `split` as its split.
  /// `lora`: the policy deciding whether this layer holds a LoRA adapter (none: it does not).
  Linear(std::string name, std::int64_t in, std::int64_t out, Init init, parallel::TensorParallelGroup* tp = nullptr,
         TensorSplit split = {}, const ops::Float8Policy* float8 = nullptr,
         std::shared_ptr<ParameterStack<T>> stack = {}, std::size_t stack_index = 0, const LoraPolicy* lora = nullptr)
      : tp_(tp) {
    if (lora != nullptr && lora->applies(name)) lora_.emplace(name, in, out, *lora, tp, split);
    if (float8 != nullptr && float8->applies(name, in, out)) {
      float8_ = ops::float8_casts(float8->recipe);
      emulate_float8_ = float8->emulate;
      float8_tp_gather_ = float8->tp_all_gather;
      if (!emulate_float8_) check_float8_gemms(name, split.piece_of(Shape{out, in}), split.split());
      TESSERA_CHECK(split.holders <= 1, name, ": float8 with ", split.holders, " tensor-parallel ranks holding each "
                    "piece of it (more ranks than key/value heads): each rank's output gradient is its part of a sum "
                    "one rank casts to float8 whole; keep it out by float8.filter_fqns, or use a tensor-parallel "
                    "degree that divides n_kv_heads");
    }
    // FSDP may gather this weight in float8: its one scale is the forward's and the input
    // gradient's alike (tensorwise), so both multiply the gathered values.
    const bool gathers_float8 = float8_ && float8->all_gather;
    TESSERA_CHECK(!gathers_float8 || (float8_->weight.axis == ops::Float8Axis::tensor &&
                                      float8_->weight_for_grad_input.axis == ops::Float8Axis::tensor &&
                                      float8_->weight.format == DType::f8e4m3 &&
                                      float8_->weight_for_grad_input.format == DType::f8e4m3),
                  "float8.enable_fsdp_float8_all_gather needs the tensorwise recipe (one scale a weight): ", name);
    if (stack) {
      const TensorSplit& st = stack->split(stack_index);
      TESSERA_CHECK(st.dim == split.dim && st.parts == split.parts && st.index == split.index &&
                        st.holders == split.holders,
                    name, ": its ParameterStack splits it otherwise than the layer does");
    }
    weight_ = Parameter<T>::template on<B>(std::move(name) + ".weight", Shape{out, in}, init, std::move(stack),
                                           stack_index);
    weight_.gathers_float8 = gathers_float8;
    weight_.split = split;
    parallel::check_split(weight_);
  }

  /// y = x W^T; x is kept for the backward unless `keep_input` is false (the caller then
  /// gives it to backward or backward_into).
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x, bool keep_input = true) {
    return forward_(ctx, x, keep_input, nullptr);
  }

  /// residual + x W^T, the forward with a block's residual added in the GEMM's epilogue
  /// (the GEMM's C, read apart from its output: gemm_out_of_place, float8_gemm's c_in),
  /// so no pass of its own, and a bf16 sum rounded once. The backward is the forward's:
  /// the residual's gradient is dy itself, which the block passes on. The op "y" of ctx
  /// is the sum.
  Tensor<T> forward_adding(const Context<T>& ctx, const Tensor<T>& x, const Tensor<T>& residual,
                           bool keep_input = true) {
    TESSERA_CHECK(residual.shape().rank == 2 && residual.size(0) == x.size(0) && residual.size(1) == out_features(),
                  weight_.name, ": the residual added to the output is ", residual.shape().str(), ", the output (",
                  x.size(0), ", ", out_features(), ")");
    return forward_(ctx, x, keep_input, &residual);
  }

  /// `input`: the forward's input where the forward did not keep it (else nullptr).
  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy, const Tensor<T>* input = nullptr) {
    Tensor<T> dx = B::template empty<T>(Shape{dy.size(0), in_features()});
    backward_into(ctx, dy, dx, 0.0f, input);
    return dx;
  }

  /// dx = beta * dx + dy W, so several layers reading one input can sum into one dx.
  /// `input`: the forward's input where the forward did not keep it (else nullptr); the
  /// weight gradient may read it later (a zero-bubble schedule's), so it holds a reference.
  void backward_into(const Context<T>& ctx, const Tensor<T>& dy, const Tensor<T>& dx, float beta,
                     const Tensor<T>* input = nullptr) {
    const RowsBackward f = start_rows_backward(ctx, dy);
    rows_backward(f, dy, 0, dy.size(0), beta, dx.view());
    Tensor<T> du;  // the adapter's s dy B
    if (lora_) {
      du = lora_->grad_down(dy.cview());
      lora_->add_input_grad(du.cview(), dx.view());
    }
    queue_weight_grad_(ctx, dy, du, input, f.dyt8);
  }

  /// backward of the output gradient whose rows arrive by a sequence-parallel gather over
  /// `tp` (a row-parallel layer's): dx = dy W, returned, its GEMM a block of rows at a time
  /// as the rows arrive (parallel::whole_rows_overlapped) where the group overlaps its
  /// collectives, no adapter adds to dx, and dy is cast to float8 by rows or not at all
  /// (each block cast as it arrives); else after the gather.
  Tensor<T> backward_gathering(const Context<T>& ctx, parallel::TensorParallelGroup* tp, const Tensor<T>& dy_rows,
                               const Tensor<T>* input = nullptr) {
    if (!parallel::overlaps(tp) || lora_ || !casts_grad_output_by_rows())
      return backward(ctx, parallel::whole_rows<B>(tp, dy_rows), input);
    Tensor<T> dx = B::template empty<T>(Shape{dy_rows.size(0) * tp->degree(), in_features()});
    std::optional<RowsBackward> f;  // prepared once the transfers are on their way
    const Tensor<T> dy = parallel::whole_rows_overlapped<B>(
        tp, dy_rows, [&](const Tensor<T>& whole, std::int64_t begin, std::int64_t end) {
          if (!f) f = start_block_backward(ctx);
          rows_backward(*f, whole, begin, end, 0.0f, dx.view().slice_rows(begin, end));
        });
    queue_weight_grad_(ctx, dy, Tensor<T>{}, input);
    return dx;
  }

  // ---- The forward's GEMM a block of rows at a time ----------------------------------
  // Asynchronous tensor parallelism runs a row-parallel layer's forward GEMM one peer's
  // rows at a time, each block sent as soon as it is written (output_projection).

  /// Whether the forward may run by blocks of rows now (start_rows_forward): no adapter
  /// adds to its output, and ctx neither stashes nor replays op outputs (selective
  /// checkpointing's op policy keeps the GEMM's whole output).
  bool runs_by_rows(const Context<T>& ctx) const {
    return !lora_ && !ctx.stashes_ops();
  }

  /// The forward of x prepared to run a block of rows at a time: a float8 layer's operands
  /// cast once, as its forward casts them (the scales its backward reuses kept in ctx), or
  /// x a block at a time (`by_blocks`: start_block_forward).
  struct RowsForward {
    bool float8 = false, by_blocks = false;
    Float8Operand<B> x8, w8;  // x (whole, unless by blocks) and, where this layer casts it, the weight
    Float8GemmOperand w;      // the weight as the float8 GEMM multiplies it
    Float8GemmOptions options;
  };
  /// For the forward of x, which is here whole.
  RowsForward start_rows_forward(const Context<T>& ctx, const Tensor<T>& x) { return start_rows_forward_(ctx, &x); }
  /// For the forward of an input whose rows arrive a block at a time (a sequence-parallel
  /// gather): each block cast as it comes, by rows_forward. Where casts_input_by_rows().
  RowsForward start_block_forward(const Context<T>& ctx) {
    TESSERA_CHECK(casts_input_by_rows(), weight_.name, ": a float8 cast of the input by one scale needs the "
                  "whole input; it cannot be cast a block of rows at a time");
    return start_rows_forward_(ctx, nullptr);
  }
  /// Whether the forward's input may be cast a block of rows at a time, each row by itself:
  /// no float8 cast of it, or one by rows over this rank's whole rows (not by one scale,
  /// and not over columns other ranks hold).
  bool casts_input_by_rows() const {
    return !float8_ || (float8_->input.axis == ops::Float8Axis::rows && !input_split().spans(float8_->input.axis));
  }
  /// Rows [begin, end) of the forward's product x W^T into `out` (those rows; x's rows
  /// [begin, end) there).
  void rows_forward(const RowsForward& f, const Tensor<T>& x, std::int64_t begin, std::int64_t end,
                    TensorView<T> out) const {
    if (!f.float8) {
      B::gemm(Trans::no, Trans::yes, 1.0f, x.cview().slice_rows(begin, end), weight_.value.cview(), 0.0f, out);
      return;
    }
    if (f.by_blocks) {  // the block cast as the whole would cast its rows (an open Float8SharedCasts shares it)
      const Float8Operand<B> x8 =
          cast_first_operand<B>(Trans::no, x.cview().slice_rows(begin, end), float8_->input, weight_.name);
      float8_multiply<B>(x8.gemm_operand(weight_.name), f.w, 0.0f, out, weight_.name, f.options);
      return;
    }
    float8_multiply<B>(rows_of(f.x8.gemm_operand(weight_.name), begin, end), f.w, 0.0f, out, weight_.name, f.options);
  }
  /// The input gradient's GEMM (dx = beta dx + dy W) prepared to run a block of rows at a
  /// time: a float8 layer's operands cast once (backward_into runs it whole; an adapter's
  /// addition to dx is the caller's), or dy a block at a time (`by_blocks`).
  struct RowsBackward {
    bool float8 = false, by_blocks = false;
    Float8Operand<B> dy8, wt8;  // dy (whole, unless by blocks), and the storage of the weight's transpose
    Float8Operand<B> dyt8;      // dy^T, where cast with dy in one pass for the weight gradient
    Float8GemmOperand wt;       // the weight's transpose as the float8 GEMM multiplies it
  };
  /// For the input gradient of dy, which is here whole.
  RowsBackward start_rows_backward(const Context<T>& ctx, const Tensor<T>& dy) {
    return start_rows_backward_(ctx, &dy);
  }
  /// For an output gradient whose rows arrive a block at a time (a sequence-parallel
  /// gather): each block cast as it comes, by rows_backward. Where casts_grad_output_by_rows().
  RowsBackward start_block_backward(const Context<T>& ctx) {
    TESSERA_CHECK(casts_grad_output_by_rows(), weight_.name, ": a float8 cast of the output gradient by one scale "
                  "needs the whole gradient; it cannot be cast a block of rows at a time");
    return start_rows_backward_(ctx, nullptr);
  }
  /// Whether the input gradient's cast of the output gradient may take a block of rows at
  /// a time (casts_input_by_rows's rule, for dy).
  bool casts_grad_output_by_rows() const {
    return !float8_ ||
           (float8_->grad_output.axis == ops::Float8Axis::rows && !grad_output_split().spans(float8_->grad_output.axis));
  }
  /// Rows [begin, end) of dx = beta dx + dy W (`dx`: those rows; dy's rows [begin, end) there).
  void rows_backward(const RowsBackward& f, const Tensor<T>& dy, std::int64_t begin, std::int64_t end, float beta,
                     TensorView<T> dx) const {
    if (!f.float8) {
      B::gemm(Trans::no, Trans::no, 1.0f, dy.cview().slice_rows(begin, end), weight_.value.cview(),
              static_cast<accum_t<T>>(beta), dx);
      return;
    }
    if (f.by_blocks) {
      const Float8Operand<B> dy8 =
          cast_first_operand<B>(Trans::no, dy.cview().slice_rows(begin, end), float8_->grad_output, weight_.name);
      float8_multiply<B>(dy8.gemm_operand(weight_.name), f.wt, beta, dx, weight_.name, {emulate_float8_, false});
      return;
    }
    float8_multiply<B>(rows_of(f.dy8.gemm_operand(weight_.name), begin, end), f.wt, beta, dx, weight_.name,
                       {emulate_float8_, false});
  }
  /// The rest of the backward once rows_backward has made dx: the weight gradient.
  void finish_rows_backward(const Context<T>& ctx, const Tensor<T>& dy, const RowsBackward& f,
                            const Tensor<T>* input = nullptr) {
    queue_weight_grad_(ctx, dy, Tensor<T>{}, input, f.dyt8);
  }

  /// Keeps the forward's input for the backward, as forward does (rows_forward's callers).
  void keep_input(const Context<T>& ctx, const Tensor<T>& x) const { ctx.save("x", SaveKind::input, x); }

 private:
  /// start_rows_forward (`x` whole) and start_block_forward (`x` null: cast by blocks).
  RowsForward start_rows_forward_(const Context<T>& ctx, const Tensor<T>* x) {
    RowsForward f;
    if (!float8_ && weight_.float8_value.empty()) return f;
    f.float8 = true;
    f.by_blocks = x == nullptr;
    f.options = {emulate_float8_, float8_->fast_accumulation_forward};
    const auto cast_x = [&] {
      if (x != nullptr) f.x8 = cast_first_operand<B>(Trans::no, x->cview(), float8_->input, weight_.name, input_split());
    };
    if (!weight_.float8_value.empty()) {  // the weight gathered in float8 (forward_'s first branch)
      cast_x();
      f.w = gathered_float8_weight(false);
      return f;
    }
    std::optional<Float8SharedCasts<B>> own;  // x's tensorwise scale found here for the backward (save_scale)
    Float8SharedCasts<B>& casts = open_casts(own);
    cast_x();
    f.w8 = cast_to_float8<B>(weight_.value.cview(), float8_->weight, false, weight_split());
    f.w = f.w8.gemm_operand(weight_.name);
    if (x != nullptr) save_scale(ctx, casts, "x", x->cview(), float8_->input, reuses_input_scale());
    save_scale(ctx, casts, "w", weight_.value.cview(), float8_->weight, reuses_weight_scale());
    return f;
  }
  /// start_rows_backward (`dy` whole) and start_block_backward (`dy` null: cast by blocks).
  RowsBackward start_rows_backward_(const Context<T>& ctx, const Tensor<T>* dy) {
    RowsBackward f;
    if (!float8_ && weight_.float8_value.empty()) return f;
    f.float8 = true;
    f.by_blocks = dy == nullptr;
    if (dy != nullptr && casts_grad_output_both_layouts())  // dy^T for the weight gradient's GEMM
      f.dy8 = cast_to_float8_both_layouts<B>(dy->cview(), float8_->grad_output, grad_output_split(), &f.dyt8);
    else if (dy != nullptr)
      f.dy8 = cast_first_operand<B>(Trans::no, dy->cview(), float8_->grad_output, weight_.name, grad_output_split());
    f.wt = float8_weight_transposed_(ctx, f.wt8);
    return f;
  }

  /// Whether the backward casts dy into both layouts in one pass (nn::cast_to_float8_both_layouts):
  /// the input gradient's GEMM takes dy and the weight gradient's dy^T, by one tensorwise
  /// cast, and the weight gradient is in float8. The weight gradient multiplies the dy^T
  /// so made (RowsBackward::dyt8), now or, deferred (a zero-bubble schedule's), later: it
  /// then holds dy^T's byte an element rather than dy's two, and casts nothing.
  bool casts_grad_output_both_layouts() const {
    return float8_ && !float8_->grad_weight_high_precision && !weight_.frozen && !lora_ &&
           float8_->grad_output.axis == ops::Float8Axis::tensor &&
           same_cast(float8_->grad_output, float8_->grad_output_for_grad_weight);
  }

  /// The weight's transpose as the float8 GEMM of dx = dy W multiplies it: FSDP's weight
  /// gathered in float8, transposed, or the weight cast by its input-gradient cast (by the
  /// forward's scale where it kept one). `held` keeps its storage.
  Float8GemmOperand float8_weight_transposed_(const Context<T>& ctx, Float8Operand<B>& held) {
    if (!weight_.float8_value.empty()) {
      held.e4m3 = B::template empty<float8_e4m3>(Shape{in_features(), out_features()});
      return gathered_float8_weight(true, held.e4m3);
    }
    std::optional<Float8SharedCasts<B>> own;  // the forward's scale of the weight, for its transpose
    Float8SharedCasts<B>& casts = open_casts(own);
    hand_scale(casts, weight_.value.cview(), float8_->weight, saved_scale(ctx, "w"));
    held = cast_to_float8<B>(weight_.value.cview(), float8_->weight_for_grad_input, true, weight_split());
    return held.gemm_operand(weight_.name);
  }

  /// backward_float8's weight gradient, dW (+)= dy^T x: dy8's values transposed with its
  /// scale, x^T cast by the forward's scale (through ctx.weight_grad).
  void queue_float8_weight_grad_(const Context<T>& ctx, const Float8Operand<B>& dy8, const Tensor<T>* input) {
    ctx.weight_grad([this, x = input != nullptr ? *input : ctx.saved("x"), dy8, x_scale = saved_scale(ctx, "x")] {
      std::optional<Float8SharedCasts<B>> own;
      Float8SharedCasts<B>& casts = open_casts(own);
      hand_scale(casts, x.cview(), float8_->input, x_scale);
      const Float8Operand<B> dyt = transposed_float8<B>(dy8);
      const Float8Operand<B> xt = cast_to_float8<B>(x.cview(), float8_->input_for_grad_weight, true, input_split());
      float8_multiply<B>(dyt.gemm_operand(weight_.name), xt.gemm_operand(weight_.name),
                         static_cast<float>(weight_.grad_write_beta()), weight_.grad.view(), weight_.name,
                         {emulate_float8_, false});
    });
  }

  /// The weight gradient's part of the backward (through ctx.weight_grad): the adapter's
  /// and the weight's, of dy and the forward's input; `du` the adapter's s dy B. `dyt8`:
  /// dy^T in float8 where the input gradient's cast made it with dy (RowsBackward::dyt8),
  /// which the weight gradient then multiplies, holding it rather than dy; else it casts
  /// dy^T itself.
  void queue_weight_grad_(const Context<T>& ctx, const Tensor<T>& dy, const Tensor<T>& du, const Tensor<T>* input,
                          const Float8Operand<B>& dyt8 = {}) {
    if (weight_.frozen && !lora_) return;
    const Tensor<T>* kept_u = lora_ ? ctx.saved_if("lora_u") : nullptr;
    const Tensor<T> dy_held = has_values(dyt8) ? Tensor<T>{} : dy;
    // The forward's input gathered in float8 (forward_float8), where it was: its transpose
    // is the weight gradient's operand.
    const Float8Operand<B> x8 = input == nullptr ? saved_float8_input(ctx) : Float8Operand<B>{};
    if (!x8.e4m3.empty()) {
      ctx.weight_grad([this, x8, dy = dy_held, dyt8] {
        weight_gemm_float8_input(dy, x8, weight_.grad_write_beta(), weight_.grad, dyt8);
      });
      return;
    }
    ctx.weight_grad([this, x = input != nullptr ? *input : ctx.saved("x"), dy = dy_held, dyt8, du,
                     x_scale = saved_scale(ctx, "x"), u = kept_u != nullptr ? *kept_u : Tensor<T>{}] {
      if (lora_) lora_->weight_grads(dy.cview(), x.cview(), du.cview(), u.empty() ? nullptr : &u);
      if (weight_.frozen) return;
      if (parallel::active(tp_) && weight_.split.holders > 1) {
        Tensor<accum_t<T>> dw = B::template empty<accum_t<T>>(weight_.grad.shape());
        weight_gemm(dy, x, 0.0f, dw, x_scale, dyt8);
        parallel::accumulate_over_holders<B>(tp_, dw, weight_);
      } else {
        weight_gemm(dy, x, weight_.grad_write_beta(), weight_.grad, x_scale, dyt8);
      }
    });
  }
  static bool has_values(const Float8Operand<B>& q) { return !q.e4m3.empty() || !q.e5m2.empty(); }

 public:
  // ---- Operands gathered in float8 over sequence-parallel ranks ------------------------
  // Under sequence parallelism a column-parallel layer's input and a row-parallel layer's
  // output gradient arrive by an all-gather of every rank's rows. Where this layer casts
  // that operand by one scale (tensorwise) and its weight gradient casts the operand's
  // transpose by the same cast, the rows may be cast on each rank and gathered as float8
  // (nn::gather_float8_rows: the same bytes, half a bf16 gather's), and the layer then
  // multiplies them as they are: torchtitan's float8 tensor parallelism.

  /// Whether the forward may take x in float8 (forward_float8).
  bool takes_float8_input() const {
    return float8_ && float8_tp_gather_ && !lora_ && !weight_.frozen && float8_->input.axis == ops::Float8Axis::tensor &&
           float8_->input.format == DType::f8e4m3 && reuses_input_scale();
  }
  /// Whether the backward may take dy in float8 (backward_float8).
  bool takes_float8_grad_output() const {
    return float8_ && float8_tp_gather_ && !lora_ && !weight_.frozen && !float8_->grad_weight_high_precision &&
           float8_->grad_output.axis == ops::Float8Axis::tensor &&
           same_cast(float8_->grad_output, float8_->grad_output_for_grad_weight);
  }

  /// y = x W^T with x already cast by this layer's input cast (`x8`: every row, e4m3, one
  /// scale). x8 is kept for the backward (one byte an element), whose weight gradient
  /// multiplies its transpose; where takes_float8_input().
  Tensor<T> forward_float8(const Context<T>& ctx, const Float8Operand<B>& x8) {
    Tensor<T> y = ctx.op("y", SaveKind::matmul, [&] {
      Float8Rows f = start_float8_rows(ctx, x8);
      float8_rows(f, x8, 0, x8.rows);
      return f.out;
    });
    keep_float8_input(ctx, x8);
    return y;
  }

  // ---- forward_float8 and backward_float8 a block of rows at a time ------------------
  // For an operand whose rows arrive one rank's at a time (gather_float8_rows over a group
  // that overlaps its collectives): start_float8_rows casts (or takes) the weight once and
  // makes the output, float8_rows multiplies a block of rows into it. The forward's caller
  // then keeps x8 (keep_float8_input); the backward's queues the weight gradient
  // (backward_float8_gathering does both ends).

  /// The weight as this layer's float8 GEMMs multiply it and the output being written.
  struct Float8Rows {
    Tensor<T> out;
    Float8Operand<B> cast;  // the weight's cast, where this layer makes it
    Float8GemmOperand w;
    Float8GemmOptions options;
  };

  /// For the forward of x8 (where takes_float8_input()): the weight cast by its forward
  /// cast (its scale kept for the backward where reused), the output (x8.rows, out).
  Float8Rows start_float8_rows(const Context<T>& ctx, const Float8Operand<B>& x8) {
    TESSERA_CHECK(takes_float8_input() && x8.cast.format == DType::f8e4m3 && x8.cast.axis == ops::Float8Axis::tensor &&
                      !x8.transposed && x8.cols == in_features(),
                  weight_.name, ": an input in float8 needs this layer's tensorwise e4m3 input cast and ",
                  in_features(), " features a row");
    Float8Rows f;
    f.out = B::template empty<T>(Shape{x8.rows, out_features()});
    f.options = {emulate_float8_, float8_->fast_accumulation_forward};
    if (!weight_.float8_value.empty()) {
      f.w = gathered_float8_weight(false);
      return f;
    }
    f.cast = cast_to_float8<B>(weight_.value.cview(), float8_->weight, false, weight_split());
    f.w = f.cast.gemm_operand(weight_.name);
    if constexpr (std::is_same_v<accum_t<T>, float>) {
      if (reuses_weight_scale()) {
        ctx.save(scale_key("w"), SaveKind::scale, f.cast.scale);
        ctx.save(inverse_key("w"), SaveKind::scale, f.cast.inverse);
      }
    }
    return f;
  }

  /// Rows [begin, end) of f's product: of the forward (x8 W^T) or, from
  /// start_float8_backward_rows, of the input gradient (dy8 W).
  void float8_rows(Float8Rows& f, const Float8Operand<B>& a8, std::int64_t begin, std::int64_t end) const {
    float8_multiply<B>(rows_of(a8.gemm_operand(weight_.name), begin, end), f.w, 0.0f,
                       f.out.view().slice_rows(begin, end), weight_.name, f.options);
  }

  /// Keeps x8, the forward's input in float8, for the backward (forward_float8's end).
  void keep_float8_input(const Context<T>& ctx, const Float8Operand<B>& x8) const {
    ctx.save("x8", SaveKind::input, x8.e4m3);
    if constexpr (std::is_same_v<accum_t<T>, float>) {
      ctx.save(scale_key("x8"), SaveKind::scale, x8.scale);
      ctx.save(inverse_key("x8"), SaveKind::scale, x8.inverse);
    }
  }

  /// dx = dy W, returned, and dW (+)= dy^T x (through ctx.weight_grad) with dy already
  /// cast by this layer's output-gradient cast (`dy8`: every row, one scale); `input`: the
  /// forward's input where it did not keep it. Where takes_float8_grad_output().
  Tensor<T> backward_float8(const Context<T>& ctx, const Float8Operand<B>& dy8, const Tensor<T>* input = nullptr) {
    Float8Rows f = start_float8_backward_rows(ctx, dy8);
    float8_rows(f, dy8, 0, dy8.rows);
    queue_float8_weight_grad_(ctx, dy8, input);
    return f.out;
  }

  /// backward_float8 of the output gradient whose rows are cast on each rank of `tp` and
  /// gathered as float8 (gather_float8_rows), dx's GEMM a block of rows at a time as they
  /// arrive where the group overlaps its collectives.
  Tensor<T> backward_float8_gathering(const Context<T>& ctx, parallel::TensorParallelGroup& tp, const Tensor<T>& dy_rows,
                                      const Tensor<T>* input = nullptr) {
    std::optional<Float8Rows> f;
    const Float8Operand<B> dy8 = gather_float8_rows<B>(
        tp, dy_rows.cview(), float8_->grad_output, [&](const Float8Operand<B>& whole, std::int64_t begin, std::int64_t end) {
          if (!f) f = start_float8_backward_rows(ctx, whole);
          float8_rows(*f, whole, begin, end);
        });
    queue_float8_weight_grad_(ctx, dy8, input);
    return f->out;
  }

  /// For the input gradient of dy8 (where takes_float8_grad_output()): the weight's
  /// transpose cast for it (by the forward's scale where it kept one), dx (dy8.rows, in).
  Float8Rows start_float8_backward_rows(const Context<T>& ctx, const Float8Operand<B>& dy8) {
    TESSERA_CHECK(takes_float8_grad_output() && dy8.cast.format == float8_->grad_output.format &&
                      dy8.cast.axis == ops::Float8Axis::tensor && !dy8.transposed && dy8.cols == out_features(),
                  weight_.name, ": an output gradient in float8 needs this layer's tensorwise output-gradient cast and ",
                  out_features(), " features a row");
    Float8Rows f;
    f.out = B::template empty<T>(Shape{dy8.rows, in_features()});
    f.options = {emulate_float8_, false};
    f.w = float8_weight_transposed_(ctx, f.cast);
    return f;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight_);
    if (lora_) lora_->for_each_parameter(f);
  }

  Parameter<T>& weight() { return weight_; }
  /// The LoRA adapter this layer holds, or nullptr.
  LoraAdapter<T, B>* lora() { return lora_ ? &*lora_ : nullptr; }
  const Parameter<T>& weight() const { return weight_; }
  /// Whether this layer can run in one GEMM with others reading its input (stacked_forward):
  /// its GEMMs in the model's precision (not float8), and its gradient its own (not summed
  /// over tensor-parallel ranks holding the same piece).
  bool stackable() const {
    return !float8_ && weight_.float8_value.empty() && !(parallel::active(tp_) && weight_.split.holders > 1);
  }
  std::int64_t in_features() const { return weight_.piece_shape()[1]; }
  std::int64_t out_features() const { return weight_.piece_shape()[0]; }
  /// The casts of this layer's float8 GEMMs, when it has them.
  const std::optional<ops::Float8LinearCasts>& float8() const { return float8_; }
  /// Whether the forward casts its input to float8 by scales from the amaxes of the
  /// input's rows (tensorwise, or by rows): the kernel that writes the input may hand
  /// them over (Float8RowAmaxes) and spare the cast its own pass.
  bool float8_input_by_rows() const { return float8_ && float8_->input.axis != ops::Float8Axis::columns; }
  /// The same for the backward's cast of the output's gradient (the input gradient's GEMM).
  bool float8_grad_output_by_rows() const {
    return float8_ && float8_->grad_output.axis != ops::Float8Axis::columns;
  }

 private:
  /// The weight as FSDP's float8 all-gather left it, as a float8 GEMM's second operand: as
  /// gathered (out x in: the forward's), or `transposed` into `into` (in x out: the input
  /// gradient's, the reduction over the output features).
  Float8GemmOperand gathered_float8_weight(bool transposed, const Tensor<float8_e4m3>& into = {}) const {
    const Tensor<float8_e4m3>& w = weight_.float8_value;
    const std::int64_t out = w.size(0), in = w.size(1);
    if (!transposed) return {w.data(), DType::f8e4m3, out, in, weight_.float8_inverse.data(), false};
    B::for_each(out * in, ops::Float8Transpose<float8_e4m3>{w.data(), out, in, into.data()});
    return {into.data(), DType::f8e4m3, in, out, weight_.float8_inverse.data(), false};
  }

  // ---- How the float8 casts' operands lie over the tensor-parallel group ----------------
  // Column-parallel (the weight split by output rows): x whole on every rank, W and dy
  // (rows x this rank's output features) split. Row-parallel (split by input columns):
  // x (rows x this rank's input features) and W split by columns, dy whole.
  bool column_parallel() const { return parallel::active(tp_) && weight_.split.split() && weight_.split.dim == 0; }
  bool row_parallel() const { return parallel::active(tp_) && weight_.split.split() && weight_.split.dim == 1; }
  Float8Split input_split() const { return row_parallel() ? Float8Split::columns(tp_->comm()) : Float8Split{}; }
  Float8Split grad_output_split() const {
    return column_parallel() ? Float8Split::columns(tp_->comm()) : Float8Split{};
  }
  Float8Split weight_split() const {
    if (column_parallel()) return Float8Split::rows(tp_->comm());
    return row_parallel() ? Float8Split::columns(tp_->comm()) : Float8Split{};
  }

  /// A layer whose float8 GEMMs are not emulated needs a backend that has them and sizes
  /// they take: this rank's piece's (`piece`, out x in), a tensor-parallel one where
  /// `split` (its tokens are checked at each GEMM).
  static void check_float8_gemms(const std::string& name, Shape piece, bool split) {
    TESSERA_CHECK(HasFloat8Gemm<B>, "float8.emulate = false: ", name, " would run float8 GEMMs on the ",
                  name_of(B::device), " backend, which has none (cuBLASLt's need a GPU of compute capability 8.9 "
                  "or later); set float8.emulate = true to run them emulated");
    const std::int64_t in = piece[1], out = piece[0];
    TESSERA_CHECK(in % kFloat8GemmMultiple == 0 && out % kFloat8GemmMultiple == 0, "model.converters = [\"float8\"]: ",
                  name, " (", in, " -> ", out, " features", split ? " on each tensor-parallel rank" : "",
                  ") cannot run float8 GEMMs, which need both sizes in multiples of ", kFloat8GemmMultiple,
                  "; keep it out by float8.filter_fqns or set float8.emulate = true");
  }

  /// A scale and its inverse the forward saved (held: a deferred weight gradient may run
  /// after the store is cleared), or none (empty).
  struct SavedScale {
    Tensor<float> scale, inverse;
    bool found() const { return scale.data() != nullptr && inverse.data() != nullptr; }
  };

  /// into = dy^T x + beta into: the weight's gradient, in float8 where the recipe casts
  /// it, x's transpose cast with the forward's scale of x where it kept one.
  void weight_gemm(const Tensor<T>& dy, const Tensor<T>& x, accum_t<T> beta, const Tensor<accum_t<T>>& into,
                   const SavedScale& x_scale = {}, const Float8Operand<B>& dyt8 = {}) {
    if (float8_ && !float8_->grad_weight_high_precision) {
      std::optional<Float8SharedCasts<B>> own;
      Float8SharedCasts<B>& casts = open_casts(own);
      hand_scale(casts, x.cview(), float8_->input, x_scale);
      if (has_values(dyt8)) {  // dy^T cast with dy (the input gradient's): float8_gemm's GEMM with it as the first operand
        const Float8Operand<B> xt = cast_to_float8<B>(x.cview(), float8_->input_for_grad_weight, true, input_split());
        if (into.numel() > 0)
          float8_multiply<B>(dyt8.gemm_operand(weight_.name), xt.gemm_operand(weight_.name), static_cast<float>(beta),
                             into.view(), weight_.name, {emulate_float8_, false});
        return;
      }
      float8_gemm<B>(Trans::yes, Trans::no, dy.cview(), float8_->grad_output_for_grad_weight, x.cview(),
                     float8_->input_for_grad_weight, static_cast<float>(beta), into.view(), weight_.name,
                     {emulate_float8_, false, grad_output_split(), input_split()});
    } else {
      B::gemm(Trans::yes, Trans::no, 1.0f, dy.cview(), x.cview(), beta, into.view());
    }
  }

  /// The input forward_float8 kept (its values, scale and inverse), or none (empty).
  Float8Operand<B> saved_float8_input(const Context<T>& ctx) const {
    Float8Operand<B> q;
    if constexpr (std::is_same_v<accum_t<T>, float>) {
      const Tensor<float8_e4m3>* x8 = ctx.template saved_if<float8_e4m3>("x8");
      if (x8 == nullptr) return q;
      q.e4m3 = *x8;
      q.scale = ctx.template saved<float>(scale_key("x8"));
      q.inverse = ctx.template saved<float>(inverse_key("x8"));
      q.cast = float8_->input;
      q.rows = x8->size(0);
      q.cols = x8->size(1);
    }
    return q;
  }

  /// into = dy^T x + beta into with x as forward_float8 kept it (`x8`): its transpose the
  /// GEMM's second operand, dy^T cast by the recipe.
  void weight_gemm_float8_input(const Tensor<T>& dy, const Float8Operand<B>& x8, accum_t<T> beta,
                                const Tensor<accum_t<T>>& into, const Float8Operand<B>& dyt8 = {}) {
    std::optional<Float8SharedCasts<B>> own;
    open_casts(own);
    const Float8Operand<B> dyt =
        has_values(dyt8) ? dyt8
                         : cast_first_operand<B>(Trans::yes, dy.cview(), float8_->grad_output_for_grad_weight,
                                                 weight_.name, grad_output_split());
    const Float8Operand<B> xt = transposed_float8<B>(x8);
    float8_multiply<B>(dyt.gemm_operand(weight_.name), xt.gemm_operand(weight_.name), static_cast<float>(beta),
                       into.view(), weight_.name, {emulate_float8_, false});
  }

  // ---- The forward's tensorwise scales, taken again by the backward ------------------
  // A tensorwise recipe casts x and W by one scale each in the forward, and their
  // transposes by the same casts for the weight and input gradients: the amax of the
  // same values. The forward saves the two scales (a statistic each: 4 bytes and its
  // inverse), and the backward hands them to its casts (Float8SharedCasts::keep_scale),
  // which then only cast: no amax pass over x and W again. Where the forward's GEMM did
  // not run (an output replayed from selective checkpointing's stash) nothing is saved,
  // and the backward takes the amax itself, as before.

  /// The Float8SharedCasts open on this thread, or `own` opened (a linear layer's casts
  /// join the scope its layer opened around it: a scope of its own would hide them).
  static Float8SharedCasts<B>& open_casts(std::optional<Float8SharedCasts<B>>& own) {
    if (Float8SharedCasts<B>* open = Float8SharedCasts<B>::current()) return *open;
    return own.emplace();
  }

  /// The input's backward cast (for the weight gradient) is the forward's, transposed.
  bool reuses_input_scale() const {
    return float8_ && !float8_->grad_weight_high_precision && float8_->input.axis == ops::Float8Axis::tensor &&
           same_cast(float8_->input, float8_->input_for_grad_weight);
  }
  /// The weight's backward cast (for the input gradient) is the forward's, transposed.
  bool reuses_weight_scale() const {
    return float8_ && float8_->weight.axis == ops::Float8Axis::tensor &&
           same_cast(float8_->weight, float8_->weight_for_grad_input);
  }
  static bool same_cast(const ops::Float8Cast& a, const ops::Float8Cast& b) {
    return a.format == b.format && a.axis == b.axis && a.power_of_two == b.power_of_two;
  }

  /// x W^T (+ *residual, added by the GEMM as its C where given).
  Tensor<T> forward_(const Context<T>& ctx, const Tensor<T>& x, bool keep_input, const Tensor<T>* residual) {
    Tensor<T> lora_u;
    Tensor<T> y = ctx.op("y", SaveKind::matmul, [&] {
      Tensor<T> out = B::template empty<T>(Shape{x.size(0), out_features()});
      const float beta = residual != nullptr ? 1.0f : 0.0f;
      const TensorView<const T> c = residual != nullptr ? residual->cview() : TensorView<const T>{};
      if (!weight_.float8_value.empty())
        float8_gemm<B>(Trans::no, x.cview(), float8_->input, gathered_float8_weight(false), beta, out.view(),
                       weight_.name, {emulate_float8_, float8_->fast_accumulation_forward, input_split()}, c);
      else if (float8_) {
        // The GEMM's casts, whose tensorwise scales the backward takes: kept in the scope
        // open around it (a layer's, sharing x between its linear layers), else in one here.
        std::optional<Float8SharedCasts<B>> own;
        Float8SharedCasts<B>& casts = open_casts(own);
        float8_gemm<B>(Trans::no, Trans::yes, x.cview(), float8_->input, weight_.value.cview(), float8_->weight, beta,
                       out.view(), weight_.name,
                       {emulate_float8_, float8_->fast_accumulation_forward, input_split(), weight_split()}, c);
        save_scale(ctx, casts, "x", x.cview(), float8_->input, reuses_input_scale());
        save_scale(ctx, casts, "w", weight_.value.cview(), float8_->weight, reuses_weight_scale());
      } else if (residual != nullptr) {
        gemm_out_of_place<B>(Trans::no, Trans::yes, 1.0f, x.cview(), weight_.value.cview(), 1.0f, c, out.view());
      } else {
        B::gemm(Trans::no, Trans::yes, 1.0f, x.cview(), weight_.value.cview(), 0.0f, out.view());
      }
      if (lora_) lora_u = lora_->add_forward(x.cview(), out.view());
      return out;
    });
    // The adapter's u for the backward, where the GEMMs ran (an output a policy replays
    // from its stash did not: the backward makes it again).
    if (!lora_u.empty()) ctx.save("lora_u", SaveKind::matmul, lora_u);
    if (keep_input) ctx.save("x", SaveKind::input, x);
    return y;
  }

  static std::string scale_key(const char* what) { return std::string(what) + "_float8_scale"; }
  static std::string inverse_key(const char* what) { return std::string(what) + "_float8_inverse"; }

  /// After the forward's GEMM: the scale its cast of `v` by `cast` took (found in
  /// `casts`, or in a scope around it), saved under `what` where `reused`.
  void save_scale(const Context<T>& ctx, const Float8SharedCasts<B>& casts, const char* what, TensorView<const T> v,
                  const ops::Float8Cast& cast, bool reused) const {
    if constexpr (std::is_same_v<accum_t<T>, float>) {
      if (!reused) return;
      const Float8Operand<B>* q = casts.find(Float8SharedCasts<B>::key_of(v, cast, false));
      if (q == nullptr) return;
      ctx.save(scale_key(what), SaveKind::scale, q->scale);
      ctx.save(inverse_key(what), SaveKind::scale, q->inverse);
    }
  }
  /// What save_scale saved under `what`, or none.
  static SavedScale saved_scale(const Context<T>& ctx, const char* what) {
    SavedScale s;
    if constexpr (std::is_same_v<accum_t<T>, float>) {
      const Tensor<float>* scale = ctx.template saved_if<float>(scale_key(what));
      const Tensor<float>* inverse = ctx.template saved_if<float>(inverse_key(what));
      if (scale != nullptr && inverse != nullptr) s = {*scale, *inverse};
    }
    return s;
  }
  /// Hands `casts` the forward's scale `s` of `v` (by the forward's `cast`), where it saved one.
  static void hand_scale(Float8SharedCasts<B>& casts, TensorView<const T> v, const ops::Float8Cast& cast,
                         const SavedScale& s) {
    if (s.found()) casts.keep_scale(Float8SharedCasts<B>::key_of(v, cast, false), s.scale, s.inverse);
  }

  Parameter<T> weight_;
  std::optional<LoraAdapter<T, B>> lora_;
  parallel::TensorParallelGroup* tp_ = nullptr;
  std::optional<ops::Float8LinearCasts> float8_;
  bool emulate_float8_ = true;
  bool float8_tp_gather_ = true;  // ops::Float8Policy::tp_all_gather
};

/// A block's output projection (attention's wo, the feed-forward's w2): x W^T summed over
/// the tensor-parallel ranks `tp`, plus `residual` where given. The residual is added in
/// W's GEMM (Linear::forward_adding) where `fused` (the layer's projections run fused) and
/// no tensor-parallel partial sums are to be reduced first, else by a pass after the sum.
template <class T, Backend B>
Tensor<T> output_projection(Linear<T, B>& w, const Context<T>& ctx, const Tensor<T>& x, const Tensor<T>* residual,
                            bool fused, parallel::TensorParallelGroup* tp, bool keep_input = true) {
  if (residual != nullptr && fused && !parallel::active(tp)) return w.forward_adding(ctx, x, *residual, keep_input);
  Tensor<T> y;
  if (parallel::overlaps(tp) && w.runs_by_rows(ctx)) {  // each peer's rows sent as soon as they are made
    const typename Linear<T, B>::RowsForward f = w.start_rows_forward(ctx, x);
    y = parallel::summed_rows_overlapped<B, T>(tp, x.size(0), w.out_features(),
                                               [&](const Tensor<T>& partial, std::int64_t begin, std::int64_t end) {
                                                 w.rows_forward(f, x, begin, end, partial.view().slice_rows(begin, end));
                                               });
    if (keep_input) w.keep_input(ctx, x);
  } else {
    y = parallel::summed_rows<B>(tp, w.forward(ctx, x, keep_input));
  }
  return residual != nullptr ? sum_of<B>(*residual, y) : y;
}

/// gathered_forward's and gathered_float8_forward's `then` that keeps each output as made.
inline constexpr auto as_made = [](std::size_t, const auto& y) { return y; };

/// Each of the layers' forward of x_rows gathered over the sequence-parallel ranks of `tp`
/// (parallel::whole_rows; x_rows itself without them), each output i handed to
/// `then(i, y)` and what it returns kept, in order; `names` their children of ctx; x cast
/// to float8 once for all of them where they cast it alike (Float8SharedCasts). Where the
/// group overlaps its collectives, ctx neither stashes nor replays op outputs, and each
/// layer runs by rows with its input cast by rows or not at all (Linear::runs_by_rows,
/// casts_input_by_rows), each layer's GEMM runs a block of rows at a time as the rows
/// arrive, each block cast once; else the layers run one after another on the gathered x,
/// each output through `then` before the next layer runs (so that what `then` replaces,
/// a projection's output RoPE rotates out of place, is freed before the next is made).
template <class T, Backend B, class Then, class... Ls>
std::array<Tensor<T>, 1 + sizeof...(Ls)> gathered_forward(const Context<T>& ctx, parallel::TensorParallelGroup* tp,
                                                          const Tensor<T>& x_rows,
                                                          std::array<const char*, 1 + sizeof...(Ls)> names,
                                                          Then&& then, Linear<T, B>& first, Ls&... rest) {
  constexpr std::size_t n = 1 + sizeof...(Ls);
  const std::array<Linear<T, B>*, n> layers{&first, &rest...};
  std::array<Tensor<T>, n> outs;
  bool by_blocks = parallel::overlaps(tp);
  for (std::size_t i = 0; i < n; ++i)
    by_blocks = by_blocks && layers[i]->runs_by_rows(ctx.child(names[i])) && layers[i]->casts_input_by_rows();
  Float8SharedCasts<B> shared;  // float8 GEMMs: x, or each block of it, cast once for all
  if (!by_blocks) {
    const Tensor<T> x = parallel::whole_rows<B>(tp, x_rows);
    for (std::size_t i = 0; i < n; ++i) outs[i] = then(i, layers[i]->forward(ctx.child(names[i]), x));
    return outs;
  }
  const std::int64_t rows = x_rows.size(0) * tp->degree();
  for (std::size_t i = 0; i < n; ++i) outs[i] = B::template empty<T>(Shape{rows, layers[i]->out_features()});
  std::array<std::optional<typename Linear<T, B>::RowsForward>, n> f;  // prepared once the transfers are on their way
  const Tensor<T> x = parallel::whole_rows_overlapped<B>(
      tp, x_rows, [&](const Tensor<T>& whole, std::int64_t begin, std::int64_t end) {
        for (std::size_t i = 0; i < n; ++i) {
          if (!f[i]) f[i] = layers[i]->start_block_forward(ctx.child(names[i]));
          layers[i]->rows_forward(*f[i], whole, begin, end, outs[i].view().slice_rows(begin, end));
        }
      });
  for (std::size_t i = 0; i < n; ++i) {
    layers[i]->keep_input(ctx.child(names[i]), x);
    outs[i] = then(i, outs[i]);
  }
  return outs;
}

/// Each of the layers' forward_float8 of x_rows cast by the first one's input cast (which
/// they share: Attention's and FeedForward's gathers_float8_input) and gathered over `tp`
/// as float8 (gather_float8_rows), each output i handed to `then(i, y)` and what it
/// returns kept, in order, as gathered_forward does; `names` their children of ctx. Where
/// the group overlaps its collectives and ctx neither stashes nor replays op outputs, each
/// layer's GEMM runs a block of rows at a time as the rows arrive; else one after another,
/// each output through `then` before the next layer runs.
template <class T, Backend B, class Then, class... Ls>
std::array<Tensor<T>, 1 + sizeof...(Ls)> gathered_float8_forward(const Context<T>& ctx,
                                                                 parallel::TensorParallelGroup& tp,
                                                                 const Tensor<T>& x_rows,
                                                                 std::array<const char*, 1 + sizeof...(Ls)> names,
                                                                 Then&& then, Linear<T, B>& first, Ls&... rest) {
  constexpr std::size_t n = 1 + sizeof...(Ls);
  const std::array<Linear<T, B>*, n> layers{&first, &rest...};
  const Float8Cast cast = first.float8()->input;
  std::array<Tensor<T>, n> outs;
  if (!parallel::overlaps(&tp) || ctx.stashes_ops()) {
    const Float8Operand<B> x8 = gather_float8_rows<B>(tp.comm(), x_rows.cview(), cast);
    for (std::size_t i = 0; i < n; ++i) outs[i] = then(i, layers[i]->forward_float8(ctx.child(names[i]), x8));
    return outs;
  }
  std::array<std::optional<typename Linear<T, B>::Float8Rows>, n> rows;
  const Float8Operand<B> x8 = gather_float8_rows<B>(
      tp, x_rows.cview(), cast, [&](const Float8Operand<B>& whole, std::int64_t begin, std::int64_t end) {
        for (std::size_t i = 0; i < n; ++i) {
          if (!rows[i]) rows[i] = layers[i]->start_float8_rows(ctx.child(names[i]), whole);
          layers[i]->float8_rows(*rows[i], whole, begin, end);
        }
      });
  for (std::size_t i = 0; i < n; ++i) {
    layers[i]->keep_float8_input(ctx.child(names[i]), x8);
    outs[i] = then(i, rows[i]->out);
  }
  return outs;
}

/// dx = dy_0 W_0 + dy_1 W_1 + ... of layers reading one input (each's backward, its weight
/// gradient queued), summed over the tensor-parallel ranks `tp` (parallel::summed_rows);
/// `names` their children of ctx. Where the group overlaps its collectives and no layer
/// has an adapter, dx is made a peer's rows at a time, each sent as soon as it is made.
template <class T, Backend B, class... Ls>
Tensor<T> summed_input_grads(const Context<T>& ctx, parallel::TensorParallelGroup* tp,
                             std::array<const char*, 1 + sizeof...(Ls)> names,
                             std::array<const Tensor<T>*, 1 + sizeof...(Ls)> dys, Linear<T, B>& first, Ls&... rest) {
  constexpr std::size_t n = 1 + sizeof...(Ls);
  const std::array<Linear<T, B>*, n> layers{&first, &rest...};
  bool adapted = false;
  for (Linear<T, B>* l : layers) adapted = adapted || l->lora() != nullptr;
  if (!parallel::overlaps(tp) || adapted) {
    const Tensor<T> dx = first.backward(ctx.child(names[0]), *dys[0]);
    for (std::size_t i = 1; i < n; ++i) layers[i]->backward_into(ctx.child(names[i]), *dys[i], dx, 1.0f);
    return parallel::summed_rows<B>(tp, dx);
  }
  std::array<typename Linear<T, B>::RowsBackward, n> f;
  for (std::size_t i = 0; i < n; ++i) f[i] = layers[i]->start_rows_backward(ctx.child(names[i]), *dys[i]);
  const Tensor<T> dx = parallel::summed_rows_overlapped<B, T>(
      tp, dys[0]->size(0), first.in_features(), [&](const Tensor<T>& partial, std::int64_t begin, std::int64_t end) {
        for (std::size_t i = 0; i < n; ++i)
          layers[i]->rows_backward(f[i], *dys[i], begin, end, i == 0 ? 0.0f : 1.0f, partial.view().slice_rows(begin, end));
      });
  for (std::size_t i = 0; i < n; ++i) layers[i]->finish_rows_backward(ctx.child(names[i]), *dys[i], f[i]);
  return dx;
}

// ---- Linear layers reading one input, run as one -------------------------------------
//
// Attention's wq, wk and wv read the same x, as the feed-forward's w1 and w3 do. With
// their weights side by side (a ParameterStack, or an FSDP unit's flat buffer) the
// weights are one matrix W = [W_0; W_1; ...] of their rows, and the layers run as one:
// y = x W^T, dx = dy W and dW = dy^T x, each one GEMM where there was one a layer (and
// the input gradient's sum over them, added into dx one GEMM at a time, is one GEMM's
// reduction). y (rows, the outputs' sum) holds each layer's output in its columns, side
// by side, and dy the same for their gradients. Fewer, larger GEMMs: cuBLASLt runs the
// 512-column key and value projections of Llama 3.2 1B at 0.58 of the peak, the fused
// one at 0.66 (examples/machines/h200.toml).

/// Whether `first` and `rest`... run as one now (stacked_forward): each stackable, their
/// weights side by side, and a context that keeps or drops its saves as a whole rather
/// than stashing op outputs (selective checkpointing keeps every other projection's
/// output, as torchtitan's policy counts them: run separately there, as there).
template <class T, Backend B, class... Ls>
bool runs_stacked(const Context<T>& ctx, const Linear<T, B>& first, const Ls&... rest) {
  if (ctx.stashes_ops()) return false;
  return first.stackable() && (rest.stackable() && ...) && side_by_side(first.weight(), rest.weight()...);
}

/// y = x [W_0; W_1; ...]^T, (rows, the layers' outputs side by side), the op "y" of ctx;
/// x kept for the backward. Where runs_stacked holds. x is x_rows gathered over the
/// sequence-parallel ranks of `tp` (parallel::whole_rows; x_rows itself without them),
/// the GEMM a block of rows at a time as they arrive where the group overlaps its
/// collectives (parallel::whole_rows_overlapped).
template <class T, Backend B, class... Ls>
Tensor<T> stacked_forward(const Context<T>& ctx, parallel::TensorParallelGroup* tp, const Tensor<T>& x_rows,
                          Linear<T, B>& first, Ls&... rest) {
  const std::int64_t in = first.in_features(), out = (first.out_features() + ... + rest.out_features());
  const TensorView<const T> w(first.weight().value.data(), Shape{out, in});
  std::array<Tensor<T>, 1 + sizeof...(Ls)> us;  // each adapter's u = x A^T, for its backward
  Tensor<T> x;
  Tensor<T> y = ctx.op("y", SaveKind::matmul, [&] {
    Tensor<T> o = B::template empty<T>(Shape{x_rows.size(0) * (parallel::splits_rows(tp) ? tp->degree() : 1), out});
    x = parallel::whole_rows_overlapped<B>(tp, x_rows, [&](const Tensor<T>& whole, std::int64_t begin, std::int64_t end) {
      B::gemm(Trans::no, Trans::yes, 1.0f, whole.cview().slice_rows(begin, end), w, 0.0f,
              o.view().slice_rows(begin, end));
    });
    std::int64_t col = 0;  // each adapter's output into its layer's columns
    std::size_t i = 0;
    auto add_adapter = [&](Linear<T, B>& l) {
      if (LoraAdapter<T, B>* a = l.lora()) us[i] = a->add_forward(x.cview(), o.view().slice_cols(col, col + l.out_features()));
      col += l.out_features();
      ++i;
    };
    add_adapter(first);
    (add_adapter(rest), ...);
    return o;
  });
  if (x.empty()) x = parallel::whole_rows<B>(tp, x_rows);  // the op's output came from a stash
  ctx.save("x", SaveKind::input, x);
  for (std::size_t i = 0; i < us.size(); ++i)
    if (!us[i].empty()) ctx.save("lora_u" + std::to_string(i), SaveKind::matmul, us[i]);
  return y;
}

/// The backward of stacked_forward: dx = dy [W_0; W_1; ...] (one GEMM) summed over the
/// tensor-parallel ranks `tp` (parallel::summed_rows) and returned, and each weight's
/// gradient dW_i (+)= dy_i^T x through ctx.weight_grad: one GEMM where the gradients lie
/// side by side too and each is written alike this step (all first writes, or all
/// additions), else one a layer on dy's columns. Where the group overlaps its collectives
/// and no adapter adds to dx, dx's GEMM runs a peer's rows at a time, each sent as soon as
/// it is made (parallel::summed_rows_overlapped).
template <class T, Backend B, class... Ls>
Tensor<T> stacked_backward(const Context<T>& ctx, parallel::TensorParallelGroup* tp, const Tensor<T>& dy,
                           Linear<T, B>& first, Ls&... rest) {
  const std::int64_t in = first.in_features(), out = (first.out_features() + ... + rest.out_features());
  const TensorView<const T> w(first.weight().value.data(), Shape{out, in});
  std::array<Parameter<T>*, 1 + sizeof...(Ls)> ws{&first.weight(), &rest.weight()...};
  // The adapters' input gradients, and their s dy B, by layer (none where it has none).
  std::array<LoraAdapter<T, B>*, 1 + sizeof...(Ls)> adapters{first.lora(), rest.lora()...};
  std::array<Tensor<T>, 1 + sizeof...(Ls)> dus, us;  // s dy B, and the u the forward kept
  std::array<std::int64_t, 2 + sizeof...(Ls)> cols{};
  bool adapted = false;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    cols[i + 1] = cols[i] + ws[i]->value.size(0);
    adapted = adapted || adapters[i] != nullptr;
  }
  const auto input_grad = [&](const Tensor<T>& dx, std::int64_t begin, std::int64_t end) {
    B::gemm(Trans::no, Trans::no, 1.0f, dy.cview().slice_rows(begin, end), w, 0.0f, dx.view().slice_rows(begin, end));
  };
  Tensor<T> dx_summed;
  if (parallel::overlaps(tp) && !adapted) {
    dx_summed = parallel::summed_rows_overlapped<B, T>(tp, dy.size(0), in, input_grad);
  } else {
    const Tensor<T> dx = B::template empty<T>(Shape{dy.size(0), in});
    input_grad(dx, 0, dy.size(0));
    for (std::size_t i = 0; i < ws.size(); ++i) {
      if (adapters[i] == nullptr) continue;
      dus[i] = adapters[i]->grad_down(dy.cview().slice_cols(cols[i], cols[i + 1]));
      adapters[i]->add_input_grad(dus[i].cview(), dx.view());
      if (const Tensor<T>* u = ctx.saved_if("lora_u" + std::to_string(i))) us[i] = *u;
    }
    dx_summed = parallel::summed_rows<B>(tp, dx);
  }
  ctx.weight_grad([ws, adapters, dus, us, cols, x = ctx.saved("x"), dy, in, out] {
    using G = accum_t<T>;
    for (std::size_t i = 0; i < ws.size(); ++i)
      if (adapters[i] != nullptr)
        adapters[i]->weight_grads(dy.cview().slice_cols(cols[i], cols[i + 1]), x.cview(), dus[i].cview(),
                                  us[i].empty() ? nullptr : &us[i]);
    bool frozen = false, trained = false;
    for (Parameter<T>* w : ws) (w->frozen ? frozen : trained) = true;
    if (!trained) return;
    bool alike = !frozen;  // each written alike, and (still) side by side
    for (std::size_t i = 1; i < ws.size(); ++i)
      alike = alike && ws[i]->grad_written == ws[0]->grad_written &&
              ws[i]->grad.data() == ws[i - 1]->grad.data() + ws[i - 1]->grad.numel();
    if (alike) {
      G beta{};
      for (Parameter<T>* w : ws) beta = w->grad_write_beta();
      B::gemm(Trans::yes, Trans::no, 1.0f, dy.cview(), x.cview(), beta,
              TensorView<G>(ws.front()->grad.data(), Shape{out, in}));
      return;
    }
    for (std::size_t i = 0; i < ws.size(); ++i)
      if (!ws[i]->frozen)
        B::gemm(Trans::yes, Trans::no, 1.0f, dy.cview().slice_cols(cols[i], cols[i + 1]), x.cview(),
                ws[i]->grad_write_beta(), ws[i]->grad.view());
  });
  return dx_summed;
}

}  // namespace tessera::nn
