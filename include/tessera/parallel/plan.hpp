// The run-time side of the parallel policies: where this rank sits (the DeviceMesh)
// and what the Dynamic policies resolve to.
//
// Policies are types (parallel/policies.hpp). A static one (Sharding<FSDP>,
// Checkpoint<Full>) fixes its choice at compile time; Sharding<Dynamic> and
// Checkpoint<Dynamic> and TensorParallel<dynamic>, which the binaries use, read it from the Plan, which
// llama-train fills from the [parallelism] and [activation_checkpoint] keys.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layer/lora.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/schedule_csv.hpp"
#include "tessera/parallel/schedule_kind.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/parallel/wording.hpp"

namespace tessera::parallel {

enum class ShardingMode : std::uint8_t { none, ddp, fsdp, hsdp };

constexpr const char* name_of(ShardingMode m) {
  switch (m) {
    case ShardingMode::none: return "none";
    case ShardingMode::ddp: return "DDP";
    case ShardingMode::fsdp: return "FSDP";
    case ShardingMode::hsdp: return "HSDP";
  }
  return "?";
}

/// torchtitan's fsdp_reshard_after_forward: whether a unit frees its gathered
/// parameters after its forward (and gathers them again for its backward).
enum class Reshard : std::uint8_t {
  default_policy,  // every unit but the last block and norm + output (which backward needs at once)
  always,
  never,
};

inline Reshard parse_reshard(std::string_view s) {
  if (s == "default") return Reshard::default_policy;
  if (s == "always") return Reshard::always;
  if (s == "never") return Reshard::never;
  fail("parallelism.fsdp_reshard_after_forward = \"", s, "\": expected \"default\", \"always\" or \"never\"");
}

/// What activation checkpointing does to one block.
struct CheckpointMode {
  enum class Kind : std::uint8_t {
    none,             // every activation kept
    full,             // only the block's input kept; the block recomputed before its backward
    selective_op,     // matmul and attention outputs kept (torchtitan's op policy); the rest recomputed
    selective_layer,  // every `every`-th block fully checkpointed, the others not
  } kind = Kind::none;
  int every = 0;  // selective_layer only

