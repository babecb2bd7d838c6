// The Llama model: token embedding, a stack of blocks, final norm, output head and loss.
//
// Transformer<T, B, Block> takes any Block satisfying the Layer concept and
// constructible from BlockArgs, so a user's own block type gets the same model,
// trainer and policies; a block with settings of its own (Block::options_type) gets them
// from the model's third argument. What the model says of its size (num_params,
// flops_per_token) it asks of the block: one block's parameters are counted as made,
// and a block may state its attention term of the FLOP count (layer/block_args.hpp).
// One training micro-step is
//   h = embed(ids) -> block_0 ... block_{L-1} -> norm -> fused head + loss (+ dh)
//   then norm, blocks (in reverse) and embedding backward,
// each block's saved activations released as soon as its backward ran.
//
// The model is its parts and their order. How they are laid out over ranks is its
// runtime's (layer/runtime.hpp), which the block type chooses: a bare block runs on
// one rank; a tessera::Parallel block brings parallel::ModelRuntime, which decides
// which parts this rank builds (a pipeline's stages, parallel/model_pipeline.hpp),
// where the parameters' values live (whole, tensor-parallel pieces, data-parallel
// shards: on a parallel plan no rank ever holds the whole model, and the values are
// bitwise a one-rank model's), when each data-parallel unit is gathered, prefetched,
// reduced and freed around the walk below (parallel/model_units.hpp), and how a
// pipeline schedule's pass runs over the model's stages. The walk tells the runtime
// where it is (begin_step, before_block_forward, ...); the parts it hands over are
// public (embedding(), layer(i), final_norm(), head(), ...), so a user's own model can
// use the same runtime.
//
// Tensor parallelism is the layers' own: under a TensorParallel policy the blocks split
// their heads and hidden units over the mesh's tp group, the hidden state between them
// is split by rows (sequence parallelism), the embedding and the output by vocabulary,
// and the loss is computed without gathering the logits (parallel/tensor_parallel.hpp).
//
// Context parallelism is the model's and the blocks': the model takes whole sequences
// and gives its blocks this rank's two chunks of each (share_of; a pipeline's micro-
// batches are split first), and the blocks attend across the cp group's ranks
// (parallel/context_parallel.hpp). Each rank's loss is the sum over its own tokens.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/core/type_name.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/runtime.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/nn/embedding.hpp"
#include "tessera/nn/lora.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/nn/rope.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/ops/ragged_documents.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/parallel/context_parallel.hpp"
#include "tessera/parallel/host_values.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera::nn {

namespace detail {
/// The options a model is made with when it is given none: the type's default. Only a
/// call that leaves them out instantiates it (it is the constructor's default argument),
/// so a block whose options have no default compiles as long as every model of it is
/// given them.
template <class Options>
Options default_block_options() {
  static_assert(std::default_initializable<Options>,
                "tessera::nn::Transformer<T, B, Block>: the block's options_type has no default value: give the "
                "model the block's options, Transformer(args, plan, options)");
  return Options{};
}
}  // namespace detail


/// A micro-batch in the backend's memory, staged ahead of the forward_backward that reads
/// it (Transformer::stage): its ids (with their grouping for the embedding's backward),
/// its targets and its loss scale. Nothing crosses from the host during a forward_backward
/// over it. A fixed one (fixed()) is staged again into the same tensors every time, so
/// every step over it launches the same work at the same addresses: a step a graph
/// captures once and replays (train/trainer.hpp).
template <Backend B, class A>
struct StagedBatch {
  Geometry g;
  StagedIds<B> inputs;
  Tensor<std::int32_t> targets;  // (rows)
  Tensor<A> loss_scale;          // (1): d(step loss)/d(a token's loss)
  Tensor<std::int32_t> documents;  // (rows, 2): each row's ops::DocumentSpan; empty: not masked apart
  static StagedBatch fixed_layout() {
    StagedBatch b;
    b.inputs.fixed = true;
    return b;
  }
  bool fixed() const { return inputs.fixed; }
};

template <class T, Backend B, class Block = LlamaBlock<T, B>>
class Transformer {
  static_assert(Layer<Block>, "tessera::nn::Transformer<T, B, Block>: Block must satisfy tessera::nn::Layer "
                              "(forward, backward over a Context, for_each_parameter)");
  static_assert(std::is_constructible_v<Block, const BlockArgs<T, B>&>,
                "tessera::nn::Transformer<T, B, Block>: Block must be constructible from tessera::nn::BlockArgs<T, B>");

 public:
  using scalar_type = T;
  using backend_type = B;
  using block_type = Block;
  using A = accum_t<T>;  // gradients, statistics and logits: fp32 for bf16
  /// How the model is laid out over ranks: its block type's choice (layer/runtime.hpp).
  using Runtime = typename RuntimeOf<Block>::type;
  /// The same model with another block type (a one-rank copy of a wrapped block's).
  template <class Other>
  using with_block = Transformer<T, B, Other>;
  /// The block's own settings (Block::options_type, looked through tessera::Parallel;
  /// NoBlockOptions for a block that declares none).
  using block_options_type = block_options_t<Block>;

  /// On a parallel plan (a mesh of more than one rank, or units over one rank: CPU offload,
  /// the early step) the parameters are made
  /// without storage: init_weights() gives this rank its share only. `options` reach
  /// every block this rank makes (BlockArgs::options); left out, they are the type's
  /// default, and a type without one must be given.
  explicit Transformer(const ModelArgs& args, const parallel::Plan& plan = {},
                       const block_options_type& options = detail::default_block_options<block_options_type>())
      : Transformer(args, plan, options,
                    DeferParameterStorage((plan.mesh != nullptr && plan.mesh->world().size() > 1) || plan.units_over_self()),
                    FreezeParameters(plan.lora.enabled || FreezeParameters::active())) {}

