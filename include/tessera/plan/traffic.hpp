// The analytic count of what one training step of the Llama model sends, per rank,
// under each layout: the figure a run's measured traffic (the Communicator's Traffic)
// is held to in tests and benchmarks. Each collective is counted as comm::Traffic
// counts it: all-gather (p-1) x the bytes a rank contributes, reduce-scatter (p-1) x
// the bytes it receives, all-reduce 2 (p-1)/p x the buffer (rounded down per call).
//
// Data parallelism, per micro-batch, for a unit of N parameters (this rank's
// tensor-parallel pieces) sharded S ways (shard n = ceil(N / S)):
//   FSDP  all-gather (S-1) n p bytes each time the unit is gathered (p = 2 with
//         bfloat16 parameters, else 4): once in the forward, and again for the
//         backward if the unit was freed after its forward; reduce-scatter (S-1) n 4.
//   HSDP  the same over dp_shard, then an all-reduce of the shard over R replicas.
//   DDP   nothing per micro-batch; after the last, an all-reduce of each unit's
//         gradients over D ranks.
// Tensor parallelism over T ranks, per micro-batch of `rows` tokens (a row shard is
// rows / T x dim floats, a = its bytes; w = rows x dim floats, the whole):
//   embedding  reduce-scatter forward, all-gather backward
//   each block gather + reduce-scatter around attention and around the feed-forward,
//              forward and backward (8 (T-1) a), again for the forward a checkpoint
//              policy recomputes (4 (T-1) a); an all-reduce of each norm's weight
//              gradient (dim floats) and, with fewer kv heads than ranks, of wk's and
//              wv's gradient pieces over the ranks sharing them
//   head       all-gather of the normed rows; under loss parallelism two all-reduces
//              per chunk of rows (the row maxima, then sums and target logits) and a
//              reduce-scatter of dh; the final norm's weight gradient all-reduced
// Without sequence parallelism every rank holds every row between the regions:
//   embedding  an all-reduce of w forward
//   each block an all-reduce of w out of attention and out of the feed-forward forward,
//              and of the input gradient into each backward (4), again for a
//              recomputed forward (2); no norm gradient is reduced (every rank's is whole)
//   head       under loss parallelism the chunks' all-reduces and an all-reduce of dh
// Pipeline parallelism over P ranks: a pass's microbatches each send this rank's
// stages' outputs forward and input gradients back (the rows it holds), the loss is
// all-reduced over the pipeline once per pass, and data-parallel units are gathered
// and reduced once per pass (they stay gathered through it).
// Per step: the target-token count and the loss sum all-reduced over dp, and the
// squared gradient norm over the world (8 bytes each).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/parallel/checkpoint.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/train/job_config.hpp"
#include "tessera/train/job_plan.hpp"

