// The Llama model: token embedding, a stack of blocks, final norm, output head and loss.
//
// Transformer<T, B, Block> takes any Block satisfying the Layer concept and
// constructible from BlockArgs, so a user's own block type gets the same model,
// trainer and policies. One training micro-step is
//   h = embed(ids) -> block_0 ... block_{L-1} -> norm -> fused head + loss (+ dh)
//   then norm, blocks (in reverse) and embedding backward,
// each block's saved activations released as soon as its backward ran.
//
// Data parallelism: when Block is a tessera::Parallel with a Sharding policy, the
// model's outer units (the embedding; norm + output) are sharded the same way, and
// this loop drives the order: each unit is gathered before it runs, the next unit's
// gather is prefetched while the current one computes (forward and backward), and
// each unit's gradient reduction is issued when its backward ends and completed while
// the next unit's backward runs (freeing its whole gradient).
//
// Parameter storage: on a parallel plan the model is made without any (nn::
// DeferParameterStorage), and init_weights() allocates and initialises this rank's
// share only (its stages' parameters, their tensor-parallel pieces, its data-parallel
// shards of those), each element from (seed, name, index in the whole): no rank ever
// holds the whole model, and the values are bitwise a one-rank model's. Reaching the
// parameters before that (for_each_parameter: a load, a user's own values) makes them
// whole, as on one rank, and shard() then keeps this rank's share.
//
// Tensor parallelism: when Block is a tessera::Parallel with a TensorParallel policy,
// the blocks split their heads and hidden units over the mesh's tp group, the hidden
// state between them is split by rows (sequence parallelism), the embedding and the
// output by vocabulary, and the loss is computed without gathering the logits
// (parallel/tensor_parallel.hpp). shard() keeps each parameter's tensor-parallel
// piece first, then its data-parallel shard of those pieces.
//
// Pipeline parallelism: when Block carries a Pipeline policy, the model is cut into
// stages (parallel/stages.hpp; the embedding and the output count as one layer each),
// stage s on pipeline rank s % P, and this rank builds only its stages. A micro-batch
// from the trainer is cut into pipeline microbatches; the model gives its stages
// (PipelineStages: a stage's forward and backward for a microbatch, the head's loss,
// a zero-bubble schedule's deferred weight-gradient work) and the pipeline runtime
// (parallel/pipeline_runner.hpp) walks the schedule's lowered program over them
// (parallel/pipeline_program.hpp): transfers in grouped, untagged send/recv calls that
// follow NCCL's rules. Data-parallel units stay gathered through a pass and are reduced
// once after it.
#pragma once

#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/nn/embedding.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/nn/rope.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/parallel/host_values.hpp"
#include "tessera/parallel/pipeline_program.hpp"
#include "tessera/parallel/pipeline_runner.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/sharding.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

namespace detail {
/// The sharding a block type applies under a plan: a Parallel wrapper says; a bare block none.
template <class Block>
parallel::ShardingMode block_sharding(const parallel::Plan& plan) {
  if constexpr (requires { Block::sharding_mode(plan); })
    return Block::sharding_mode(plan);
  else
    return parallel::ShardingMode::none;
}

/// The tensor-parallel degree a block type applies under a plan (a bare block: 1).
template <class Block>
int block_tensor_parallel(const parallel::Plan& plan) {
  if constexpr (requires { Block::tensor_parallel_degree(plan); })
    return Block::tensor_parallel_degree(plan);
  else
    return 1;
}

/// The pipeline degree a block type applies under a plan (a bare block: 1).
template <class Block>
int block_pipeline(const parallel::Plan& plan) {
  if constexpr (requires { Block::pipeline_degree(plan); })
    return Block::pipeline_degree(plan);
  else
    return 1;
}

/// The layer a Pipeline wrapper wraps (the type whole copies of remote stages are made of).
template <class Block>
struct bare_block {
  using type = Block;
};
template <class Block>
  requires requires { typename Block::block_type; }
struct bare_block<Block> {
  using type = typename Block::block_type;
};

/// The plan's tp communicator, once the block type, the mesh and the model agree on the degree.
template <class Block>
comm::Communicator* tensor_parallel_comm(const ModelArgs& args, const parallel::Plan& plan) {
  const int mesh_tp = plan.tp_degree();
  const int block_tp = block_tensor_parallel<Block>(plan);
  TESSERA_CHECK(block_tp == mesh_tp || block_tp == 1, "model: the blocks' tessera::TensorParallel<", block_tp,
                "> on a mesh whose tensor_parallel_degree is ", mesh_tp);
  TESSERA_CHECK(mesh_tp == 1 || block_tp > 1, "parallelism.tensor_parallel_degree = ", mesh_tp,
                ": the block type has no tessera::TensorParallel policy (wrap it in tessera::Parallel<Block, "
                "tessera::TensorParallel<tessera::dynamic>, ...>)");
  parallel::check_tensor_parallel(args, mesh_tp, plan.loss_parallel);
  return mesh_tp > 1 ? &plan.mesh->tp() : nullptr;
}
}  // namespace detail

/// Fills `n` values at `out` (in B's memory) with elements where(0), ..., where(n - 1)
/// of parameter p as its Init makes them from (seed, p.name, element index in the
/// whole) only: one launch of ops::InitValues on B, so the values are made where they
/// live and are bitwise the same on every backend and in every layout.
template <Backend B, class T>
void init_parameter(const Parameter<T>& p, std::uint64_t seed, T* out, std::int64_t n, ops::PieceIndex where = {}) {
  const Init& in = p.init;
  ops::InitKind kind = ops::InitKind::zeros;
  switch (in.kind) {
    case Init::Kind::ones: kind = ops::InitKind::ones; break;
    case Init::Kind::zeros: kind = ops::InitKind::zeros; break;
    case Init::Kind::normal: kind = ops::InitKind::normal; break;
    case Init::Kind::truncated_normal: kind = ops::InitKind::truncated_normal; break;
  }
  B::for_each(n, ops::InitValues<T>{out, parameter_key(seed, p.name), kind, in.std, in.lo, in.hi, where});
}