  friend bool operator==(const CheckpointMode&, const CheckpointMode&) = default;
  std::string str() const {
    switch (kind) {
      case Kind::none: return "none";
      case Kind::full: return "full";
      case Kind::selective_op: return "selective (op)";
      case Kind::selective_layer: return "selective (every " + std::to_string(every) + " layers)";
    }
    return "?";
  }
};

/// [activation_checkpoint] mode and selective_ac_option, as torchtitan reads them.
inline CheckpointMode parse_checkpoint(std::string_view mode, std::string_view option) {
  using K = CheckpointMode::Kind;
  if (mode == "none") return {K::none, 0};
  if (mode == "full") return {K::full, 0};
  if (mode == "selective") {
    if (option == "op") return {K::selective_op, 0};
    int every = 0;
    bool digits = !option.empty() && option.size() <= 6;
    for (char c : option) digits = digits && c >= '0' && c <= '9';
    if (digits) every = std::stoi(std::string(option));
    TESSERA_CHECK(digits && every >= 1, "activation_checkpoint.selective_ac_option = \"", option,
                  "\": expected \"op\" or a positive integer (checkpoint every N-th layer)");
    return {K::selective_layer, every};
  }
  fail("activation_checkpoint.mode = \"", mode, "\": expected \"none\", \"full\" or \"selective\"");
}

/// The sharding a mesh implies (torchtitan's reading of the degrees): replicate and
/// shard → HSDP; shard only → FSDP; replicate only → DDP; neither → none. Context
/// parallelism shards as dp_shard does (FSDP over dp_shard x cp), since its ranks hold
/// the same parameters and must sum their gradients.
inline ShardingMode sharding_for(const comm::MeshShape& s) {
  const int shard = s.dp_shard * s.cp;
  if (s.dp_replicate > 1 && shard > 1) return ShardingMode::hsdp;
  if (shard > 1) return ShardingMode::fsdp;
  if (s.dp_replicate > 1) return ShardingMode::ddp;
  return ShardingMode::none;
}

/// How the keys and values reach every rank of the group (torchtitan's
/// context_parallel_rotate_method): round the ring, one neighbour's at a time beside the
/// compute ("alltoall"), or all at once ("allgather").
enum class ContextRotation : std::uint8_t { ring, all_gather };

/// torchtitan's spelling of `r`.
constexpr const char* name_of(ContextRotation r) { return r == ContextRotation::ring ? "alltoall" : "allgather"; }

/// Parses parallelism.context_parallel_rotate_method; throws naming the key.
inline ContextRotation parse_context_rotation(std::string_view name) {
  if (name == "alltoall") return ContextRotation::ring;
  if (name == "allgather") return ContextRotation::all_gather;
  fail("parallelism.context_parallel_rotate_method: unknown method \"", name, "\" (known: alltoall, allgather)");
}

/// How a sequence's chunks are dealt to the context-parallel ranks (torchtitan's
/// context_parallel_load_balancer): head and tail to each rank, so every rank attends over
/// as many keys ("headtail"), or in order ("none").
enum class ContextBalance : std::uint8_t { head_tail, none };

/// torchtitan's spelling of `b`.
constexpr const char* name_of(ContextBalance b) { return b == ContextBalance::head_tail ? "headtail" : "none"; }

/// Parses parallelism.context_parallel_load_balancer; throws naming the key.
inline ContextBalance parse_context_balance(std::string_view name) {
  if (name == "headtail") return ContextBalance::head_tail;
  if (name == "none") return ContextBalance::none;
  fail("parallelism.context_parallel_load_balancer: unknown balancer \"", name, "\" (known: headtail, none; "
       "torchtitan's ptrr balances FlexAttention's masks, which tessera's attention does not take)");
}

/// What Pipeline<...> with run-time choices reads: torchtitan's pipeline_parallel_* keys.
struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::one_f_one_b;
  /// Stages per pipeline rank; 0: what split_points or layers_per_stage imply, else 1 for
  /// GPipe and 1F1B and 2 for the others.
  int stages_per_rank = 0;
  /// Sequences per microbatch: a data-parallel rank's batch is cut into
  /// local_batch_size / microbatch_size microbatches.
  std::int64_t microbatch_size = 1;
  /// Block indices where a stage begins (torchtitan's pipeline_parallel_split_points);
  /// empty: an even split (parallel/stages.hpp).
  std::vector<int> split_points;
  /// Layers per stage of the even split (torchtitan's pipeline_parallel_layers_per_stage):
  /// the stage count is the units (blocks and the weights below) over this, rounded up.
  /// 0: not set.
  int layers_per_stage = 0;
  /// How many layers the embedding and the output count as in the even split
  /// (pipeline_parallel_first_stage_less_layers, _last_stage_less_layers).
  StageWeights weights{};
  /// The order PipelineScheduleSingle and PipelineScheduleMulti run, read from a file
  /// (pipeline_parallel_schedule_csv; schedule_csv.hpp); nullptr for the schedules that
  /// lay out their own.
  std::shared_ptr<const ScheduleTable> table;
};

/// The schedule a pipeline run by `kind` with `p` runs on `ranks` x `stages_per_rank`
/// stages for `microbatches` microbatches: the file's order for PipelineScheduleSingle and
/// PipelineScheduleMulti (schedule_from_table), else the named schedule's (make_schedule).
inline Schedule schedule_for(ScheduleKind kind, const PipelineOptions& p, int ranks, int stages_per_rank,
                             int microbatches, Wording wording = config_keys) {
  if (!from_file(kind)) return make_schedule(kind, ranks, stages_per_rank, microbatches);
  TESSERA_CHECK(p.table != nullptr, wording(settings::schedule), " = ", name_of(kind),
                " runs the order of a schedule file, and ", wording(settings::schedule_csv), " names none");
  return schedule_from_table(*p.table, kind, ranks, stages_per_rank, microbatches, wording);
}

