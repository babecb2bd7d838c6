// The training loop: data -> forward -> loss -> backward -> clip -> AdamW -> metrics.
//
// One step consumes one global batch: global_batch_size / local_batch_size
// micro-batches (gradient accumulation), each a forward_backward whose loss is scaled
// by 1 / (target tokens in the whole global batch), so the gradient is that of the
// mean token loss however the batch is split. Then the global gradient norm is
// clipped, AdamW steps at the scheduled learning rate, and the step's metrics are
// returned. Under the early step (Plan::early_step, optimizer.early_step_in_backward)
// AdamW updates each sharding unit inside the last micro-batch's backward, as soon as
// the unit's gradient is reduced, and its gradient is freed: nothing is clipped (the
// whole gradient's norm comes too late), and the norm reported is the one the gradients
// had. Without clipping, the same update as the step without it, element for element.
//
// A Trainer is built from a model, TrainerOptions (train/trainer_options.hpp: named
// fields, or trainer_options(JobConfig) for a config) and a data::BatchSource (a
// DataLoader, a token stream or a callback: data/batch_source.hpp). It keeps copies of
// both, so temporaries may be passed.
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "tessera/backend/graph.hpp"
#include "tessera/checkpoint/sharded.hpp"
#include "tessera/core/type_name.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/core/region.hpp"
#include "tessera/data/batch_source.hpp"
#include "tessera/data/documents.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/optim/lr_schedule.hpp"
#include "tessera/parallel/host_values.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/train/dataset.hpp"
#include "tessera/train/job_config.hpp"
#include "tessera/train/job_plan.hpp"
#include "tessera/train/metrics.hpp"
#include "tessera/train/step_scalars.hpp"
#include "tessera/train/trainer_options.hpp"

namespace tessera::train {

/// What a resume loads of a checkpoint: everything but the parts named in
/// checkpoint.exclude_from_loading (torchtitan's names), which start afresh.
struct ResumeParts {
  bool model = true;         // the weights (and the optimizer's fp32 masters of bf16 weights)
  bool optimizer = true;     // the moments and the step count
  bool lr_scheduler = true;  // the schedule's position
  bool dataloader = true;    // the position in the data
  bool train_state = true;   // the step count

  static ResumeParts excluding(const std::vector<std::string>& names) {
    ResumeParts p;
    for (const std::string& n : names) {
      bool* part = n == "model"          ? &p.model
                   : n == "optimizer"    ? &p.optimizer
                   : n == "lr_scheduler" ? &p.lr_scheduler
                   : n == "dataloader"   ? &p.dataloader
                   : n == "train_state"  ? &p.train_state
                                         : nullptr;
      TESSERA_CHECK(part, "checkpoint.exclude_from_loading: '", n,
                    "' is not one of model, optimizer, lr_scheduler, dataloader, train_state");
      *part = false;
    }
    return p;
  }
};

template <class Model>
class Trainer {
 public:
  using T = typename Model::scalar_type;
  using B = typename Model::backend_type;

  /// The model is sharded here (model.shard()) if its plan is data-parallel; `batches`
  /// gives this rank's slice of each global batch (a DataLoader must already read the
  /// model's data-parallel slice; a token stream or a callback is bound to it here).
  Trainer(Model& model, TrainerOptions options, data::BatchSource batches);

  /// Does the first step's one-time work ahead of it (the model's rotary and
  /// gradient-norm tables, the optimizer's tables of tensors), so that the first step
  /// does what every later one does. Optional: a step does whatever of it is not done.
  /// The dry run (plan/dry_run.hpp) calls it and traces the first step.
  void prepare();

  /// One optimizer step over one global batch.
  StepMetrics step();

  std::int64_t steps_done() const { return step_; }
  std::int64_t accumulation_steps() const { return accumulation_; }
  const optim::AdamW<T, B>& optimizer() const { return optimizer_; }
  const data::BatchSource& batches() const { return batches_; }
  const TrainerOptions& options() const { return options_; }

  /// The global batch, in sequences.
  std::int64_t global_batch() const {
    return accumulation_ * batches_.local_batch_size() * model_.plan().dp_degree();
  }

  /// Saves everything a resumed run needs as a sharded checkpoint in `dir`
  /// (checkpoint/sharded.hpp): the parameters, the optimizer's moments, masters
  /// and step count, the step, the schedule's position, the data position and the
  /// settings a resume must keep. A collective: every rank writes its own share.
  void save_checkpoint(const std::string& dir);

