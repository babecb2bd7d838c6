// What a job's config asks of the parallel runtime: the settings this build cannot run,
// refused by key, and the run-time Plan (parallel/plan.hpp) that [parallelism] and
// [activation_checkpoint] describe. The trainer, llama-train and the dry run
// (plan/dry_run.hpp) all start from it.
#pragma once

#include <cmath>
#include <memory>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/schedule_csv.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

/// Rejects the settings this build cannot run yet, naming the key.
inline void check_supported(const JobConfig& c) {
  const auto& p = c.parallelism;
  // Each context-parallel rank holds two chunks of every sequence (the causal balance).
  TESSERA_CHECK(p.context_parallel_degree <= 1 || c.training.seq_len % (2 * p.context_parallel_degree) == 0,
                "training.seq_len = ", c.training.seq_len, " does not split into 2 x parallelism.context_parallel_degree"
                " = ", 2 * p.context_parallel_degree, " equal chunks (each context-parallel rank holds two chunks of "
                "every sequence)");
  const parallel::ScheduleKind schedule = parallel::parse_schedule_kind(p.pipeline_parallel_schedule);
  {  // the two keys agree at any degree (the file is read whenever named: pipeline_options)
    TESSERA_CHECK(!parallel::from_file(schedule) || !p.pipeline_parallel_schedule_csv.empty(),
                  "parallelism.pipeline_parallel_schedule = \"", p.pipeline_parallel_schedule, "\" runs the order of a "
                  "schedule file, and parallelism.pipeline_parallel_schedule_csv names none");
    TESSERA_CHECK(parallel::from_file(schedule) || p.pipeline_parallel_schedule_csv.empty(),
                  "parallelism.pipeline_parallel_schedule_csv = \"", p.pipeline_parallel_schedule_csv, "\" is an "
                  "order to run, and parallelism.pipeline_parallel_schedule = \"", p.pipeline_parallel_schedule,
                  "\" lays out its own: set it to PipelineScheduleMulti (or PipelineScheduleSingle) to run the file's");
  }
  parallel::parse_checkpoint(c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option);
  parallel::parse_reshard(c.parallelism.fsdp_reshard_after_forward);
  if (float8_enabled(c)) {
    TESSERA_CHECK(!c.float8.precompute_float8_dynamic_scale_for_fsdp || c.float8.enable_fsdp_float8_all_gather,
                  "float8.precompute_float8_dynamic_scale_for_fsdp needs float8.enable_fsdp_float8_all_gather = true");
    TESSERA_CHECK(!c.float8.enable_fsdp_float8_all_gather || c.float8.recipe_name == "tensorwise",
                  "float8.enable_fsdp_float8_all_gather needs float8.recipe_name = \"tensorwise\" (one scale a "
                  "weight, agreed over the shards), not \"", c.float8.recipe_name, "\"");
    // Float8 GEMMs that are not emulated run on the backend's own (nn::Linear refuses a
    // backend without one); cuBLASLt's reduce over the tokens in multiples of 16.
    TESSERA_CHECK(c.float8.emulate || c.training.seq_len % 16 == 0, "training.seq_len = ", c.training.seq_len,
                  ": float8 GEMMs (float8.emulate = false) reduce over a micro-batch's tokens, which cuBLASLt takes "
                  "in multiples of 16; use a seq_len that is one, or set float8.emulate = true");
  }
}

/// The LoRA policy [lora] describes, when model.converters asks for it.
inline nn::LoraPolicy lora_policy(const JobConfig& c) {
  nn::LoraPolicy l;
  if (!lora_enabled(c)) return l;
  TESSERA_CHECK(c.lora.rank >= 1, "lora.rank = ", c.lora.rank, ": the adapters' rank must be at least 1");
  TESSERA_CHECK(std::isfinite(c.lora.alpha), "lora.alpha = ", c.lora.alpha, ": must be finite");
  l.enabled = true;
  l.rank = c.lora.rank;
  l.alpha = c.lora.alpha;
  l.target_modules = c.lora.target_modules;
  return l;
}

/// The float8 policy [float8] describes, when model.converters asks for it: checked
/// against the parameters' dtype, which must be bfloat16 (after "auto" is resolved).
inline ops::Float8Policy float8_policy(const JobConfig& c) {
  ops::Float8Policy f;
  if (!float8_enabled(c)) return f;
  TESSERA_CHECK(c.training.mixed_precision_param == "bfloat16", "model.converters = [\"float8\"]: float8 GEMMs "
                "cast a bfloat16 model's values, and training.mixed_precision_param is \"",
                c.training.mixed_precision_param, "\" (set it to \"bfloat16\")");
  f.enabled = true;
  f.recipe = ops::parse_float8_recipe(c.float8.recipe_name, "float8.recipe_name");
  f.emulate = c.float8.emulate;
  f.all_gather = c.float8.enable_fsdp_float8_all_gather;
  f.tp_all_gather = c.float8.enable_tp_float8_all_gather;
  f.filter_fqns.clear();  // the config's list, in place of the policy's default
  for (const std::string& name : c.float8.filter_fqns) {
    if (name == "auto_filter_small_kn")
      f.auto_filter = true;
    else
      f.filter_fqns.push_back(name);
  }
  return f;
}