namespace tessera::plan {

/// A unit's parameter count (this rank's tensor-parallel pieces) and how often a
/// pass gathers it.
struct UnitTraffic {
  std::int64_t numel = 0;
  int gathers = 1;
};

/// What one step's traffic depends on.
struct StepLayout {
  nn::ModelArgs args;
  comm::MeshShape shape;
  parallel::ShardingMode mode = parallel::ShardingMode::none;
  parallel::Reshard reshard = parallel::Reshard::default_policy;
  DType param_dtype = DType::f32;
  std::int64_t micro_batches = 1;  // forward_backward passes per step (gradient accumulation)
  std::int64_t rows = 0;           // tokens of one pass on one data-parallel rank (batch x seq_len)
  std::int64_t seq_len = 0;
  parallel::CheckpointMode checkpoint{};
  bool loss_parallel = true;
  bool sequence_parallel = true;
  parallel::PipelineOptions pipeline{};
  int pp_rank = 0;  // the pipeline rank counted (ranks of different stages send different bytes)
};

/// The layers one pipeline rank holds.
struct RankLayers {
  bool embedding = true, output = true;
  std::vector<int> blocks;  // global block ids
  std::vector<int> stages;  // global stage ids
  int n_stages = 1;
  parallel::Placement placement = parallel::Placement::loop;
};

inline RankLayers rank_layers(const StepLayout& l) {
  RankLayers r;
  const int L = static_cast<int>(l.args.n_layers), P = l.shape.pp;
  if (P == 1) {
    for (int i = 0; i < L; ++i) r.blocks.push_back(i);
    r.stages = {0};
    return r;
  }
  const parallel::StageSplit split = parallel::pipeline_stages(l.pipeline.schedule, l.pipeline, L, P);
  const int V = split.per_rank;
  const auto& stages = split.stages;
  r.n_stages = P * V;
  r.placement = parallel::placement_of(l.pipeline.schedule, l.pipeline);
  r.embedding = r.output = false;
  for (int v = 0; v < V; ++v) {
    const int s = parallel::stage_of_rank(r.placement, P, l.pp_rank, v);
    r.stages.push_back(s);
    for (int i = stages[static_cast<std::size_t>(s)].first_block; i < stages[static_cast<std::size_t>(s)].end_block; ++i)
      r.blocks.push_back(i);
    r.embedding = r.embedding || stages[static_cast<std::size_t>(s)].embedding;
    r.output = r.output || stages[static_cast<std::size_t>(s)].output;
  }
  return r;
}

/// The units this rank holds in order (embedding, blocks, norm + output), their sizes
/// on one of the tp ranks, and how many times a pass gathers each under `reshard`
/// (in a pipeline, once: units stay gathered through the pass).
inline std::vector<UnitTraffic> llama_units(const StepLayout& l) {
  const nn::ModelArgs& a = l.args;
  const std::int64_t tp = l.shape.tp, d = a.dim, hd = a.head_dim(), f = a.ffn_hidden_dim();
  const std::int64_t kv_local = std::max<std::int64_t>(1, a.kv_heads() / tp);
  const std::int64_t block =
      2 * d + (d * a.n_heads * hd + a.n_heads * hd * d + 3 * d * f) / tp + 2 * d * kv_local * hd;
  const bool pipelined = l.shape.pp > 1;
  const RankLayers r = rank_layers(l);
  std::vector<UnitTraffic> units;
  // The embedding is freed after its forward unless never, or tied to the output.
  if (r.embedding)
    units.push_back(
        {a.vocab_size * d / tp, !pipelined && l.reshard != parallel::Reshard::never && !a.tie_embeddings ? 2 : 1});
  for (int i : r.blocks) {
    const bool last = i + 1 == a.n_layers;
    const bool freed = !pipelined && (l.reshard == parallel::Reshard::always ||
                                      (l.reshard == parallel::Reshard::default_policy && !last));
    units.push_back({block, freed ? 2 : 1});
  }
  // Norm + output run forward and backward back to back: gathered once.
  const std::int64_t output = a.tie_embeddings ? 0 : a.vocab_size * d / (l.loss_parallel ? tp : 1);
  if (r.output) units.push_back({d + output, 1});
  return units;
}

namespace detail {
inline std::uint64_t all_reduce_bytes(std::uint64_t bytes, std::uint64_t p) {
  return p > 1 ? 2 * bytes * (p - 1) / p : 0;
}

/// The loss-parallel head's all-reduces over a pass of `rows` tokens: two per chunk of
/// rows (the row maxima, then the sums and target logits), chunks as a host sizes them
/// (these counts are checked on CPU ranks).
inline std::uint64_t loss_parallel_bytes(const StepLayout& l, std::int64_t rows) {
  const auto T = static_cast<std::uint64_t>(l.shape.tp);
  const std::int64_t local = l.args.vocab_size / static_cast<std::int64_t>(T);
  const std::int64_t step = nn::loss_chunk_rows(local, rows, nn::loss_chunk_bytes_per_logit(l.param_dtype));
  std::uint64_t bytes = 0;
  for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
    const auto n = static_cast<std::uint64_t>(std::min(step, rows - r0));
    bytes += all_reduce_bytes(n * 4, T) + all_reduce_bytes(2 * n * 4, T);
  }
  return bytes;
}

/// Tensor-parallel bytes of one pass of `rows` tokens through the layers `r`.
inline std::uint64_t tensor_parallel_bytes(const StepLayout& l, const RankLayers& r, std::int64_t rows) {
  const nn::ModelArgs& a = l.args;
  const auto T = static_cast<std::uint64_t>(l.shape.tp);
  if (T <= 1) return 0;
  const auto d = static_cast<std::uint64_t>(a.dim), hd = static_cast<std::uint64_t>(a.head_dim());
  const std::uint64_t shard = static_cast<std::uint64_t>(rows) / T * d * 4;  // one row shard's bytes
  const std::uint64_t region = (T - 1) * shard;                             // one gather or reduce-scatter
  const std::uint64_t norm = all_reduce_bytes(d * 4, T);
  const auto kv = static_cast<std::uint64_t>(a.kv_heads());
  const std::uint64_t kv_pieces = kv < T ? 2 * all_reduce_bytes(hd * d * 4, T / kv) : 0;
  if (!l.sequence_parallel) {
    // One all-reduce of every row where the split layout has a gather and a reduce-scatter.
    const std::uint64_t whole = all_reduce_bytes(static_cast<std::uint64_t>(rows) * d * 4, T);
    std::uint64_t bytes = r.embedding ? whole : 0;
    for (int i : r.blocks) {
      bytes += 4 * whole + kv_pieces;
      if (parallel::checkpoint_for_layer(l.checkpoint, i).kind != parallel::CheckpointMode::Kind::none)
        bytes += 2 * whole;
    }
    if (r.output && l.loss_parallel) bytes += loss_parallel_bytes(l, rows) + whole;  // the chunks; dh
    return bytes;
  }
  std::uint64_t bytes = r.embedding ? 2 * region : 0;  // the embedding's reduce-scatter and all-gather
  for (int i : r.blocks) {
    bytes += 8 * region + 2 * norm + kv_pieces;
    if (parallel::checkpoint_for_layer(l.checkpoint, i).kind != parallel::CheckpointMode::Kind::none)
      bytes += 4 * region;
  }
  if (!r.output) return bytes;
  bytes += region + norm;  // the head's gather of the normed rows; the final norm's weight
  if (l.loss_parallel) bytes += loss_parallel_bytes(l, rows) + region;  // the chunks; dh reduce-scattered to rows
  return bytes;
}
}  // namespace detail

