// Causal grouped-query self-attention with rotary embeddings.
//
//   q = x Wq^T (rows, H*hd), k = x Wk^T, v = x Wv^T (rows, KV*hd)
//   q, k <- rope(q), rope(k);  o = softmax(q k^T / sqrt(hd), causal) v;  y = o Wo^T
// Saves the rotated q and k, v, o and the row log-sum-exp; the backend's attention
// backward recomputes the probabilities from them.
//
// Under context parallelism (parallel/context_parallel.hpp) the rows are this rank's two
// chunks of each sequence: RoPE rotates them by their global positions and the keys
// and values of the other chunks come round the cp ring.
//
// Packed documents (Geometry::documents): RoPE counts positions from each row's
// document start and each query attends only within its document.
//
// Under tensor parallelism (parallel/tensor_parallel.hpp) x arrives as this rank's
// rows and is gathered; wq, wk, wv are column-parallel (this rank's heads), wo is
// row-parallel and its partial sums are reduce-scattered back to rows. Key/value
// heads are split like the query heads, or, with more ranks than kv heads, each rank
// holds the one kv head its query heads read.
//
// The three projections run as one (nn::stacked_forward): wq, wk and wv are stored side by
// side (a ParameterStack), one GEMM writes x [Wq; Wk; Wv]^T, (rows, (H + 2 KV) hd), RoPE
// rotates its q and k columns in place, and attention reads q, k and v as column blocks of
// it (the backends take any leading dimension). The backward writes dq, dk and dv into
// one such matrix, RoPE turns its q and k columns back, and one GEMM gives dx, one the
// three weights' gradients. The saves are the same bytes (q, k and v, now one matrix).
// Not under context parallelism (the ring moves contiguous keys and values), float8,
// selective checkpointing's op stash, or `fuse_projections` false: there the projections
// run one by one, as before.
//
// Decoding (a Context that carries a KV cache, layer/kv_cache.hpp): the rows are one
// sequence's next tokens, at positions Geometry::past on. Their keys and values go into
// this layer's slot of the cache after those of the tokens before them, and the queries
// attend to every key the slot holds (the backend's attention with AttentionShape::past).
// One whole sequence on one rank: no tensor or context parallelism, no packed documents.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/kv_cache.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/linear.hpp"
#include "tessera/nn/rope.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/parallel/context_parallel.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

template <class T, Backend B>
class Attention : public LayerTypes<T, B> {
 public:
  static constexpr bool writes_gradients_first = true;  // layer.hpp's first-write rule
  /// `out_std`: the init std of wo (torchtitan scales it by depth).
  /// `tp`: the tensor-parallel group (nullptr or degree 1: every head here); a degree the
  /// head counts do not allow is refused before anything is made.
  /// `float8`: which of the projections multiply in float8 (ops::Float8Policy; none: none).
  /// `cp`: the ranks holding the other parts of each sequence (nullptr or degree 1: none).
  /// `fuse_projections`: wq, wk and wv stored side by side and run as one GEMM each way
  /// where they can be (false: stored and run one by one).
  /// `lora`: which of the projections hold LoRA adapters (layer/lora.hpp; none: none).
  Attention(const std::string& name, const ModelArgs& a, double out_std, std::shared_ptr<RopeTable<T, B>> rope,
            parallel::TensorParallelGroup* tp = nullptr, const ops::Float8Policy* float8 = nullptr,
            parallel::ContextParallelGroup* cp = nullptr, bool fuse_projections = true,
            const LoraPolicy* lora = nullptr)
      : n_heads_(heads_here(name, a, tp)),
        n_kv_heads_(std::max<std::int64_t>(1, a.kv_heads() / (tp ? tp->degree() : 1))),
        head_dim_(a.head_dim()),
        qkv_(fuse_projections ? qkv_stack(a, tp) : nullptr),
        wq_(name + ".wq", a.dim, a.n_heads * a.head_dim(), Init::truncated_normal(0.02), tp, split(tp, 0, a.n_heads),
            float8, qkv_, 0, lora),
        wk_(name + ".wk", a.dim, a.kv_heads() * a.head_dim(), Init::truncated_normal(0.02), tp,
            split(tp, 0, a.kv_heads()), float8, qkv_, 1, lora),
        wv_(name + ".wv", a.dim, a.kv_heads() * a.head_dim(), Init::truncated_normal(0.02), tp,
            split(tp, 0, a.kv_heads()), float8, qkv_, 2, lora),
        wo_(name + ".wo", a.n_heads * a.head_dim(), a.dim, Init::truncated_normal(out_std), tp, split(tp, 1, a.n_heads),
            float8, nullptr, 0, lora),
        rope_(std::move(rope)),
        tp_(tp),
        cp_(cp),
        fuse_(fuse_projections),
        name_(name) {}

