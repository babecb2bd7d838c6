// What another runtime's step runs where tessera's trace has its own: Aleph Alpha's
// `scaling` (plan/scaling_memory.hpp says which runtime and why), in time. Two rewrites
// of a traced step, each read from that runtime's code: its eager RMSNorm, and when and
// in what precision it reduces the gradients.
//
// A trace of tessera's step prices tessera's kernels. Where the other runtime runs an
// operation as eager PyTorch, one kernel per tensor expression and one per autograd
// formula, the trace's kernel is replaced by that runtime's sequence, each with the bytes
// it reads and writes, so the pricer (plan/cost.hpp) charges every pass over memory and
// every launch. Which ones are replaced is what the runtime's code shows; the rest of the
// trace (GEMMs, attention, the collectives) is already what both runtimes run.
//
// RMSNorm without the "RMS kernel" (scaling v0.1.0, src/scaling/core/nn/norm/rms_norm.py:
// `self._norm(x.float()).type_as(x) * self.weight` with `_norm(x) = x *
// torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)`, x bf16): the forward's eight
// kernels below, and the backward's fourteen from PyTorch's autograd formulas
// (tools/autograd/derivatives.yaml: mul, grad * other and grad * self, summed to the
// weight's shape; _to_copy, back to the input's dtype; rsqrt, -0.5 grad result^3; mean,
// grad expanded and divided by the count; pow, grad * exponent * self.pow(exponent - 1);
// the two gradients of the fp32 input summed). Per element of the (rows, dim) input: 36
// bytes forward, 92 backward, against the fused kernel's one pass each way. With the RMS
// kernel (flash-attn's fused rms_norm) tessera's own kernels stand: one pass forward, one
// backward, as there.
//
// The gradients (scaling v0.2.0, src/scaling/core/optimizer/optimizer.py:147-149 and
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
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <string_view>
#include <variant>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/region.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/layout.hpp"

