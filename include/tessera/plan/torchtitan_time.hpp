// What torchtitan's step runs where tessera's trace has its own, in time: the runtime of
// torchtitan's published Llama 2 / Llama 3 table on 64 A100s (docs/performance.md, made
// with the train_configs of commit 1ea476e9f, 2024-04-24, on a PyTorch nightly of
// 2024-04-12: eager PyTorch, no torch.compile, FSDP2 with bf16 parameters and fp32
// gradient reductions). Rewrites of a traced step of the same FSDP layout, each read from
// that code (paths at 1ea476e9f; PyTorch's FSDP2 from its 2.3.0 and 2.4.0 sources, which
// agree on everything here):
//
// The eager kernels (plan/eager.hpp has the sequences), per block:
//   RMSNorm (torchtitan/models/norms.py): `norm_type = "fused_rmsnorm"` (the 8B and 13B
//     configs) is a Triton kernel that makes tessera's passes, one each way, and sums the
//     weight's gradient from one fp32 row of partials per SM (`_dw.sum(0)`, then a cast
//     to bf16) where tessera reads the rows again; `"rmsnorm"` (the 70B configs) is
//     eight eager kernels forward and sixteen backward.
//   RoPE (models/llama/model.py:104-110): per q and k, casts to fp32 and back around a
//     complex multiply, forward and backward.
//   repeat_kv (model.py:112-121, 196-197): with fewer key/value heads than query heads,
//     expand + reshape copies keys and values to every query head; the backward sums
//     them back.
//   SwiGLU (model.py:248) and autograd's gradient sums (q, k, v into the norm's output:
//     two adds; w1, w3: one; each residual's two: one, which tessera's norm backward adds
//     as it writes). The residual adds are tessera's own (Add). SDPA's output transpose
//     is a view (PyTorch's flash path returns it in (B, T, H, D) memory), as are the
//     transposes before it.
//   the loss (model.py:432, train.py:164): the logits cast to fp32, log_softmax, the
//     NLL; backward: a zero fill of the fp32 logits' gradient, the scatter,
//     log_softmax's backward, and the cast back (tessera's one-pass kernel reads and
//     writes 20 bytes a logit; these 42, before the same cast).
//   the embedding's backward: a zero fill of the whole bf16 table before the scatter.
//   AdamW (train.py:95-98, foreach=True; torch/optim/adamw.py's _multi_tensor_adamw):
//     eight foreach passes over the fp32 shard, 48 bytes read and 32 written an element.
// Left out, each under a tenth of a percent of the step: the conjugated frequency table
// copied per RoPE backward, repeat_kv's copies again in a selective-op recomputation
// (the attention is not recomputed in tessera's trace, so they have no site there), the
// gradient clipping's foreach passes (as tessera's), the first two `.cuda()` copies of
// the batch that synchronise the step's start.
//
// FSDP2 (torch/distributed/_composable/fsdp/_fsdp_collectives.py): before each
// all-gather, each parameter's fp32 shard cast to bf16 (6 bytes an element) and copied
// into the all-gather's input (4); after it, on the compute stream, the output split into
// the unsharded parameters (split_with_sizes_copy: 2 read, 2 written an unsharded
// element); before each reduce-scatter the bf16 gradients copied into its fp32 input
// (_chunk_cat: 2 read, 4 written). tessera gathers into its parameters and reduces its
// fp32 gradients in place: none of these. They are priced on the compute stream, where
// the copy-out runs; the copy-in and _chunk_cat run on FSDP's own streams, beside the
// compute, through the same memory.
//
// The memory is tessera's trace's (the table's fits and out-of-memory run are predicted
// right with it); torchtitan's tensor and pipeline parallelism are not counted, and are
// refused.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <variant>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/core/error.hpp"
#include "tessera/plan/traced_step.hpp"
#include "tessera/plan/eager.hpp"

