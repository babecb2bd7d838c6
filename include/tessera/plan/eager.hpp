// What eager PyTorch launches where tessera's trace has one kernel: another runtime's
// step, in time, from a trace of tessera's step of the same layout.
//
// tessera fuses what a PyTorch model writes as separate tensor expressions: RMSNorm is
// one pass over a row each way, RoPE one rotation, SwiGLU one kernel each way, and a
// tensor that feeds several GEMMs gets its gradients summed by the GEMMs themselves
// (beta = 1). Eager PyTorch launches one kernel per expression, each reading its
// operands from memory and writing its result, and its autograd one kernel per formula
// (PyTorch's tools/autograd/derivatives.yaml) and one add wherever a tensor fed several
// operations. A runtime's step is priced by rewriting the trace at tessera's kernels
// (the sites below): the runtime's sequence goes in a kernel's place, or before or after
// it where tessera has no counterpart (autograd's sums, repeat_kv's copies), every
// kernel with the bytes it reads and writes, so the pricer (plan/cost.hpp) charges each
// pass over memory and each launch. Which sequences a runtime runs is read from its
// code: plan/scaling_time.hpp and plan/torchtitan_time.hpp say which and where from.
// The sequences of PyTorch expressions both runtimes write the same way are here.
//
// A kernel's bytes are given per row (token) of its site, as bytes per element of the
// widths a row has there: the model's dim, the query and key/value widths on this rank
// (heads x head_dim), the feed-forward width on this rank, the vocabulary, the head
// dimension, and the site's own width (a norm's dim, a RoPE call's heads x head_dim,
// the feed-forward width at SwiGLU, the query width at attention); plus bytes per row,
// and per element of a norm's weight once a launch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <variant>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layer/args.hpp"