template <class T, Backend B, class Block = LlamaBlock<T, B>>
class Transformer {
  using Unit = parallel::ShardedUnit<T, B>;

  static_assert(Layer<Block>, "tessera::nn::Transformer<T, B, Block>: Block must satisfy tessera::nn::Layer "
                              "(forward, backward over a Context, for_each_parameter)");
  static_assert(std::is_constructible_v<Block, const BlockArgs<T, B>&>,
                "tessera::nn::Transformer<T, B, Block>: Block must be constructible from tessera::nn::BlockArgs<T, B>");

 public:
  using scalar_type = T;
  using backend_type = B;
  using block_type = Block;
  using A = accum_t<T>;  // gradients, statistics and logits: fp32 for bf16

  /// On a parallel plan (a mesh of more than one rank) the parameters are made
  /// without storage: init_weights() gives this rank its share only.
  explicit Transformer(const ModelArgs& args, const parallel::Plan& plan = {})
      : Transformer(args, plan, DeferParameterStorage(plan.mesh != nullptr && plan.mesh->world().size() > 1)) {}

 private:
  // The scope is a temporary of the delegating constructor's call: it lives until this
  // one has finished, so every parameter the members and the body make sees it.
  Transformer(const ModelArgs& args, const parallel::Plan& plan, const DeferParameterStorage&);

 public:
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelArgs& args() const { return args_; }
  const parallel::Plan& plan() const { return plan_; }

  /// Every parameter this rank holds once, in a fixed order: embedding, blocks, norm,
  /// output (in a pipeline, those of its stages; inside with_whole_parameters, all).
  /// On a model without storage yet (a parallel plan's, before init_weights or shard)
  /// the parameters are first made whole and zeroed, as on one rank: for a load, or
  /// values set by hand, before shard().
  template <class F>
  void for_each_parameter(F&& f) {
    if (storage_ == Storage::none) make_whole();
    visit_parameters(f);
  }

  /// Initialises every parameter this rank holds from (seed, name, element index in
  /// the whole parameter): torchtitan's initialisers, bitwise the same values in every
  /// layout and on every backend. On a model without storage yet, allocates this rank's
  /// share only and initialises it in place: the model is sharded on return.
  void init_weights(std::uint64_t seed);

  /// n consecutive parameter values this rank holds: elements where(0), ...,
  /// where(n - 1) of `param`'s whole, stored from `offset` of the local parameter
  /// `local` (for_each_local_parameter's: `param` itself, or the flat shard holding this
  /// part of it), so at the same offset of its gradient and its optimizer state.
  struct HeldStretch {
    Parameter<T>* param;
    ops::PieceIndex where;
    std::int64_t n;
    Parameter<T>* local;
    std::int64_t offset;
    /// Whether this rank is the one to save these values: each element of the model has
    /// exactly one writer over the world (the first data-parallel replica, the first
    /// tensor-parallel holder, the pipeline rank of its stage).
    bool writer;
    T* values() const { return local->value.data() + offset; }
  };

  /// Calls f(const HeldStretch&) for every stretch of parameter values this rank holds,
  /// in a fixed order; a model without storage is given its share (zeroed) first.
  /// Together the stretches cover each parameter of this rank's stages once.
  template <class F>
  void for_each_held_stretch(F&& f) {
    if (storage_ == Storage::none) allocate_share();
    if (storage_ == Storage::whole) {
      // Every rank of a stage holds it whole: the first of its tp and dp groups writes.
      const bool first = !plan_.mesh || (plan_.mesh->tp_rank() == 0 && plan_.mesh->dp_rank() == 0);
      visit_parameters([&](Parameter<T>& p) { f(HeldStretch{&p, ops::PieceIndex{}, p.numel(), &p, 0, first}); });
      return;
    }
    if (units_)
      for_each_unit([&](Unit& u) {
        u.for_each_held_stretch([&](Parameter<T>& p, std::int64_t first, std::int64_t n, Parameter<T>& local,
                                    std::int64_t offset) {
          f(HeldStretch{&p, parallel::piece_index(p, first), n, &local, offset, u.first_replica() && p.split.owner});
        });
      });
    else
      visit_parameters([&](Parameter<T>& p) {
        f(HeldStretch{&p, parallel::piece_index(p, 0), p.numel(), &p, 0, p.split.owner});
      });
  }

  /// Keeps this rank's share of every parameter: its tensor-parallel piece, then its
  /// data-parallel shard; a no-op on one rank. After a load (or any whole values, the
  /// same on every rank); on a model without storage yet, allocates the share zeroed.
  void shard();
  bool sharded() const {
    return storage_ == Storage::share || (storage_ == Storage::whole && !units_ && !tp_.active());
  }

 private:
  /// for_each_parameter without making storage.
  template <class F>
  void visit_parameters(F&& f) {
    if (!whole_.empty()) {
      for (auto& p : whole_) f(*p);
      return;
    }
    if (has_embedding_) tok_embeddings_.for_each_parameter(f);
    for (auto& l : layers_) l.for_each_parameter(f);
    if (has_head_) {
      norm_.for_each_parameter(f);
      if (output_) f(*output_);
    }
  }

  /// Where the parameters' values are.
  enum class Storage : std::uint8_t {
    none,   // made without storage (a parallel plan), nothing allocated yet
    whole,  // every parameter whole (one rank; or made whole for a load, before shard())
    share,  // this rank's share: tensor-parallel pieces, data-parallel shards
  };

  /// none -> whole: every parameter this rank holds, whole and zeroed.
  void make_whole() {
    visit_parameters([](Parameter<T>& p) { p.template allocate<B>(p.whole); });
    storage_ = Storage::whole;
  }