  /// Starts an asynchronous save in `dir` (checkpoint.async_mode = "async"): the state
  /// is copied to host memory now, and a background thread writes it; poll_checkpoint
  /// commits it. A collective. Returns the seconds the copy held this rank.
  double start_checkpoint(const std::string& dir);

  /// A collective, after each step while a save is pending: the folder of the save this
  /// call committed ("" for none). With `wait`, waits for the background write.
  std::string poll_checkpoint(bool wait = false);
  bool checkpoint_pending() const { return async_.pending(); }
  /// Waits for this rank's write of the pending save (not a collective; poll_checkpoint
  /// commits it): a synchronous save that lets the caller act before the commit.
  void wait_checkpoint_written() { async_.wait_written(); }

  /// Resumes from a checkpoint save_checkpoint wrote, under this layout or any other:
  /// the next step() is the one that followed the save. Parts not in `parts` keep
  /// their present state. A setting that differs from the saving run's is refused by
  /// name (kept_settings); one a resume may change (reported_settings) is returned, a
  /// line each, for the caller to report.
  std::vector<std::string> load_checkpoint(const std::string& dir, ResumeParts parts = {});

 private:
  static Model& prepared(Model& model) {
    model.shard();
    return model;
  }

  /// The geometry of a micro-batch: its shape, and where its documents start when they
  /// are masked apart (the model finds them in the ids).
  nn::Geometry geometry(const data::Batch& b) const {
    nn::Geometry g{b.batch, b.seq_len};
    g.document_start_id = options_.document_start_id;
    return g;
  }

  /// The optimizer's options, once the parameters' dtype is checked against the model's
  /// in the words the user wrote them in.
  static optim::AdamWOptions checked_optimizer(const TrainerOptions& o) {
    const std::string_view key = o.name("training.mixed_precision_param", "optimizer.param_dtype");
    TESSERA_CHECK((!o.optimizer.param_dtype || *o.optimizer.param_dtype == DType::bf16 || !std::is_same_v<T, bf16>),
                  "a bfloat16 model has bfloat16 parameters: ", key, " = \"", name_of(*o.optimizer.param_dtype),
                  "\" contradicts it (", o.from == SettingsFrom::config ? "set it to \"bfloat16\" or \"auto\"" : "leave it unset",
                  ")");
    return o.optimizer;
  }

  /// The settings a resumed run must keep, by name, with the part of the state that needs
  /// them (a part not loaded frees its settings): the options' own, then the sequence
  /// length, the global batch and the parameters' dtype this Trainer runs with.
  nlohmann::json kept_settings() const {
    nlohmann::json f = nlohmann::json::object();
    for (const KeptSetting& k : options_.keep_on_resume) f[k.name] = {k.value, k.part};
    f[std::string(options_.name("training.seq_len", "seq_len"))] = {batches_.seq_len(), "dataloader"};
    f[std::string(options_.name("training.global_batch_size", "global_batch_size"))] = {global_batch(), "dataloader"};
    f[std::string(options_.name("training.mixed_precision_param", "optimizer.param_dtype"))] = {
        name_of(optimizer_.param_dtype()), "model"};
    return f;
  }

  /// The model's arguments that no tensor's shape shows, by name: a resume may change
  /// them (a RoPE base raised to lengthen the context, say), and is told when it does.
  /// Saved beside the kept settings, with the part "model". None for a model without
  /// nn::ModelArgs.
  nlohmann::json reported_settings() const {
    nlohmann::json f = nlohmann::json::object();
    if constexpr (requires { { model_.args() } -> std::convertible_to<const nn::ModelArgs&>; }) {
      const nn::ModelArgs& a = model_.args();
      const nn::RopeScaling& s = a.rope_scaling;
      f[std::string(options_.name("model.rope_theta", "rope_theta"))] = a.rope_theta;
      f[std::string(options_.name("model.norm_eps", "norm_eps"))] = a.norm_eps;
      f[std::string(options_.name("model.rope_scaling", "rope_scaling"))] = {
          {"enabled", s.enabled}, {"factor", s.factor}, {"low_freq_factor", s.low_freq_factor},
          {"high_freq_factor", s.high_freq_factor}, {"original_max_position", s.original_max_position}};
    }
    // LoRA's settings (the adapters' shapes show the rank; alpha shows nowhere else): what
    // merges them into the weights on export (llama-checkpoint --convert).
    if constexpr (requires { model_.plan().lora; }) {
      const nn::LoraPolicy& l = model_.plan().lora;
      if (l.enabled)
        f[std::string(options_.name("lora", "lora"))] = {
            {"rank", l.rank}, {"alpha", l.alpha}, {"target_modules", l.target_modules}};
    }
    return f;
  }

