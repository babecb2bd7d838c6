// The analytic count of what one training step of the Llama model sends, per rank,
// under each data-parallel sharding: the figure a run's measured traffic (the
// Communicator's Traffic) is held to in tests and benchmarks.
//
// Per micro-batch, for a unit of N parameters sharded S ways (shard n = ceil(N / S)),
// each collective counted as comm::Traffic counts it:
//   FSDP  all-gather (S-1) n p bytes each time the unit is gathered (p = 2 with
//         bfloat16 parameters, else 4): once in the forward, and again for the
//         backward if the unit was freed after its forward; reduce-scatter (S-1) n 4.
//   HSDP  the same over dp_shard, then an all-reduce of the shard over R replicas:
//         2 n 4 / R.
//   DDP   nothing per micro-batch; after the last, an all-reduce of each unit's
//         gradients over D ranks: 2 (D-1) N 4 / D.
// Per step: the target-token count and the loss sum all-reduced over dp (8 bytes
// each), and under FSDP/HSDP the squared gradient norm over dp_shard (8 bytes).
#pragma once

#include <cstdint>
#include <vector>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/nn/args.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera::parallel {

/// A unit's parameter count and how often a micro-batch gathers it.
struct UnitTraffic {
  std::int64_t numel = 0;
  int gathers = 1;
};

/// The units of the Llama model in order (embedding, blocks, norm + output) and how
/// many times each is gathered per micro-batch under `reshard`.
inline std::vector<UnitTraffic> llama_units(const nn::ModelArgs& a, Reshard reshard) {
  const std::int64_t d = a.dim, hd = a.head_dim(), f = a.ffn_hidden_dim();
  const std::int64_t block = 2 * d + d * a.n_heads * hd + 2 * d * a.kv_heads() * hd + a.n_heads * hd * d + 3 * d * f;
  std::vector<UnitTraffic> units;
  // The embedding is freed after its forward unless never, or tied to the output.
  units.push_back({a.vocab_size * d, reshard != Reshard::never && !a.tie_embeddings ? 2 : 1});
  for (std::int64_t i = 0; i < a.n_layers; ++i) {
    const bool last = i + 1 == a.n_layers;
    const bool freed = reshard == Reshard::always || (reshard == Reshard::default_policy && !last);
    units.push_back({block, freed ? 2 : 1});
  }
  // Norm + output run forward and backward back to back: gathered once.
  units.push_back({d + (a.tie_embeddings ? 0 : a.vocab_size * d), 1});
  return units;
}

namespace detail {
inline std::uint64_t all_reduce_bytes(std::uint64_t bytes, std::uint64_t p) { return 2 * bytes * (p - 1) / p; }
}  // namespace detail

/// Bytes one rank sends in one step of `micro_batches` micro-batches.
inline std::uint64_t expected_step_bytes(const nn::ModelArgs& a, const comm::MeshShape& shape, ShardingMode mode,
                                         Reshard reshard, DType param_dtype, std::int64_t micro_batches) {
  const auto S = static_cast<std::uint64_t>(shape.dp_shard), R = static_cast<std::uint64_t>(shape.dp_replicate),
             D = static_cast<std::uint64_t>(shape.dp());
  const std::uint64_t p = param_dtype == DType::bf16 ? 2 : 4, g = 4;
  const auto m = static_cast<std::uint64_t>(micro_batches);
  std::uint64_t bytes = 0;
  for (const UnitTraffic& u : llama_units(a, reshard)) {
    const auto n = static_cast<std::uint64_t>(u.numel);
    switch (mode) {
      case ShardingMode::none: break;
      case ShardingMode::fsdp:
      case ShardingMode::hsdp: {
        const std::uint64_t shard = (n + S - 1) / S;
        std::uint64_t per_micro = static_cast<std::uint64_t>(u.gathers) * (S - 1) * shard * p + (S - 1) * shard * g;
        if (mode == ShardingMode::hsdp) per_micro += detail::all_reduce_bytes(shard * g, R);
        bytes += m * per_micro;
        break;
      }
      case ShardingMode::ddp: bytes += detail::all_reduce_bytes(n * g, D); break;
    }
  }
  if (D > 1) bytes += 2 * detail::all_reduce_bytes(8, D);  // target count, loss sum
  if (mode == ShardingMode::fsdp || mode == ShardingMode::hsdp) bytes += detail::all_reduce_bytes(8, S);  // grad norm
  return bytes;
}

}  // namespace tessera::parallel
