// One traced training step, as the dry run (plan/dry_run.hpp) records it, and what the
// planner does with it without running the model: its prediction on a machine, the
// checks a config passes before it is traced, and the ranks of a layout whose traces
// differ. The layout pricing, the search and the scaling runtimes read traces through
// this header alone; only what traces a step includes the model and the trainer.
#pragma once

#include <cstddef>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/train/job_config.hpp"
#include "tessera/train/job_plan.hpp"

namespace tessera::plan {

/// One traced step.
struct StepTrace {
  trace::Trace trace;                 // a steady step's operations and memory events
  std::size_t peak_bytes = 0;         // the device's memory peak, from the model's construction on
  std::size_t reserved_peak_bytes = 0;  // ... as tessera's caching allocator holds it: its segments at its peak
  MemoryBreakdown at_peak{};          // what it held then
  std::size_t host_peak_bytes = 0;    // host tensors the step made (read-backs, uploads' sources)
  std::size_t offloaded_bytes = 0;    // host memory beside the device at its peak (CPU offload's shards and state)
  std::size_t saved_activation_bytes = 0;  // the activation store's peak in the step
  StepShape shape;
  comm::MeshShape mesh;               // the layout's
  int rank = 0;                       // the world rank traced
  double seconds = 0;                 // how long the dry run took
};

/// predict() of a traced step: its time, and its memory with the fit judged by what
/// tessera's caching allocator reserves at its peak.
inline Prediction predict(const StepTrace& st, const Pricer& pricer, std::size_t top = 12) {
  return predict(st.trace, pricer, st.shape, st.peak_bytes, st.at_peak, top, st.reserved_peak_bytes);
}

/// Refuses what a dry run cannot plan, naming the key: settings llama-train refuses, and
/// degrees that do not make a mesh of `world` ranks. Returns the mesh.
inline comm::MeshShape check_dry_run(const train::JobConfig& c, int world = 1) {
  train::check_supported(c);
  TESSERA_CHECK(world >= 1, "a layout needs at least one rank, got ", world);
  return train::mesh_shape(c, world);
}

/// One world rank at each pipeline position of `shape` (its other coordinates 0): the
/// ranks whose traces differ. Data- and tensor-parallel peers trace as these do, and so
/// do context-parallel peers under the head-tail balance. With `context_in_order`
/// (parallelism.context_parallel_load_balancer = "none") the context-parallel ranks'
/// work differs, the last attending over the most keys: the position's rank is that one,
/// whose pace the ring keeps.
inline std::vector<int> distinct_ranks(const comm::MeshShape& shape, bool context_in_order = false) {
  std::vector<int> ranks;
  const int cp_coordinate = context_in_order ? shape.cp - 1 : 0;
  for (int p = 0; p < shape.pp; ++p) ranks.push_back(p * shape.per_stage() + cp_coordinate * shape.tp);
  return ranks;
}

/// distinct_ranks for the layout `c` describes on `shape` (its context-parallel balance).
inline std::vector<int> distinct_ranks(const comm::MeshShape& shape, const train::JobConfig& c) {
  return distinct_ranks(shape, parallel::parse_context_balance(c.parallelism.context_parallel_load_balancer) ==
                                   parallel::ContextBalance::none);
}

}  // namespace tessera::plan