/// Where a pipeline run by `kind` with `p` puts its stages: where the schedule file's
/// rows put them for PipelineScheduleSingle and PipelineScheduleMulti, else the
/// schedule's own placement (schedule_kind.hpp).
inline Placement placement_of(ScheduleKind kind, const PipelineOptions& p) {
  return from_file(kind) && p.table ? p.table->order.placement() : placement_of(kind);
}

/// Stages per pipeline rank for `kind` on `pp` ranks with a model of `n_layers` blocks:
/// what split_points imply (their stage count over pp), else what layers_per_stage does,
/// else the explicit count, else a schedule file's, else 1 for GPipe and 1F1B and 2 for
/// the others (default_stages_per_rank). Throws naming the settings (`wording`) when they disagree,
/// when split points come with layers_per_stage or other weights, or when the stage count
/// is not a multiple of pp.
inline int stages_per_rank(ScheduleKind kind, const PipelineOptions& p, int n_layers, int pp,
                           Wording wording = config_keys) {
  int V = p.stages_per_rank;
  auto agree = [&](int S) {
    TESSERA_CHECK(V == 0 || V == S / pp, wording.pick("parallelism", "pipeline"), ": ", S, " stages over ", pp,
                  " ranks is ", S / pp, " stages per rank, not ", V);
    return S / pp;
  };
  if (!p.split_points.empty()) {
    TESSERA_CHECK(p.layers_per_stage == 0, wording(settings::split_points), " and ",
                  wording(settings::layers_per_stage), " both say where the stages begin: give one");
    TESSERA_CHECK(p.weights == StageWeights{}, wording(settings::split_points), " place every block: ",
                  wording(settings::first_stage_less_layers), " and ", wording(settings::last_stage_less_layers),
                  " weigh the even split only (leave them 1)");
    const int S = static_cast<int>(p.split_points.size()) + 1;
    TESSERA_CHECK(S % pp == 0, wording(settings::split_points), ": ", p.split_points.size(), " points make ", S,
                  " stages, not a multiple of ", wording(settings::pipeline_parallel_degree, pp));
    return agree(S);
  }
  if (p.layers_per_stage > 0) {
    const int units = n_layers + p.weights.embedding + p.weights.output;
    const int S = (units + p.layers_per_stage - 1) / p.layers_per_stage;
    TESSERA_CHECK(S % pp == 0, wording(settings::layers_per_stage, p.layers_per_stage), ": ",
                  detail::unit_count(n_layers, p.weights), " make ", S, " stages of at most ", p.layers_per_stage,
                  ", not a multiple of ", wording(settings::pipeline_parallel_degree, pp));
    return agree(S);
  }
  if (V > 0) return V;
  if (from_file(kind) && p.table) return p.table->order.stages_per_rank;
  return default_stages_per_rank(kind);
}

/// The stages of a model of `n_layers` blocks on `pp` pipeline ranks run by `kind` (the
/// block policy's schedule, or p.schedule) with `p`: how many each rank holds, and what
/// every stage holds (split_stages), in stage order.
struct StageSplit {
  int per_rank = 1;
  std::vector<StageRange> stages;
};

inline StageSplit pipeline_stages(ScheduleKind kind, const PipelineOptions& p, int n_layers, int pp,
                                  Wording wording = config_keys) {
  StageSplit out;
  out.per_rank = stages_per_rank(kind, p, n_layers, pp, wording);
  out.stages = split_stages(n_layers, pp * out.per_rank, p.split_points, wording, p.weights);
  return out;
}