  nlohmann::json training_state() const {
    nlohmann::json config = kept_settings();
    const nlohmann::json reported = reported_settings();  // items() views it: held for the loop
    for (const auto& [key, value] : reported.items()) config[key] = {value, "model"};
    return {{"step", step_}, {"lr_step", lr_step_}, {"data_position", batches_.position()}, {"config", config}};
  }

  comm::Communicator* world() { return sharded::world_of(model_); }

  /// Whether the model takes staged micro-batches (nn::StagedBatch): a Transformer does,
  /// unless pipelined (its schedule stages its own).
  static constexpr bool kStages = requires { typename Model::staged_batch_type; };
  /// Whether the model updates its units in the backward (the early step).
  static constexpr bool kUpdatesInBackward = requires(Model& m) { m.update_in_backward({}); };
  bool stages() const {
    if constexpr (kStages)
      return model_.pipeline_degree() == 1;
    else
      return false;
  }

  /// The step's launches, from the gradients' start to the optimizer's staged update,
  /// `forward_backward(i, last)` running micro-batch i; over staged micro-batches they
  /// issue no copy from the host and read nothing back (what a graph captures). Returns
  /// the largest saved activations of a micro-batch.
  template <class F>
  std::size_t launch_step(std::size_t micro_batches, comm::DeviceMesh* mesh, F&& forward_backward);

