// The runtime of a model whose blocks are wrapped in tessera::Parallel (the seam and
// the list of what a model asks of it: layer/runtime.hpp).
//
// It lays the model out before the model makes its parts: the pipeline stages this rank
// holds (model_pipeline.hpp) and the tensor-parallel group the layers split over. Once
// the parts exist it makes the data-parallel units (model_units.hpp) and keeps where
// the parameters' values are:
//   none   made without storage (a parallel plan), nothing allocated yet;
//   whole  every parameter whole (one rank; or made whole for a load, before shard());
//   share  this rank's share: tensor-parallel pieces, then data-parallel shards.
// On a parallel plan a model is made without storage and init_weights() allocates and
// initialises this rank's share only, so no rank ever holds the whole model; reaching
// the parameters before that (a load, a user's own values) makes them whole, and
// shard() then keeps this rank's share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/type_name.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/runtime.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/parallel/host_values.hpp"
#include "tessera/parallel/model_pipeline.hpp"
#include "tessera/parallel/model_units.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::parallel {

/// `Block`: a tessera::Parallel type (its sharding mode, tensor-parallel and pipeline
/// degrees and schedule under a Plan; the block it wraps).
template <class Block>
class ModelRuntime {
  using T = typename Block::scalar_type;
  using B = typename Block::backend_type;
  using Unit = ShardedUnit<T, B>;

 public:
  static constexpr bool pipelines = true;

  /// `plan` is the model's own, which outlives the runtime.
  ModelRuntime(const nn::ModelArgs& args, const Plan& plan)
      : plan_(plan),
        pipeline_(args, plan, Block::pipeline_degree(plan), [&] { return Block::pipeline_schedule(plan); }),
        storage_(nn::DeferParameterStorage::active() ? Storage::none : Storage::whole) {}

  const nn::StackLayout& layout() const { return pipeline_.layout(); }

  /// The plan's tp communicator, once the block type, the mesh and the model agree on the
  /// degree, and the model's parts and its blocks (given `options`) can split over it.
  comm::Communicator* tensor_parallel_comm(const nn::ModelArgs& args,
                                           const nn::block_options_t<Block>& options) const {
    const int mesh_tp = plan_.tp_degree();
    const int block_tp = Block::tensor_parallel_degree(plan_);
    const Wording w = plan_.wording();
    TESSERA_CHECK(block_tp == mesh_tp || block_tp == 1, "model: the blocks' tessera::TensorParallel<", block_tp,
                  "> on a mesh whose ", w.pick("tensor_parallel_degree", "tensor-parallel degree"), " is ", mesh_tp);
    TESSERA_CHECK(mesh_tp == 1 || block_tp > 1, w(settings::tensor_parallel_degree, mesh_tp),
                  ": the block type has no tessera::TensorParallel policy (wrap it in tessera::Parallel<Block, "
                  "tessera::TensorParallel<tessera::dynamic>, ...>)");
    // A static degree is named by its policy, where the number is written; a dynamic one
    // by where the mesh got it.
    using Policy = typename Block::tensor_parallel_policy;
    const nn::TensorParallelDegree degree =
        Policy::dynamic_degree ? mesh_degree(mesh_tp, w)
                               : nn::TensorParallelDegree{mesh_tp, tessera::detail::concat("tessera::TensorParallel<",
                                                                                           mesh_tp, ">")};
    check_tensor_parallel<Block>(args, options, degree, plan_.loss_parallel, w);
    return mesh_tp > 1 ? &plan_.mesh->tp() : nullptr;
  }

  /// The group each sequence is split over (nullptr at degree 1), once the block type is
  /// one that runs on a share of each sequence (nn::ContextParallelLayer).
  comm::Communicator* context_parallel_comm() const {
    const int cp = plan_.cp_degree();
    if (cp == 1) return nullptr;
    TESSERA_CHECK(nn::ContextParallelLayer<nn::bare_block_t<Block>>, plan_.wording()(settings::context_parallel_degree, cp),
                  ": the block type ", type_name<nn::bare_block_t<Block>>(),
                  " does not declare that it runs on part of each sequence (`static constexpr bool context_parallel = "
                  "true`, attending across the ranks of nn::BlockArgs::cp as nn::LlamaBlock does)");
    return &plan_.mesh->cp();
  }

  /// Once the model's parts exist: the embedding's and the head's data-parallel units.
  template <class Model>
  void attach(Model& m) {
    const nn::StackLayout& l = layout();
    units_.attach(m, Block::sharding_mode(plan_), plan_, pipeline_.degree() > 1, l.embedding, l.head);
  }

