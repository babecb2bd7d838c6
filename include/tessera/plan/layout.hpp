// A layout's step on a cluster: its pipeline positions' traces, priced and replayed
// together (plan/timeline.hpp), summed up as a user compares layouts: the step's time,
// tokens/s per GPU (as torchtitan reports them), MFU, each position's memory peak and
// whether every one fits.
//
// One GPU's step is the case of one position and no collectives: its step time is that of
// plan::predict on the same trace, so a layout of one rank prices as llama-plan always has.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string_view>
#include <vector>

#include "tessera/core/region.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/traced_step.hpp"
#include "tessera/plan/timeline.hpp"

namespace tessera::plan {

/// Whether `c` is a gradient all-reduce over the data-parallel replicas of `st` (the
/// DDP bucket of a unit; the per-step scalars, 8 bytes, are not).
inline bool is_gradient_all_reduce(const trace::Collective& c, const StepTrace& st) {
  return std::string_view(c.kind) == "all_reduce" && st.mesh.dp_replicate > 1 && c.group.size == st.mesh.dp_replicate &&
         c.group.stride == st.mesh.tp && c.bytes > 64;
}

/// Accounts a trace of data-parallel replicas (DDP: data_parallel_shard_degree 1) as
/// ZeRO-1 over them, the layout of Megatron's distributed optimizer, which tessera's
/// runtime does not run: parameters and gradients whole on every rank, in bf16; the
/// optimizer's fp32 masters and moments, and its work (gradient norm, clipping, the
/// AdamW update), split over the data-parallel ranks. The gradients are reduced in bf16
/// (reduce-scatter, then the updated parameters all-gathered: the bytes of one all-reduce,
/// which the trace's all-reduce already moves), or with `reduce_in_bf16` false in the
/// trace's fp32 (a runtime that reduces so: plan/scaling_time.hpp). The memory the trace
/// held at its peak drops by what the sharded state and the narrower gradients give back.
inline void account_zero1(StepTrace& st, bool reduce_in_bf16 = true) {
  TESSERA_CHECK(st.mesh.dp_shard == 1, "plan.zero1: the data-parallel ranks must be replicas (data_parallel_shard_degree "
                "1, got ", st.mesh.dp_shard, "); ZeRO-1 shards the optimizer alone");
  const int dp = st.mesh.dp_replicate;
  const bool bf16_model = st.shape.dtype == DType::bf16;
  for (trace::Event& e : st.trace.mutable_events()) {
    trace::Op& op = e.op;
    if (std::string_view(e.region) == region::kOptimizer) {
      if (auto* k = std::get_if<trace::Kernel>(&op)) {
        k->n = (k->n + dp - 1) / dp;
        k->traffic.bytes_read /= dp;
        k->traffic.bytes_written /= dp;
        k->traffic.flops /= dp;
        k->traffic.transcendentals /= dp;
      } else if (auto* f = std::get_if<trace::Fill>(&op)) {
        f->bytes /= dp;
      }
    }
    // The gradients' all-reduce over the replicas, in bf16 rather than fp32.
    if (auto* c = std::get_if<trace::Collective>(&op); c && bf16_model && reduce_in_bf16 && is_gradient_all_reduce(*c, st)) {
      c->bytes /= 2;
      for (auto& p : c->peers) p.bytes /= 2;
    }
  }
  const std::size_t optimizer = st.at_peak[MemoryUse::optimizer];
  const std::size_t gradients = st.at_peak[MemoryUse::gradients];
  const std::size_t optimizer_after = optimizer / static_cast<std::size_t>(dp);
  const std::size_t gradients_after = bf16_model ? gradients / 2 : gradients;
  st.at_peak.by_use[static_cast<std::size_t>(MemoryUse::optimizer)] = optimizer_after;
  st.at_peak.by_use[static_cast<std::size_t>(MemoryUse::gradients)] = gradients_after;
  st.peak_bytes -= (optimizer - optimizer_after) + (gradients - gradients_after);
  // A layout of another runtime, whose allocator is not tessera's: its live bytes decide.
  st.reserved_peak_bytes = st.peak_bytes;
}

/// One pipeline position: its trace's prices by class and memory, and its replay.
struct PositionPrediction {
  int rank = 0;           // the world rank traced
  Prediction compute;     // its own operations by class (collectives and waits left out)
  PositionTime time;      // its replay beside the others
};

struct LayoutPrediction {
  comm::MeshShape mesh;
  int gpus = 1;
  std::vector<PositionPrediction> positions;  // in pipeline order
  double step_seconds = 0;
  double tokens_per_sec = 0;  // per GPU
  double mfu_pct = 0, mfu_causal_pct = 0;
  std::size_t peak_memory_bytes = 0;      // the largest position's live bytes
  std::size_t reserved_memory_bytes = 0;  // the largest position's allocator reservation
  double usable_bytes = 0;
  bool fits = false;                      // every position's reservation within the usable memory
  double exposed_comm_seconds = 0;    // the costliest position's waits for collectives
  double pipeline_wait_seconds = 0;   // ... and for send/recv groups
  double collective_sm_seconds = 0;   // ... and what the collectives' SMs added to its GEMMs and attention
};

/// Prices `positions` (one StepTrace per pipeline position, distinct_ranks order, all of
/// one layout) on `compute` and `net`; `top`: the costliest kinds of operation each
/// position lists (predict's).
inline LayoutPrediction predict_layout(const std::vector<StepTrace>& positions, const Pricer& compute,
                                       const Network& net, std::size_t top = 12) {
  TESSERA_CHECK(!positions.empty(), "predict_layout: no positions");
  const StepTrace& first = positions.front();
  TESSERA_CHECK(static_cast<int>(positions.size()) == first.mesh.pp, "predict_layout: ", positions.size(),
                " traces for ", first.mesh.pp, " pipeline positions");
  LayoutPrediction out;
  out.mesh = first.mesh;
  out.gpus = first.shape.devices;
  std::vector<const trace::Trace*> traces;
  for (const StepTrace& st : positions) traces.push_back(&st.trace);
  const Timeline t = simulate_step(traces, first.mesh.per_stage(), compute, net);
  out.step_seconds = t.step_seconds;
  out.usable_bytes = compute.usable_bytes();
  out.fits = true;
  double worst_end = -1;
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const StepTrace& st = positions[i];
    PositionPrediction pp{st.rank, predict(st, compute, top), t.positions[i]};
    out.peak_memory_bytes = std::max(out.peak_memory_bytes, pp.compute.peak_memory_bytes);
    out.reserved_memory_bytes = std::max(out.reserved_memory_bytes, pp.compute.reserved_memory_bytes);
    out.fits = out.fits && pp.compute.fits;
    if (pp.time.end_seconds > worst_end) {
      worst_end = pp.time.end_seconds;
      out.exposed_comm_seconds = pp.time.exposed_comm_seconds;
      out.pipeline_wait_seconds = pp.time.pipeline_wait_seconds;
      out.collective_sm_seconds = pp.time.collective_sm_seconds;
    }
    out.positions.push_back(std::move(pp));
  }
  const StepShape& shape = first.shape;
  out.tokens_per_sec = out.step_seconds > 0 ? static_cast<double>(shape.tokens) / out.step_seconds / out.gpus : 0;
  const double peak = compute.peak_flops(shape.dtype);
  out.mfu_pct = 100 * out.tokens_per_sec * nn::training_flops_per_token(shape.args, shape.lora, shape.seq_len) / peak;
  out.mfu_causal_pct =
      100 * out.tokens_per_sec * nn::training_flops_per_token(shape.args, shape.lora, shape.seq_len, true) / peak;
  return out;
}

}  // namespace tessera::plan