namespace tessera::plan {

/// The runtime's choices that change its kernels.
struct TorchtitanRun {
  nn::ModelArgs args;
  bool fused_rmsnorm = true;  // norm_type fused_rmsnorm (Triton), else rmsnorm (eager)
  int sm_count = 108;         // the GPU's: the Triton norm's backward keeps a row of partials per SM
};

// repeat_kv: keys and values copied to every query head, and summed back.
inline constexpr EagerKernel kRepeatKvCopies[] = {
    {"repeat_kv: keys expanded to the query heads", {.kv = 2}, {.q = 2}},
    {"repeat_kv: values expanded to the query heads", {.kv = 2}, {.q = 2}},
};
inline constexpr EagerKernel kRepeatKvSums[] = {
    {"repeat_kv backward: values' gradient summed over the repeats", {.q = 2}, {.kv = 2}},
    {"repeat_kv backward: keys' gradient summed over the repeats", {.q = 2}, {.kv = 2}},
};

// The loss in place of tessera's cross-entropy (which writes the bf16 gradient the head's
// GEMMs read): 48 bytes a logit (own = vocab), .float()'s backward cast included.
inline constexpr EagerKernel kTorchtitanCrossEntropy[] = {
    {"eager loss: logits.float()", {.own = 2}, {.own = 4}},
    {"eager loss: log_softmax", {.own = 12}, {.own = 4}, 0, 0, 0},
    {"eager loss: nll_loss", {.fixed = 12}, {}},
    {"eager loss backward: the logits' gradient zeroed", {}, {.own = 4}},
    {"eager loss backward: nll_loss_backward's scatter", {.fixed = 12}, {.fixed = 4}},
    {"eager loss backward: log_softmax_backward", {.own = 12}, {.own = 4}},
    {"eager loss backward: .float()'s backward, the gradient cast to bf16", {.own = 4}, {.own = 2}},
};

// The embedding's dense gradient zeroed before the scatter (own = vocab x dim, one row).
inline constexpr EagerKernel kDenseEmbeddingGradientZeroed[] = {
    {"eager embedding backward: the table's bf16 gradient zeroed", {}, {.own = 2}},
};

// AdamW, foreach (own = one element of the fp32 shard): weight decay, the first moment's
// lerp, the second's mul and addcmul, sqrt, the bias correction's div, + eps, addcdiv.
inline constexpr EagerKernel kForeachAdamW[] = {
    {"foreach AdamW: params *= 1 - lr wd", {.own = 4}, {.own = 4}},
    {"foreach AdamW: exp_avg.lerp_(grad)", {.own = 8}, {.own = 4}},
    {"foreach AdamW: exp_avg_sq *= beta2", {.own = 4}, {.own = 4}},
    {"foreach AdamW: exp_avg_sq.addcmul_(grad, grad)", {.own = 8}, {.own = 4}},
    {"foreach AdamW: sqrt(exp_avg_sq)", {.own = 4}, {.own = 4}, 0, 0, 1},
    {"foreach AdamW: / bias correction", {.own = 4}, {.own = 4}},
    {"foreach AdamW: + eps", {.own = 4}, {.own = 4}},
    {"foreach AdamW: params.addcdiv_(exp_avg, denom)", {.own = 12}, {.own = 4}},
};

/// The Triton norm's weight gradient: the per-SM partials summed, then cast to bf16.
inline std::vector<EagerKernel> triton_rmsnorm_weight_gradient(int sm_count) {
  TESSERA_CHECK(sm_count > 0, "plan.runtime torchtitan: ", sm_count, " SMs");
  return {{"Triton RMSNorm backward: _dw.sum(0) over the SMs' partials", {}, {}, 4.0 * sm_count, 4},
          {"Triton RMSNorm backward: the weight's gradient to bf16", {}, {}, 4, 2}};
}

/// What torchtitan_step_time rewrote.
struct TorchtitanTimeRewrites {
  EagerCounts eager{};
  std::int64_t all_gathers = 0, reduce_scatters = 0;  // FSDP collectives given their copies
};

/// FSDP2's copies around the trace's FSDP collectives (the data-parallel shard group's
/// all-gathers and reduce-scatters): the copy-in and the copy-out of each all-gather,
/// _chunk_cat before each reduce-scatter.
inline TorchtitanTimeRewrites torchtitan_fsdp_copies(StepTrace& st, std::vector<trace::Event>& spare) {
  TorchtitanTimeRewrites r;
  const auto& mesh = st.mesh;
  const auto fsdp = [&](const trace::Collective& c, std::string_view kind) {
    return std::string_view(c.kind) == kind && mesh.dp_shard > 1 && c.group.size == mesh.dp_shard &&
           c.group.stride == mesh.tp;
  };
  const auto copy = [](const char* name, double read, double written, const char* region) {
    trace::Kernel k;
    k.functor = name;
    k.n = static_cast<std::int64_t>(written);
    k.traffic.bytes_read = read;
    k.traffic.bytes_written = written;
    return trace::Event{k, region};
  };
  std::vector<std::pair<std::uint64_t, double>> gathering;  // all-gathers issued, not yet waited for: id, bytes
  st.trace.rewrite(spare, [&](std::vector<trace::Event>& events, std::vector<trace::Event>& out) {
    for (trace::Event& ev : events) {
      if (const auto* c = std::get_if<trace::Collective>(&ev.op)) {
        const double bytes = static_cast<double>(c->bytes);
        if (fsdp(*c, "all_gather")) {
          // The bf16 gather's bytes: 2 an unsharded element; the shard's fp32 elements cast.
          const double shard = bytes / 2 / c->group.size;
          out.push_back(copy("FSDP2 all-gather copy-in: the shard cast to bf16", 4 * shard, 2 * shard, ev.region));
          out.push_back(copy("FSDP2 all-gather copy-in: _foreach_copy_", 2 * shard, 2 * shard, ev.region));
          gathering.emplace_back(c->id, bytes);
          ++r.all_gathers;
        } else if (fsdp(*c, "reduce_scatter")) {
          // fp32: 4 bytes an unsharded element, copied in from the bf16 gradients.
          out.push_back(copy("FSDP2 reduce-scatter copy-in: _chunk_cat to fp32", bytes / 2, bytes, ev.region));
          ++r.reduce_scatters;
        }
        out.push_back(std::move(ev));
        continue;
      }
      if (const auto* w = std::get_if<trace::CommWait>(&ev.op)) {
        const auto it = std::find_if(gathering.begin(), gathering.end(), [&](const auto& g) { return g.first == w->id; });
        if (it != gathering.end()) {
          const double bytes = it->second;
          gathering.erase(it);
          out.push_back(std::move(ev));
          out.push_back(copy("FSDP2 all-gather copy-out: split_with_sizes_copy", bytes, bytes, out.back().region));
          continue;
        }
      }
      out.push_back(std::move(ev));
    }
  });
  return r;
}

inline TorchtitanTimeRewrites torchtitan_fsdp_copies(StepTrace& st) {
  std::vector<trace::Event> spare;
  return torchtitan_fsdp_copies(st, spare);
}

/// Every rewrite above on the trace of one rank of torchtitan's FSDP layout, the new events
/// built in `spare` (trace::Trace::rewrite).
inline TorchtitanTimeRewrites torchtitan_step_time(StepTrace& st, const TorchtitanRun& run,
                                                   std::vector<trace::Event>& spare) {
  TESSERA_CHECK(st.mesh.tp == 1 && st.mesh.pp == 1 && st.mesh.cp == 1, "plan.runtime torchtitan: counts the FSDP "
                "layouts of its published table; its tensor, pipeline and context parallelism (tp ", st.mesh.tp, ", pp ",
                st.mesh.pp, ", cp ", st.mesh.cp, ") are not counted");
  using enum EagerSite;
  using enum EagerPlace;
  const std::vector<EagerKernel> triton_weight = triton_rmsnorm_weight_gradient(run.sm_count);
  std::vector<EagerRewrite> rewrites;
  if (run.fused_rmsnorm) {
    rewrites.push_back({rmsnorm_weight_gradient, instead, triton_weight});
    add_fused_rmsnorm(rewrites);
  } else {
    add_torch_rmsnorm(rewrites);
  }
  rewrites.push_back({rope, instead, kComplexRope});
  if (run.args.kv_heads() < run.args.n_heads) {
    rewrites.push_back({attention_forward, before, kRepeatKvCopies});
    rewrites.push_back({attention_backward, after, kRepeatKvSums});
  }
  add_swiglu_and_gradient_sums(rewrites);
  rewrites.push_back({cross_entropy, instead, kTorchtitanCrossEntropy});
  rewrites.push_back({embedding_backward, before, kDenseEmbeddingGradientZeroed});
  rewrites.push_back({adamw, instead, kForeachAdamW});
  TorchtitanTimeRewrites r = torchtitan_fsdp_copies(st, spare);
  r.eager = rewrite_eager(st.trace, rewrites, eager_widths(run.args), st.shape.dtype, spare);
  return r;
}

inline TorchtitanTimeRewrites torchtitan_step_time(StepTrace& st, const TorchtitanRun& run) {
  std::vector<trace::Event> spare;
  return torchtitan_step_time(st, run, spare);
}

}  // namespace tessera::plan
