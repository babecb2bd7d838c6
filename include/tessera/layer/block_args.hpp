// What a model hands each block it builds, and what a block says of itself: the seam
// between the model (nn/transformer.hpp), the policies that wrap its blocks (parallel/)
// and a user's own block type. It names the run-time layout and the tensor-parallel
// group by declaration only, so the policies can wrap a block without knowing the model
// and a block can be written without including the policies.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/backend/backend.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"

namespace tessera::parallel {
struct Plan;                // parallel/plan.hpp: what the parallel policies read at run time
class TensorParallelGroup;  // parallel/tensor_parallel.hpp: the ranks a block splits over
}  // namespace tessera::parallel

namespace tessera::nn {

template <class T, Backend B>
class RopeTable;  // nn/rope.hpp: the rotary angles every block of a model shares

/// A layer that splits its heads and hidden units over BlockArgs::tp and takes its
/// input as that group's rows (parallel/tensor_parallel.hpp).
template <class L>
concept TensorParallelLayer = Layer<L> && requires {
  { L::tensor_parallel } -> std::convertible_to<bool>;
  requires L::tensor_parallel;
};

/// torchtitan's init std for a block's output projections (wo, w2, w3).
inline double output_init_std(const ModelArgs& a, std::int64_t layer_id) {
  double depth = a.depth_init ? 2.0 * static_cast<double>(layer_id + 1) : 2.0 * static_cast<double>(a.n_layers);
  return 0.02 / std::sqrt(depth);
}

/// What the model hands each block's constructor; a user block takes the same.
template <class T, Backend B>
struct BlockArgs {
  const ModelArgs& model;
  std::int64_t layer_id;
  std::string name;  // "layers.<layer_id>"
  std::shared_ptr<RopeTable<T, B>> rope;
  const parallel::Plan* plan = nullptr;  // the run-time layout; nullptr: one rank, no checkpointing
  /// The tensor-parallel group the block splits its heads and hidden units over, and
  /// whose ranks each hold some of the rows x has (nullptr: degree 1). A block that
  /// can split says so with `static constexpr bool tensor_parallel = true`.
  parallel::TensorParallelGroup* tp = nullptr;
};

}  // namespace tessera::nn