namespace tessera::plan {

/// One eager kernel of the sequence: bytes read and written per element of the input,
/// per row, and per element of the weight (dim).
struct EagerKernel {
  const char* name;
  double read_per_element, written_per_element;
  double read_per_row = 0, written_per_row = 0;
  double read_per_weight = 0, written_per_weight = 0;
  double transcendentals_per_row = 0;
};

// Forward: x.float(), pow, mean, + eps, rsqrt, x * rsqrt, type_as, * weight.
inline constexpr EagerKernel kTorchRmsNormForward[] = {
    {"torch RMSNorm forward: x.float()", 2, 4},
    {"torch RMSNorm forward: pow(2)", 4, 4},
    {"torch RMSNorm forward: mean(-1)", 4, 0, 0, 4},
    {"torch RMSNorm forward: + eps", 0, 0, 4, 4},
    {"torch RMSNorm forward: rsqrt", 0, 0, 4, 4, 0, 0, 1},
    {"torch RMSNorm forward: x * rsqrt", 4, 4, 4, 0},
    {"torch RMSNorm forward: type_as(x)", 4, 2},
    {"torch RMSNorm forward: * weight", 2, 2, 0, 0, 2, 0},
};

// Backward, in autograd's order: the weight's mul, the bf16 cast, x * rsqrt's mul, rsqrt,
// mean, pow, the two fp32 gradients summed, the fp32 cast.
inline constexpr EagerKernel kTorchRmsNormBackward[] = {
    {"torch RMSNorm backward: grad * weight", 2, 2, 0, 0, 2, 0},
    {"torch RMSNorm backward: grad * normed", 4, 2},
    {"torch RMSNorm backward: weight grad, sum over rows", 2, 0, 0, 0, 0, 2},
    {"torch RMSNorm backward: grad.float()", 2, 4},
    {"torch RMSNorm backward: grad * rsqrt", 4, 4, 4, 0},
    {"torch RMSNorm backward: grad * x", 8, 4},
    {"torch RMSNorm backward: sum(-1)", 4, 0, 0, 4},
    {"torch RMSNorm backward: rsqrt backward", 0, 0, 8, 4},
    {"torch RMSNorm backward: mean backward", 0, 4, 4, 0},
    {"torch RMSNorm backward: x.pow(1)", 4, 4},
    {"torch RMSNorm backward: * 2", 4, 4},
    {"torch RMSNorm backward: grad * 2x", 8, 4},
    {"torch RMSNorm backward: sum of x's gradients", 8, 4},
    {"torch RMSNorm backward: to bfloat16", 4, 2},
};

namespace detail {
inline void append_eager(std::vector<trace::Event>& out, const char* region, std::span<const EagerKernel> ks,
                         std::int64_t rows, std::int64_t dim) {
  const double e = static_cast<double>(rows) * static_cast<double>(dim), r = static_cast<double>(rows),
               w = static_cast<double>(dim);
  for (const EagerKernel& k : ks) {
    trace::Kernel op;
    op.functor = k.name;
    op.n = k.read_per_element > 0 || k.written_per_element > 0 ? rows * dim : rows;
    op.traffic.bytes_read = k.read_per_element * e + k.read_per_row * r + k.read_per_weight * w;
    op.traffic.bytes_written = k.written_per_element * e + k.written_per_row * r + k.written_per_weight * w;
    op.traffic.flops = k.read_per_element > 0 ? e : r;
    op.traffic.transcendentals = k.transcendentals_per_row * r;
    out.push_back(trace::Event{op, region});
  }
}
}  // namespace detail

/// Replaces, in `t`, tessera's RMSNorm kernels on rows of `dim` elements by the eager
/// sequence of the runtime's torch RMSNorm (forward for RmsNormForward, the whole backward
/// for RmsNormBackwardInput, whose weight gradient is in it, so RmsNormBackwardWeight
/// goes). Returns the norms replaced (forward and backward).
inline std::int64_t scaling_torch_rmsnorm(trace::Trace& t, std::int64_t dim) {
  TESSERA_CHECK(dim > 0, "plan.rmsnorm torch: dimension ", dim);
  std::vector<trace::Event>& events = t.mutable_events();
  std::vector<trace::Event> out;
  out.reserve(events.size());
  std::int64_t replaced = 0;
  for (trace::Event& ev : events) {
    const auto* k = std::get_if<trace::Kernel>(&ev.op);
    const std::string_view f = k ? std::string_view(k->functor) : std::string_view();
    if (f.starts_with("RmsNormForward<")) {
      detail::append_eager(out, ev.region, kTorchRmsNormForward, k->n, dim);
      ++replaced;
    } else if (f.starts_with("RmsNormBackwardInput<")) {
      detail::append_eager(out, ev.region, kTorchRmsNormBackward, k->n, dim);
      ++replaced;
    } else if (!f.starts_with("RmsNormBackwardWeight<")) {
      out.push_back(std::move(ev));
    }
  }
  events = std::move(out);
  return replaced;
}

/// Moves the trace's gradient all-reduces over the data-parallel replicas, and their
/// waits, to after the backward (just before the optimizer), in the order issued, and
/// adds the all-gather of the updated bf16 parameters after the optimizer, as the
/// runtime reduces them. The all-reduces keep the trace's bytes: fp32 gradients, as the
/// runtime all-reduces them (plan::account_zero1 with reduce_in_bf16 false). Returns the
/// all-reduces moved.
inline std::int64_t scaling_gradient_reduction(StepTrace& st) {
  std::vector<trace::Event>& events = st.trace.mutable_events();
  std::vector<trace::Event> kept, reduces, waits;
  std::vector<std::uint64_t> ids;
  std::int64_t gradient_bytes = 0;
  std::uint64_t next_id = 1;
  trace::CommGroup group;
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
    kept.push_back(std::move(ev));
  }
  TESSERA_CHECK(waits.size() == reduces.size(), "plan.runtime scaling: ", reduces.size(),
                " gradient all-reduces in the trace, ", waits.size(), " waited for");
  if (reduces.empty()) {
    events = std::move(kept);
    return 0;
  }
  const auto optimizer = [](const trace::Event& e) { return std::string_view(e.region) == region::kOptimizer; };
  auto first = std::find_if(kept.begin(), kept.end(), optimizer);
  TESSERA_CHECK(first != kept.end(), "plan.runtime scaling: the traced step has no optimizer region");
  const auto at = static_cast<std::size_t>(first - kept.begin());
  std::vector<trace::Event> out;
  out.reserve(kept.size() + reduces.size() + waits.size() + 2);
  std::move(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(at), std::back_inserter(out));
  for (auto* part : {&reduces, &waits})
    for (trace::Event& e : *part) out.push_back(std::move(e));
  std::size_t last_optimizer = at;
  for (std::size_t i = at; i < kept.size(); ++i)
    if (optimizer(kept[i])) last_optimizer = i;
  for (std::size_t i = at; i < kept.size(); ++i) {
    out.push_back(std::move(kept[i]));
    if (i != last_optimizer) continue;
    // The updated parameters, all-gathered: whole bf16 (or fp32) values, 4-byte gradients.
    trace::Collective gather;
    gather.kind = "all_gather";
    gather.bytes = gradient_bytes / 4 * (st.shape.dtype == DType::bf16 ? 2 : 4);
    gather.group = group;
    gather.id = next_id;
    out.push_back(trace::Event{gather, region::kOptimizer});
    out.push_back(trace::Event{trace::CommWait{next_id}, region::kOptimizer});
  }
  events = std::move(out);
  return static_cast<std::int64_t>(reduces.size());
}

}  // namespace tessera::plan
