// A model cut into pipeline stages: which stages (and so which blocks) this rank holds,
// and a pass of the schedule's lowered program over them.
//
// The model is cut into stages (stages.hpp; the embedding and the output count as one
// layer each unless the plan weighs them otherwise), stage s on pipeline rank s % P (or,
// for ZBVZeroBubble and DualPipeV, down the ranks and back up: schedule_kind.hpp's
// placements; for a schedule file's order, where its rows put them); the rank builds
// only its stages' layers (layout()). A micro-batch from the trainer is cut into
// pipeline microbatches; Stages below gives the runner (pipeline_runner.hpp) this rank's
// stages over the model's parts: a stage's forward and backward for a microbatch, the head's loss, a
// zero-bubble schedule's deferred weight-gradient work. Transfers go in grouped,
// untagged send/recv calls that follow NCCL's rules (pipeline_program.hpp).
// Data-parallel units stay gathered through a pass and are reduced once after it.
//
// A model hands its parts through: embedding(), layer(j) and n_layers(), final_norm(),
// head(), tensor_parallel(), activation_meter(), args().
#pragma once

#include <cstddef>
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
#include "tessera/core/error.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/runtime.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/norm.hpp"
#include "tessera/parallel/model_units.hpp"
#include "tessera/parallel/pipeline_program.hpp"
#include "tessera/parallel/pipeline_runner.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::parallel {

template <class T, Backend B>
class ModelPipeline {
  using A = accum_t<T>;

 public:
  /// Lays out the stages of a model of `args.n_layers` blocks whose block type applies
  /// `block_pp` (1: no Pipeline policy); `schedule_of()` gives its schedule, asked only
  /// at a degree above 1.
  template <class ScheduleOf>
  ModelPipeline(const nn::ModelArgs& args, const Plan& plan, int block_pp, ScheduleOf schedule_of) : plan_(plan) {
    const int mesh_pp = plan.pp_degree();
    const Wording w = plan.wording();
    TESSERA_CHECK(block_pp == mesh_pp || block_pp == 1, "model: the blocks' tessera::Pipeline<", block_pp,
                  "> on a mesh whose ", w.pick("pipeline_parallel_degree", "pipeline degree"), " is ", mesh_pp);
    TESSERA_CHECK(mesh_pp == 1 || block_pp > 1, w(settings::pipeline_parallel_degree, mesh_pp),
                  ": the block type has no tessera::Pipeline policy (wrap it in tessera::Parallel<Block, "
                  "tessera::Pipeline<tessera::dynamic>, ...>)");
    pp_ = mesh_pp;
    const auto L = static_cast<int>(args.n_layers);
    if (pp_ == 1) {
      layout_ = nn::StackLayout::whole(L);
      stages_ = {StageRange{0, L, true, true}};
      return;
    }
    kind_ = schedule_of();
    TESSERA_CHECK(!args.tie_embeddings, w(settings::pipeline_parallel_degree, pp_), " with tied embeddings (",
                  args.flavor, "): the embedding and the output live on different stages");
    rank_ = plan.mesh->pp_rank();
    StageSplit split = pipeline_stages(kind_, plan.pipeline, L, pp_, w);
    const int V = split.per_rank;
    stages_per_rank_ = V;
    stages_ = std::move(split.stages);
    for (int v = 0; v < V; ++v) {
      const StageRange& r = stages_[static_cast<std::size_t>(stage_of_rank(placement(), pp_, rank_, v))];
      for (int i = r.first_block; i < r.end_block; ++i) layout_.layer_ids.push_back(i);
    }
    layout_.embedding = rank_of_stage(placement(), pp_, 0) == rank_;
    layout_.head = rank_of_stage(placement(), pp_, pp_ * V - 1) == rank_;
    // The schedule's own checks (stages per rank) with the smallest microbatch count it
    // takes; a file's rows against the ranks and the stages.
    check_schedule_shape(kind_, pp_, V, min_microbatches(kind_, pp_), w);
    TESSERA_CHECK(!from_file(kind_) || plan.pipeline.table != nullptr, w(settings::schedule), " = ", name_of(kind_),
                  " runs the order of a schedule file, and ", w(settings::schedule_csv), " names none");
    // A table beside a named schedule is refused here too (it lays out its own order).
    if (plan.pipeline.table) check_table_shape(*plan.pipeline.table, kind_, pp_, V, std::nullopt, w);
  }

  const nn::StackLayout& layout() const { return layout_; }
  int degree() const { return pp_; }
  int stages_per_rank() const { return stages_per_rank_; }
  const std::vector<StageRange>& stages() const { return stages_; }
  double wait_seconds() const { return wait_seconds_; }

