// DeviceMesh: the world's ranks laid out on named dimensions [pp, dp_replicate, dp_shard, cp, tp].
//
// A rank's coordinates follow from its world rank with tp varying fastest:
//   rank = (((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t
// so tensor-parallel peers are neighbours (one node, fastest links), then the
// context-parallel ranks that pass keys round their ring, as torchtitan lays its mesh
// out. Each dimension has a communicator over the ranks that differ only in that
// coordinate, made by splitting the world (Communicator::split_strided); `dp` spans
// dp_replicate x dp_shard together (the ranks that read different slices of the batch),
// `dp_shard_cp` spans dp_shard x cp (the ranks FSDP shards parameters over: the
// context-parallel ranks hold the same parameters and sum their gradients, as
// torchtitan's dp_shard_cp), and `dp_cp` spans dp_replicate x dp_shard x cp (the ranks
// whose token losses make the step's loss).
#pragma once

#include <cstdint>
#include <string>

#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"

namespace tessera::comm {

struct MeshShape {
  int pp = 1;
  int dp_replicate = 1;
  int dp_shard = 1;
  int tp = 1;
  int cp = 1;  // last, so that {pp, dp_replicate, dp_shard, tp} still reads as before

  int world() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int dp() const { return dp_replicate * dp_shard; }
  /// The ranks of one pipeline stage.
  int per_stage() const { return dp_replicate * dp_shard * cp * tp; }
  std::string str() const {
    return tessera::detail::concat("[pp ", pp, ", dp_replicate ", dp_replicate, ", dp_shard ", dp_shard,
                                   cp > 1 ? tessera::detail::concat(", cp ", cp) : std::string(), ", tp ", tp, "]");
  }
  friend bool operator==(const MeshShape&, const MeshShape&) = default;
};

/// The mesh torchtitan's [parallelism] degrees describe on `world_size` ranks; a
/// data_parallel_shard_degree of -1 takes the ranks the other degrees leave. Every
/// rank computes the same answer from the same config, so a bad layout is the same
/// error everywhere, before any collective runs.
inline MeshShape mesh_shape(int world_size, std::int64_t dp_replicate, std::int64_t dp_shard, std::int64_t tp,
                            std::int64_t pp, std::int64_t cp = 1) {
  auto positive = [](std::int64_t v, const char* key) {
    TESSERA_CHECK(v >= 1, "parallelism.", key, " = ", v, ": a degree must be at least 1");
  };
  positive(dp_replicate, "data_parallel_replicate_degree");
  positive(tp, "tensor_parallel_degree");
  positive(pp, "pipeline_parallel_degree");
  positive(cp, "context_parallel_degree");
  const std::int64_t others = dp_replicate * tp * pp * cp;
  const std::string cp_term = cp > 1 ? tessera::detail::concat(" x context_parallel_degree ", cp) : std::string();
  if (dp_shard == -1) {
    TESSERA_CHECK(world_size % others == 0, "parallelism: data_parallel_replicate_degree ", dp_replicate,
                  " x tensor_parallel_degree ", tp, " x pipeline_parallel_degree ", pp, cp_term, " = ", others,
                  " does not divide the world size ", world_size,
                  ", so data_parallel_shard_degree = -1 cannot be inferred");
    dp_shard = world_size / others;
  }
  positive(dp_shard, "data_parallel_shard_degree");
  TESSERA_CHECK(others * dp_shard == world_size, "parallelism: data_parallel_replicate_degree ", dp_replicate,
                " x data_parallel_shard_degree ", dp_shard, " x tensor_parallel_degree ", tp,
                " x pipeline_parallel_degree ", pp, cp_term, " = ", others * dp_shard, ", but the world has ",
                world_size, " ranks");
  return MeshShape{static_cast<int>(pp), static_cast<int>(dp_replicate), static_cast<int>(dp_shard),
                   static_cast<int>(tp), static_cast<int>(cp)};
}

class DeviceMesh {
 public:
  /// Every rank of `world` must construct it (the splits are collective).
  DeviceMesh(Communicator world, MeshShape shape) : world_(std::move(world)), shape_(shape) {
    TESSERA_CHECK(shape.world() == world_.size(), "DeviceMesh ", shape.str(), " needs ", shape.world(),
                  " ranks, the world has ", world_.size());
    const int r = world_.rank(), T = shape.tp, C = shape.cp, S = shape.dp_shard, R = shape.dp_replicate;
    tp_rank_ = r % T;
    cp_rank_ = (r / T) % C;
    shard_rank_ = (r / (T * C)) % S;
    replicate_rank_ = (r / (T * C * S)) % R;
    pp_rank_ = r / (T * C * S * R);
    // Each dimension's ranks differ in its coordinate alone: a digit of the world rank
    // (tp fastest), so each communicator is a strided split of the world; the joint ones
    // span adjacent digits. Without context parallelism they are the ones without it.
    tp_ = world_.split_strided(1, T).named("tp");
    cp_ = world_.split_strided(T, C).named("cp");
    dp_shard_ = world_.split_strided(T * C, S).named("dp_shard");
    dp_replicate_ = world_.split_strided(T * C * S, R).named("dp_replicate");
    pp_ = world_.split_strided(T * C * S * R, shape.pp).named("pp");
    dp_ = world_.split_strided(T * C, S * R).named("dp");
    dp_shard_cp_ = C == 1 ? dp_shard_ : world_.split_strided(T, C * S).named("dp_shard_cp");
    dp_cp_ = C == 1 ? dp_ : world_.split_strided(T, C * S * R).named("dp_cp");
  }

  /// One rank alone.
  DeviceMesh() : DeviceMesh(Communicator(), MeshShape{}) {}

  const MeshShape& shape() const { return shape_; }
  Communicator& world() { return world_; }
  Communicator& pp() { return pp_; }
  Communicator& dp_replicate() { return dp_replicate_; }
  Communicator& dp_shard() { return dp_shard_; }
  Communicator& tp() { return tp_; }
  Communicator& dp() { return dp_; }
  Communicator& cp() { return cp_; }
  /// The ranks FSDP shards parameters over: dp_shard x cp.
  Communicator& dp_shard_cp() { return dp_shard_cp_; }
  /// The ranks whose losses make the step's: dp_replicate x dp_shard x cp.
  Communicator& dp_cp() { return dp_cp_; }

  int rank() const { return world_.rank(); }
  int pp_rank() const { return pp_rank_; }
  int dp_replicate_rank() const { return replicate_rank_; }
  int dp_shard_rank() const { return shard_rank_; }
  int tp_rank() const { return tp_rank_; }
  int cp_rank() const { return cp_rank_; }
  /// This rank's slice of the global batch, and how many slices there are.
  int dp_rank() const { return replicate_rank_ * shape_.dp_shard + shard_rank_; }
  int dp_degree() const { return shape_.dp(); }

 private:
  Communicator world_;
  MeshShape shape_;
  int pp_rank_ = 0, replicate_rank_ = 0, shard_rank_ = 0, cp_rank_ = 0, tp_rank_ = 0;
  Communicator pp_, dp_replicate_, dp_shard_, cp_, tp_, dp_, dp_shard_cp_, dp_cp_;
};

}  // namespace tessera::comm
