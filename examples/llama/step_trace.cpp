#include "step_trace.hpp"

#include "tessera/plan/dry_run.hpp"

namespace llama_plan {

tessera::plan::StepTrace trace_step(const tessera::train::JobConfig& c, bool bf16_model, std::size_t device_bytes,
                                    int world, int rank) {
  tessera::plan::StepTrace st = bf16_model ? tessera::plan::dry_run_step<tessera::bf16>(c, device_bytes, world, rank)
                                            : tessera::plan::dry_run_step<float>(c, device_bytes, world, rank);
  // The host's memory is the CPU backend's, which caches nothing: its live bytes are what
  // it holds, not what the CUDA allocator the dry run replays would reserve.
  if (device_bytes == 0) st.reserved_peak_bytes = st.peak_bytes;
  return st;
}

std::string memory_snapshot(const tessera::train::JobConfig& c, bool bf16_model, std::size_t device_bytes, int world,
                            int rank) {
  std::string out;
  if (bf16_model) tessera::plan::dry_run_step<tessera::bf16>(c, device_bytes, world, rank, 0, &out);
  else tessera::plan::dry_run_step<float>(c, device_bytes, world, rank, 0, &out);
  return out;
}

tessera::train::JobConfig on_one_device(tessera::train::JobConfig c) {
  auto& p = c.parallelism;
  p.data_parallel_replicate_degree = p.data_parallel_shard_degree = p.tensor_parallel_degree = 1;
  p.pipeline_parallel_degree = p.context_parallel_degree = 1;
  return c;
}

}  // namespace llama_plan