  /// The schedule (its action lists) a micro-batch of `microbatches` pipeline microbatches runs by.
  const Schedule& schedule(int microbatches) {
    auto it = schedules_.find(microbatches);
    if (it == schedules_.end())
      it = schedules_
               .emplace(microbatches,
                        schedule_for(kind_, plan_.pipeline, pp_, stages_per_rank_, microbatches, plan_.wording()))
               .first;
    return it->second;
  }

  /// The sequences per pipeline microbatch for a data-parallel rank's batch of `batch`
  /// (the batch itself at degree 1). Throws naming the settings when the microbatch size
  /// does not divide it or the schedule cannot run that many microbatches.
  std::int64_t microbatch_size(std::int64_t batch) const {
    if (pp_ == 1) return batch;
    const std::int64_t mb = plan_.pipeline.microbatch_size;
    const Wording w = plan_.wording();
    TESSERA_CHECK(mb >= 1 && batch % mb == 0, w(settings::microbatch_size, mb), " does not divide ",
                  w(settings::local_batch_size, batch),
                  " (each data-parallel rank's batch is cut into microbatches of that many sequences)");
    check_schedule_shape(kind_, pp_, stages_per_rank_, static_cast<int>(batch / mb), w);
    if (from_file(kind_))
      check_table_shape(*plan_.pipeline.table, kind_, pp_, stages_per_rank_, static_cast<int>(batch / mb), w);
    return mb;
  }

  /// One micro-batch through the pipeline: the schedule's program run over this rank's
  /// stages; then every data-parallel unit reduces once. Adds the sum of token losses
  /// to *loss_sum in B's memory (on every pipeline rank), which the host does not read.
  template <class Model>
  void forward_backward(Model& m, ModelUnits<T, B>& units, std::span<const std::int32_t> inputs,
                        std::span<const std::int32_t> targets, nn::Geometry g, double loss_scale,
                        bool last_micro_batch, double* loss_sum) {
    const std::int64_t mb = microbatch_size(g.batch);
    const int M = static_cast<int>(g.batch / mb);
    Tensor<double> pass_sum = B::template zeros<double>(Shape{1});
    Stages<Model> stages(*this, m, units, inputs, targets, g.sequences(0, mb), M, loss_scale, true, pass_sum.data());
    const PipelinePass pass = run_pipeline<B>(program(M), rank_, plan_.mesh->pp(), stages);
    stages.check_done();
    wait_seconds_ = pass.wait_seconds;
    units.reduce_after_pass(m, last_micro_batch);
    sum_over_pipeline(pass_sum);
    B::for_each(1, ops::LaneSum{pass_sum.data(), 1, loss_sum, true});
  }

  /// The sum of token losses without gradients: the whole batch as one microbatch,
  /// forward through every stage in order (lower_forward).
  template <class Model>
  double loss(Model& m, ModelUnits<T, B>& units, std::span<const std::int32_t> inputs,
              std::span<const std::int32_t> targets, nn::Geometry g) {
    if (!forward_program_) {
      forward_program_ = lower_forward(pp_, stages_per_rank_, placement());
      check_program(*forward_program_);
    }
    Tensor<double> sum = B::template zeros<double>(Shape{1});
    Stages<Model> stages(*this, m, units, inputs, targets, g, 1, 0.0, false, sum.data());
    run_pipeline<B>(*forward_program_, rank_, plan_.mesh->pp(), stages);
    sum_over_pipeline(sum);
    return download<B>(sum)[0];
  }

  /// The last stage's loss sum on every pipeline rank (the others add zero): a collective
  /// on the device.
  void sum_over_pipeline(Tensor<double>& sum) { plan_.mesh->pp().all_reduce(std::span<double>(sum.data(), 1)); }

  /// Every parameter of the whole model, each broadcast from the pipeline rank holding
  /// it (whose values are whole already): `all` names and shapes them (a one-rank
  /// model's, with storage). A collective over the pipeline.
  template <class Model>
  void gather_stages(Model& m, std::vector<std::unique_ptr<nn::Parameter<T>>>& all) {
    std::map<std::string, nn::Parameter<T>*> mine;
    m.for_each_parameter([&](nn::Parameter<T>& p) { mine[p.name] = &p; });
    for (auto& q : all) {
      const int owner = rank_of_stage(placement(), pp_, stage_of(q->name));
      if (owner == rank_) {
        const nn::Parameter<T>& p = *mine.at(q->name);
        B::for_each(q->numel(), ops::Copy<T>{p.value.data(), q->value.data()});
      }
      plan_.mesh->pp().broadcast(std::span<T>(q->value.data(), static_cast<std::size_t>(q->numel())), owner);
    }
  }

 private:
  /// Where the schedule (or its file) puts the stages (plan.hpp).
  Placement placement() const { return placement_of(kind_, plan_.pipeline); }

