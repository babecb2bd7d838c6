// What a job's config asks of the parallel runtime: the settings this build cannot run,
// refused by key, and the run-time Plan (parallel/plan.hpp) that [parallelism] and
// [activation_checkpoint] describe. The trainer, llama-train and the dry run
// (plan/dry_run.hpp) all start from it.
#pragma once

#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

/// Rejects the settings this build cannot run yet, naming the key.
inline void check_supported(const JobConfig& c) {
  const auto& p = c.parallelism;
  TESSERA_CHECK(p.context_parallel_degree == 1, "parallelism.context_parallel_degree = ", p.context_parallel_degree,
                ": not available in this build (data, tensor and pipeline parallelism are; context parallelism is not "
                "yet)");
  parallel::parse_schedule_kind(p.pipeline_parallel_schedule);
  parallel::parse_checkpoint(c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option);
  parallel::parse_reshard(c.parallelism.fsdp_reshard_after_forward);
}

/// The run-time plan [parallelism] and [activation_checkpoint] describe, on `mesh`.
inline parallel::Plan make_plan(const JobConfig& c, comm::DeviceMesh* mesh) {
  parallel::Plan plan;
  plan.mesh = mesh;
  plan.from_config = true;
  plan.reshard = parallel::parse_reshard(c.parallelism.fsdp_reshard_after_forward);
  plan.checkpoint = parallel::parse_checkpoint(c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option);
  // "auto" is the model's own type: a float32 model's blocks compute with float32 values
  // (a bf16 model's are bf16 whatever this says).
  plan.param_dtype = param_dtype(c).value_or(DType::f32);
  plan.loss_parallel = !c.parallelism.disable_loss_parallel;
  plan.sequence_parallel = !c.parallelism.disable_sequence_parallel;
  plan.pipeline.schedule = parallel::parse_schedule_kind(c.parallelism.pipeline_parallel_schedule);
  plan.pipeline.microbatch_size = c.parallelism.pipeline_parallel_microbatch_size;
  plan.pipeline.split_points = parallel::parse_split_points(c.parallelism.pipeline_parallel_split_points);
  return plan;
}

}  // namespace tessera::train