  /// none -> share: this rank's pieces and shards, zeroed, never the whole.
  void allocate_share() {
    if (units_)
      for_each_unit([](Unit& u) { u.shard(); });  // every parameter belongs to a unit then
    else
      visit_parameters([](Parameter<T>& p) { p.template allocate<B>(p.piece_shape()); });
    storage_ = Storage::share;
  }

 public:
  /// The parameters this rank updates: flat shards under FSDP/HSDP, else the parameters.
  template <class F>
  void for_each_local_parameter(F&& f) {
    if (!units_) return for_each_parameter(f);
    for_each_unit([&](Unit& u) { u.for_each_local_parameter(f); });
  }

  /// The first step's one-time work, done ahead of it: the rotary tables for sequences
  /// of `seq_len` and the gradient norm's table of pieces. A step after it does what every
  /// later step does (Trainer::prepare; the dry run traces such a step).
  void prepare(std::int64_t seq_len);

  void zero_grad();

  /// The L2 norm of the whole gradient, over every piece and shard of every rank
  /// (every rank gets the same value). Each rank sums the squares of the elements it
  /// owns (its shard; the first replica; the first holder of a tensor-parallel piece),
  /// and the sum over the world counts every element once.
  double grad_norm();

  /// Runs f() with every parameter whole on every rank (for saving): gathers the
  /// data-parallel shards and tensor-parallel pieces, and in a pipeline brings every
  /// stage's parameters to every rank; then frees them again. A collective.
  template <class F>
  void with_whole_parameters(F&& f) {
    for_each_unit([](Unit& u) { u.unshard(); });
    std::vector<std::pair<Parameter<T>*, Tensor<T>>> pieces;
    auto restore = [&] {
      whole_.clear();
      for (auto& [p, piece] : pieces) p->value = piece;
      for_each_unit([](Unit& u) { u.reshard(); });
    };
    try {
      if (tp_.active())
        for_each_parameter([&](Parameter<T>& p) {
          if (!p.split.split()) return;
          Tensor<T> whole = parallel::gather_whole<B>(tp(), p);
          pieces.emplace_back(&p, std::exchange(p.value, whole));
        });
      if (pp_ > 1) gather_stages();
      f();
    } catch (...) {
      restore();
      throw;
    }
    restore();
  }

  /// The parameters of the stages this rank holds, each counted whole (every
  /// parameter on one rank), whatever share this rank holds.
  std::int64_t num_params();

  /// Forward and backward of one micro-batch; accumulates gradients of
  /// loss_scale * (sum of token losses) and returns this rank's sum of token losses.
  /// `last_micro_batch`: the step's last (DDP reduces its gradients after it). On
  /// return every gradient reduction has completed.
  double forward_backward(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
                          double loss_scale, bool last_micro_batch = true);