/// Bytes one rank (at pipeline rank l.pp_rank) sends in one step.
inline std::uint64_t expected_step_bytes(const StepLayout& l) {
  const comm::MeshShape& shape = l.shape;
  const auto S = static_cast<std::uint64_t>(shape.dp_shard), R = static_cast<std::uint64_t>(shape.dp_replicate),
             D = static_cast<std::uint64_t>(shape.dp()), W = static_cast<std::uint64_t>(shape.world()),
             P = static_cast<std::uint64_t>(shape.pp);
  const std::uint64_t p = l.param_dtype == DType::bf16 ? 2 : 4, g = 4;
  const auto m = static_cast<std::uint64_t>(l.micro_batches);
  std::uint64_t bytes = 0;
  for (const UnitTraffic& u : llama_units(l)) {
    const auto n = static_cast<std::uint64_t>(u.numel);
    switch (l.mode) {
      case parallel::ShardingMode::none: break;
      case parallel::ShardingMode::fsdp:
      case parallel::ShardingMode::hsdp: {
        const std::uint64_t shard = (n + S - 1) / S;
        std::uint64_t per_pass = static_cast<std::uint64_t>(u.gathers) * (S - 1) * shard * p + (S - 1) * shard * g;
        if (l.mode == parallel::ShardingMode::hsdp) per_pass += detail::all_reduce_bytes(shard * g, R);
        bytes += m * per_pass;
        break;
      }
      case parallel::ShardingMode::ddp: bytes += detail::all_reduce_bytes(n * g, D); break;
    }
  }
  const RankLayers r = rank_layers(l);
  if (P == 1) {
    bytes += m * detail::tensor_parallel_bytes(l, r, l.rows);
  } else {
    // Each pass: its pipeline microbatches through this rank's stages, each stage
    // sending its output forward (but the last) and its input gradient back (but the
    // first) where the stage at the other end is on another rank (the V placement's
    // middle two share one), then the loss all-reduced over the pipeline.
    const std::int64_t mb_rows = l.pipeline.microbatch_size * l.seq_len;
    const auto microbatches = static_cast<std::uint64_t>(l.rows / mb_rows);
    const std::int64_t held = l.sequence_parallel ? mb_rows / shape.tp : mb_rows;  // rows between the regions
    const std::uint64_t activation = static_cast<std::uint64_t>(held * l.args.dim) * 4;
    std::uint64_t sends = 0;
    const auto elsewhere = [&](int stage) { return parallel::rank_of_stage(r.placement, P, stage) != l.pp_rank; };
    for (int s : r.stages)
      sends += (s + 1 < r.n_stages && elsewhere(s + 1) ? activation : 0) + (s > 0 && elsewhere(s - 1) ? activation : 0);
    bytes += m * (microbatches * (detail::tensor_parallel_bytes(l, r, mb_rows) + sends) + detail::all_reduce_bytes(8, P));
  }
  bytes += 2 * detail::all_reduce_bytes(8, D);  // target count, loss sum
  bytes += detail::all_reduce_bytes(8, W);      // squared gradient norm
  return bytes;
}

/// What the count above needs of a job (train/job_config.hpp) on `shape`,
/// for the ranks at pipeline rank `pp_rank`.
inline StepLayout step_layout(const train::JobConfig& c, const comm::MeshShape& shape, int pp_rank = 0) {
  const parallel::Plan layout = train::make_plan(c, nullptr);
  StepLayout l;
  l.args = c.model.args;
  l.shape = shape;
  l.mode = parallel::sharding_for(shape);
  l.reshard = layout.reshard;
  l.param_dtype = layout.param_dtype;
  const std::int64_t local = c.training.local_batch_size;
  const std::int64_t global = c.training.global_batch_size > 0 ? c.training.global_batch_size : local * shape.dp();
  l.micro_batches = global / (local * shape.dp());
  l.rows = local * c.training.seq_len;
  l.seq_len = c.training.seq_len;
  l.checkpoint = layout.checkpoint;
  l.loss_parallel = layout.loss_parallel;
  l.sequence_parallel = layout.sequence_parallel;
  l.pipeline = layout.pipeline;
  l.pp_rank = pp_rank;
  return l;
}

}  // namespace tessera::plan