 private:
  // The scopes are temporaries of the delegating constructor's call: they live until this
  // one has finished, so every parameter the members and the body make sees them. Under
  // LoRA every parameter is made frozen but the adapters (nn::LoraAdapter).
  Transformer(const ModelArgs& args, const parallel::Plan& plan, const block_options_type& options,
              const DeferParameterStorage&, const FreezeParameters&);

 public:
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelArgs& args() const { return args_; }
  const parallel::Plan& plan() const { return plan_; }
  /// The settings every block was made with.
  const block_options_type& block_options() const { return options_; }

  /// Every parameter this rank holds once, in a fixed order: embedding, blocks, norm,
  /// output (in a pipeline, those of its stages; inside with_whole_parameters, all).
  /// On a model without storage yet (a parallel plan's, before init_weights or shard)
  /// the parameters are first made whole and zeroed, as on one rank: for a load, or
  /// values set by hand, before shard().
  template <class F>
  void for_each_parameter(F&& f) {
    runtime_.make_storage(*this);
    visit_parameters(f);
  }

  /// for_each_parameter without making storage (the runtime's view).
  template <class F>
  void visit_parameters(F&& f) {
    if (!whole_.empty()) {
      for (auto& p : whole_) f(*p);
      return;
    }
    if (layout().embedding) tok_embeddings_.for_each_parameter(f);
    for (auto& l : layers_) l.for_each_parameter(f);
    if (layout().head) {
      norm_.for_each_parameter(f);
      for_each_output_parameter(f);
    }
  }

  /// The output projection's weight and its LoRA adapter's, where the model has them.
  template <class F>
  void for_each_output_parameter(F&& f) {
    if (output_) f(*output_);
    if (output_lora_) output_lora_->for_each_parameter(f);
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
    runtime_.for_each_held_stretch(*this, [&](Parameter<T>& p, ops::PieceIndex where, std::int64_t n,
                                              Parameter<T>& local, std::int64_t offset, bool writer) {
      f(HeldStretch{&p, where, n, &local, offset, writer});
    });
  }

  /// Keeps this rank's share of every parameter: its tensor-parallel piece, then its
  /// data-parallel shard; a no-op on one rank. After a load (or any whole values, the
  /// same on every rank); on a model without storage yet, allocates the share zeroed.
  void shard() { runtime_.shard(*this); }
  bool sharded() const { return runtime_.sharded(); }

  /// The parameters this rank updates: flat shards under FSDP/HSDP, else the parameters.
  template <class F>
  void for_each_local_parameter(F&& f) {
    runtime_.for_each_local_parameter(*this, f);
  }

  /// The first step's one-time work, done ahead of it: the rotary tables for sequences
  /// of `seq_len` and the gradient norm's table of pieces. A step after it does what every
  /// later step does (Trainer::prepare; the dry run traces such a step).
  void prepare(std::int64_t seq_len);

  /// Starts a step's gradients: marks every gradient unwritten (PyTorch's
  /// zero_grad(set_to_none=True)); no kernel runs. The next forward_backward's first
  /// write of each overwrites it, and what it writes nothing into is zeroed as it ends
  /// (layer.hpp's first-write rule): read gradients after a forward_backward.
  void zero_grad();

  /// The L2 norm of the whole gradient, over every piece and shard of every rank
  /// (every rank gets the same value). Each rank sums the squares of the elements it
  /// owns (its shard; the first replica; the first holder of a tensor-parallel piece),
  /// and the sum over the world counts every element once.
  double grad_norm();

  /// The square of grad_norm() written to *out in B's memory, not read by the host: the
  /// chunks' sums and their total on the device, and the sum over the world a collective
  /// there (train::StepScalars clips from it).
  void squared_grad_norm(double* out);

  /// The early step (optimizer.early_step_in_backward; parallel/model_units.hpp): in
  /// each step's last micro-batch `update(params, group)` gets each sharding unit's local
  /// parameters as soon as their gradients are final (reduced over the data-parallel
  /// ranks), and the unit's gradient shard is freed after; squared_grad_norm() is then
  /// the norm those gradients had. Needs the parameters in sharding units: a
  /// data-parallel plan, or Plan::early_step (units over the rank alone). An empty
  /// function turns it off.
  void update_in_backward(UnitUpdate<T> update) {
    TESSERA_CHECK(!update || runtime_.units_active(), "model: the early step updates each sharding unit as its ",
                  "gradient is reduced, and this model's parameters are in none: give the plan early_step = true ",
                  "(optimizer.early_step_in_backward) or a data-parallel sharding");
    TESSERA_CHECK(!update || pipeline_degree() == 1, "model: the early step runs in a walk of the whole model, not a "
                  "pipeline's schedule");
    runtime_.update_in_backward(std::move(update));
  }

  /// Runs f() with every parameter whole on every rank (for saving): gathers the
  /// data-parallel shards and tensor-parallel pieces, and in a pipeline brings every
  /// stage's parameters to every rank; then frees them again. A collective.
  template <class F>
  void with_whole_parameters(F&& f) {
    runtime_.with_whole_parameters(*this, f);
  }

  /// Makes `all` (every parameter of the whole model, whole) what for_each_parameter
  /// visits, until called again with none: the runtime's, inside with_whole_parameters.
  void hold_whole(std::vector<std::unique_ptr<Parameter<T>>> all) { whole_ = std::move(all); }