  /// Sum of token losses, no gradients and nothing saved.
  double loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g);

  /// Logits (batch * seq_len, vocab) at every position, on the host, in accum_t<T>
  /// (fp32 for bf16); for evaluation and checks on small inputs (a whole (rows, vocab)
  /// matrix is made at once).
  Tensor<A> logits(std::span<const std::int32_t> inputs, Geometry g);

  /// Logits (batch, vocab) at the last position of each sequence, on the host, in accum_t<T>.
  Tensor<A> last_logits(std::span<const std::int32_t> inputs, Geometry g);

  /// Seconds this rank waited for another stage's activations or gradients during the
  /// last pipelined forward_backward: its share of the pipeline bubble, measured.
  double pipeline_wait_seconds() const { return pipeline_wait_seconds_; }

  /// Peak bytes of saved activations during the last forward_backward (checkpoint
  /// stashes and recomputes included).
  std::size_t saved_activation_bytes() const { return saved_bytes_peak_; }

  /// The name of every parameter of the whole model, in order, whichever stages this
  /// rank holds (a loader checks a file's tensors against these).
  std::vector<std::string> parameter_names() const;

  /// The i-th block this rank holds (in a pipeline, of its stages: see layer_id).
  Block& layer(std::size_t i) { return layers_.at(i); }
  std::size_t n_layers() const { return layers_.size(); }
  std::int64_t layer_id(std::size_t i) const { return layer_ids_.at(i); }

  /// Pipeline: the degree, stages per rank, every stage's range, and the schedule (its
  /// action lists) a micro-batch of `microbatches` pipeline microbatches runs by.
  int pipeline_degree() const { return pp_; }
  int stages_per_rank() const { return stages_per_rank_; }

  /// Checks, before anything runs, that a data-parallel rank's batch of `batch`
  /// sequences of `seq_len` tokens can go through this model's layout: its rows split
  /// over the tensor-parallel ranks, and in a pipeline, the microbatch size divides it
  /// and the schedule runs that many microbatches. Throws naming the keys.
  void check_batch(std::int64_t batch, std::int64_t seq_len) const;
  const std::vector<parallel::StageRange>& stages() const { return stages_; }
  const parallel::Schedule& schedule(int microbatches) {
    auto it = schedules_.find(microbatches);
    if (it == schedules_.end())
      it = schedules_.emplace(microbatches, parallel::make_schedule(schedule_kind_, pp_, stages_per_rank_, microbatches))
               .first;
    return it->second;
  }

 private:
  /// Adds to norms_ the gradient elements this rank counts in the global norm.
  void add_owned_gradients() {
    if (units_)
      for_each_unit([&](Unit& u) { u.add_owned_gradient(norms_); });
    else
      for_each_parameter([&](Parameter<T>& p) {
        if (p.split.owner) norms_.add(p.grad);
      });
  }

  void check_geometry(std::span<const std::int32_t> inputs, Geometry g) const {
    TESSERA_CHECK(g.batch > 0 && g.seq_len > 0 && static_cast<std::int64_t>(inputs.size()) == g.rows(), "model: ",
                  inputs.size(), " tokens for a batch of ", g.batch, " x ", g.seq_len);
    TESSERA_CHECK(!tp_.sequence_parallel() || g.rows() % tp_.degree() == 0, "model: a batch of ", g.batch, " x ",
                  g.seq_len, " = ", g.rows(), " tokens does not split into rows over ", tp_.degree(),
                  " tensor-parallel ranks");
    TESSERA_CHECK(g.seq_len <= args_.max_seq_len, "model: seq_len ", g.seq_len, " exceeds max_seq_len ",
                  args_.max_seq_len);
  }

  /// The final normed hidden state, every row; a sharded model gathers and frees each unit in turn.
  /// With a sharded model every rank must call it together. The head's parameters stay
  /// gathered afterwards, for the logits; free_head() frees them.
  Tensor<T> final_hidden(std::span<const std::int32_t> inputs, Geometry g) {
    check_geometry(inputs, g);
    TESSERA_CHECK(sharded(), "model: inference before shard() on a parallel plan");
    TESSERA_CHECK(pp_ == 1, "model: logits of a pipelined model: take them from a whole copy (made inside "
                            "with_whole_parameters), as llama-train samples");
    if (embedding_unit_) embedding_unit_->unshard();
    Tensor<T> h = tok_embeddings_.forward(inputs);
    if (embedding_unit_ && !args_.tie_embeddings) embedding_unit_->reshard();
    for (auto& l : layers_) h = l.forward(Context<T>(g, nullptr), h);
    if (head_unit_) head_unit_->unshard();
    return parallel::whole_rows<B>(tp(), norm_.forward(Context<T>(g, nullptr), h));
  }

  /// Frees what final_hidden left gathered for the head.
  void free_head() {
    if (!head_unit_) return;
    head_unit_->reshard();
    if (args_.tie_embeddings) embedding_unit_->reshard();
  }

  static Unit* unit_of(Block& b) {
    if constexpr (requires { b.unit(); })
      return b.unit();
    else
      return nullptr;
  }

  /// The tensor-parallel group the layers split over, or nullptr at degree 1.
  parallel::TensorParallelGroup* tp() { return tp_.active() ? &tp_ : nullptr; }

  void prefetch(Unit* u) {
    if (u && plan_.prefetch) u->prefetch();
  }

  template <class F>
  void for_each_unit(F&& f) {
    if (!units_) return;
    if (embedding_unit_) f(*embedding_unit_);
    for (auto& l : layers_)
      if (Unit* u = unit_of(l)) f(*u);
    if (head_unit_) f(*head_unit_);
  }

  static void release(Parameter<T>& p) {
    p.value.release();
    p.grad.release();
  }

  // ---- pipeline parallelism -------------------------------------------------------

  /// Which stages this rank holds, and so which layers it builds.
  void lay_out_pipeline() {
    const int block_pp = detail::block_pipeline<Block>(plan_);
    const int mesh_pp = plan_.pp_degree();
    TESSERA_CHECK(block_pp == mesh_pp || block_pp == 1, "model: the blocks' tessera::Pipeline<", block_pp,
                  "> on a mesh whose pipeline_parallel_degree is ", mesh_pp);
    TESSERA_CHECK(mesh_pp == 1 || block_pp > 1, "parallelism.pipeline_parallel_degree = ", mesh_pp,
                  ": the block type has no tessera::Pipeline policy (wrap it in tessera::Parallel<Block, "
                  "tessera::Pipeline<tessera::dynamic>, ...>)");
    pp_ = mesh_pp;
    const auto L = static_cast<int>(args_.n_layers);
    if (pp_ == 1) {
      for (int i = 0; i < L; ++i) layer_ids_.push_back(i);
      stages_ = {parallel::StageRange{0, L, true, true}};
      return;
    }
    if constexpr (requires { Block::pipeline_schedule(plan_); }) schedule_kind_ = Block::pipeline_schedule(plan_);
    TESSERA_CHECK(!args_.tie_embeddings, "parallelism.pipeline_parallel_degree = ", pp_, " with tied embeddings (",
                  args_.flavor, "): the embedding and the output live on different stages");
    pp_rank_ = plan_.mesh->pp_rank();
    const int V = parallel::stages_per_rank(schedule_kind_, plan_.pipeline, pp_);
    stages_per_rank_ = V;
    stages_ = parallel::split_stages(L, pp_ * V, plan_.pipeline.split_points);
    for (int s = pp_rank_; s < pp_ * V; s += pp_) {
      const parallel::StageRange& r = stages_[static_cast<std::size_t>(s)];
      for (int i = r.first_block; i < r.end_block; ++i) layer_ids_.push_back(i);
    }
    has_embedding_ = pp_rank_ == 0;
    has_head_ = (pp_ * V - 1) % pp_ == pp_rank_;
    // The schedule's own checks (stages per rank) with the smallest microbatch count it takes.
    parallel::check_schedule_shape(schedule_kind_, pp_, V, parallel::min_microbatches(schedule_kind_, pp_));
  }

  /// The index in layers_ of the first block of stage s (one of this rank's).
  std::size_t first_local_layer(int s) const {
    std::size_t n = 0;
    for (int t = pp_rank_; t < s; t += pp_) n += static_cast<std::size_t>(stages_[static_cast<std::size_t>(t)].blocks());
    return n;
  }

  /// This rank's stages for one pipelined pass, as parallel::run_pipeline walks them
  /// (parallel::PipelineStages): the model's part of a pass. It holds what the stages
  /// keep between a microbatch's forward and backward: each block's saved activations
  /// per (local layer, microbatch), the final norm's, the head's output gradient, and a
  /// zero-bubble backward_input's deferred weight-gradient work. Without `training`
  /// (evaluation) nothing is saved and the head computes the loss only.
  class PipelineStages {
   public:
    using tensor_type = Tensor<T>;

    PipelineStages(Transformer& model, std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                   Geometry microbatch, int microbatches, double loss_scale, bool training)
        : model_(model),
          inputs_(inputs),
          targets_(targets),
          g_(microbatch),
          M_(microbatches),
          loss_scale_(loss_scale),
          training_(training),
          head_grad_(static_cast<std::size_t>(microbatches)),
          deferred_(static_cast<std::size_t>(model.stages_per_rank_ * microbatches)) {
      if (!training) return;
      for (std::size_t i = 0; i < model.layers_.size() * static_cast<std::size_t>(M_); ++i)
        stores_.emplace_back("", &model.meter_);
      for (int m = 0; m < M_; ++m) norm_stores_.emplace_back("norm", &model.meter_);
    }

    /// A tensor of the shape that crosses between stages: this tensor-parallel rank's
    /// rows of a microbatch's hidden state.
    Tensor<T> transfer_buffer() const {
      return B::template empty<T>(Shape{model_.tp_.rows_held(g_.rows()), model_.args_.dim});
    }

    Tensor<T> forward(int s, int m, Tensor<T> x, double& loss) {
      Transformer& t = model_;
      const parallel::StageRange& range = t.stages_[static_cast<std::size_t>(s)];
      if (range.embedding) {
        if (t.embedding_unit_) t.embedding_unit_->unshard();
        x = t.tok_embeddings_.forward(ids(inputs_, m));
        if (!training_ && t.embedding_unit_) t.embedding_unit_->reshard();
      }
      const std::size_t first = t.first_local_layer(s);
      for (std::size_t j = first; j < first + static_cast<std::size_t>(range.blocks()); ++j)
        x = t.layers_[j].forward(Context<T>(g_, training_ ? &store(j, m) : nullptr), x);
      if (!range.output) return x;
      if (!training_) {
        if (t.head_unit_) t.head_unit_->unshard();
        loss += t.head_.forward(parallel::whole_rows<B>(t.tp(), t.norm_.forward(Context<T>(g_, nullptr), x)),
                                ids(targets_, m), A(0), nullptr);
        if (t.head_unit_) t.head_unit_->reshard();
        return {};
      }
      if (t.head_unit_) {
        t.head_unit_->unshard();
        t.head_unit_->begin_grads();
      }
      Tensor<T> hn =
          parallel::whole_rows<B>(t.tp(), t.norm_.forward(Context<T>(g_, &norm_stores_[static_cast<std::size_t>(m)]), x));
      x.release();
      Tensor<T> dhn = B::template empty<T>(hn.shape());
      loss += t.head_.forward(hn, ids(targets_, m), static_cast<A>(loss_scale_), &dhn);
      head_grad_[static_cast<std::size_t>(m)] = t.head_.vocab_parallel() ? parallel::summed_rows<B>(t.tp(), dhn)
                                                                           : parallel::own_rows<B>(t.tp(), dhn);
      return {};
    }

    Tensor<T> backward(int s, int m, Tensor<T> dy, bool defer) {
      Transformer& t = model_;
      const parallel::StageRange& range = t.stages_[static_cast<std::size_t>(s)];
      WeightGradQueue* later = defer ? &queue(s, m) : nullptr;
      if (range.output) {
        auto& norm_store = norm_stores_[static_cast<std::size_t>(m)];
        dy = t.norm_.backward(Context<T>(g_, &norm_store).deferring_weight_grads(later),
                              head_grad_[static_cast<std::size_t>(m)]);
        norm_store.clear();
        head_grad_[static_cast<std::size_t>(m)].release();
      }
      const std::size_t first = t.first_local_layer(s);
      for (std::size_t j = first + static_cast<std::size_t>(range.blocks()); j-- > first;) {
        dy = t.layers_[j].backward(Context<T>(g_, &store(j, m)).deferring_weight_grads(later), dy);
        store(j, m).clear();
      }
      if (!range.embedding) return dy;
      if (t.embedding_unit_) t.embedding_unit_->begin_grads();
      t.tok_embeddings_.backward(ids(inputs_, m), dy);
      return {};
    }

    void backward_weight(int s, int m) {
      WeightGradQueue& q = queue(s, m);
      for (auto& work : q) work();
      q.clear();
    }

    /// Throws if some weight-gradient work was left undone.
    void check_done() const {
      for (const auto& q : deferred_)
        TESSERA_CHECK(q.empty(), "pipeline: the schedule left weight-gradient work undone (a bug in its action list)");
    }

   private:
    std::span<const std::int32_t> ids(std::span<const std::int32_t> all, int m) const {
      const auto rows = static_cast<std::size_t>(g_.rows());
      return all.subspan(static_cast<std::size_t>(m) * rows, rows);
    }
    ActivationStore<T>& store(std::size_t layer, int m) {
      return stores_[layer * static_cast<std::size_t>(M_) + static_cast<std::size_t>(m)];
    }
    WeightGradQueue& queue(int s, int m) {
      return deferred_[static_cast<std::size_t>((s / model_.pp_) * M_ + m)];
    }

    Transformer& model_;
    std::span<const std::int32_t> inputs_, targets_;
    Geometry g_;
    int M_;
    double loss_scale_;
    bool training_;
    std::deque<ActivationStore<T>> stores_;       // (local layer, microbatch)
    std::deque<ActivationStore<T>> norm_stores_;  // per microbatch
    std::vector<Tensor<T>> head_grad_;            // per microbatch: the head's gradient of the final norm's output
    std::vector<WeightGradQueue> deferred_;       // (local stage, microbatch)
  };

  /// One micro-batch through the pipeline: the schedule's program (parallel/
  /// pipeline_program.hpp) run over this rank's stages (parallel/pipeline_runner.hpp).
  /// Data-parallel units stay gathered through the pass and reduce once after it.
  /// Returns the sum of token losses (on every pipeline rank).
  double pipeline_forward_backward(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                                   Geometry g, double loss_scale, bool last_micro_batch) {
    check_batch(g.batch, g.seq_len);
    const std::int64_t mb = plan_.pipeline.microbatch_size;
    const int M = static_cast<int>(g.batch / mb);
    meter_.reset_peak();
    PipelineStages stages(*this, inputs, targets, Geometry{mb, g.seq_len}, M, loss_scale, true);
    const parallel::PipelinePass pass = parallel::run_pipeline<B>(program(M), pp_rank_, plan_.mesh->pp(), stages);
    stages.check_done();
    pipeline_wait_seconds_ = pass.wait_seconds;
    // Every unit ran its last backward of the pass: reduce its gradients, free it.
    for_each_unit([&](Unit& u) {
      u.reduce_grads(last_micro_batch);
      u.reshard();
    });
    for_each_unit([](Unit& u) { u.finish_grads(); });
    saved_bytes_peak_ = meter_.peak();
    return pass.loss;
  }

  /// The sum of token losses without gradients: the whole batch as one microbatch,
  /// forward through every stage in order (parallel::lower_forward).
  double pipeline_loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g) {
    TESSERA_CHECK(sharded(), "model: inference before shard() on a parallel plan");
    if (!forward_program_) {
      forward_program_ = parallel::lower_forward(pp_, stages_per_rank_);
      parallel::check_program(*forward_program_);
    }
    PipelineStages stages(*this, inputs, targets, g, 1, 0.0, false);
    return parallel::run_pipeline<B>(*forward_program_, pp_rank_, plan_.mesh->pp(), stages).loss;
  }

  /// The lowered program of the schedule for `microbatches` microbatches, made and
  /// checked against NCCL's rules (parallel::check_program) before it first runs: once
  /// per process for each schedule shape (parallel::checked_program).
  const parallel::Program& program(int microbatches) {
    auto it = programs_.find(microbatches);
    if (it == programs_.end())
      it = programs_.emplace(microbatches, parallel::checked_program(schedule_kind_, pp_, stages_per_rank_, microbatches))
               .first;
    return *it->second;
  }

  /// The stage (and so the pipeline rank) holding a parameter, by its name.
  int stage_of(const std::string& name) const {
    if (name.rfind("tok_embeddings.", 0) == 0) return 0;
    if (name.rfind("layers.", 0) == 0) {
      const int layer = std::stoi(name.substr(7));
      for (std::size_t s = 0; s < stages_.size(); ++s)
        if (layer >= stages_[s].first_block && layer < stages_[s].end_block) return static_cast<int>(s);
    }
    return static_cast<int>(stages_.size()) - 1;  // norm, output
  }

  /// Makes whole_ every parameter of the model, each broadcast from the pipeline rank
  /// holding it (whose values are whole already). A collective over the pipeline.
  void gather_stages() {
    std::map<std::string, Parameter<T>*> mine;
    for_each_parameter([&](Parameter<T>& p) { mine[p.name] = &p; });
    {
      // A one-rank model of the bare block type names and shapes every parameter.
      Transformer<T, B, typename detail::bare_block<Block>::type> all(args_);
      all.for_each_parameter([&](Parameter<T>& q) {
        q.grad.release();
        whole_.push_back(std::make_unique<Parameter<T>>(std::move(q)));
      });
    }
    for (auto& q : whole_) {
      const int owner = stage_of(q->name) % pp_;
      if (owner == pp_rank_) {
        const Parameter<T>& p = *mine.at(q->name);
        B::for_each(q->numel(), ops::Copy<T>{p.value.data(), q->value.data()});
      }
      plan_.mesh->pp().broadcast(std::span<T>(q->value.data(), static_cast<std::size_t>(q->numel())), owner);
    }
  }

  ModelArgs args_;
  parallel::Plan plan_;
  parallel::TensorParallelGroup tp_;  // before the layers: they point to it
  ActivationMeter meter_;  // before the stores: they report to it until they go
  std::shared_ptr<RopeTable<T, B>> rope_;
  Embedding<T, B> tok_embeddings_;
  std::deque<Block> layers_;  // a deque: blocks never move (a sharding unit points into its block)
  RmsNorm<T, B> norm_;
  std::unique_ptr<Parameter<T>> output_;
  ChunkedCrossEntropyHead<T, B> head_{nullptr};
  std::deque<ActivationStore<T>> stores_;
  std::size_t saved_bytes_peak_ = 0;
  std::unique_ptr<Unit> embedding_unit_, head_unit_;  // with data-parallel sharding
  bool units_ = false;                                // data-parallel units exist
  Storage storage_ = Storage::whole;
  // Pipeline parallelism (degree 1: the one stage is here).
  int pp_ = 1, pp_rank_ = 0, stages_per_rank_ = 1;
  parallel::ScheduleKind schedule_kind_ = parallel::ScheduleKind::one_f_one_b;
  std::vector<parallel::StageRange> stages_;
  std::vector<std::int64_t> layer_ids_;  // the global id of each block held here
  bool has_embedding_ = true, has_head_ = true;
  std::map<int, parallel::Schedule> schedules_;           // by microbatch count
  std::map<int, std::shared_ptr<const parallel::Program>> programs_;  // the schedules lowered, by microbatch count
  std::optional<parallel::Program> forward_program_;      // evaluation's forward-only walk, lowered
  double pipeline_wait_seconds_ = 0;
  optim::SquaredNorms<B, A> norms_;   // the gradient norm's pieces, their table kept between steps
  std::vector<std::unique_ptr<Parameter<T>>> whole_;       // every parameter, inside with_whole_parameters
};

