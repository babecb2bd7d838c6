// What another runtime's step runs where tessera's trace has its own: Aleph Alpha's
// `scaling` (plan/scaling_memory.hpp says which runtime and why), in time. Rewrites of a
// traced step, each read from that runtime's code (tag 0.1.0 unless said; paths under
// src/scaling/): its eager PyTorch kernels, its tensor-parallel reductions, its gradient
// accumulation, and when and in what precision it reduces the gradients.
//
// The eager kernels (plan/eager.hpp has the sequences and how a trace is rewritten), per
// layer and micro-batch, of the Llama path its Llama 2 configuration takes
// (`relative_position_embedding_type: rotary_complex`, `attention_qkv_in_one: false`,
// `mlp_type: swiglu`, `norm_type: rms`; the library's defaults, cos/sin rotary over one
// fused qkv linear, launch as many bytes within a tenth; which the published runs used
// their sheets do not say):
//   RMSNorm without the "RMS kernel" (core/nn/norm/rms_norm.py): eight kernels forward,
//     sixteen backward. With it (flash-attn's fused rms_norm) tessera's kernels stand.
//   RoPE (core/nn/rotary.py:75-90, 249-255): per q and k, the position's frequencies
//     gathered (forward; the backward copies their conjugate), the casts to fp32 and
//     back around a complex multiply.
//   attention (core/nn/attention/attention.py:66, 230): flash_attn_varlen_func needs the
//     longest sequence on the host: `(cu[1:] - cu[:-1]).max().item()`, two small kernels
//     and a synchronisation in every layer's forward. With micro-batches of more than one
//     sequence, the output's two rearranges (attention.py:259, 616) copy, forward and
//     backward.
//   SwiGLU (core/nn/mlp.py:158-160): silu and the product, three kernels backward, and
//     autograd's sum of the input's two gradients; the separate q, k and v linears'
//     input gradients summed by two adds.
// Left out, each under a tenth of a percent of the step: the frequency table rebuilt each
// layer (S x head_dim / 2 complex), the gather's index bytes, dropout (p = 0 launches
// nothing), the norm weights' gradient accumulation.
//
// Tensor parallelism without sequence parallelism (core/nn/linear/utils.py:43-45, 266):
// each column-parallel linear all-reduces its own input's gradient before autograd sums
// them: three all-reduces into the attention (q, k, v) and two into the feed-forward (w1,
// w3) where tessera's layout all-reduces the summed gradient once each; the forward's
// two are the same. Each is waited for where it is issued, as the trace's are.
//
// Gradient accumulation: the weights' gradients are bf16 `.grad` tensors; the first
// micro-batch of a step's backward hands its GEMM's output over, every later one adds
// into them (PyTorch's AccumulateGrad: one add of 4 bytes read and 2 written an element
// per weight and micro-batch), where tessera's GEMMs accumulate in place (beta = 1).
//
// The gradients (v0.2.0, src/scaling/core/optimizer/optimizer.py:147-149 and
// allreduce.py:9-38, parameter_group.py:444-474): after the step's last backward, the
// bf16 gradients are all-reduced over the data-parallel ranks in buckets of 500M
// elements, each flattened and copied to fp32 for the all-reduce; after the optimizer
// has updated this rank's shard, the bf16 parameters are all-gathered. Nothing of it
// overlaps the backward. A trace of data-parallel replicas (the ZeRO-1 accounting's,
// plan/layout.hpp) all-reduces each unit's fp32 gradient as soon as its last backward
// is done, beside the backward still to run: scaling_gradient_reduction moves those
// all-reduces (and their waits) to after the backward, in fp32, and adds the parameters'
// all-gather after the optimizer. The buckets are the trace's units (a block each):
// the same bytes, a few more launches.
//
// Not yet counted: the pipeline's blocking send/recv, the received activations' clone
// and the host synchronisations around them (core/nn/parallel_module/communicator.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <span>
#include <string_view>
#include <tuple>
#include <variant>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/region.hpp"
#include "tessera/plan/traced_step.hpp"
#include "tessera/plan/eager.hpp"
#include "tessera/plan/layout.hpp"
#include "tessera/plan/scaling_memory.hpp"