struct Plan {
  /// This rank's place; nullptr for one rank alone. Must outlive the model.
  comm::DeviceMesh* mesh = nullptr;
  /// Whether these values (and the mesh's degrees) came from a job's config
  /// (train::make_plan): the run-time checks then name what they refuse by config key,
  /// else in words (parallel/wording.hpp).
  bool from_config = false;
  Reshard reshard = Reshard::default_policy;
  /// For Checkpoint<Dynamic>.
  CheckpointMode checkpoint{};
  /// The feed-forward's SwiGLU output made again in the backward rather than kept for it
  /// (nn::FeedForward; activation_checkpoint.recompute_swiglu), under any checkpoint mode.
  bool recompute_swiglu = false;
  /// Attention's wq, wk and wv, and the feed-forward's w1 and w3, stored side by side and
  /// each run as one GEMM a direction where they can be (nn::stacked_forward; model.fuse_projections).
  bool fuse_projections = true;
  /// Parameters as the blocks compute with them: bf16 halves what all-gathers send.
  DType param_dtype = DType::f32;
  /// Gather the next unit's parameters while this one computes.
  bool prefetch = true;
  /// FSDP's and HSDP's shards, their gradients and the optimizer's state kept in host
  /// memory, the optimizer run on the host (parallel/sharding.hpp; training.enable_cpu_offload).
  bool cpu_offload = false;
  /// Each unit's parameters updated as soon as its gradient is final, in the last
  /// micro-batch's backward, and its gradient shard freed (optimizer.early_step_in_backward;
  /// train/trainer.hpp, parallel/model_units.hpp). Units of FSDP, HSDP or DDP; no pipeline.
  bool early_step = false;
  /// Under tensor parallelism: the output split by vocabulary and the loss computed
  /// without gathering logits (torchtitan's default; disable_loss_parallel turns it off).
  bool loss_parallel = true;
  /// Under tensor parallelism: the rows split over the ranks between the regions, where
  /// norms and residual adds run (torchtitan's layout; disable_sequence_parallel turns
  /// it off: every rank then holds every row, Megatron-LM's layout without
  /// --sequence-parallel). parallel/tensor_parallel.hpp.
  bool sequence_parallel = true;
  /// Under tensor and sequence parallelism: each region's gather and reduce-scatter cut
  /// into one transfer per peer, each beside a GEMM on the rows already there
  /// (parallelism.enable_async_tensor_parallel; parallel/tensor_parallel.hpp).
  bool async_tensor_parallel = false;
  /// For Pipeline<dynamic> (and a pipeline's run-time details).
  PipelineOptions pipeline{};
  /// Which linear layers multiply in float8, by which recipe (ops/float8.hpp).
  ops::Float8Policy float8{};
  /// Which linear layers hold LoRA adapters, everything else frozen (layer/lora.hpp).
  nn::LoraPolicy lora{};
  /// Under context parallelism: how the keys and values reach every rank of the group
  /// (parallel/context_parallel.hpp; parallelism.context_parallel_rotate_method).
  ContextRotation context_rotation = ContextRotation::ring;
  /// Under context parallelism: which chunks of each sequence each rank holds
  /// (ops::ContextShard; parallelism.context_parallel_load_balancer).
  ContextBalance context_balance = ContextBalance::head_tail;

  int dp_degree() const { return mesh ? mesh->dp_degree() : 1; }
  int tp_degree() const { return mesh ? mesh->shape().tp : 1; }
  int pp_degree() const { return mesh ? mesh->shape().pp : 1; }
  int cp_degree() const { return mesh ? mesh->shape().cp : 1; }
  int dp_rank() const { return mesh ? mesh->dp_rank() : 0; }
  /// Whether the parameters live in sharding units even on a mesh with no data-parallel
  /// sharding or replication: CPU offload keeps FSDP's shards in host memory, and the
  /// early step updates a unit's shard and frees its gradient. Each unit is then FSDP
  /// over the rank alone (its shard, whole).
  bool units_over_self() const { return cpu_offload || early_step; }
  /// What Sharding<Dynamic> means on this plan's mesh.
  ShardingMode dynamic_sharding() const {
    const ShardingMode m = mesh ? sharding_for(mesh->shape()) : ShardingMode::none;
    return units_over_self() && m == ShardingMode::none ? ShardingMode::fsdp : m;
  }
  /// How the run-time checks name this plan's settings.
  Wording wording() const { return Wording{from_config}; }
};

}  // namespace tessera::parallel