/// The mesh the [parallelism] degrees describe on `world` ranks (comm::mesh_shape).
inline comm::MeshShape mesh_shape(const JobConfig& c, int world) {
  const auto& p = c.parallelism;
  return comm::mesh_shape(world, p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                          p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree);
}

/// What [parallelism]'s pipeline_parallel_* keys say (parallel::PipelineOptions).
inline parallel::PipelineOptions pipeline_options(const JobConfig& c) {
  const auto& p = c.parallelism;
  parallel::PipelineOptions o;
  o.schedule = parallel::parse_schedule_kind(p.pipeline_parallel_schedule);
  o.microbatch_size = p.pipeline_parallel_microbatch_size;
  o.split_points = parallel::parse_split_points(p.pipeline_parallel_split_points);
  o.layers_per_stage = static_cast<int>(p.pipeline_parallel_layers_per_stage.value_or(0));
  o.weights = {static_cast<int>(p.pipeline_parallel_first_stage_less_layers),
               static_cast<int>(p.pipeline_parallel_last_stage_less_layers)};
  // The file is read (and checked) wherever the schedule names one, so that a bad file
  // is refused at start-up; only a pipeline runs its order.
  if (parallel::from_file(o.schedule) && !p.pipeline_parallel_schedule_csv.empty()) {
    try {
      o.table = std::make_shared<const parallel::ScheduleTable>(
          parallel::read_schedule_csv(p.pipeline_parallel_schedule_csv));
    } catch (const Error& e) {
      fail("parallelism.pipeline_parallel_schedule_csv: ", e.what());
    }
  }
  return o;
}

/// The schedule each data-parallel rank's pass runs under `c`, a config whose degrees and
/// batch are resolved, with a pipeline degree above 1: its action lists, as the pipeline
/// ranks will run them (the schedule file's order, or the named schedule's for
/// local_batch_size / pipeline_parallel_microbatch_size microbatches). Throws naming the
/// keys where the schedule cannot run that shape.
inline parallel::Schedule pipeline_schedule(const JobConfig& c) {
  const auto& p = c.parallelism;
  const int pp = static_cast<int>(p.pipeline_parallel_degree);
  TESSERA_CHECK(pp > 1, "parallelism.pipeline_parallel_degree = ", pp, ": a layout without a pipeline has no schedule");
  TESSERA_CHECK(p.pipeline_parallel_microbatch_size >= 1 &&
                    c.training.local_batch_size % p.pipeline_parallel_microbatch_size == 0,
                "parallelism.pipeline_parallel_microbatch_size = ", p.pipeline_parallel_microbatch_size,
                " does not divide training.local_batch_size = ", c.training.local_batch_size);
  const parallel::PipelineOptions o = pipeline_options(c);
  const int V = parallel::pipeline_stages(o.schedule, o, static_cast<int>(c.model.args.n_layers), pp).per_rank;
  const int M = static_cast<int>(c.training.local_batch_size / p.pipeline_parallel_microbatch_size);
  return parallel::schedule_for(o.schedule, o, pp, V, M);
}

/// The run-time plan [parallelism] and [activation_checkpoint] describe, on `mesh`.
inline parallel::Plan make_plan(const JobConfig& c, comm::DeviceMesh* mesh) {
  parallel::Plan plan;
  plan.mesh = mesh;
  plan.from_config = true;
  plan.reshard = parallel::parse_reshard(c.parallelism.fsdp_reshard_after_forward);
  plan.checkpoint = parallel::parse_checkpoint(c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option);
  plan.recompute_swiglu = c.activation_checkpoint.recompute_swiglu;
  plan.fuse_projections = c.model.fuse_projections;
  // "auto" is the model's own type: a float32 model's blocks compute with float32 values
  // (a bf16 model's are bf16 whatever this says).
  plan.param_dtype = param_dtype(c).value_or(DType::f32);
  plan.loss_parallel = !c.parallelism.disable_loss_parallel;
  plan.sequence_parallel = !c.parallelism.disable_sequence_parallel;
  plan.async_tensor_parallel = c.parallelism.enable_async_tensor_parallel;
  plan.pipeline = pipeline_options(c);
  plan.float8 = float8_policy(c);
  plan.lora = lora_policy(c);
  plan.context_rotation = parallel::parse_context_rotation(c.parallelism.context_parallel_rotate_method);
  plan.context_balance = parallel::parse_context_balance(c.parallelism.context_parallel_load_balancer);
  plan.cpu_offload = c.training.enable_cpu_offload;
  plan.early_step = c.optimizer.early_step_in_backward;
  return plan;
}

}  // namespace tessera::train