  // ---- where the values are -------------------------------------------------------

  /// none -> whole: every parameter this rank holds, whole and zeroed.
  template <class Model>
  void make_storage(Model& m) {
    if (storage_ != Storage::none) return;
    m.visit_parameters([](nn::Parameter<T>& p) { p.template allocate<B>(p.whole); });
    storage_ = Storage::whole;
  }

  /// Keeps this rank's share of every parameter: its tensor-parallel piece, then its
  /// data-parallel shard; without storage yet, allocates the share zeroed, never the whole.
  template <class Model>
  void shard(Model& m) {
    switch (storage_) {
      case Storage::share: return;
      case Storage::none:
        if (units_.active())
          units_.for_each(m, [](Unit& u) { u.shard(); });  // every parameter belongs to a unit then
        else
          m.visit_parameters([](nn::Parameter<T>& p) { p.template allocate<B>(p.piece_shape()); });
        break;
      case Storage::whole:
        m.visit_parameters([](nn::Parameter<T>& p) { narrow<B>(p); });
        units_.for_each(m, [](Unit& u) { u.shard(); });
        break;
    }
    storage_ = Storage::share;
  }
  bool sharded() const {
    return storage_ == Storage::share || (storage_ == Storage::whole && !units_.active() && plan_.tp_degree() == 1);
  }

  /// Calls f(param, where, n, local, offset, writer) for every stretch of parameter
  /// values this rank holds (nn::Transformer::HeldStretch says what each is); a model
  /// without storage is given its share (zeroed) first.
  template <class Model, class F>
  void for_each_held_stretch(Model& m, F&& f) {
    if (storage_ == Storage::none) shard(m);
    if (storage_ == Storage::whole) {
      // Every rank of a stage holds it whole: the first of its tp and dp groups writes.
      const bool first = !plan_.mesh || (plan_.mesh->tp_rank() == 0 && plan_.mesh->dp_rank() == 0);
      m.visit_parameters([&](nn::Parameter<T>& p) { f(p, ops::PieceIndex{}, p.numel(), p, std::int64_t{0}, first); });
      return;
    }
    if (units_.active())
      units_.for_each(m, [&](Unit& u) {
        u.for_each_held_stretch([&](nn::Parameter<T>& p, std::int64_t first, std::int64_t n, nn::Parameter<T>& local,
                                    std::int64_t offset) {
          f(p, piece_index(p, first), n, local, offset, u.first_replica() && p.split.owner);
        });
      });
    else
      m.visit_parameters([&](nn::Parameter<T>& p) {
        f(p, piece_index(p, 0), p.numel(), p, std::int64_t{0}, p.split.owner);
      });
  }

  /// The parameters this rank updates: flat shards under FSDP/HSDP, else the parameters.
  template <class Model, class F>
  void for_each_local_parameter(Model& m, F&& f) {
    if (!units_.active()) return m.for_each_parameter(f);
    units_.for_each(m, [&](Unit& u) { u.for_each_local_parameter(f); });
  }

  /// Runs f() with every parameter whole on every rank: gathers the data-parallel shards
  /// and tensor-parallel pieces, and in a pipeline brings every stage's parameters to
  /// every rank (into the model's hold_whole); then frees them again. A collective.
  template <class Model, class F>
  void with_whole_parameters(Model& m, F&& f) {
    units_.for_each(m, [](Unit& u) { u.unshard_values(); });
    std::vector<std::pair<nn::Parameter<T>*, Tensor<T>>> pieces;
    auto restore = [&] {
      m.hold_whole({});
      for (auto& [p, piece] : pieces) p->value = piece;
      units_.for_each(m, [](Unit& u) { u.reshard(); });
    };
    try {
      if (plan_.tp_degree() > 1)
        m.for_each_parameter([&](nn::Parameter<T>& p) {
          if (!p.split.split()) return;
          Tensor<T> whole = gather_whole<B>(m.tensor_parallel(), p);
          pieces.emplace_back(&p, std::exchange(p.value, whole));
        });
      if (pipeline_.degree() > 1) {
        std::vector<std::unique_ptr<nn::Parameter<T>>> all = whole_model_parameters(m);
        pipeline_.gather_stages(m, all);
        m.hold_whole(std::move(all));
      }
      f();
    } catch (...) {
      restore();
      throw;
    }
    restore();
  }