namespace tessera::plan {

/// Bytes per row, as bytes per element of each width a row has at a site.
struct PerRow {
  double own = 0;       // the site's own width
  double dim = 0;       // the model's dim
  double q = 0;         // query heads x head_dim on this rank
  double kv = 0;        // key/value heads x head_dim on this rank
  double ffn = 0;       // feed-forward width on this rank
  double vocab = 0;     // the logits' width on this rank
  double head_dim = 0;  // one head (a RoPE table row is head_dim / 2 complex values)
  double fixed = 0;     // bytes per row
};

/// One eager kernel: what it reads and writes per row, and once a launch per element of
/// a norm's weight; or, `synchronizes`, the host waiting for the device (a `.item()`).
struct EagerKernel {
  const char* name;
  PerRow read{}, written{};
  double weight_read = 0, weight_written = 0;
  double transcendentals = 0;  // per row
  bool synchronizes = false;
};

/// The widths of a row on this rank.
struct EagerWidths {
  std::int64_t dim = 0, q = 0, kv = 0, ffn = 0, vocab = 0, head_dim = 0;
};

/// A row's widths of model `a` on one of `tp` tensor-parallel ranks: heads and the
/// feed-forward split, the rows whole (no sequence parallelism), the vocabulary whole.
inline EagerWidths eager_widths(const nn::ModelArgs& a, std::int64_t tp = 1) {
  return EagerWidths{a.dim, a.n_heads / tp * a.head_dim(), a.kv_heads() / tp * a.head_dim(), a.ffn_hidden_dim() / tp,
                     a.vocab_size, a.head_dim()};
}

/// Where in tessera's trace a sequence goes: the kernels (by functor) and calls it
/// stands for, each with the rows it runs over and its own width.
enum class EagerSite {
  rmsnorm_forward,          // RmsNormForward: rows = n, own = dim
  rmsnorm_backward,         // RmsNormBackwardInput: rows = n, own = dim
  rmsnorm_backward_residual,  // RmsNormBackwardInput adding a residual's gradient (a Llama block's two norms)
  rmsnorm_weight_gradient,  // RmsNormBackwardWeight: rows = 1, own = dim (the weight)
  rope,                     // RopeRotate, forward or backward alike: rows = n, own = the call's heads x head_dim
  swiglu_forward,           // SwiGluForward: rows = n / ffn, own = ffn
  swiglu_backward,          // SwiGluBackward
  attention_forward,        // an attention call: rows = batch x seq, own = q (q, kv from its heads)
  attention_backward,
  cross_entropy,            // CrossEntropyRow (the loss and the logits' gradient): rows = n, own = vocab
  embedding_backward,       // EmbeddingBackward: rows = 1, own = vocab x dim (the table)
  adamw,                    // AdamWMultiStep: rows = n (elements), own = 1
};
inline constexpr std::size_t kEagerSites = 12;

enum class EagerPlace { instead, before, after };

/// A sequence at a site: in the place of tessera's kernel (which goes; `kernels` may be
/// empty), or before or after it.
struct EagerRewrite {
  EagerSite site;
  EagerPlace place;
  std::span<const EagerKernel> kernels;
};

// ---------------------------------------------------------------------------------------
// The sequences both runtimes' PyTorch code launches. Bytes are bf16 activations (2), fp32
// (4) and complex64 (8, 4 a real element).

// RMSNorm as `self._norm(x.float()).type_as(x) * self.weight`, `_norm(x) = x *
// torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)` (scaling v0.1.0
// src/scaling/core/nn/norm/rms_norm.py; torchtitan 1ea476e9f torchtitan/models/norms.py:90-95):
// x.float(), pow, mean, + eps, rsqrt, x * rsqrt, type_as, * weight.
inline constexpr EagerKernel kTorchRmsNormForward[] = {
    {"torch RMSNorm forward: x.float()", {.own = 2}, {.own = 4}},
    {"torch RMSNorm forward: pow(2)", {.own = 4}, {.own = 4}},
    {"torch RMSNorm forward: mean(-1)", {.own = 4}, {.fixed = 4}},
    {"torch RMSNorm forward: + eps", {.fixed = 4}, {.fixed = 4}},
    {"torch RMSNorm forward: rsqrt", {.fixed = 4}, {.fixed = 4}, 0, 0, 1},
    {"torch RMSNorm forward: x * rsqrt", {.own = 4, .fixed = 4}, {.own = 4}},
    {"torch RMSNorm forward: type_as(x)", {.own = 4}, {.own = 2}},
    {"torch RMSNorm forward: * weight", {.own = 2}, {.own = 2}, 2, 0},
};

// Its backward, in autograd's order (derivatives.yaml): the weight's mul (grad * other,
// grad * self summed to the weight's shape), type_as's cast, x * rsqrt's mul (grad *
// other, grad * self summed over the row), rsqrt's -0.5 * grad * result.pow(3) (three
// per-row kernels), mean's grad.expand() / N, pow's grad * 2 * self.pow(1) (pow(1) is a
// copy), the fp32 input's two gradients summed, x.float()'s cast back. Per element 54
// bytes read and 38 written, against the fused kernels' one pass.
inline constexpr EagerKernel kTorchRmsNormBackward[] = {
    {"torch RMSNorm backward: grad * weight", {.own = 2}, {.own = 2}, 2, 0},
    {"torch RMSNorm backward: grad * normed", {.own = 4}, {.own = 2}},
    {"torch RMSNorm backward: weight grad, sum over rows", {.own = 2}, {}, 0, 2},
    {"torch RMSNorm backward: grad.float()", {.own = 2}, {.own = 4}},
    {"torch RMSNorm backward: grad * rsqrt", {.own = 4, .fixed = 4}, {.own = 4}},
    {"torch RMSNorm backward: grad * x", {.own = 8}, {.own = 4}},
    {"torch RMSNorm backward: sum(-1)", {.own = 4}, {.fixed = 4}},
    {"torch RMSNorm backward: rsqrt backward: -0.5 * grad", {.fixed = 4}, {.fixed = 4}},
    {"torch RMSNorm backward: rsqrt backward: result.pow(3)", {.fixed = 4}, {.fixed = 4}},
    {"torch RMSNorm backward: rsqrt backward: product", {.fixed = 8}, {.fixed = 4}},
    {"torch RMSNorm backward: mean backward", {.fixed = 4}, {.own = 4}},
    {"torch RMSNorm backward: x.pow(1)", {.own = 4}, {.own = 4}},
    {"torch RMSNorm backward: * 2", {.own = 4}, {.own = 4}},
    {"torch RMSNorm backward: grad * 2x", {.own = 8}, {.own = 4}},
    {"torch RMSNorm backward: sum of x's gradients", {.own = 8}, {.own = 4}},
    {"torch RMSNorm backward: to bfloat16", {.own = 4}, {.own = 2}},
};

// Rotary embedding over complex numbers, per call (q or k), Meta's Llama code as both
// runtimes write it (torchtitan 1ea476e9f torchtitan/models/llama/model.py:104-110;
// scaling v0.1.0 src/scaling/core/nn/rotary.py:75-90): `view_as_complex(x.float()...)`,
// a complex multiply by the position's frequencies (head_dim / 2 complex64 a row,
// broadcast over the heads), `view_as_real(...).type_as(x)`; the views launch nothing.
// The backward is the same three in reverse: type_as's cast to fp32, grad *
// freqs.conj(), x.float()'s cast back. tessera's RopeRotate does not say which direction
// it runs; both cost these bytes.
inline constexpr EagerKernel kComplexRope[] = {
    {"eager RoPE: to float32", {.own = 2}, {.own = 4}},
    {"eager RoPE: complex multiply by the frequencies", {.own = 4, .head_dim = 4}, {.own = 4}},
    {"eager RoPE: to bfloat16", {.own = 4}, {.own = 2}},
};

// SwiGLU as `w2(F.silu(w1(x)) * w3(x))`, two linears (torchtitan model.py:248; scaling
// v0.1.0 src/scaling/core/nn/mlp.py:158-160): silu, then the product.
inline constexpr EagerKernel kEagerSwiGluForward[] = {
    {"eager SwiGLU: silu(w1 x)", {.own = 2}, {.own = 2}},
    {"eager SwiGLU: silu(w1 x) * w3 x", {.own = 4}, {.own = 2}},
};
// Its backward: the product's grad * other and grad * self, silu_backward.
inline constexpr EagerKernel kEagerSwiGluBackward[] = {
    {"eager SwiGLU backward: grad * w3 x", {.own = 4}, {.own = 2}},
    {"eager SwiGLU backward: grad * silu(w1 x)", {.own = 4}, {.own = 2}},
    {"eager SwiGLU backward: silu_backward", {.own = 4}, {.own = 2}},
};

// Autograd's sums where a tensor fed several linears: the feed-forward input's two
// gradients (w1, w3), the attention input's three (wq, wk, wv: two adds), bf16.
inline constexpr EagerKernel kFeedForwardInputGradientSum[] = {
    {"autograd: the feed-forward input's gradients summed", {.dim = 4}, {.dim = 2}},
};
// A residual's two gradients (the branch's, through the norm, and the skip's): autograd
// adds them in a kernel of their own where tessera's norm backward adds them as it writes.
inline constexpr EagerKernel kResidualGradientSum[] = {
    {"autograd: a residual's gradients summed", {.dim = 4}, {.dim = 2}},
};
// A fused norm's backward (the input's gradient) without the residual's: x and dy read,
// rstd per row, the weight once, dx written; tessera's pass less the residual it reads.
inline constexpr EagerKernel kFusedRmsNormBackwardInput[] = {
    {"fused RMSNorm backward (input)", {.own = 4, .fixed = 4}, {.own = 2}, 2, 0},
};
inline constexpr EagerKernel kAttentionInputGradientSums[] = {
    {"autograd: the attention input's gradients summed (q + k)", {.dim = 4}, {.dim = 2}},
    {"autograd: the attention input's gradients summed (+ v)", {.dim = 4}, {.dim = 2}},
};

/// Adds the rewrites of the torch RMSNorm: its eight kernels forward, its sixteen backward
/// (which hold the weight's gradient, so tessera's separate pass goes).
inline void add_torch_rmsnorm(std::vector<EagerRewrite>& r) {
  r.push_back({EagerSite::rmsnorm_forward, EagerPlace::instead, kTorchRmsNormForward});
  r.push_back({EagerSite::rmsnorm_backward, EagerPlace::instead, kTorchRmsNormBackward});
  r.push_back({EagerSite::rmsnorm_backward_residual, EagerPlace::instead, kTorchRmsNormBackward});
  r.push_back({EagerSite::rmsnorm_weight_gradient, EagerPlace::instead, {}});
}

/// Adds the rewrite of a fused (Triton) norm: tessera's passes, but the backward that adds
/// a residual's gradient as it writes reads that gradient no more (autograd's sum does,
/// add_swiglu_and_gradient_sums).
inline void add_fused_rmsnorm(std::vector<EagerRewrite>& r) {
  r.push_back({EagerSite::rmsnorm_backward_residual, EagerPlace::instead, kFusedRmsNormBackwardInput});
}

/// Adds the rewrites of SwiGLU over two linears and autograd's sums of the gradients of
/// the tensors that fed several linears (the attention's and the feed-forward's inputs)
/// or a residual connection.
inline void add_swiglu_and_gradient_sums(std::vector<EagerRewrite>& r) {
  r.push_back({EagerSite::rmsnorm_backward_residual, EagerPlace::after, kResidualGradientSum});
  r.push_back({EagerSite::attention_backward, EagerPlace::after, kAttentionInputGradientSums});
  r.push_back({EagerSite::swiglu_forward, EagerPlace::instead, kEagerSwiGluForward});
  r.push_back({EagerSite::swiglu_backward, EagerPlace::instead, kEagerSwiGluBackward});
  r.push_back({EagerSite::swiglu_backward, EagerPlace::after, kFeedForwardInputGradientSum});
}

// ---------------------------------------------------------------------------------------

namespace detail {

inline double row_bytes(const PerRow& b, const EagerWidths& w, double own) {
  return b.own * own + b.dim * static_cast<double>(w.dim) + b.q * static_cast<double>(w.q) +
         b.kv * static_cast<double>(w.kv) + b.ffn * static_cast<double>(w.ffn) + b.vocab * static_cast<double>(w.vocab) +
         b.head_dim * static_cast<double>(w.head_dim) + b.fixed;
}

/// The site a traced operation is, and its rows and own width.
struct SiteAt {
  EagerSite site;
  double rows = 0, own = 0;
  EagerWidths widths;  // the run's, with an attention call's own heads
};

inline std::optional<SiteAt> site_of(const trace::Op& op, const EagerWidths& w, DType activations) {
  if (const auto* a = std::get_if<trace::Attention>(&op)) {
    EagerWidths at = w;
    at.q = a->shape.n_heads * a->shape.head_dim;
    at.kv = a->shape.n_kv_heads * a->shape.head_dim;
    return SiteAt{a->backward ? EagerSite::attention_backward : EagerSite::attention_forward,
                  static_cast<double>(a->shape.rows()), static_cast<double>(at.q), at};
  }
  const auto* k = std::get_if<trace::Kernel>(&op);
  if (!k) return std::nullopt;
  const std::string_view f = k->functor;
  const double n = static_cast<double>(k->n), dim = static_cast<double>(w.dim);
  if (f.starts_with("RmsNormForward<")) return SiteAt{EagerSite::rmsnorm_forward, n, dim, w};
  if (f.starts_with("RmsNormBackwardInput<")) {
    // A residual's gradient added in the pass shows in the flops: 8 an element where the
    // norm alone makes 7 (ops/rmsnorm.hpp), 4 more a row.
    const bool residual = k->traffic.flops > 7.5 * n * dim;
    return SiteAt{residual ? EagerSite::rmsnorm_backward_residual : EagerSite::rmsnorm_backward, n, dim, w};
  }
  if (f.starts_with("RmsNormBackwardWeight<")) return SiteAt{EagerSite::rmsnorm_weight_gradient, 1, dim, w};
  if (f.starts_with("RopeRotate<")) {
    const double width = k->traffic.bytes_written / n / static_cast<double>(size_of(activations));
    return SiteAt{EagerSite::rope, n, width, w};
  }
  if (f.starts_with("SwiGluForward") || f.starts_with("SwiGluBackward")) {
    const EagerSite site = f.starts_with("SwiGluForward") ? EagerSite::swiglu_forward : EagerSite::swiglu_backward;
    // SwiGluForwardRows / SwiGluBackwardRows (with float8's row amaxes) and the Paired ones
    // (w1 and w3 run as one GEMM) go by rows.
    if (f.find("Rows<") != std::string_view::npos || f.find("Paired<") != std::string_view::npos)
      return SiteAt{site, n, static_cast<double>(w.ffn), w};
    TESSERA_CHECK(w.ffn > 0 && k->n % w.ffn == 0, "eager rewrite: ", k->functor, " over ", k->n,
                  " elements is not whole rows of the feed-forward width ", w.ffn);
    return SiteAt{site, n / static_cast<double>(w.ffn), static_cast<double>(w.ffn), w};
  }
  if (f.starts_with("CrossEntropyRow<")) return SiteAt{EagerSite::cross_entropy, n, static_cast<double>(w.vocab), w};
  if (f.starts_with("EmbeddingBackward<"))
    return SiteAt{EagerSite::embedding_backward, 1, static_cast<double>(w.vocab) * dim, w};
  if (f.starts_with("AdamWMultiStep<")) return SiteAt{EagerSite::adamw, n, 1, w};
  return std::nullopt;
}

inline trace::Event eager_event(const EagerKernel& k, const SiteAt& at, const char* region) {
  if (k.synchronizes) return trace::Event{trace::Synchronize{}, region};
  trace::Kernel op;
  op.functor = k.name;
  op.n = static_cast<std::int64_t>(at.rows * at.own);
  op.traffic.bytes_read = at.rows * row_bytes(k.read, at.widths, at.own) + k.weight_read * static_cast<double>(at.widths.dim);
  op.traffic.bytes_written =
      at.rows * row_bytes(k.written, at.widths, at.own) + k.weight_written * static_cast<double>(at.widths.dim);
  op.traffic.flops = at.rows * at.own;
  op.traffic.transcendentals = at.rows * k.transcendentals;
  return trace::Event{op, region};
}

}  // namespace detail

/// How many sites of each kind a rewrite met.
using EagerCounts = std::array<std::int64_t, kEagerSites>;

/// Rewrites `t` at every site `rewrites` name: each sequence before, in place of, or
/// after tessera's operation, in the order given. Returns the sites met, by kind. The
/// new events are built in `spare` (trace::Trace::rewrite).
inline EagerCounts rewrite_eager(trace::Trace& t, std::span<const EagerRewrite> rewrites, const EagerWidths& w,
                                 DType activations, std::vector<trace::Event>& spare) {
  EagerCounts met{};
  t.rewrite(spare, [&](std::vector<trace::Event>& events, std::vector<trace::Event>& out) {
    for (trace::Event& ev : events) {
      const std::optional<detail::SiteAt> at = detail::site_of(ev.op, w, activations);
      bool wanted = false, replaced = false;
      if (at)
        for (const EagerRewrite& r : rewrites)
          if (r.site == at->site) {
            wanted = true;
            replaced = replaced || r.place == EagerPlace::instead;
          }
      if (!wanted) {
        out.push_back(std::move(ev));
        continue;
      }
      ++met[static_cast<std::size_t>(at->site)];
      const char* region = ev.region;
      for (EagerPlace place : {EagerPlace::before, EagerPlace::instead, EagerPlace::after}) {
        if (place == EagerPlace::instead && !replaced) out.push_back(std::move(ev));
        for (const EagerRewrite& r : rewrites)
          if (r.site == at->site && r.place == place)
            for (const EagerKernel& k : r.kernels) out.push_back(detail::eager_event(k, *at, region));
      }
    }
  });
  return met;
}

inline EagerCounts rewrite_eager(trace::Trace& t, std::span<const EagerRewrite> rewrites, const EagerWidths& w,
                                 DType activations) {
  std::vector<trace::Event> spare;
  return rewrite_eager(t, rewrites, w, activations, spare);
}

}  // namespace tessera::plan