// The members whose bodies reach the whole model (its layers, the collectives, the
// pipeline), defined out of the class: an `extern template` of a model type
// (tessera/instances.hpp) then keeps a file that only calls them from compiling them.

template <class T, Backend B, class Block>
Transformer<T, B, Block>::Transformer(const ModelArgs& args, const parallel::Plan& plan, const DeferParameterStorage&)
    : args_((args.validate(), args)),
      plan_(plan),
      tp_(detail::tensor_parallel_comm<Block>(args, plan), plan.loss_parallel, plan.sequence_parallel),
      rope_(std::make_shared<RopeTable<T, B>>(args.head_dim(), args.rope_theta, args.rope_scaling)),
      tok_embeddings_("tok_embeddings", args.vocab_size, args.dim,
                      args.tie_embeddings ? Init::truncated_normal(0.02) : Init::normal(1.0), tp()),
      norm_("norm", args.dim, args.norm_eps, tp()) {
  storage_ = DeferParameterStorage::active() ? Storage::none : Storage::whole;
  lay_out_pipeline();
  for (std::int64_t i : layer_ids_)
    layers_.emplace_back(BlockArgs<T, B>{args_, i, "layers." + std::to_string(i), rope_, &plan_, tp()});
  if (!args.tie_embeddings) {
    const double std = 1.0 / std::sqrt(static_cast<double>(args.dim));
    output_ = std::make_unique<Parameter<T>>(Parameter<T>::template on<B>(
        "output.weight", Shape{args.vocab_size, args.dim}, Init::truncated_normal(std, -3 * std, 3 * std)));
    // Loss parallelism splits it by vocabulary; without, every rank holds it whole
    // and computes the whole head (the first rank counts it in the gradient norm).
    output_->split = plan.loss_parallel ? tp_.split(0) : tp_.whole();
  }
  head_ = ChunkedCrossEntropyHead<T, B>(output_ ? output_.get() : &tok_embeddings_.weight(),
                                        plan.loss_parallel ? tp() : nullptr);
  if (!has_embedding_) release(tok_embeddings_.weight());
  if (!has_head_) {
    release(norm_.weight());
    if (output_) release(*output_);
  }
  for (std::size_t i = 0; i < layers_.size(); ++i) stores_.emplace_back("", &meter_);
  const parallel::ShardingMode mode = detail::block_sharding<Block>(plan_);
  units_ = mode != parallel::ShardingMode::none || plan_.dp_degree() > 1;
  if (units_) {
    // Tied weights: the head needs the embedding's parameters, so that unit stays
    // gathered from its forward to its backward.
    // In a pipeline, units stay gathered through the pass.
    const bool reshard_embedding =
        pp_ == 1 && plan_.reshard != parallel::Reshard::never && !args.tie_embeddings;
    if (has_embedding_) {
      embedding_unit_ = std::make_unique<Unit>("tok_embeddings", mode, plan_, reshard_embedding);
      tok_embeddings_.for_each_parameter([&](Parameter<T>& p) { embedding_unit_->add(p); });
    }
    if (has_head_) {
      head_unit_ = std::make_unique<Unit>("norm+output", mode, plan_,
                                          pp_ == 1 && plan_.reshard == parallel::Reshard::always);
      norm_.for_each_parameter([&](Parameter<T>& p) { head_unit_->add(p); });
      if (output_) head_unit_->add(*output_);
    }
  }
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::init_weights(std::uint64_t seed) {
  if (storage_ == Storage::none) allocate_share();
  for_each_held_stretch([&](const HeldStretch& h) { init_parameter<B>(*h.param, seed, h.values(), h.n, h.where); });
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::shard() {
  switch (storage_) {
    case Storage::share: return;
    case Storage::none: allocate_share(); return;
    case Storage::whole:
      visit_parameters([](Parameter<T>& p) { parallel::narrow<B>(p); });
      for_each_unit([](Unit& u) { u.shard(); });
      storage_ = Storage::share;
      return;
  }
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::prepare(std::int64_t seq_len) {
  // Only where a block of this rank kept the shared table (a pipeline stage of the
  // embedding or the head alone holds none; a user's block may not rotate).
  if (rope_.use_count() > 1) rope_->ensure(seq_len);
  add_owned_gradients();
  norms_.prepare();
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::zero_grad() {
  for_each_local_parameter([](Parameter<T>& p) { B::for_each(p.numel(), ops::Fill<A>{A(0), p.grad.data()}); });
}

template <class T, Backend B, class Block>
double Transformer<T, B, Block>::grad_norm() {
  add_owned_gradients();
  double s = norms_.sum();
  if (plan_.mesh && plan_.mesh->world().size() > 1) s = parallel::all_reduce_host<B>(plan_.mesh->world(), s);
  return std::sqrt(s);
}

template <class T, Backend B, class Block>
std::int64_t Transformer<T, B, Block>::num_params() {
  std::int64_t n = 0;
  visit_parameters([&](Parameter<T>& p) { n += p.whole.numel(); });
  return n;
}

template <class T, Backend B, class Block>
double Transformer<T, B, Block>::forward_backward(std::span<const std::int32_t> inputs,
                                                  std::span<const std::int32_t> targets, Geometry g,
                                                  double loss_scale, bool last_micro_batch) {
  check_geometry(inputs, g);
  TESSERA_CHECK(sharded(), "model: forward_backward before shard() on a parallel plan");
  if (pp_ > 1) return pipeline_forward_backward(inputs, targets, g, loss_scale, last_micro_batch);
  meter_.reset_peak();
  for (auto& l : layers_)
    if constexpr (requires { l.set_last_micro_batch(true); }) l.set_last_micro_batch(last_micro_batch);

  // Forward: each unit gathered before it runs, the next one's gather in flight.
  if (embedding_unit_) embedding_unit_->unshard();
  prefetch(layers_.empty() ? head_unit_.get() : unit_of(layers_.front()));
  Tensor<T> h = tok_embeddings_.forward(inputs);
  if (embedding_unit_ && embedding_unit_->reshard_after_forward()) embedding_unit_->reshard();
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    prefetch(i + 1 < layers_.size() ? unit_of(layers_[i + 1]) : head_unit_.get());
    h = layers_[i].forward(Context<T>(g, &stores_[i]), h);
  }
  if (head_unit_) {
    head_unit_->unshard();
    head_unit_->begin_grads();
    if (args_.tie_embeddings) embedding_unit_->begin_grads();
  }
  ActivationStore<T> norm_store("norm", &meter_);
  // Under sequence parallelism each rank holds some rows; the head takes them all.
  Tensor<T> hn = parallel::whole_rows<B>(tp(), norm_.forward(Context<T>(g, &norm_store), h));
  h.release();
  Tensor<T> dhn = B::template empty<T>(hn.shape());
  double loss = head_.forward(hn, targets, static_cast<A>(loss_scale), &dhn);
  hn.release();
  // Loss parallelism leaves each rank its vocabulary's share of dhn; else dhn is whole.
  dhn = head_.vocab_parallel() ? parallel::summed_rows<B>(tp(), dhn) : parallel::own_rows<B>(tp(), dhn);

  // Backward, each unit's gradients reduced as soon as it is done.
  Tensor<T> dh = norm_.backward(Context<T>(g, &norm_store), dhn);
  norm_store.clear();
  dhn.release();
  if (head_unit_) {
    head_unit_->reduce_grads(last_micro_batch);
    head_unit_->reshard();
  }
  // One reduction in flight: each unit's completes (and frees its whole gradient)
  // while the next unit's backward runs.
  Unit* reducing = head_unit_.get();
  for (std::size_t i = layers_.size(); i-- > 0;) {
    prefetch(i > 0 ? unit_of(layers_[i - 1]) : embedding_unit_.get());
    dh = layers_[i].backward(Context<T>(g, &stores_[i]), dh);
    stores_[i].clear();
    if (reducing) reducing->finish_grads();
    reducing = unit_of(layers_[i]);
  }
  if (embedding_unit_) {
    embedding_unit_->unshard();
    embedding_unit_->begin_grads();
  }
  tok_embeddings_.backward(inputs, dh);
  if (embedding_unit_) {
    embedding_unit_->reduce_grads(last_micro_batch);
    embedding_unit_->reshard();
    for_each_unit([](Unit& u) { u.finish_grads(); });
  }
  saved_bytes_peak_ = meter_.peak();
  return loss;
}

template <class T, Backend B, class Block>
double Transformer<T, B, Block>::loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                                      Geometry g) {
  if (pp_ > 1) return pipeline_loss(inputs, targets, g);
  const double l = head_.forward(final_hidden(inputs, g), targets, A(0), nullptr);
  free_head();
  return l;
}

template <class T, Backend B, class Block>
auto Transformer<T, B, Block>::logits(std::span<const std::int32_t> inputs, Geometry g) -> Tensor<A> {
  Tensor<A> z = head_.logits(final_hidden(inputs, g));
  free_head();
  return download<B>(z);
}

template <class T, Backend B, class Block>
auto Transformer<T, B, Block>::last_logits(std::span<const std::int32_t> inputs, Geometry g) -> Tensor<A> {
  Tensor<T> hn = final_hidden(inputs, g);
  Tensor<T> last = B::template empty<T>(Shape{g.batch, args_.dim});
  for (std::int64_t b = 0; b < g.batch; ++b)
    B::for_each(args_.dim, ops::Copy<T>{hn.data() + ((b + 1) * g.seq_len - 1) * args_.dim, last.data() + b * args_.dim});
  Tensor<A> z = head_.logits(last);
  free_head();
  return download<B>(z);
}

template <class T, Backend B, class Block>
std::vector<std::string> Transformer<T, B, Block>::parameter_names() const {
  std::vector<std::string> names = {"tok_embeddings.weight"};
  std::vector<std::string> block;  // one block's names, "layers.0." stripped
  {
    const DeferParameterStorage names_only;  // no storage for a block made for its names
    typename detail::bare_block<Block>::type b(BlockArgs<T, B>{args_, 0, "layers.0", rope_, nullptr, nullptr});
    b.for_each_parameter([&](Parameter<T>& p) { block.push_back(p.name.substr(9)); });
  }
  for (std::int64_t i = 0; i < args_.n_layers; ++i)
    for (const auto& n : block) names.push_back("layers." + std::to_string(i) + "." + n);
  names.push_back("norm.weight");
  if (!args_.tie_embeddings) names.push_back("output.weight");
  return names;
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::check_batch(std::int64_t batch, std::int64_t seq_len) const {
  const std::int64_t mb = pp_ > 1 ? plan_.pipeline.microbatch_size : batch;
  if (pp_ > 1) {
    TESSERA_CHECK(mb >= 1 && batch % mb == 0, "parallelism.pipeline_parallel_microbatch_size = ", mb,
                  " does not divide training.local_batch_size = ", batch,
                  " (each data-parallel rank's batch is cut into microbatches of that many sequences)");
    const int M = static_cast<int>(batch / mb);
    parallel::check_schedule_shape(schedule_kind_, pp_, stages_per_rank_, M);
  }
  TESSERA_CHECK(!tp_.sequence_parallel() || (mb * seq_len) % tp_.degree() == 0,
                pp_ > 1 ? "parallelism.pipeline_parallel_microbatch_size" : "training.local_batch_size",
                " x training.seq_len (", mb, " x ", seq_len, " = ", mb * seq_len,
                " tokens) does not split into equal rows over parallelism.tensor_parallel_degree = ", tp_.degree(),
                " ranks");
}


}  // namespace tessera::nn
