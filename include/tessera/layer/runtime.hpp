// The seam between a model and the runtime that lays it out over ranks.
//
// A model (nn::Transformer, or a user's own) is its layers and their order: it walks
// them forward and backward and says where it is. Its runtime decides which of those
// layers this rank builds, where the parameters' values live (whole, tensor-parallel
// pieces, data-parallel shards), when each sharding unit is gathered, prefetched,
// reduced and freed around the walk, and how a pipeline schedule runs the model's
// stages. The block type chooses the runtime: RuntimeOf<Block>::type. A block wrapped
// in tessera::Parallel brings parallel::ModelRuntime (parallel/model_runtime.hpp); a
// bare block runs on one rank (OneRank, here), whose every step is a no-op.
//
// What a model asks of its runtime (OneRank below is the whole list, each member its
// one-rank answer):
//   Runtime(args, plan)          lays the model out, before its parts are made: layout()
//                                says which blocks, and whether the embedding and the head,
//                                this rank builds; tensor_parallel_comm(args, options) the
//                                group the layers split over (nullptr at degree 1), once the
//                                model's parts and its blocks (given their own options) can
//                                split over it; context_parallel_comm() the group each
//                                sequence is split over (nullptr at degree 1)
//   attach(model)                once the parts exist (the data-parallel units)
//   make_storage, shard, sharded, for_each_held_stretch, for_each_local_parameter,
//   with_whole_parameters, add_owned_gradients, sum_over_world
//                                where the parameters' values live, as the model's callers
//                                see them, and the gradient norm's share of each rank
//   begin_step, embedding_forward_done, before_block_forward, before_head,
//   head_backward_done, before_block_backward, block_backward_done,
//   before_embedding_backward, embedding_backward_done
//                                the points of a step's walk, in the order the model
//                                passes them; gather_embedding, embedding_done,
//                                gather_head, head_done: inference's
//   units_active, update_in_backward, updates_in_backward, updated_squared_norm
//                                the early step: each sharding unit updated as its gradient
//                                is reduced (none here: no units)
//   pipelines, pipeline_degree, stages_per_rank, microbatch_size, pipeline_wait_seconds
//                                a pipeline's shape; where `pipelines` is true, also
//                                pipeline_forward_backward, pipeline_loss, stages, schedule
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/init.hpp"

namespace tessera::nn {

/// The parts of a model one rank builds: the global ids of its blocks, in order, and
/// whether it holds the embedding and the head (final norm + output).
struct StackLayout {
  std::vector<std::int64_t> layer_ids;
  bool embedding = true;
  bool head = true;

  static StackLayout whole(std::int64_t n_layers) {
    StackLayout l;
    for (std::int64_t i = 0; i < n_layers; ++i) l.layer_ids.push_back(i);
    return l;
  }
};

/// The early step's update (optimizer.early_step_in_backward; parallel/model_units.hpp):
/// called with one sharding unit's local parameters, whose gradients are final; `group`
/// names the unit, the same every step.
template <class T>
using UnitUpdate = std::function<void(std::span<Parameter<T>* const> params, const void* group)>;

/// The runtime of a model whose blocks carry no parallelism policy: every layer on this
/// rank, every parameter whole, nothing gathered or reduced.
class OneRank {
 public:
  static constexpr bool pipelines = false;

  /// `plan`: a parallel::Plan; a mesh of more than one rank needs policies on the block.
  template <class Plan>
  OneRank(const ModelArgs& args, const Plan& plan)
      : layout_(StackLayout::whole(args.n_layers)), allocated_(!DeferParameterStorage::active()) {
    const int ranks = plan.mesh ? plan.mesh->world().size() : 1;
    TESSERA_CHECK(ranks == 1, "model: a mesh of ", ranks,
                  " ranks, but the block type has no parallelism policy (wrap it in tessera::Parallel<Block, "
                  "tessera::Sharding<...>, ...>)");
  }

  const StackLayout& layout() const { return layout_; }
  template <class Options>
  std::nullptr_t tensor_parallel_comm(const ModelArgs&, const Options&) const {
    return nullptr;
  }
  std::nullptr_t context_parallel_comm() const { return nullptr; }

  template <class Model>
  void attach(Model&) {}

  // Where the values are: whole, on this rank (made without storage only inside a
  // DeferParameterStorage scope, then allocated zeroed when first reached).
  template <class Model>
  void make_storage(Model& m) {
    if (allocated_) return;
    m.visit_parameters([](auto& p) { p.template allocate<typename Model::backend_type>(p.whole); });
    allocated_ = true;
  }
  template <class Model>
  void shard(Model& m) {
    make_storage(m);
  }
  bool sharded() const { return allocated_; }
  template <class Model, class F>
  void for_each_held_stretch(Model& m, F&& f) {
    make_storage(m);
    m.visit_parameters([&](auto& p) { f(p, ops::PieceIndex{}, p.numel(), p, std::int64_t{0}, true); });
  }
  template <class Model, class F>
  void for_each_local_parameter(Model& m, F&& f) {
    m.for_each_parameter(f);
  }
  template <class Model, class F>
  void with_whole_parameters(Model&, F&& f) {
    f();
  }
  template <class Model, class Norms>
  void add_owned_gradients(Model& m, Norms& norms) {
    m.for_each_parameter([&](auto& p) {
      if (p.split.owner) norms.add(p.grad);
    });
  }
  void sum_over_world(double*) const {}

  // The early step: no sharding units to update.
  bool units_active() const { return false; }
  template <class Update>
  void update_in_backward(Update&&) {}
  bool updates_in_backward() const { return false; }
  template <class Model>
  void updated_squared_norm(Model&, double*) {}

  // The walk: nothing to gather or reduce.
  template <class Model>
  void begin_step(Model&, bool) {}
  void embedding_forward_done() {}
  template <class Model>
  void before_block_forward(Model&, std::size_t) {}
  template <class Model>
  void before_head(Model&) {}
  void head_backward_done(bool) {}
  template <class Model>
  void before_block_backward(Model&, std::size_t) {}
  template <class Model>
  void block_backward_done(Model&, std::size_t) {}
  void before_embedding_backward() {}
  template <class Model>
  void embedding_backward_done(Model&, bool) {}
  void gather_embedding() {}
  void embedding_done(bool) {}
  void gather_head() {}
  void head_done(bool) {}

  int pipeline_degree() const { return 1; }
  int stages_per_rank() const { return 1; }
  double pipeline_wait_seconds() const { return 0; }
  std::int64_t microbatch_size(std::int64_t batch) const { return batch; }

 private:
  StackLayout layout_;
  bool allocated_;
};

/// The runtime a model of `Block`s runs under; tessera::Parallel specialises it.
template <class Block>
struct RuntimeOf {
  using type = OneRank;
};

}  // namespace tessera::nn