  /// Adds to `norms` the gradient elements this rank counts in the global norm: its
  /// shards, on the first replica; the first holder of a tensor-parallel piece.
  template <class Model, class Norms>
  void add_owned_gradients(Model& m, Norms& norms) {
    if (units_.active())
      units_.for_each(m, [&](Unit& u) { u.add_owned_gradient(norms); });
    else
      m.for_each_parameter([&](nn::Parameter<T>& p) {
        if (p.split.owner && !p.frozen) norms.add(p.grad);
      });
  }

  /// *s (B's memory, each rank's own part) summed over every rank of the world, there: a collective on the
  /// device, no host read.
  void sum_over_world(double* s) const {
    if (plan_.mesh && plan_.mesh->world().size() > 1) plan_.mesh->world().all_reduce(std::span<double>(s, 1));
  }

  // ---- the early step (model_units.hpp) ---------------------------------------------

  bool units_active() const { return units_.active(); }
  void update_in_backward(typename ModelUnits<T, B>::Update update) { units_.update_in_backward(std::move(update)); }
  bool updates_in_backward() const { return units_.updates_in_backward(); }
  template <class Model>
  void updated_squared_norm(Model& m, double* out) {
    units_.updated_squared_norm(m, out);
  }

  // ---- a step's walk: the data-parallel units' order ------------------------------

  template <class Model>
  void begin_step(Model& m, bool last_micro_batch) { units_.begin_step(m, last_micro_batch); }
  void embedding_forward_done() { units_.embedding_forward_done(); }
  template <class Model>
  void before_block_forward(Model& m, std::size_t i) { units_.before_block_forward(m, i); }
  template <class Model>
  void before_head(Model& m) { units_.before_head(m.args().tie_embeddings); }
  void head_backward_done(bool last_micro_batch) { units_.head_backward_done(last_micro_batch); }
  template <class Model>
  void before_block_backward(Model& m, std::size_t i) { units_.before_block_backward(m, i); }
  template <class Model>
  void block_backward_done(Model& m, std::size_t i) { units_.block_backward_done(m, i); }
  void before_embedding_backward() { units_.before_embedding_backward(); }
  template <class Model>
  void embedding_backward_done(Model& m, bool last_micro_batch) { units_.embedding_backward_done(m, last_micro_batch); }
  void gather_embedding() { units_.gather_embedding(); }
  void embedding_done(bool tied) { units_.embedding_done(tied); }
  void gather_head() { units_.gather_head(); }
  void head_done(bool tied) { units_.head_done(tied); }

  // ---- the pipeline ---------------------------------------------------------------

  int pipeline_degree() const { return pipeline_.degree(); }
  int stages_per_rank() const { return pipeline_.stages_per_rank(); }
  const std::vector<StageRange>& stages() const { return pipeline_.stages(); }
  const Schedule& schedule(int microbatches) { return pipeline_.schedule(microbatches); }
  double pipeline_wait_seconds() const { return pipeline_.wait_seconds(); }
  std::int64_t microbatch_size(std::int64_t batch) const { return pipeline_.microbatch_size(batch); }

  template <class Model>
  void pipeline_forward_backward(Model& m, std::span<const std::int32_t> inputs,
                                 std::span<const std::int32_t> targets, nn::Geometry g, double loss_scale,
                                 bool last_micro_batch, double* loss_sum) {
    pipeline_.forward_backward(m, units_, inputs, targets, g, loss_scale, last_micro_batch, loss_sum);
  }
  template <class Model>
  double pipeline_loss(Model& m, std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                       nn::Geometry g) {
    return pipeline_.loss(m, units_, inputs, targets, g);
  }

 private:
  /// Every parameter of the whole model, whole and zeroed: a one-rank model of the
  /// wrapped block type names and shapes each (with LoRA's adapters where the model has them).
  template <class Model>
  static std::vector<std::unique_ptr<nn::Parameter<T>>> whole_model_parameters(Model& m) {
    std::vector<std::unique_ptr<nn::Parameter<T>>> all;
    Plan converters;
    converters.lora = m.plan().lora;
    typename Model::template with_block<typename Block::block_type> one_rank(m.args(), converters, m.block_options());
    one_rank.for_each_parameter([&](nn::Parameter<T>& q) {
      q.grad.release();
      all.push_back(std::make_unique<nn::Parameter<T>>(std::move(q)));
    });
    return all;
  }

  enum class Storage : std::uint8_t { none, whole, share };

  const Plan& plan_;
  ModelPipeline<T, B> pipeline_;
  ModelUnits<T, B> units_;
  Storage storage_;
};

}  // namespace tessera::parallel