  /// The attention's output (this rank's rows), plus `residual` where given (a block's
  /// x, the same rows): added in wo's GEMM where it can be (output_).
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x_rows, const Tensor<T>* residual = nullptr) {
    if constexpr (attends_past_keys<B>)
      if (KvCache<T>* cache = ctx.kv_cache()) return cached_forward_(ctx, *cache, x_rows, residual);
    TESSERA_CHECK(ctx.kv_cache() == nullptr, name_,
                  ": decoding through a KV cache on a backend whose attention takes no keys before its queries");
    const AttentionShape s = shape(ctx.geometry());
    if (stacked(ctx)) return stacked_forward_(ctx, s, x_rows, residual);
    // RoPE out of place: the projections' outputs may be kept by a checkpoint policy.
    const auto rotated = [&](std::size_t i, const Tensor<T>& y) {
      return i == 2 ? y : rope_->rotated(y, i == 0 ? n_heads_ : n_kv_heads_, ctx.geometry().positions());
    };
    // The rows cast here and gathered as float8, multiplied as gathered; else gathered (in
    // blocks multiplied as they arrive, where they can be) and multiplied.
    const std::array<Tensor<T>, 3> qkv =
        gathers_float8_input() ? gathered_float8_forward(ctx, *tp_, x_rows, {"wq", "wk", "wv"}, rotated, wq_, wk_, wv_)
                               : gathered_forward(ctx, tp_, x_rows, {"wq", "wk", "wv"}, rotated, wq_, wk_, wv_);
    const Tensor<T>& q = qkv[0];
    const Tensor<T>& k = qkv[1];
    const Tensor<T>& v = qkv[2];
    Tensor<accum_t<T>> lse;  // fp32 for bf16
    Tensor<T> o = ctx.op("o", SaveKind::attention, [&] {
      Tensor<T> out = B::template empty<T>(q.shape());
      lse = B::template empty<accum_t<T>>(Shape{s.batch, n_heads_, s.seq_len});
      parallel::attention_forward<B>(cp_, s, q.cview(), k.cview(), v.cview(), out.view(), lse.data());
      return out;
    });
    lse = ctx.op("lse", SaveKind::attention, [&] { return lse; });  // made with o, kept with o
    ctx.save("q", SaveKind::pointwise, q);
    ctx.save("k", SaveKind::pointwise, k);
    ctx.save("v", SaveKind::matmul, v);
    ctx.save("o", SaveKind::attention, o);
    ctx.save("lse", SaveKind::attention, lse);
    return output_(ctx, o, residual);
  }

  Tensor<T> backward(const Context<T>& ctx, const Tensor<T>& dy_rows) {
    const AttentionShape s = shape(ctx.geometry());
    Tensor<T> d_o;
    {
      Float8SharedCasts<B> shared;  // float8 GEMMs (tensorwise): dy's amax once for both of wo's gradients
      if (parallel::splits_rows(tp_) && wo_.takes_float8_grad_output())  // dy's rows cast here, gathered as float8
        d_o = wo_.backward_float8_gathering(ctx.child("wo"), *tp_, dy_rows);
      else
        d_o = wo_.backward_gathering(ctx.child("wo"), tp_, dy_rows);
    }
    if (const Tensor<T>* qkv = ctx.saved_if("qkv")) return stacked_backward_(ctx, s, *qkv, d_o);
    const Tensor<T>& q = ctx.saved("q");
    const Tensor<T>& k = ctx.saved("k");
    Tensor<T> dq = B::template empty<T>(q.shape());
    Tensor<T> dk = B::template empty<T>(k.shape());
    Tensor<T> dv = B::template empty<T>(k.shape());
    parallel::attention_backward<B>(cp_, s, q.cview(), k.cview(), ctx.saved("v").cview(), ctx.saved("o").cview(),
                                    ctx.template saved<accum_t<T>>("lse").data(), d_o.cview(), dq.view(), dk.view(),
                                    dv.view());
    rope_->rotate(dq, n_heads_, ctx.geometry().positions(), true);
    rope_->rotate(dk, n_kv_heads_, ctx.geometry().positions(), true);
    // Float8 GEMMs: x^T cast once for the three weight gradients, and (tensorwise) each
    // of dq, dk and dv's amax taken once for its input and weight gradients.
    Float8SharedCasts<B> shared;
    return summed_input_grads(ctx, tp_, {"wq", "wk", "wv"}, {&dq, &dk, &dv}, wq_, wk_, wv_);
  }

  /// Whether the projections' float8 casts of the input take their scales from its rows'
  /// amaxes, the input as it arrives (not gathered over sequence-parallel ranks first, or
  /// cast before a float8 gather): the norm before it may write them (nn::Float8RowAmaxes,
  /// nn::LlamaBlock).
  bool float8_input_by_rows() const {
    return (!parallel::splits_rows(tp_) || gathers_float8_input()) &&
           (wq_.float8_input_by_rows() || wk_.float8_input_by_rows() || wv_.float8_input_by_rows());
  }

  /// Whether the input's sequence-parallel gather carries float8 values (each rank's rows
  /// cast by the one scale wq, wk and wv cast x by: Linear::forward_float8).
  bool gathers_float8_input() const {
    return parallel::splits_rows(tp_) && wq_.takes_float8_input() && wk_.takes_float8_input() &&
           wv_.takes_float8_input();
  }

  template <class F>
  void for_each_parameter(F&& f) {
    wq_.for_each_parameter(f);
    wk_.for_each_parameter(f);
    wv_.for_each_parameter(f);
    wo_.for_each_parameter(f);
  }

 private:
  // ---- wq, wk and wv as one --------------------------------------------------------

  /// Whether the projections run as one in this call (the comment at the top).
  bool stacked(const Context<T>& ctx) const {
    return fuse_ && !parallel::active(cp_) && runs_stacked(ctx, wq_, wk_, wv_);
  }

  /// The stack wq, wk and wv are stored in: their whole shapes and splits, as made below.
  static std::shared_ptr<ParameterStack<T>> qkv_stack(const ModelArgs& a, parallel::TensorParallelGroup* tp) {
    const std::int64_t q = a.n_heads * a.head_dim(), kv = a.kv_heads() * a.head_dim();
    return std::make_shared<ParameterStack<T>>(
        std::vector<Shape>{Shape{q, a.dim}, Shape{kv, a.dim}, Shape{kv, a.dim}},
        std::vector<TensorSplit>{split(tp, 0, a.n_heads), split(tp, 0, a.kv_heads()), split(tp, 0, a.kv_heads())});
  }

  /// Columns [first, first + heads hd) of m: one projection's block.
  template <class V>
  V heads_of(V m, std::int64_t first, std::int64_t heads) const {
    return m.slice_cols(first, first + heads * head_dim_);
  }

  /// x_rows: the rows this rank holds (parallel::whole_rows gathers the rest).
  Tensor<T> stacked_forward_(const Context<T>& ctx, const AttentionShape& s, const Tensor<T>& x_rows,
                             const Tensor<T>* residual) {
    const std::int64_t q_cols = n_heads_ * head_dim_, kv_cols = n_kv_heads_ * head_dim_;
    const Tensor<T> qkv = stacked_forward(ctx.child("wqkv"), tp_, x_rows, wq_, wk_, wv_);
    const ops::RowPositions positions = ctx.geometry().positions();
    rope_->rotate(heads_of(qkv.view(), 0, n_heads_), n_heads_, positions, false);
    rope_->rotate(heads_of(qkv.view(), q_cols, n_kv_heads_), n_kv_heads_, positions, false);
    const TensorView<const T> all = qkv.cview();
    Tensor<accum_t<T>> lse;
    Tensor<T> o = ctx.op("o", SaveKind::attention, [&] {
      Tensor<T> out = B::template empty<T>(Shape{qkv.size(0), q_cols});
      lse = B::template empty<accum_t<T>>(Shape{s.batch, n_heads_, s.seq_len});
      parallel::attention_forward<B>(cp_, s, heads_of(all, 0, n_heads_), heads_of(all, q_cols, n_kv_heads_),
                                     heads_of(all, q_cols + kv_cols, n_kv_heads_), out.view(), lse.data());
      return out;
    });
    lse = ctx.op("lse", SaveKind::attention, [&] { return lse; });
    ctx.save("qkv", SaveKind::matmul, qkv);  // rotated q and k, and v
    ctx.save("o", SaveKind::attention, o);
    ctx.save("lse", SaveKind::attention, lse);
    return output_(ctx, o, residual);
  }

  /// Decoding (the comment at the top): the projections as forward() runs them, the keys
  /// and values appended to this layer's slot of `cache`, attention over the whole slot.
  Tensor<T> cached_forward_(const Context<T>& ctx, KvCache<T>& cache, const Tensor<T>& x_rows,
                            const Tensor<T>* residual) {
    const Geometry& g = ctx.geometry();
    TESSERA_CHECK(!parallel::active(cp_) && (tp_ == nullptr || tp_->degree() == 1) && g.batch == 1 &&
                      g.documents == nullptr,
                  name_, ": decoding through a KV cache takes one whole sequence on one rank (no tensor or context "
                         "parallelism, no packed documents)");
    const std::int64_t q_cols = n_heads_ * head_dim_, kv_cols = n_kv_heads_ * head_dim_, n = g.seq_len;
    typename KvCache<T>::Slot& slot = cache.slot(this, [&] {
      return typename KvCache<T>::Slot{B::template empty<T>(Shape{cache.capacity(), kv_cols}),
                                       B::template empty<T>(Shape{cache.capacity(), kv_cols}), 0};
    });
    TESSERA_CHECK(slot.length == g.past, name_, ": its KV cache holds ", slot.length,
                  " tokens where the new rows start at position ", g.past);
    TESSERA_CHECK(g.past + n <= cache.capacity(), name_, ": ", n, " new tokens after ", g.past,
                  " do not fit a KV cache of ", cache.capacity());
    // q, k and v of the new rows, rotated to their positions (past on): one matrix, or three.
    Tensor<T> qkv;
    std::array<Tensor<T>, 3> apart;
    TensorView<const T> q, k, v;
    if (stacked(ctx)) {
      qkv = stacked_forward(ctx.child("wqkv"), tp_, x_rows, wq_, wk_, wv_);
      rope_->rotate(heads_of(qkv.view(), 0, n_heads_), n_heads_, g.positions(), false);
      rope_->rotate(heads_of(qkv.view(), q_cols, n_kv_heads_), n_kv_heads_, g.positions(), false);
      q = heads_of(qkv.cview(), 0, n_heads_);
      k = heads_of(qkv.cview(), q_cols, n_kv_heads_);
      v = heads_of(qkv.cview(), q_cols + kv_cols, n_kv_heads_);
    } else {
      const auto rotated = [&](std::size_t i, const Tensor<T>& y) {
        return i == 2 ? y : rope_->rotated(y, i == 0 ? n_heads_ : n_kv_heads_, g.positions());
      };
      apart = gathered_forward(ctx, tp_, x_rows, {"wq", "wk", "wv"}, rotated, wq_, wk_, wv_);
      q = apart[0].cview();
      k = apart[1].cview();
      v = apart[2].cview();
    }
    for (std::int64_t r = 0; r < n; ++r) {
      B::for_each(kv_cols, ops::Copy<T>{k.row(r), slot.keys.data() + (g.past + r) * kv_cols});
      B::for_each(kv_cols, ops::Copy<T>{v.row(r), slot.values.data() + (g.past + r) * kv_cols});
    }
    slot.length = g.past + n;
    AttentionShape s = shape(g);
    s.past = g.past;
    Tensor<T> o = B::template empty<T>(Shape{n, q_cols});
    const Tensor<accum_t<T>> lse = B::template empty<accum_t<T>>(Shape{1, n_heads_, n});
    B::attention_forward(s, q, TensorView<const T>(slot.keys.data(), Shape{slot.length, kv_cols}),
                         TensorView<const T>(slot.values.data(), Shape{slot.length, kv_cols}), o.view(), lse.data());
    return output_(ctx, o, residual);
  }

  /// o Wo^T summed over the tensor-parallel ranks, plus `residual` where given.
  Tensor<T> output_(const Context<T>& ctx, const Tensor<T>& o, const Tensor<T>* residual) {
    return output_projection(wo_, ctx.child("wo"), o, residual, fuse_, tp_);
  }

  Tensor<T> stacked_backward_(const Context<T>& ctx, const AttentionShape& s, const Tensor<T>& qkv,
                              const Tensor<T>& d_o) {
    const std::int64_t q_cols = n_heads_ * head_dim_, kv_cols = n_kv_heads_ * head_dim_;
    const TensorView<const T> all = qkv.cview();
    const Tensor<T> dqkv = B::template empty<T>(qkv.shape());
    const TensorView<T> d = dqkv.view();
    parallel::attention_backward<B>(cp_, s, heads_of(all, 0, n_heads_), heads_of(all, q_cols, n_kv_heads_),
                                    heads_of(all, q_cols + kv_cols, n_kv_heads_), ctx.saved("o").cview(),
                                    ctx.template saved<accum_t<T>>("lse").data(), d_o.cview(), heads_of(d, 0, n_heads_),
                                    heads_of(d, q_cols, n_kv_heads_), heads_of(d, q_cols + kv_cols, n_kv_heads_));
    const ops::RowPositions positions = ctx.geometry().positions();
    rope_->rotate(heads_of(d, 0, n_heads_), n_heads_, positions, true);
    rope_->rotate(heads_of(d, q_cols, n_kv_heads_), n_kv_heads_, positions, true);
    return stacked_backward(ctx.child("wqkv"), tp_, dqkv, wq_, wk_, wv_);
  }

  /// The query heads this rank computes, once the group's degree is checked against the
  /// head counts (first, so that a bad degree is named as such rather than as a
  /// projection that does not split).
  static std::int64_t heads_here(const std::string& name, const ModelArgs& a, parallel::TensorParallelGroup* tp) {
    if (!tp) return a.n_heads;
    parallel::check_heads_split(a, parallel::layer_degree(name, *tp));
    return a.n_heads / tp->degree();
  }

  /// How a projection of `heads` heads splits along `dim` over the group.
  static TensorSplit split(parallel::TensorParallelGroup* tp, int dim, std::int64_t heads) {
    return tp ? tp->pieces(dim, heads) : TensorSplit{};
  }

  AttentionShape shape(const Geometry& g) const {
    return AttentionShape{g.batch,     g.seq_len, n_heads_,         n_kv_heads_,
                          head_dim_,   true,      g.documents,      g.document_table,
                          g.document_slots};
  }

  std::int64_t n_heads_, n_kv_heads_, head_dim_;
  std::shared_ptr<ParameterStack<T>> qkv_;  // wq, wk and wv side by side (none: fuse_projections false)
  Linear<T, B> wq_, wk_, wv_, wo_;
  std::shared_ptr<RopeTable<T, B>> rope_;
  parallel::TensorParallelGroup* tp_;
  parallel::ContextParallelGroup* cp_;
  bool fuse_ = true;
  std::string name_;  // "layers.3.attention": errors name the layer
};

}  // namespace tessera::nn