  /// The index among this rank's blocks of the first block of stage s (one of this
  /// rank's, its (s / P)-th in model order under either placement).
  std::size_t first_local_layer(int s) const {
    std::size_t n = 0;
    for (int v = 0; v < s / pp_; ++v) {
      const int earlier = stage_of_rank(placement(), pp_, rank_, v);
      n += static_cast<std::size_t>(stages_[static_cast<std::size_t>(earlier)].blocks());
    }
    return n;
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

  /// The lowered program of the schedule for `microbatches` microbatches, made and
  /// checked against NCCL's rules (check_program) before it first runs: once per
  /// process for each schedule shape (checked_program), once per model for a file's order.
  const Program& program(int microbatches) {
    auto it = programs_.find(microbatches);
    if (it == programs_.end()) {
      std::shared_ptr<const Program> p;
      if (from_file(kind_)) {  // the file's order: lowered and checked once per model
        p = std::make_shared<const Program>(lower(schedule(microbatches)));
        check_program(*p);
      } else {
        p = checked_program(kind_, pp_, stages_per_rank_, microbatches);
      }
      it = programs_.emplace(microbatches, std::move(p)).first;
    }
    return *it->second;
  }

  /// This rank's stages for one pass, as run_pipeline walks them (PipelineStages): it
  /// holds what the stages keep between a microbatch's forward and backward: each
  /// block's saved activations per (local layer, microbatch), the final norm's, the
  /// head's output gradient, and a zero-bubble backward_input's deferred weight-gradient
  /// work. Without `training` (evaluation) nothing is saved and the head computes the
  /// loss only.
  template <class Model>
  class Stages {
   public:
    using tensor_type = Tensor<T>;
    /// The head adds its loss into loss_sum_ (B's memory), not run_pipeline's `loss`.
    static constexpr bool kLossOnDevice = true;

    Stages(ModelPipeline& pipeline, Model& model, ModelUnits<T, B>& units, std::span<const std::int32_t> inputs,
           std::span<const std::int32_t> targets, nn::Geometry microbatch, int microbatches, double loss_scale,
           bool training, double* loss_sum)
        : pipeline_(pipeline),
          model_(model),
          units_(units),
          inputs_(inputs),
          targets_(targets),
          g_(microbatch),
          M_(microbatches),
          loss_scale_(loss_scale),
          training_(training),
          loss_sum_(loss_sum),
          head_grad_(static_cast<std::size_t>(microbatches)),
          deferred_(static_cast<std::size_t>(pipeline.stages_per_rank_ * microbatches)) {
      if (!training) return;
      for (std::size_t i = 0; i < model.n_layers() * static_cast<std::size_t>(M_); ++i)
        stores_.emplace_back("", &model.activation_meter());
      for (int m = 0; m < M_; ++m) norm_stores_.emplace_back("norm", &model.activation_meter());
    }

    /// Microbatch m's geometry: its sequences' documents where they are masked apart.
    nn::Geometry geometry(int m) const { return g_.sequences(m * g_.batch, g_.batch); }

    /// A tensor of the shape that crosses between stages: this tensor-parallel rank's
    /// rows of a microbatch's hidden state.
    Tensor<T> transfer_buffer() const {
      const std::int64_t rows = g_.rows();
      const TensorParallelGroup* tp = model_.tensor_parallel();
      return B::template empty<T>(Shape{tp ? tp->rows_held(rows) : rows, model_.args().dim});
    }

    Tensor<T> forward(int s, int m, Tensor<T> x, double& /*loss: kLossOnDevice*/) {
      Model& t = model_;
      const StageRange& range = pipeline_.stages_[static_cast<std::size_t>(s)];
      if (range.embedding) {
        const profile::Span span("layer", "tok_embeddings forward");
        if (Unit* u = units_.embedding()) u->unshard();
        x = t.embedding().forward(ids(inputs_, m));
        if (Unit* u = units_.embedding(); u && !training_) u->reshard();
      }
      const std::size_t first = pipeline_.first_local_layer(s);
      for (std::size_t j = first; j < first + static_cast<std::size_t>(range.blocks()); ++j) {
        const profile::Span span("layer", [&] { return t.layer_span(j, " forward"); });
        x = t.layer(j).forward(nn::Context<T>(geometry(m), training_ ? &store(j, m) : nullptr), x);
      }
      if (!range.output) return x;
      Unit* head = units_.head();
      if (!training_) {
        if (head) head->unshard();
        Tensor<T> hn = t.final_norm().forward(nn::Context<T>(geometry(m), nullptr), x);
        t.head().forward(whole_rows<B>(t.tensor_parallel(), hn), ids(targets_, m), A(0), nullptr, loss_sum_);
        if (head) head->reshard();
        return {};
      }
      if (head) {
        head->unshard();
        head->begin_grads();
      }
      nn::ActivationStore<T>& norm_store = norm_stores_[static_cast<std::size_t>(m)];
      Tensor<T> hn =
          whole_rows<B>(t.tensor_parallel(), t.final_norm().forward(nn::Context<T>(geometry(m), &norm_store), x));
      x.release();
      Tensor<T> dhn = B::template empty<T>(hn.shape());
      t.head().forward(hn, ids(targets_, m), static_cast<A>(loss_scale_), &dhn, loss_sum_);
      head_grad_[static_cast<std::size_t>(m)] = t.head().vocab_parallel() ? summed_rows<B>(t.tensor_parallel(), dhn)
                                                                          : own_rows<B>(t.tensor_parallel(), dhn);
      return {};
    }

    Tensor<T> backward(int s, int m, Tensor<T> dy, bool defer) {
      Model& t = model_;
      const StageRange& range = pipeline_.stages_[static_cast<std::size_t>(s)];
      nn::WeightGradQueue* later = defer ? &queue(s, m) : nullptr;
      if (range.output) {
        auto& norm_store = norm_stores_[static_cast<std::size_t>(m)];
        dy = t.final_norm().backward(nn::Context<T>(geometry(m), &norm_store).deferring_weight_grads(later),
                                     head_grad_[static_cast<std::size_t>(m)]);
        norm_store.clear();
        head_grad_[static_cast<std::size_t>(m)].release();
      }
      const std::size_t first = pipeline_.first_local_layer(s);
      for (std::size_t j = first + static_cast<std::size_t>(range.blocks()); j-- > first;) {
        const profile::Span span("layer", [&] { return t.layer_span(j, defer ? " backward_input" : " backward"); });
        nn::prepare_gradients(t.layer(j));
        dy = t.layer(j).backward(nn::Context<T>(geometry(m), &store(j, m)).deferring_weight_grads(later), dy);
        store(j, m).clear();
      }
      if (!range.embedding) return dy;
      const profile::Span span("layer", "tok_embeddings backward");
      if (Unit* u = units_.embedding()) u->begin_grads();
      t.embedding().backward(ids(inputs_, m), dy);
      return {};
    }

    void backward_weight(int s, int m) {
      nn::WeightGradQueue& q = queue(s, m);
      for (auto& work : q) work();
      q.clear();
    }

    /// Throws if some weight-gradient work was left undone.
    void check_done() const {
      for (const auto& q : deferred_)
        TESSERA_CHECK(q.empty(), "pipeline: the schedule left weight-gradient work undone (a bug in its action list)");
    }

   private:
    using Unit = typename ModelUnits<T, B>::Unit;

    std::span<const std::int32_t> ids(std::span<const std::int32_t> all, int m) const {
      const auto rows = static_cast<std::size_t>(g_.rows());
      return all.subspan(static_cast<std::size_t>(m) * rows, rows);
    }
    nn::ActivationStore<T>& store(std::size_t layer, int m) {
      return stores_[layer * static_cast<std::size_t>(M_) + static_cast<std::size_t>(m)];
    }
    nn::WeightGradQueue& queue(int s, int m) {
      return deferred_[static_cast<std::size_t>((s / pipeline_.pp_) * M_ + m)];
    }

    ModelPipeline& pipeline_;
    Model& model_;
    ModelUnits<T, B>& units_;
    std::span<const std::int32_t> inputs_, targets_;
    nn::Geometry g_;
    int M_;
    double loss_scale_;
    bool training_;
    double* loss_sum_;  // B's memory: the sum of this pass's token losses (the last stage's)
    std::deque<nn::ActivationStore<T>> stores_;       // (local layer, microbatch)
    std::deque<nn::ActivationStore<T>> norm_stores_;  // per microbatch
    std::vector<Tensor<T>> head_grad_;                // per microbatch: the head's gradient of the final norm's output
    std::vector<nn::WeightGradQueue> deferred_;       // (local stage, microbatch)
  };

  const Plan& plan_;  // the model's, which outlives this
  int pp_ = 1, rank_ = 0, stages_per_rank_ = 1;
  ScheduleKind kind_ = ScheduleKind::one_f_one_b;
  std::vector<StageRange> stages_;
  nn::StackLayout layout_;
  std::map<int, Schedule> schedules_;                         // by microbatch count
  std::map<int, std::shared_ptr<const Program>> programs_;    // the schedules lowered, by microbatch count
  std::optional<Program> forward_program_;                    // evaluation's forward-only walk, lowered
  double wait_seconds_ = 0;
};

}  // namespace tessera::parallel