  /// The parameters of the whole model, the same on every rank of every layout (a
  /// pipeline rank holds some stages, a sharded one pieces and shards): the embedding,
  /// n_layers blocks, the final norm and the output, each counted whole. A block is
  /// counted as the model makes it (one made on one rank, without storage, when the model
  /// is made): the count cannot disagree with what trains, whatever the block.
  std::int64_t num_params() const { return num_params_; }

  /// Training FLOPs per token by torchtitan's formula: 6 x the parameters but the token
  /// embedding, plus each block's attention term (its own, where it states it:
  /// nn::DescribesAttentionFlops; else the model's attention, 12 H hd T), over the whole
  /// T x T square, or halved (`causal_halved`: what causal attention computes). For the
  /// Llama block, exactly ModelArgs::flops_per_token. The same on every rank.
  /// Frozen parameters (LoRA) count 4, not 6: no gradient of theirs is computed.
  double flops_per_token(std::int64_t seq_len, bool causal_halved = false) const {
    return training_flops_per_token(num_params_ - args_.num_embedding_params() - frozen_params_,
                                    static_cast<double>(args_.n_layers) * block_attention_flops(seq_len), causal_halved,
                                    frozen_params_);
  }

  /// Forward and backward of one micro-batch; accumulates gradients of
  /// loss_scale * (sum of token losses) and returns this rank's sum of token losses.
  /// `last_micro_batch`: the step's last (DDP reduces its gradients after it). On
  /// return every gradient reduction has completed.
  double forward_backward(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
                          double loss_scale, bool last_micro_batch = true);

  /// As above, this rank's sum of token losses added to *loss_sum in B's memory, which
  /// the host does not read: nothing in the micro-batch waits for the device
  /// (train::StepScalars holds the sum until the step ends).
  void forward_backward(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
                        double loss_scale, bool last_micro_batch, double* loss_sum);

  using staged_batch_type = StagedBatch<B, A>;

  /// Writes a micro-batch to `into` in B's memory (copies from the host, issued without
  /// waiting for the device), checked as forward_backward checks it. A fixed `into` keeps
  /// its tensors: the geometry must stay the one it was first staged with.
  void stage(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
             double loss_scale, staged_batch_type& into) const;

  /// forward_backward over a staged micro-batch, the loss scale read on the device: the
  /// micro-batch issues no copy from the host and reads nothing back, so a step of them
  /// can be captured as a graph. Not for a pipelined model (its schedule stages its own).
  void forward_backward(const staged_batch_type& batch, bool last_micro_batch, double* loss_sum);

