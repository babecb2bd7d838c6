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
#include <vector>

#include "tessera/plan/cost.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/timeline.hpp"

namespace tessera::plan {

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
  std::size_t peak_memory_bytes = 0;  // the largest position's
  double usable_bytes = 0;
  bool fits = false;                  // every position's peak within the usable memory
  double exposed_comm_seconds = 0;    // the costliest position's waits for collectives
  double pipeline_wait_seconds = 0;   // ... and for send/recv groups
};

/// Prices `positions` (one StepTrace per pipeline position, distinct_ranks order, all of
/// one layout) on `compute` and `net`.
inline LayoutPrediction predict_layout(const std::vector<StepTrace>& positions, const Pricer& compute,
                                       const Network& net) {
  TESSERA_CHECK(!positions.empty(), "predict_layout: no positions");
  const StepTrace& first = positions.front();
  TESSERA_CHECK(static_cast<int>(positions.size()) == first.mesh.pp, "predict_layout: ", positions.size(),
                " traces for ", first.mesh.pp, " pipeline positions");
  LayoutPrediction out;
  out.mesh = first.mesh;
  out.gpus = first.shape.devices;
  std::vector<const trace::Trace*> traces;
  for (const StepTrace& st : positions) traces.push_back(&st.trace);
  const Timeline t = simulate_step(traces, first.mesh.dp() * first.mesh.tp, compute, net);
  out.step_seconds = t.step_seconds;
  out.fits = true;
  double worst_end = -1;
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const StepTrace& st = positions[i];
    PositionPrediction pp{st.rank, predict(st.trace, compute, st.shape, st.peak_bytes, st.at_peak), t.positions[i]};
    out.peak_memory_bytes = std::max(out.peak_memory_bytes, st.peak_bytes);
    out.fits = out.fits && pp.compute.fits;
    out.usable_bytes = pp.compute.usable_bytes;
    if (pp.time.end_seconds > worst_end) {
      worst_end = pp.time.end_seconds;
      out.exposed_comm_seconds = pp.time.exposed_comm_seconds;
      out.pipeline_wait_seconds = pp.time.pipeline_wait_seconds;
    }
    out.positions.push_back(std::move(pp));
  }
  const StepShape& shape = first.shape;
  out.tokens_per_sec = out.step_seconds > 0 ? static_cast<double>(shape.tokens) / out.step_seconds / out.gpus : 0;
  const double peak = compute.peak_flops(shape.dtype);
  out.mfu_pct = 100 * out.tokens_per_sec * shape.args.flops_per_token(shape.seq_len) / peak;
  out.mfu_causal_pct = 100 * out.tokens_per_sec * shape.args.flops_per_token(shape.seq_len, true) / peak;
  return out;
}

}  // namespace tessera::plan