  Model& model_;
  TrainerOptions options_;
  data::BatchSource batches_;
  // The memory in use on this rank's device once the model is built and initialised,
  // before the optimizer's state (a default member initializer, run in declaration
  // order): the first step's metrics report it. Under FSDP it is the rank's share.
  std::size_t memory_after_init_ = memory_stats(B::device).current();
  bool memory_after_init_reported_ = false;
  optim::AdamW<T, B> optimizer_;
  optim::LrSchedule schedule_;
  train::StepScalars<B, accum_t<T>> scalars_;  // the step's loss sum, norm and clip scale, on the device
  std::int64_t accumulation_ = 1;
  // options.graph: the staged micro-batches at fixed addresses, the captured step and the
  // activations its capture measured.
  struct Graphed;
  std::shared_ptr<Graphed> graphed_;
  std::int64_t step_ = 0;
  std::int64_t lr_step_ = 0;  // the schedule's position: the step count unless a resume restarted one of them
  // The host copy of a save, reused by the next (pinned on a GPU: checkpoint/sharded.hpp).
  sharded::HostBuffers buffers_{sharded::host_pinning<B>()};
  sharded::AsyncSave<B> async_;    // after buffers_: destroyed first, its write joined
};

template <class Model>
Trainer<Model>::Trainer(Model& model, TrainerOptions options, data::BatchSource batches)
    : model_(prepared(model)),
      options_(std::move(options)),
      batches_(std::move(batches)),
      optimizer_(model, checked_optimizer(options_)),
      schedule_(options_.schedule) {
  TESSERA_CHECK(!options_.peak_flops || *options_.peak_flops > 0, options_.name("metrics.peak_tflops", "peak_flops"),
                " must be positive, got ", *options_.peak_flops, " (unset: no MFU)");
  const std::int64_t dp = model.plan().dp_degree();
  batches_.bind(model.plan().dp_rank(), dp);
  const std::int64_t local = batches_.local_batch_size();
  const std::int64_t global = options_.global_batch_size > 0 ? options_.global_batch_size : local * dp;
  TESSERA_CHECK(global % (local * dp) == 0, options_.name("training.global_batch_size", "global_batch_size"), " (",
                global, ") must be a multiple of the local batch x the data-parallel degree (", local, " x ", dp,
                " = ", local * dp, ")");
  accumulation_ = global / (local * dp);
  if (options_.graph) {
    const std::string_view key = options_.name("training.cuda_graph", "graph");
    TESSERA_CHECK(CapturesGraphs<B>, key, ": the ", type_name<B>(), " backend does not capture graphs");
    comm::DeviceMesh* mesh = model.plan().mesh;
    TESSERA_CHECK(!mesh || mesh->world().size() == 1, key, ": a graph is one rank's work and this layout has ",
                  mesh ? mesh->world().size() : 1, " ranks (collectives are not captured): train one rank, or ",
                  options_.from == SettingsFrom::config ? "set it to false" : "leave it false");
    TESSERA_CHECK(stages(), key, ": the model does not take staged micro-batches (nn::StagedBatch)");
    TESSERA_CHECK(!model.plan().cpu_offload, key, ": the offloaded optimizer runs on the host's cores, which a graph "
                  "does not replay: turn off ", options_.name("training.enable_cpu_offload", "the plan's cpu_offload"),
                  " or the graph");
  }
  if (model.plan().early_step) {
    const auto early = model.plan().wording()(parallel::settings::early_step);
    TESSERA_CHECK(options_.max_norm <= 0, early, ": each unit is updated as soon as its gradient is reduced, before "
                  "the whole gradient's norm is known, so nothing can be clipped: set ",
                  options_.name("training.max_norm", "max_norm"), " = 0 (it is ", options_.max_norm, ")");
    TESSERA_CHECK(!options_.graph, early, ": the units' updates come with their gradients, which a captured step "
                  "does not replay: turn off ", options_.name("training.cuda_graph", "graph"), " or the early step");
    if constexpr (kUpdatesInBackward)
      TESSERA_CHECK(model.pipeline_degree() == 1, early, ": a pipeline's stages reduce their gradients after their "
                    "schedule, so there is no step to take early: turn it off under ",
                    model.plan().wording()(parallel::settings::pipeline_parallel_degree, model.pipeline_degree()));
    else
      fail(early, ": the model (", type_name<Model>(), ") does not update its units in the backward (update_in_backward)");
  }
}

template <class Model>
struct Trainer<Model>::Graphed {
  std::vector<typename Model::staged_batch_type> batches;  // fixed_layout() each
  graph_t<B> graph;
  bool warmed_up = false;  // the first step ran eagerly: lazily made tables and workspaces exist
  bool captured = false;
  std::size_t activations = 0;
};

template <class Model>
template <class F>
std::size_t Trainer<Model>::launch_step(std::size_t micro_batches, comm::DeviceMesh* mesh, F&& forward_backward) {
  model_.zero_grad();
  scalars_.begin();
  // The early step: the model hands AdamW each unit as its gradient is reduced, for this
  // step's walks only (the model never holds a hook into a Trainer that is gone).
  struct Unhook {
    Model* model = nullptr;
    ~Unhook() {
      if constexpr (kUpdatesInBackward)
        if (model) model->update_in_backward({});
    }
  } unhook;
  if constexpr (kUpdatesInBackward) {
    if (model_.plan().early_step) {
      model_.update_in_backward([this](std::span<nn::Parameter<T>* const> params, const void* group) {
        optimizer_.apply_to(group, params);
      });
      unhook.model = &model_;
    }
  }
  std::size_t activations = 0;
  for (std::size_t i = 0; i < micro_batches; ++i) {
    const profile::Span span("step", [&] { return "micro-batch " + std::to_string(i); });
    forward_backward(i, i + 1 == micro_batches);
    activations = std::max(activations, model_.saved_activation_bytes());
  }
  if (mesh) scalars_.sum_loss_over(mesh->dp_cp());  // context-parallel ranks each hold some of the tokens
  Region optimizer(region::kOptimizer);
  model_.squared_grad_norm(scalars_.squared_norm());
  scalars_.clip(options_.max_norm);
  // Skipped on the device if the loss or the norm is not finite; under the early step the
  // units were updated in the backward.
  if (!model_.plan().early_step) optimizer_.apply(scalars_.grad_scale());
  return activations;
}

template <class Model>
void Trainer<Model>::prepare() {
  model_.prepare(batches_.seq_len());
  if (!model_.plan().early_step) optimizer_.prepare();  // the early step's tables are its units'
}

template <class Model>
StepMetrics Trainer<Model>::step() {
  const auto t0 = std::chrono::steady_clock::now();
  comm::DeviceMesh* mesh = model_.plan().mesh;
  const std::uint64_t sent_before = mesh ? mesh->world().traffic().total() : 0;
  const std::uint64_t peer_sent_before = mesh ? mesh->world().traffic().send : 0;
  std::vector<data::Batch> micro;
  std::int64_t n_targets = 0;
  {
    const profile::Span span("step", "data");
    for (std::int64_t i = 0; i < accumulation_; ++i) {
      micro.push_back(batches_.next());
      if (options_.document_start_id >= 0) data::mask_document_boundaries(micro.back(), options_.document_start_id);
      n_targets += micro.back().n_targets;
    }
  }
  // The loss is the mean over the global batch's target tokens: count them on every rank
  // (staged as a double, exact below 2^53, through a backend buffer: host_values.hpp).
  if (mesh)
    n_targets = static_cast<std::int64_t>(parallel::all_reduce_host<B>(mesh->dp(), static_cast<double>(n_targets)));
  TESSERA_CHECK(n_targets > 0, "step ", step_ + 1, ": the batch has no target tokens");
  // The step launches everything without reading a value back (train/step_scalars.hpp):
  // the loss sum, the gradient norm and the clip scale stay on the device, and AdamW
  // reads the scale there; the host reads the loss and the norm once, at the end. What
  // the host gives the step (the micro-batches, the loss scale, the optimizer's learning
  // rate and bias corrections) is staged in the backend's memory before the launches,
  // which read it there: the launches are then the same every step, and with
  // options.graph the steps after the first replay the second's, captured.
  const double lr = options_.optimizer.lr * schedule_.factor(lr_step_);
  const double loss_scale = 1.0 / static_cast<double>(n_targets);
  optimizer_.stage(lr);
  std::size_t activations = 0;
  if constexpr (kStages) {
    if (stages()) {
      using Staged = typename Model::staged_batch_type;
      std::vector<Staged> eager(options_.graph ? 0 : micro.size());
      if (options_.graph && !graphed_) {
        graphed_ = std::make_shared<Graphed>();
        for (std::size_t i = 0; i < micro.size(); ++i) graphed_->batches.push_back(Staged::fixed_layout());
      }
      std::vector<Staged>& staged = options_.graph ? graphed_->batches : eager;
      for (std::size_t i = 0; i < micro.size(); ++i) {
        const std::int64_t slots = staged[i].g.document_slots;
        model_.stage(micro[i].inputs, micro[i].targets, geometry(micro[i]), loss_scale, staged[i]);
        // More packed documents in a sequence than any batch before held grow its document
        // table (nn/transformer.hpp): the captured step's attention calls take the old
        // one, so this step runs eagerly and the next is captured again.
        if (options_.graph && staged[i].g.document_slots != slots) {
          graphed_->warmed_up = false;
          graphed_->captured = false;
        }
      }
      const auto launch = [&] {
        return launch_step(staged.size(), mesh, [&](std::size_t i, bool last) {
          model_.forward_backward(staged[i], last, scalars_.loss_sum());
        });
      };
      if (!options_.graph || !graphed_->warmed_up) {
        activations = launch();  // eager; a graphed run's first step warms up
        if (options_.graph) graphed_->warmed_up = true;
      } else if constexpr (CapturesGraphs<B>) {
        if (!graphed_->captured) {
          graphed_->graph = B::capture([&] { graphed_->activations = launch(); });
          graphed_->captured = true;
        }
        graphed_->graph.replay();
        activations = graphed_->activations;
      }
    }
  }
  if (!stages()) {
    // A pipelined model takes the host's micro-batches: its schedule stages them.
    activations = launch_step(micro.size(), mesh, [&](std::size_t i, bool last) {
      const auto& b = micro[i];
      model_.forward_backward(b.inputs, b.targets, geometry(b), loss_scale, last, scalars_.loss_sum());
    });
  }
  std::optional<profile::Span> reading(std::in_place, "step", "synchronize and read the loss");
  B::synchronize();
  const auto read = scalars_.read();
  reading.reset();
  const double loss_sum = read.loss_sum, norm = read.grad_norm;
  if (!read.finite()) {
    if (model_.plan().early_step)
      fail("step ", step_ + 1, ": loss or gradient is not finite (loss sum ", loss_sum, ", grad norm ", norm,
           "); lower ", options_.name("optimizer.lr", "the learning rate"), ". Under ",
           model_.plan().wording()(parallel::settings::early_step), " the units were updated as their gradients "
           "came, so this run's parameters are not to be kept: resume from the last checkpoint");
    optimizer_.set_steps_taken(optimizer_.steps_taken() - 1);  // the update was skipped
    fail("step ", step_ + 1, ": loss or gradient is not finite (loss sum ", loss_sum, ", grad norm ", norm,
         "); lower ", options_.name("optimizer.lr", "the learning rate"), " or ",
         options_.name("training.max_norm", "max_norm"), " (the step's update was not applied)");
  }
  ++step_;
  ++lr_step_;

  StepMetrics m;
  m.step = step_;
  m.loss = loss_sum / static_cast<double>(n_targets);
  m.grad_norm = norm;
  m.lr = lr;
  m.tokens = 0;
  for (const auto& b : micro) m.tokens += b.batch * b.seq_len;
  m.tokens *= model_.plan().dp_degree();
  m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  m.tokens_per_sec = static_cast<double>(m.tokens) / m.step_seconds;
  const auto seq = micro.front().seq_len;
  if (options_.peak_flops) {
    // Per device, as torchtitan reports it. Thread ranks share one device (this
    // process's cores, which peak_flops measures); other ranks have one each.
    const bool shared_device = !mesh || mesh->world().engine_name().starts_with("threads");
    const double per_device = m.tokens_per_sec / static_cast<double>(shared_device ? 1 : mesh->world().size());
    m.mfu_pct = 100.0 * per_device * model_.flops_per_token(seq) / *options_.peak_flops;
    m.mfu_causal_pct = 100.0 * per_device * model_.flops_per_token(seq, true) / *options_.peak_flops;
  }
  m.comm_bytes = mesh ? mesh->world().traffic().total() - sent_before : 0;
  m.peer_bytes = mesh ? mesh->world().traffic().send - peer_sent_before : 0;
  m.peak_memory_bytes = memory_stats(B::device).peak();
  if (!memory_after_init_reported_) {
    m.memory_after_init_bytes = memory_after_init_;
    memory_after_init_reported_ = true;
  }
  m.activation_bytes = activations;
  return m;
}

template <class Model>
void Trainer<Model>::save_checkpoint(const std::string& dir) {
  if (async_.pending()) async_.poll(world(), true);  // saves are committed in order
  save_sharded_checkpoint(model_, optimizer_, dir, training_state(), &buffers_);
}

template <class Model>
double Trainer<Model>::start_checkpoint(const std::string& dir) {
  const auto t0 = std::chrono::steady_clock::now();
  if (async_.pending()) async_.poll(world(), true);
  async_.start(world(), snapshot_checkpoint(model_, optimizer_, training_state(), &buffers_), dir);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class Model>
std::string Trainer<Model>::poll_checkpoint(bool wait) {
  const std::string dir = async_.dir();
  return async_.poll(world(), wait) ? dir : "";
}

template <class Model>
std::vector<std::string> Trainer<Model>::load_checkpoint(const std::string& dir, ResumeParts parts) {
  const nlohmann::json now = kept_settings();
  std::vector<std::string> changed;
  auto check = [&](const nlohmann::json& state) {
    TESSERA_CHECK(state.is_object() && state.contains("step") && state.contains("data_position") &&
                      state.contains("lr_step") && state.contains("config") && state.at("config").is_object(),
                  dir, ": the training state has no step, schedule position, data position or settings");
    for (const auto& [key, value] : now.items()) {
      const std::string part = value.at(1).template get<std::string>();
      const bool loaded = part == "dataloader" ? parts.dataloader : parts.model;
      const auto saved = state.at("config").find(key);
      if (!loaded || saved == state.at("config").end() || saved->at(0) == value.at(0)) continue;
      fail(dir, ": ", key, " was ", saved->at(0).dump(), " when this checkpoint was saved and is ", value.at(0).dump(),
           " now: a resumed run must keep it (or start the ", part, " afresh: ",
           options_.from == SettingsFrom::config ? "checkpoint.exclude_from_loading = [\"" + part + "\"]"
                                                 : "ResumeParts{}." + part + " = false",
           ")");
    }
    // The model's unshaped arguments, when its weights are loaded: a change is reported
    // (nothing to compare in a checkpoint saved before they were recorded).
    if (!parts.model) return;
    const nlohmann::json reported = reported_settings();
    for (const auto& [key, value] : reported.items()) {
      const auto saved = state.at("config").find(key);
      if (saved != state.at("config").end() && saved->at(0) != value)
        changed.push_back(tessera::detail::concat(key, " was ", saved->at(0).dump(),
                                                  " when this checkpoint was saved and is ", value.dump(), " now"));
    }
  };
  graphed_.reset();  // loading may move tensors a captured step reads: the next steps capture afresh
  const nlohmann::json state =
      load_sharded_checkpoint(model_, optimizer_, dir, LoadParts{parts.model, parts.optimizer}, check);
  if (parts.train_state) step_ = state.at("step").get<std::int64_t>();
  if (parts.lr_scheduler) lr_step_ = state.at("lr_step").get<std::int64_t>();
  if (parts.dataloader) batches_.seek(state.at("data_position").get<std::int64_t>());
  return changed;
}

}  // namespace tessera::train