  /// Sum of token losses, no gradients and nothing saved.
  double loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g);

  /// Logits (batch * seq_len, vocab) at every position, on the host, in accum_t<T>
  /// (fp32 for bf16); for evaluation and checks on small inputs (a whole (rows, vocab)
  /// matrix is made at once).
  Tensor<A> logits(std::span<const std::int32_t> inputs, Geometry g);

  /// Logits (batch, vocab) at the last position of each sequence, on the host, in accum_t<T>.
  Tensor<A> last_logits(std::span<const std::int32_t> inputs, Geometry g);

  /// Whether this model decodes through a KV cache (cached_last_logits): its blocks say
  /// their attention reads one (nn::KvCacheLayer), its backend's attention takes the
  /// cache's keys (attends_past_keys), it is whole here (no tensor, context or pipeline
  /// parallelism), and no GEMM is float8 (a tensorwise cast of the input scales by the
  /// amax of all its rows: over the new rows alone it would round otherwise). nn::generate
  /// uses it where it holds.
  bool decodes_with_kv_cache() const {
    if constexpr (KvCacheLayer<Block> && attends_past_keys<B>)
      return !tp_.active() && !cp_.active() && pipeline_degree() == 1 && !plan_.float8.enabled;
    else
      return false;
  }

  /// Decoding: the logits (1, vocab) after `inputs`, the next tokens of the one sequence
  /// whose first cache.length() tokens `cache` holds, on the host, in accum_t<T>; the
  /// cache then holds them too. The same logits as last_logits over the whole sequence
  /// (to rounding: the GEMMs see fewer rows), for a forward over the new rows alone.
  Tensor<A> cached_last_logits(std::span<const std::int32_t> inputs, KvCache<T>& cache);

  /// Peak bytes of saved activations during the last forward_backward (checkpoint
  /// stashes and recomputes included).
  std::size_t saved_activation_bytes() const { return saved_bytes_peak_; }

  /// The name of every parameter of the whole model, in order, whichever stages this
  /// rank holds (a loader checks a file's tensors against these).
  std::vector<std::string> parameter_names() const;

  // ---- the parts, for the runtime (and a user's own) ------------------------------

  /// The i-th block this rank holds (in a pipeline, of its stages: see layer_id).
  Block& layer(std::size_t i) { return layers_.at(i); }
  std::size_t n_layers() const { return layers_.size(); }
  std::int64_t layer_id(std::size_t i) const { return layout().layer_ids.at(i); }
  /// "layers.12 forward": the profile's span of the i-th block's `what` (core/profile.hpp).
  std::string layer_span(std::size_t i, std::string_view what) const {
    return "layers." + std::to_string(layer_id(i)) + std::string(what);
  }
  Embedding<T, B>& embedding() { return tok_embeddings_; }
  RmsNorm<T, B>& final_norm() { return norm_; }
  /// The output projection, or nullptr when the head reads the embedding (tied).
  Parameter<T>* output_weight() { return output_.get(); }
  ChunkedCrossEntropyHead<T, B>& head() { return head_; }
  /// The tensor-parallel group the layers split over, or nullptr at degree 1.
  parallel::TensorParallelGroup* tensor_parallel() { return tp_.active() ? &tp_ : nullptr; }
  /// The group each sequence is split over, or nullptr at degree 1.
  parallel::ContextParallelGroup* context_parallel() { return cp_.active() ? &cp_ : nullptr; }
  ActivationMeter& activation_meter() { return meter_; }

  // ---- the pipeline (the runtime's; one stage on one rank) ------------------------

  int pipeline_degree() const { return runtime_.pipeline_degree(); }
  int stages_per_rank() const { return runtime_.stages_per_rank(); }
  /// Seconds this rank waited for another stage's activations or gradients during the
  /// last pipelined forward_backward: its share of the pipeline bubble, measured.
  double pipeline_wait_seconds() const { return runtime_.pipeline_wait_seconds(); }
  /// Every stage's range, and the schedule (its action lists) a micro-batch of
  /// `microbatches` pipeline microbatches runs by.
  decltype(auto) stages() const
    requires Runtime::pipelines
  {
    return runtime_.stages();
  }
  decltype(auto) schedule(int microbatches)
    requires Runtime::pipelines
  {
    return runtime_.schedule(microbatches);
  }

  /// Checks, before anything runs, that a data-parallel rank's batch of `batch`
  /// sequences of `seq_len` tokens can go through this model's layout: its rows split
  /// over the tensor-parallel ranks, and in a pipeline, the microbatch size divides it
  /// and the schedule runs that many microbatches. Throws naming the settings (by config
  /// key when the plan came from a config).
  void check_batch(std::int64_t batch, std::int64_t seq_len) const;

 private:
  const StackLayout& layout() const { return runtime_.layout(); }

  /// Calls f(Parameter<T>&) for each parameter of one block made as the model makes its
  /// blocks, but on one rank and without storage: what every block of the model has
  /// (the names under "layers.0.", the whole shapes), whichever blocks this rank holds.
  template <class F>
  void visit_one_block(F&& f) const {
    const DeferParameterStorage shapes_only;
    // Its parameters as the model's blocks have them: LoRA's adapters, and which are frozen.
    parallel::Plan converters;
    converters.lora = plan_.lora;
    const FreezeParameters frozen(plan_.lora.enabled || FreezeParameters::active());
    bare_block_t<Block> b(BlockArgs<T, B>{args_, 0, "layers.0", rope_, &converters, nullptr, BlockOptionsRef(options_)});
    b.for_each_parameter(f);
  }

  /// One block's attention term of the FLOP count: its own, or the model's attention's.
  double block_attention_flops(std::int64_t seq_len) const {
    using Bare = bare_block_t<Block>;
    if constexpr (requires { &Bare::attention_flops_per_token; }) {
      static_assert(DescribesAttentionFlops<Bare>,
                    "tessera: a block's attention_flops_per_token must be `static double attention_flops_per_token("
                    "const nn::ModelArgs&, const options_type&, std::int64_t seq_len)` (options_type: "
                    "nn::NoBlockOptions for a block without options)");
      return static_cast<double>(Bare::attention_flops_per_token(args_, options_, seq_len));
    } else {
      return args_.attention_flops_per_token(seq_len);
    }
  }

  /// Checks a batch of whole sequences as the caller gives it.
  void check_geometry(std::span<const std::int32_t> inputs, Geometry g) const {
    TESSERA_CHECK(g.batch > 0 && g.seq_len > 0 && static_cast<std::int64_t>(inputs.size()) == g.rows(), "model: ",
                  inputs.size(), " tokens for a batch of ", g.batch, " x ", g.seq_len);
    TESSERA_CHECK(g.context.whole(), "model: a batch is given as whole sequences (the model splits them over its "
                                     "context-parallel ranks)");
    const parallel::Wording w = plan_.wording();
    const int cp = cp_.degree();
    TESSERA_CHECK(g.seq_len % (2 * cp) == 0 || cp == 1, w(parallel::settings::seq_len, g.seq_len),
                  " does not split into 2 x ", w(parallel::settings::context_parallel_degree, cp), " = ", 2 * cp,
                  " equal chunks (each context-parallel rank holds two chunks of every sequence)");
    const std::int64_t rows = g.rows() / cp;
    TESSERA_CHECK(!tp_.sequence_parallel() || rows % tp_.degree() == 0, "model: a batch of ", g.batch, " x ",
                  g.seq_len, cp > 1 ? tessera::detail::concat(" (", rows, " tokens on each context-parallel rank)")
                                    : tessera::detail::concat(" = ", rows, " tokens"),
                  " does not split into rows over ", tp_.degree(), " tensor-parallel ranks");
    TESSERA_CHECK(g.seq_len <= args_.max_seq_len, "model: seq_len ", g.seq_len, " exceeds max_seq_len ",
                  args_.max_seq_len);
  }

  /// This rank's share of a checked batch of whole sequences: under context parallelism
  /// its two chunks of each, chunk-major in runs of `group` sequences (a pipeline's
  /// microbatch; parallel::context_tokens), with the geometry of its rows; else the batch.
  /// When the batch's documents are masked apart (g.document_start_id), each row's
  /// document, found in the whole sequences (so in whole-sequence positions under
  /// context parallelism) and laid out as the rows are.
  struct Share {
    std::vector<std::int32_t> owned_inputs, owned_targets;
    std::span<const std::int32_t> inputs, targets;
    std::vector<ops::DocumentSpan> documents;
    Geometry g;
  };
  Share share_of(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
                 std::int64_t group) const {
    Share s;
    if (g.document_start_id >= 0) s.documents = ops::document_spans(inputs, g.batch, g.seq_len, g.document_start_id);
    if (!cp_.active()) {
      s.inputs = inputs;
      s.targets = targets;
      s.g = g;
      return s;
    }
    const ops::ContextShard shard = cp_.shard();
    s.owned_inputs = parallel::context_tokens(inputs, g.batch, g.seq_len, shard, group);
    if (!s.documents.empty())
      s.documents = parallel::context_tokens<ops::DocumentSpan>(s.documents, g.batch, g.seq_len, shard, group);
    if (!targets.empty()) s.owned_targets = parallel::context_tokens(targets, g.batch, g.seq_len, shard, group);
    s.inputs = s.owned_inputs;
    s.targets = s.owned_targets;
    s.g = g;
    s.g.seq_len = g.seq_len / shard.degree;
    s.g.context = shard;
    return s;
  }

  /// The share's geometry with each row's document (g.documents) when the batch's
  /// documents are masked apart, and over whole sequences their document table
  /// (g.document_table, at least `min_slots` entries a sequence: ops/ragged_documents.hpp),
  /// staged in `into` (kept there when `keep` and the size is unchanged: a graph's fixed
  /// tensors).
  Geometry with_documents(const Share& share, Tensor<std::int32_t>& into, bool keep = false,
                          std::int64_t min_slots = 0) const {
    Geometry g = share.g;
    g.documents = nullptr;
    g.document_table = nullptr;
    g.document_slots = 0;
    if (g.document_start_id < 0) return g;
    const std::vector<ops::DocumentSpan>& spans = share.documents;
    ops::DocumentTable table;
    if (g.context.whole()) table = ops::document_table(spans, g.batch, g.seq_len, min_slots);
    static_assert(sizeof(ops::DocumentSpan) == 2 * sizeof(std::int32_t));
    const std::vector<std::int32_t> flat = ops::staged_documents(spans, table);
    upload_into<B>(into, std::span<const std::int32_t>(flat), keep);
    const auto* staged = reinterpret_cast<const ops::DocumentSpan*>(into.data());
    g.documents = staged;
    if (table.slots > 0) {
      g.document_table = staged + spans.size();
      g.document_slots = table.slots;
    }
    return g;
  }

  /// The final normed hidden state, every row; a sharded model gathers and frees each
  /// unit in turn, so every rank must call it together. The head's parameters stay
  /// gathered afterwards, for the logits; free_head() frees them.
  Tensor<T> final_hidden(std::span<const std::int32_t> inputs, Geometry g) {
    check_geometry(inputs, g);
    TESSERA_CHECK(!cp_.active(), "model: logits under context parallelism (each rank holds part of every sequence): "
                                 "take them from a whole copy (made inside with_whole_parameters), as llama-train "
                                 "samples");
    Tensor<std::int32_t> documents;
    return hidden(inputs, with_documents(share_of(inputs, {}, g, g.batch), documents));
  }

  /// final_hidden over rows already checked: this rank's share of the batch (share_of);
  /// with `cache`, the rows after its tokens (cached_last_logits).
  Tensor<T> hidden(std::span<const std::int32_t> inputs, Geometry g, KvCache<T>* cache = nullptr) {
    TESSERA_CHECK(sharded(), "model: inference before shard() on a parallel plan");
    TESSERA_CHECK(pipeline_degree() == 1, "model: logits of a pipelined model: take them from a whole copy (made "
                                          "inside with_whole_parameters), as llama-train samples");
    runtime_.gather_embedding();
    Tensor<T> h = tok_embeddings_.forward(inputs);
    runtime_.embedding_done(args_.tie_embeddings);
    const Context<T> ctx = Context<T>(g, nullptr).with_kv_cache(cache);
    for (auto& l : layers_) h = l.forward(ctx, h);
    runtime_.gather_head();
    return parallel::whole_rows<B>(tensor_parallel(), norm_.forward(Context<T>(g, nullptr), h));
  }

  /// Frees what final_hidden left gathered for the head.
  void free_head() { runtime_.head_done(args_.tie_embeddings); }

  /// The logits (batch, vocab) of each sequence's last row of `hn` (final_hidden's), on the
  /// host; frees the head.
  Tensor<A> last_row_logits(const Tensor<T>& hn, Geometry g);

  /// The one-stage walk of forward_backward (no pipeline).
  void walk(const staged_batch_type& batch, bool last_micro_batch, double* loss_sum);

  static void release(Parameter<T>& p) {
    p.value.release();
    p.grad.release();
  }

  ModelArgs args_;
  parallel::Plan plan_;
  block_options_type options_;        // before the runtime: it checks the blocks with them
  Runtime runtime_;                   // before the parts: it says which this rank builds
  parallel::TensorParallelGroup tp_;  // before the layers: they point to it
  parallel::ContextParallelGroup cp_;  // likewise
  ActivationMeter meter_;             // before the stores: they report to it until they go
  std::shared_ptr<RopeTable<T, B>> rope_;
  Embedding<T, B> tok_embeddings_;
  std::deque<Block> layers_;  // a deque: blocks never move (a sharding unit points into its block)
  RmsNorm<T, B> norm_;
  std::unique_ptr<Parameter<T>> output_;
  std::optional<LoraAdapter<T, B>> output_lora_;  // under LoRA, where it takes "output"
  ChunkedCrossEntropyHead<T, B> head_{nullptr};
  std::deque<ActivationStore<T>> stores_;
  std::size_t saved_bytes_peak_ = 0;
  optim::SquaredNorms<B, A> norms_;                    // the gradient norm's pieces, their table kept between steps
  std::vector<std::unique_ptr<Parameter<T>>> whole_;  // every parameter, inside with_whole_parameters
  std::int64_t num_params_ = 0;                       // of the whole model (num_params)
  std::int64_t frozen_params_ = 0;                    // of those, frozen, but the embedding's
};

