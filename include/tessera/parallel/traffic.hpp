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
// rows / T x dim floats, a = its bytes):
//   embedding  reduce-scatter forward, all-gather backward
//   each block gather + reduce-scatter around attention and around the feed-forward,
//              forward and backward (8 (T-1) a), again for the forward a checkpoint
//              policy recomputes (4 (T-1) a); an all-reduce of each norm's weight
//              gradient (dim floats) and, with fewer kv heads than ranks, of wk's and
//              wv's gradient pieces over the ranks sharing them
//   head       all-gather of the normed rows; under loss parallelism two all-reduces
//              per chunk of rows (the row maxima, then sums and target logits) and a
//              reduce-scatter of dh; the final norm's weight gradient all-reduced
// Per step: the target-token count and the loss sum all-reduced over dp, and the
// squared gradient norm over the world (8 bytes each).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/nn/args.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/parallel/checkpoint.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera::parallel {

/// A unit's parameter count (this rank's tensor-parallel pieces) and how often a
/// micro-batch gathers it.
struct UnitTraffic {
  std::int64_t numel = 0;
  int gathers = 1;
};

/// The units of the Llama model in order (embedding, blocks, norm + output), their
/// sizes on one of `tp` tensor-parallel ranks, and how many times each is gathered
/// per micro-batch under `reshard`.
inline std::vector<UnitTraffic> llama_units(const nn::ModelArgs& a, Reshard reshard, std::int64_t tp = 1,
                                            bool loss_parallel = true) {
  const std::int64_t d = a.dim, hd = a.head_dim(), f = a.ffn_hidden_dim();
  const std::int64_t kv_local = std::max<std::int64_t>(1, a.kv_heads() / tp);
  const std::int64_t block =
      2 * d + (d * a.n_heads * hd + a.n_heads * hd * d + 3 * d * f) / tp + 2 * d * kv_local * hd;
  std::vector<UnitTraffic> units;
  // The embedding is freed after its forward unless never, or tied to the output.
  units.push_back({a.vocab_size * d / tp, reshard != Reshard::never && !a.tie_embeddings ? 2 : 1});
  for (std::int64_t i = 0; i < a.n_layers; ++i) {
    const bool last = i + 1 == a.n_layers;
    const bool freed = reshard == Reshard::always || (reshard == Reshard::default_policy && !last);
    units.push_back({block, freed ? 2 : 1});
  }
  // Norm + output run forward and backward back to back: gathered once.
  const std::int64_t output = a.tie_embeddings ? 0 : a.vocab_size * d / (loss_parallel ? tp : 1);
  units.push_back({d + output, 1});
  return units;
}

/// What one step's traffic depends on.
struct StepLayout {
  nn::ModelArgs args;
  comm::MeshShape shape;
  ShardingMode mode = ShardingMode::none;
  Reshard reshard = Reshard::default_policy;
  DType param_dtype = DType::f32;
  std::int64_t micro_batches = 1;
  std::int64_t rows = 0;  // tokens of one micro-batch on one data-parallel rank (batch x seq_len)
  CheckpointMode checkpoint{};
  bool loss_parallel = true;
};

namespace detail {
inline std::uint64_t all_reduce_bytes(std::uint64_t bytes, std::uint64_t p) {
  return p > 1 ? 2 * bytes * (p - 1) / p : 0;
}

/// Tensor-parallel bytes of one micro-batch.
inline std::uint64_t tensor_parallel_bytes(const StepLayout& l) {
  const nn::ModelArgs& a = l.args;
  const auto T = static_cast<std::uint64_t>(l.shape.tp);
  if (T <= 1) return 0;
  const auto d = static_cast<std::uint64_t>(a.dim), hd = static_cast<std::uint64_t>(a.head_dim());
  const std::uint64_t shard = static_cast<std::uint64_t>(l.rows) / T * d * 4;  // one row shard's bytes
  const std::uint64_t region = (T - 1) * shard;                               // one gather or reduce-scatter
  const std::uint64_t norm = all_reduce_bytes(d * 4, T);
  const auto kv = static_cast<std::uint64_t>(a.kv_heads());
  const std::uint64_t kv_pieces = kv < T ? 2 * all_reduce_bytes(hd * d * 4, T / kv) : 0;
  std::uint64_t bytes = 2 * region;  // the embedding's reduce-scatter and all-gather
  for (std::int64_t i = 0; i < a.n_layers; ++i) {
    bytes += 8 * region + 2 * norm + kv_pieces;
    if (checkpoint_for_layer(l.checkpoint, i).kind != CheckpointMode::Kind::none) bytes += 4 * region;
  }
  bytes += region + norm;  // the head's gather of the normed rows; the final norm's weight
  if (l.loss_parallel) {
    const std::int64_t rows = l.rows, local = a.vocab_size / static_cast<std::int64_t>(T);
    const std::int64_t step = nn::loss_chunk_rows(local, rows);
    for (std::int64_t r0 = 0; r0 < rows; r0 += step) {
      const auto n = static_cast<std::uint64_t>(std::min(step, rows - r0));
      bytes += all_reduce_bytes(n * 4, T) + all_reduce_bytes(2 * n * 4, T);
    }
    bytes += region;  // dh reduce-scattered to rows
  }
  return bytes;
}
}  // namespace detail

/// Bytes one rank sends in one step.
inline std::uint64_t expected_step_bytes(const StepLayout& l) {
  const comm::MeshShape& shape = l.shape;
  const auto S = static_cast<std::uint64_t>(shape.dp_shard), R = static_cast<std::uint64_t>(shape.dp_replicate),
             D = static_cast<std::uint64_t>(shape.dp()), W = static_cast<std::uint64_t>(shape.world());
  const std::uint64_t p = l.param_dtype == DType::bf16 ? 2 : 4, g = 4;
  const auto m = static_cast<std::uint64_t>(l.micro_batches);
  std::uint64_t bytes = 0;
  for (const UnitTraffic& u : llama_units(l.args, l.reshard, shape.tp, l.loss_parallel)) {
    const auto n = static_cast<std::uint64_t>(u.numel);
    switch (l.mode) {
      case ShardingMode::none: break;
      case ShardingMode::fsdp:
      case ShardingMode::hsdp: {
        const std::uint64_t shard = (n + S - 1) / S;
        std::uint64_t per_micro = static_cast<std::uint64_t>(u.gathers) * (S - 1) * shard * p + (S - 1) * shard * g;
        if (l.mode == ShardingMode::hsdp) per_micro += detail::all_reduce_bytes(shard * g, R);
        bytes += m * per_micro;
        break;
      }
      case ShardingMode::ddp: bytes += detail::all_reduce_bytes(n * g, D); break;
    }
  }
  bytes += m * detail::tensor_parallel_bytes(l);
  bytes += 2 * detail::all_reduce_bytes(8, D);  // target count, loss sum
  bytes += detail::all_reduce_bytes(8, W);      // squared gradient norm
  return bytes;
}

}  // namespace tessera::parallel