namespace tessera::plan {

// RoPE as the runtime runs it: the frequencies first (gathered forward, the conjugate
// copied backward: head_dim / 2 complex64 a row), then the complex multiply between casts.
inline constexpr EagerKernel kScalingRope[] = {
    {"eager RoPE: the rows' frequencies (gathered; the conjugate copied backward)", {.head_dim = 4}, {.head_dim = 4}},
    kComplexRope[0],
    kComplexRope[1],
    kComplexRope[2],
};
// flash_attn_varlen_func's max_seqlen: a subtraction and a max over the sequence bounds
// (a few bytes), then .item().
inline constexpr EagerKernel kScalingMaxSeqlen[] = {
    {"flash-attn varlen: cu_seqlens[1:] - cu_seqlens[:-1]"},
    {"flash-attn varlen: max()"},
    {"flash-attn varlen: .item()", {}, {}, 0, 0, 0, true},
};
// The attention output's rearranges when a micro-batch holds several sequences.
inline constexpr EagerKernel kScalingAttentionOutputCopies[] = {
    {"rearrange copy: (b sq) np hn -> (b np) sq hn", {.q = 2}, {.q = 2}},
    {"rearrange copy: (b np) sq hn -> b sq (np hn)", {.q = 2}, {.q = 2}},
};

/// The eager rewrites of the runtime's layer (above) for a run of `run`'s shape.
inline std::vector<EagerRewrite> scaling_eager_rewrites(const ScalingRun& run) {
  using enum EagerSite;
  using enum EagerPlace;
  std::vector<EagerRewrite> r;
  if (run.fused_rmsnorm) add_fused_rmsnorm(r);
  else add_torch_rmsnorm(r);
  r.push_back({rope, instead, kScalingRope});
  r.push_back({attention_forward, before, kScalingMaxSeqlen});
  if (run.microbatch > 1) {
    r.push_back({attention_forward, after, kScalingAttentionOutputCopies});
    r.push_back({attention_backward, before, kScalingAttentionOutputCopies});
  }
  add_swiglu_and_gradient_sums(r);
  return r;
}

/// Moves the trace's gradient all-reduces over the data-parallel replicas, and their
/// waits, to after the backward (just before the optimizer), in the order issued, and
/// adds the all-gather of the updated bf16 parameters after the optimizer, as the
/// runtime reduces them. The all-reduces keep the trace's bytes: fp32 gradients, as the
/// runtime all-reduces them (plan::account_zero1 with reduce_in_bf16 false). Returns the
/// all-reduces moved.
inline std::int64_t scaling_gradient_reduction(StepTrace& st, std::vector<trace::Event>& spare) {
  std::vector<trace::Event> reduces, waits;
  std::vector<std::uint64_t> ids;
  std::int64_t gradient_bytes = 0;
  std::uint64_t next_id = 1;
  trace::CommGroup group;
  st.trace.rewrite(spare, [&](std::vector<trace::Event>& events, std::vector<trace::Event>& out) {
    out.reserve(events.size() + 2);  // what it keeps, and all it puts back below
    for (trace::Event& ev : events) {
      if (const auto* c = std::get_if<trace::Collective>(&ev.op)) {
        next_id = std::max(next_id, c->id + 1);
        if (is_gradient_all_reduce(*c, st)) {
          ids.push_back(c->id);
          gradient_bytes += c->bytes;
          group = c->group;
          reduces.push_back(std::move(ev));
          continue;
        }
      }
      if (const auto* w = std::get_if<trace::CommWait>(&ev.op);
          w && std::find(ids.begin(), ids.end(), w->id) != ids.end()) {
        waits.push_back(std::move(ev));
        continue;
      }
      out.push_back(std::move(ev));
    }
  });
  TESSERA_CHECK(waits.size() == reduces.size(), "plan.runtime scaling: ", reduces.size(),
                " gradient all-reduces in the trace, ", waits.size(), " waited for");
  if (reduces.empty()) return 0;
  // The optimizer's region closes the step: the reductions go in before it (a move of
  // its few events), the parameters' all-gather after it.
  std::vector<trace::Event>& events = st.trace.mutable_events();
  const auto optimizer = [](const trace::Event& e) { return std::string_view(e.region) == region::kOptimizer; };
  const auto first = std::find_if(events.begin(), events.end(), optimizer);
  TESSERA_CHECK(first != events.end(), "plan.runtime scaling: the traced step has no optimizer region");
  const auto at = first - events.begin();
  const auto last = std::find_if(events.rbegin(), events.rend(), optimizer).base() - events.begin();
  // The updated parameters, all-gathered: whole bf16 (or fp32) values, 4-byte gradients.
  trace::Collective gather;
  gather.kind = "all_gather";
  gather.bytes = gradient_bytes / 4 * (st.shape.dtype == DType::bf16 ? 2 : 4);
  gather.group = group;
  gather.id = next_id;
  const trace::Event after[] = {{gather, region::kOptimizer}, {trace::CommWait{next_id}, region::kOptimizer}};
  events.insert(events.begin() + last, std::begin(after), std::end(after));
  for (auto* part : {&waits, &reduces})
    events.insert(events.begin() + at, std::make_move_iterator(part->begin()), std::make_move_iterator(part->end()));
  return static_cast<std::int64_t>(reduces.size());
}

inline std::int64_t scaling_gradient_reduction(StepTrace& st) {
  std::vector<trace::Event> spare;
  return scaling_gradient_reduction(st, spare);
}


/// Splits each backward all-reduce into a tensor-parallel region as the runtime's linears
/// issue them: the attention input's gradient three times (q, k, v), the feed-forward
/// input's twice (w1, w3), each of the whole rows and waited for where issued. A
/// region's entry is told by what the backward ran since the last norm: attention or
/// SwiGLU. Returns the all-reduces added.
inline std::int64_t scaling_tensor_parallel_reductions(StepTrace& st, std::vector<trace::Event>& spare) {
  if (st.mesh.tp <= 1) return 0;
  std::uint64_t next_id = 1;
  for (const trace::Event& ev : st.trace.events())
    if (const auto* c = std::get_if<trace::Collective>(&ev.op)) next_id = std::max(next_id, c->id + 1);
  enum class Since { nothing, attention, feed_forward } since = Since::nothing;
  std::int64_t added = 0;
  st.trace.rewrite(spare, [&](std::vector<trace::Event>& events, std::vector<trace::Event>& out) {
    for (trace::Event& ev : events) {
      if (const auto* a = std::get_if<trace::Attention>(&ev.op)) {
        since = a->backward ? Since::attention : Since::nothing;
      } else if (const auto* k = std::get_if<trace::Kernel>(&ev.op)) {
        const std::string_view f = k->functor;
        if (f.starts_with("SwiGluBackward")) since = Since::feed_forward;  // SwiGluBackward<, SwiGluBackwardRows<
        if (f.starts_with("RmsNorm") || f.starts_with("SwiGluForward")) since = Since::nothing;
      } else if (const auto* c = std::get_if<trace::Collective>(&ev.op);
                 c && since != Since::nothing && std::string_view(c->kind) == "all_reduce" &&
                 c->group.size == st.mesh.tp && c->group.stride == 1) {
        const int extra = since == Since::attention ? 2 : 1;
        for (int i = 0; i < extra; ++i) {
          trace::Collective more = *c;
          more.id = next_id++;
          out.push_back(trace::Event{more, ev.region});
          out.push_back(trace::Event{trace::CommWait{more.id}, ev.region});
        }
        added += extra;
        since = Since::nothing;
      }
      out.push_back(std::move(ev));
    }
  });
  return added;
}

inline std::int64_t scaling_tensor_parallel_reductions(StepTrace& st) {
  std::vector<trace::Event> spare;
  return scaling_tensor_parallel_reductions(st, spare);
}

/// Whether `g` computes a weight's gradient (op(A) = A^T over the rows): `(tn)`, written
/// into the gradient on the step's first write (beta 0) and added after (`+=`).
inline bool is_weight_gradient(const trace::Gemm& g) { return g.ta == Trans::yes; }

/// Adds the runtime's gradient accumulation: after each weight-gradient GEMM of every
/// micro-batch but the step's first on this rank (`microbatches` of them), one add of the
/// bf16 gradient (4 bytes read, 2 written an element). The loss head's GEMMs, chunked in
/// tessera's trace, are one weight's gradient a micro-batch there. Returns the adds.
inline std::int64_t scaling_gradient_accumulation(StepTrace& st, std::int64_t microbatches,
                                                  std::vector<trace::Event>& spare) {
  TESSERA_CHECK(microbatches >= 1, "plan.runtime scaling: ", microbatches, " micro-batches a step");
  if (microbatches == 1) return 0;
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  const auto head = [](const trace::Event& e) { return std::string_view(e.region) == region::kLossHead; };
  std::map<Key, std::int64_t> count, seen;
  for (const trace::Event& ev : st.trace.events())
    if (const auto* g = std::get_if<trace::Gemm>(&ev.op); g && is_weight_gradient(*g) && !head(ev))
      ++count[Key{g->m, g->n, g->k}];
  for (const auto& [key, n] : count)
    TESSERA_CHECK(n % microbatches == 0, "plan.runtime scaling: ", n, " weight-gradient GEMMs of ", std::get<0>(key), "x",
                  std::get<1>(key), " in the step do not make ", microbatches, " equal micro-batches");
  const auto accumulate = [&](double elements, const char* region) {
    trace::Kernel k;
    k.functor = "AccumulateGrad: a weight's bf16 gradient added";
    k.n = static_cast<std::int64_t>(elements);
    k.traffic.bytes_read = 4 * elements;
    k.traffic.bytes_written = 2 * elements;
    k.traffic.flops = elements;
    return trace::Event{k, region};
  };
  std::int64_t added = 0, head_passes = 0;
  double head_elements = 0;  // the loss head's weight, while its pass is open
  const char* head_region = nullptr;
  st.trace.rewrite(spare, [&](std::vector<trace::Event>& events, std::vector<trace::Event>& out) {
    const auto close_head = [&] {
      if (head_elements > 0 && head_passes++ > 0) {
        out.push_back(accumulate(head_elements, head_region));
        ++added;
      }
      head_elements = 0;
    };
    for (trace::Event& ev : events) {
      const auto* g = std::get_if<trace::Gemm>(&ev.op);
      const bool weight = g && is_weight_gradient(*g);
      if (!head(ev)) close_head();
      if (!weight) {
        out.push_back(std::move(ev));
        continue;
      }
      out.push_back(ev);  // a GEMM, copied: its shape is read below
      const double elements = static_cast<double>(g->m) * static_cast<double>(g->n);
      if (head(ev)) {
        head_elements = elements;
        head_region = ev.region;
      } else if (const Key key{g->m, g->n, g->k}; ++seen[key] > count[key] / microbatches) {
        out.push_back(accumulate(elements, ev.region));
        ++added;
      }
    }
    close_head();
  });
  return added;
}

inline std::int64_t scaling_gradient_accumulation(StepTrace& st, std::int64_t microbatches) {
  std::vector<trace::Event> spare;
  return scaling_gradient_accumulation(st, microbatches, spare);
}

/// What scaling_step_time rewrote.
struct ScalingTimeRewrites {
  EagerCounts eager{};                        // the sites met, by kind
  std::int64_t tensor_parallel_reductions = 0;  // all-reduces added
  std::int64_t accumulations = 0;               // AccumulateGrad adds
  std::int64_t gradient_reductions = 0;         // gradient all-reduces moved after the backward
};

/// Every rewrite above, on one position's trace of `run`'s layout: the eager kernels, the
/// tensor-parallel reductions, the gradient accumulation, the gradients' reduction; the
/// new events built in `spare` (trace::Trace::rewrite), which a caller passes from
/// position to position.
inline ScalingTimeRewrites scaling_step_time(StepTrace& st, const ScalingRun& run, std::vector<trace::Event>& spare) {
  ScalingTimeRewrites r;
  // The reductions find the regions by tessera's kernels, so before those are rewritten.
  r.tensor_parallel_reductions = scaling_tensor_parallel_reductions(st, spare);
  r.accumulations = scaling_gradient_accumulation(st, run.microbatches, spare);
  const std::vector<EagerRewrite> rewrites = scaling_eager_rewrites(run);
  r.eager = rewrite_eager(st.trace, rewrites, eager_widths(run.args, run.mesh.tp), st.shape.dtype, spare);
  r.gradient_reductions = scaling_gradient_reduction(st, spare);
  return r;
}

inline ScalingTimeRewrites scaling_step_time(StepTrace& st, const ScalingRun& run) {
  std::vector<trace::Event> spare;
  return scaling_step_time(st, run, spare);
}

}  // namespace tessera::plan