// The members whose bodies reach the whole model (its layers, the collectives, the
// pipeline), defined out of the class: an `extern template` of a model type
// (tessera/instances.hpp) then keeps a file that only calls them from compiling them.

template <class T, Backend B, class Block>
Transformer<T, B, Block>::Transformer(const ModelArgs& args, const parallel::Plan& plan,
                                      const block_options_type& options, const DeferParameterStorage&,
                                      const FreezeParameters&)
    : args_((args.validate(), args)),
      plan_(plan),
      options_(options),
      runtime_(args_, plan_),
      tp_(runtime_.tensor_parallel_comm(args_, options_), plan.loss_parallel, plan.sequence_parallel,
          plan.async_tensor_parallel),
      cp_(runtime_.context_parallel_comm(), plan.context_rotation, plan.context_balance),
      rope_(std::make_shared<RopeTable<T, B>>(args.head_dim(), args.rope_theta, args.rope_scaling)),
      tok_embeddings_("tok_embeddings", args.vocab_size, args.dim,
                      args.tie_embeddings ? Init::truncated_normal(0.02) : Init::normal(1.0), tensor_parallel()),
      norm_("norm", args.dim, args.norm_eps, tensor_parallel()) {
  for (std::int64_t i : layout().layer_ids)
    layers_.emplace_back(BlockArgs<T, B>{args_, i, "layers." + std::to_string(i), rope_, &plan_, tensor_parallel(),
                                         BlockOptionsRef(options_), context_parallel()});
  if (!args.tie_embeddings) {
    const double std = 1.0 / std::sqrt(static_cast<double>(args.dim));
    output_ = std::make_unique<Parameter<T>>(Parameter<T>::template on<B>(
        "output.weight", Shape{args.vocab_size, args.dim}, Init::truncated_normal(std, -3 * std, 3 * std)));
    // Loss parallelism splits it by vocabulary; without, every rank holds it whole
    // and computes the whole head (the first rank counts it in the gradient norm).
    output_->split = plan.loss_parallel ? tp_.split(0) : tp_.whole();
    // Its adapter's gradients are partial sums over the ranks only where it is split.
    if (plan.lora.applies("output"))
      output_lora_.emplace("output", args.dim, args.vocab_size, plan.lora, tensor_parallel(), output_->split,
                           plan.loss_parallel);
  } else {
    const auto& t = plan.lora.target_modules;
    TESSERA_CHECK(!plan.lora.enabled || std::find(t.begin(), t.end(), "output") == t.end(),
                  "lora.target_modules names \"output\", and this model has none of its own (model.tie_embeddings = "
                  "true: the head multiplies by the embedding)");
  }
  head_ = ChunkedCrossEntropyHead<T, B>(output_ ? output_.get() : &tok_embeddings_.weight(),
                                        plan.loss_parallel ? tensor_parallel() : nullptr,
                                        output_lora_ ? &*output_lora_ : nullptr);
  // Counted from the parts' whole shapes, which every rank has, whatever it holds.
  std::int64_t block = 0, frozen_block = 0;
  visit_one_block([&](Parameter<T>& p) {
    block += p.whole.numel();
    if (p.frozen) frozen_block += p.whole.numel();
  });
  num_params_ = tok_embeddings_.weight().whole.numel() + args_.n_layers * block + norm_.weight().whole.numel();
  frozen_params_ = args_.n_layers * frozen_block + (norm_.weight().frozen ? norm_.weight().whole.numel() : 0);
  for_each_output_parameter([&](Parameter<T>& p) {
    num_params_ += p.whole.numel();
    if (p.frozen) frozen_params_ += p.whole.numel();
  });
  // Under LoRA something must train: the policy's targets name layers this model's blocks have.
  TESSERA_CHECK(!plan.lora.enabled || num_params_ - tok_embeddings_.weight().whole.numel() > frozen_params_,
                plan.wording().pick("lora.target_modules", "the LoRA policy's target_modules"),
                ": no linear layer of this model takes an adapter (block ", type_name<bare_block_t<Block>>(),
                "), so nothing would train");
  if (!layout().embedding) release(tok_embeddings_.weight());
  if (!layout().head) {
    release(norm_.weight());
    for_each_output_parameter([](Parameter<T>& p) { release(p); });
  }
  for (std::size_t i = 0; i < layers_.size(); ++i) stores_.emplace_back("", &meter_);
  runtime_.attach(*this);
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::init_weights(std::uint64_t seed) {
  for_each_held_stretch([&](const HeldStretch& h) {
    with_backend<B>(on_host(h.local->value), [&]<class X>() { init_parameter<X>(*h.param, seed, h.values(), h.n, h.where); });
  });
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::prepare(std::int64_t seq_len) {
  // Only where a block of this rank kept the shared table (a pipeline stage of the
  // embedding or the head alone holds none; a user's block may not rotate).
  if (rope_.use_count() > 1) rope_->ensure(seq_len);
  if (plan_.early_step) return;  // each unit's norm is taken as it is updated
  runtime_.add_owned_gradients(*this, norms_);
  norms_.prepare();
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::zero_grad() {
  for_each_local_parameter([](Parameter<T>& p) { p.forget_grad(); });
}

template <class T, Backend B, class Block>
double Transformer<T, B, Block>::grad_norm() {
  Tensor<double> sum = B::template empty<double>(Shape{1});
  squared_grad_norm(sum.data());
  return std::sqrt(download<B>(sum)[0]);
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::squared_grad_norm(double* out) {
  if (runtime_.updates_in_backward() || (plan_.early_step && runtime_.units_active())) {
    runtime_.updated_squared_norm(*this, out);  // the gradients are gone: their norms were taken
  } else {
    runtime_.add_owned_gradients(*this, norms_);
    norms_.sum_into(out);
  }
  runtime_.sum_over_world(out);
}

template <class T, Backend B, class Block>
double Transformer<T, B, Block>::forward_backward(std::span<const std::int32_t> inputs,
                                                  std::span<const std::int32_t> targets, Geometry g,
                                                  double loss_scale, bool last_micro_batch) {
  const Tensor<double> sum = B::template zeros<double>(Shape{1});
  forward_backward(inputs, targets, g, loss_scale, last_micro_batch, sum.data());
  return download<B>(sum)[0];
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::forward_backward(std::span<const std::int32_t> inputs,
                                                std::span<const std::int32_t> targets, Geometry g, double loss_scale,
                                                bool last_micro_batch, double* loss_sum) {
  if constexpr (Runtime::pipelines) {
    if (pipeline_degree() > 1) {
      check_geometry(inputs, g);
      TESSERA_CHECK(sharded(), "model: forward_backward before shard() on a parallel plan");
      check_batch(g.batch, g.seq_len);
      meter_.reset_peak();
      const Share share = share_of(inputs, targets, g, runtime_.microbatch_size(g.batch));
      Tensor<std::int32_t> documents;
      runtime_.pipeline_forward_backward(*this, share.inputs, share.targets,
                                         with_documents(share, documents), loss_scale,
                                         last_micro_batch, loss_sum);
      saved_bytes_peak_ = meter_.peak();
      for_each_local_parameter([](Parameter<T>& p) { p.template zero_grad_if_unwritten<B>(); });
      return;
    }
  }
  staged_batch_type batch;
  stage(inputs, targets, g, loss_scale, batch);
  forward_backward(batch, last_micro_batch, loss_sum);
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::stage(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                                     Geometry g, double loss_scale, staged_batch_type& into) const {
  check_geometry(inputs, g);
  TESSERA_CHECK(pipeline_degree() == 1, "model: a pipelined model stages its micro-batches in its schedule");
  Share share = share_of(inputs, targets, g, g.batch);
  TESSERA_CHECK(!into.fixed() || into.inputs.ids.empty() || (into.g.batch == g.batch && into.g.seq_len == share.g.seq_len),
                "model: a batch of ", g.batch, " x ", g.seq_len, " where every step's must be the first's (",
                into.g.batch, " x ", into.g.whole_seq_len(), "): a step a graph replays has fixed shapes");
  head_.check_targets(share.targets, share.g.rows());
  tok_embeddings_.stage(share.inputs, into.inputs, true);
  if (!share.owned_inputs.empty()) into.inputs.keep(std::move(share.owned_inputs));  // the backward groups them
  upload_into<B>(into.targets, share.targets, into.fixed());
  if (into.loss_scale.empty()) into.loss_scale = B::template empty<A>(Shape{1});
  const A scale = static_cast<A>(loss_scale);
  B::copy_from_host(&scale, into.loss_scale.data(), 1);
  // A fixed batch keeps its document slots (a graph replays the attention calls of its
  // capture), growing them only when a batch holds more documents (Trainer captures again).
  into.g = with_documents(share, into.documents, into.fixed(), into.fixed() ? into.g.document_slots : 0);
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::forward_backward(const staged_batch_type& batch, bool last_micro_batch,
                                                double* loss_sum) {
  TESSERA_CHECK(sharded(), "model: forward_backward before shard() on a parallel plan");
  TESSERA_CHECK(pipeline_degree() == 1, "model: a pipelined model stages its micro-batches in its schedule");
  meter_.reset_peak();
  walk(batch, last_micro_batch, loss_sum);
  saved_bytes_peak_ = meter_.peak();
  // What the backward wrote nothing into holds zero (a parameter this rank's part of the
  // step did not reach).
  for_each_local_parameter([](Parameter<T>& p) { p.template zero_grad_if_unwritten<B>(); });
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::walk(const staged_batch_type& batch, bool last_micro_batch, double* loss_sum) {
  const Geometry g = batch.g;
  runtime_.begin_step(*this, last_micro_batch);
  Tensor<T> h;
  {
    const profile::Span span("layer", "tok_embeddings forward");
    h = tok_embeddings_.forward(batch.inputs);
  }
  runtime_.embedding_forward_done();
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const profile::Span span("layer", [&] { return layer_span(i, " forward"); });
    runtime_.before_block_forward(*this, i);
    h = layers_[i].forward(Context<T>(g, &stores_[i]), h);
  }
  runtime_.before_head(*this);
  ActivationStore<T> norm_store("norm", &meter_);
  // Under sequence parallelism each rank holds some rows; the head takes them all.
  Tensor<T> hn = parallel::whole_rows<B>(tensor_parallel(), norm_.forward(Context<T>(g, &norm_store), h));
  h.release();
  Tensor<T> dhn = B::template empty<T>(hn.shape());
  head_.forward(hn, batch.targets, {A(0), batch.loss_scale.data()}, &dhn, loss_sum);
  hn.release();
  // Loss parallelism leaves each rank its vocabulary's share of dhn; else dhn is whole.
  dhn = head_.vocab_parallel() ? parallel::summed_rows<B>(tensor_parallel(), dhn)
                               : parallel::own_rows<B>(tensor_parallel(), dhn);

  Tensor<T> dh = norm_.backward(Context<T>(g, &norm_store), dhn);
  norm_store.clear();
  dhn.release();
  runtime_.head_backward_done(last_micro_batch);
  for (std::size_t i = layers_.size(); i-- > 0;) {
    const profile::Span span("layer", [&] { return layer_span(i, " backward"); });
    runtime_.before_block_backward(*this, i);
    prepare_gradients(layers_[i]);
    dh = layers_[i].backward(Context<T>(g, &stores_[i]), dh);
    stores_[i].clear();
    runtime_.block_backward_done(*this, i);
  }
  {
    const profile::Span span("layer", "tok_embeddings backward");
    runtime_.before_embedding_backward();
    tok_embeddings_.backward(batch.inputs, dh);
    runtime_.embedding_backward_done(*this, last_micro_batch);
  }
}

template <class T, Backend B, class Block>
double Transformer<T, B, Block>::loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets,
                                      Geometry g) {
  check_geometry(inputs, g);
  const Share share = share_of(inputs, targets, g, g.batch);
  Tensor<std::int32_t> documents;
  const Geometry sg = with_documents(share, documents);
  double l = 0;
  bool pipelined = false;
  if constexpr (Runtime::pipelines)
    if (pipeline_degree() > 1) {
      TESSERA_CHECK(sharded(), "model: inference before shard() on a parallel plan");
      l = runtime_.pipeline_loss(*this, share.inputs, share.targets, sg);
      pipelined = true;
    }
  if (!pipelined) {
    l = head_.forward(hidden(share.inputs, sg), share.targets, A(0), nullptr);
    free_head();
  }
  // Each context-parallel rank summed its own tokens' losses.
  return cp_.active() ? parallel::all_reduce_host<B>(cp_.comm(), l) : l;
}

template <class T, Backend B, class Block>
auto Transformer<T, B, Block>::logits(std::span<const std::int32_t> inputs, Geometry g) -> Tensor<A> {
  Tensor<A> z = head_.logits(final_hidden(inputs, g));
  free_head();
  return download<B>(z);
}

template <class T, Backend B, class Block>
auto Transformer<T, B, Block>::last_logits(std::span<const std::int32_t> inputs, Geometry g) -> Tensor<A> {
  return last_row_logits(final_hidden(inputs, g), g);
}

template <class T, Backend B, class Block>
auto Transformer<T, B, Block>::cached_last_logits(std::span<const std::int32_t> inputs, KvCache<T>& cache)
    -> Tensor<A> {
  TESSERA_CHECK(decodes_with_kv_cache(),
                "model: decoding through a KV cache needs a block whose attention reads it (nn::KvCacheLayer), a "
                "backend whose attention takes its keys (attends_past_keys), the whole model on this rank (no "
                "tensor, context or pipeline parallelism) and no float8 GEMMs");
  const auto n = static_cast<std::int64_t>(inputs.size());
  TESSERA_CHECK(n > 0, "model: decoding no new tokens");
  TESSERA_CHECK(cache.length() + n <= std::min(cache.capacity(), args_.max_seq_len), "model: ", n,
                " new tokens after the ", cache.length(), " a KV cache holds go past its capacity of ",
                cache.capacity(), " or max_seq_len ", args_.max_seq_len);
  Geometry g{1, n};
  g.past = cache.length();
  check_geometry(inputs, g);
  Tensor<T> hn = hidden(inputs, g, &cache);
  cache.advance(n, "model");
  return last_row_logits(hn, g);
}

template <class T, Backend B, class Block>
auto Transformer<T, B, Block>::last_row_logits(const Tensor<T>& hn, Geometry g) -> Tensor<A> {
  Tensor<T> last = B::template empty<T>(Shape{g.batch, args_.dim});
  for (std::int64_t b = 0; b < g.batch; ++b)
    B::for_each(args_.dim,
                ops::Copy<T>{hn.data() + ((b + 1) * g.seq_len - 1) * args_.dim, last.data() + b * args_.dim});
  Tensor<A> z = head_.logits(last);
  free_head();
  return download<B>(z);
}

template <class T, Backend B, class Block>
std::vector<std::string> Transformer<T, B, Block>::parameter_names() const {
  std::vector<std::string> names = {"tok_embeddings.weight"};
  std::vector<std::string> block;  // one block's names, "layers.0." stripped
  visit_one_block([&](Parameter<T>& p) { block.push_back(p.name.substr(9)); });
  for (std::int64_t i = 0; i < args_.n_layers; ++i)
    for (const auto& n : block) names.push_back("layers." + std::to_string(i) + "." + n);
  names.push_back("norm.weight");
  if (!args_.tie_embeddings) names.push_back("output.weight");
  if (output_lora_) {
    names.push_back("output.lora_a.weight");
    names.push_back("output.lora_b.weight");
  }
  return names;
}

template <class T, Backend B, class Block>
void Transformer<T, B, Block>::check_batch(std::int64_t batch, std::int64_t seq_len) const {
  const std::int64_t mb = runtime_.microbatch_size(batch);
  const parallel::Wording w = plan_.wording();
  TESSERA_CHECK(!tp_.sequence_parallel() || (mb * seq_len) % tp_.degree() == 0,
                w(pipeline_degree() > 1 ? parallel::settings::microbatch_size : parallel::settings::local_batch_size),
                " x ", w(parallel::settings::seq_len), " (", mb, " x ", seq_len, " = ", mb * seq_len,
                " tokens) does not split into equal rows over ",
                w.from_config ? w(parallel::settings::tensor_parallel_degree, tp_.degree()) + " ranks"
                              : tessera::detail::concat("the ", tp_.degree(), " tensor-parallel ranks"));
}

}  // namespace tessera::nn
