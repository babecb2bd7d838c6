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
// the next unit's backward runs (freeing its whole gradient). Parameters are made
// whole (initialised or loaded) first; shard() then keeps this rank's share.
#pragma once

#include <cmath>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/nn/args.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/nn/embedding.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/nn/rope.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/sharding.hpp"

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
}  // namespace detail

/// Fills p.value from its Init as a function of (seed, p.name, element index) only.
template <class T>
void init_parameter(Parameter<T>& p, std::uint64_t seed) {
  const Philox4x32 rng = parameter_rng(seed, p.name);
  T* v = p.value.data();
  const std::int64_t n = p.numel();
  const Init& in = p.init;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto idx = static_cast<std::uint64_t>(i);
    switch (in.kind) {
      case Init::Kind::ones: v[i] = T(1); break;
      case Init::Kind::zeros: v[i] = T(0); break;
      case Init::Kind::normal: v[i] = static_cast<T>(normal(rng, idx, 0.0, in.std)); break;
      case Init::Kind::truncated_normal:
        v[i] = static_cast<T>(truncated_normal(rng, idx, 0.0, in.std, in.lo, in.hi));
        break;
    }
  }
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

  explicit Transformer(const ModelArgs& args, const parallel::Plan& plan = {})
      : args_((args.validate(), args)),
        plan_(plan),
        rope_(std::make_shared<RopeTable<T, B>>(args.head_dim(), args.rope_theta, args.rope_scaling)),
        tok_embeddings_("tok_embeddings", args.vocab_size, args.dim,
                        args.tie_embeddings ? Init::truncated_normal(0.02) : Init::normal(1.0)),
        norm_("norm", args.dim, args.norm_eps) {
    for (std::int64_t i = 0; i < args.n_layers; ++i)
      layers_.emplace_back(BlockArgs<T, B>{args_, i, "layers." + std::to_string(i), rope_, &plan_});
    if (!args.tie_embeddings) {
      const double std = 1.0 / std::sqrt(static_cast<double>(args.dim));
      output_ = std::make_unique<Parameter<T>>("output.weight", Shape{args.vocab_size, args.dim},
                                               Init::truncated_normal(std, -3 * std, 3 * std));
    }
    head_ = ChunkedCrossEntropyHead<T, B>(output_ ? output_.get() : &tok_embeddings_.weight());
    for (std::size_t i = 0; i < layers_.size(); ++i) stores_.emplace_back("", &meter_);
    const parallel::ShardingMode mode = detail::block_sharding<Block>(plan_);
    if (mode != parallel::ShardingMode::none || plan_.dp_degree() > 1) {
      // Tied weights: the head needs the embedding's parameters, so that unit stays
      // gathered from its forward to its backward.
      const bool reshard_embedding = plan_.reshard != parallel::Reshard::never && !args.tie_embeddings;
      embedding_unit_ = std::make_unique<Unit>("tok_embeddings", mode, plan_, reshard_embedding);
      tok_embeddings_.for_each_parameter([&](Parameter<T>& p) { embedding_unit_->add(p); });
      head_unit_ = std::make_unique<Unit>("norm+output", mode, plan_, plan_.reshard == parallel::Reshard::always);
      norm_.for_each_parameter([&](Parameter<T>& p) { head_unit_->add(p); });
      if (output_) head_unit_->add(*output_);
    }
  }
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelArgs& args() const { return args_; }
  const parallel::Plan& plan() const { return plan_; }

  /// Every parameter once, in a fixed order: embedding, blocks, norm, output.
  template <class F>
  void for_each_parameter(F&& f) {
    tok_embeddings_.for_each_parameter(f);
    for (auto& l : layers_) l.for_each_parameter(f);
    norm_.for_each_parameter(f);
    if (output_) f(*output_);
  }

  void init_weights(std::uint64_t seed) {
    for_each_parameter([&](Parameter<T>& p) { init_parameter(p, seed); });
  }

  /// Keeps this rank's share of every parameter (data-parallel sharding); a no-op on
  /// one rank. Call it once the parameters are initialised or loaded: every rank
  /// holds the same whole values then.
  void shard() {
    for_each_unit([](Unit& u) { u.shard(); });
    sharded_ = true;
  }
  bool sharded() const { return sharded_ || !embedding_unit_; }

  /// The parameters this rank updates: flat shards under FSDP/HSDP, else the parameters.
  template <class F>
  void for_each_local_parameter(F&& f) {
    if (!embedding_unit_) return for_each_parameter(f);
    for_each_unit([&](Unit& u) { u.for_each_local_parameter(f); });
  }

  void zero_grad() {
    for_each_local_parameter([](Parameter<T>& p) { B::for_each(p.numel(), ops::Fill<T>{T(0), p.grad.data()}); });
  }

  /// The L2 norm of the whole gradient, over every shard of every rank (every rank
  /// gets the same value).
  double grad_norm() {
    double s = 0;
    for_each_local_parameter([&](Parameter<T>& p) { s += optim::squared_norm<B>(p.grad); });
    // Shards are disjoint over dp_shard (and identical over dp_replicate); whole
    // gradients (DDP, one rank) are the same on every rank already.
    if (embedding_unit_ && embedding_unit_->norm_comm()) s = embedding_unit_->norm_comm()->all_reduce_value(s);
    return std::sqrt(s);
  }

  /// Runs f() with every parameter whole on every rank (for saving): gathers the
  /// shards, then frees them again.
  template <class F>
  void with_whole_parameters(F&& f) {
    for_each_unit([](Unit& u) { u.unshard(); });
    try {
      f();
    } catch (...) {
      for_each_unit([](Unit& u) { u.reshard(); });
      throw;
    }
    for_each_unit([](Unit& u) { u.reshard(); });
  }

  std::int64_t num_params() {
    std::int64_t n = 0;
    for_each_parameter([&](Parameter<T>& p) { n += p.numel(); });
    return n;
  }

  /// Forward and backward of one micro-batch; accumulates gradients of
  /// loss_scale * (sum of token losses) and returns this rank's sum of token losses.
  /// `last_micro_batch`: the step's last (DDP reduces its gradients after it). On
  /// return every gradient reduction has completed.
  double forward_backward(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
                          double loss_scale, bool last_micro_batch = true) {
    check_geometry(inputs, g);
    TESSERA_CHECK(sharded(), "model: forward_backward before shard() on a data-parallel plan");
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
    Tensor<T> hn = norm_.forward(Context<T>(g, &norm_store), h);
    h.release();
    Tensor<T> dhn = B::template empty<T>(hn.shape());
    double loss = head_.forward(hn, targets, static_cast<T>(loss_scale), &dhn);
    hn.release();

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

  /// Sum of token losses, no gradients and nothing saved.
  double loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g) {
    const double l = head_.forward(final_hidden(inputs, g), targets, T(0), nullptr);
    free_head();
    return l;
  }

  /// Logits (batch * seq_len, vocab) at every position; for evaluation and checks on
  /// small inputs (a whole (rows, vocab) matrix is made at once).
  Tensor<T> logits(std::span<const std::int32_t> inputs, Geometry g) {
    Tensor<T> z = head_.logits(final_hidden(inputs, g));
    free_head();
    return z;
  }

  /// Logits (batch, vocab) at the last position of each sequence.
  Tensor<T> last_logits(std::span<const std::int32_t> inputs, Geometry g) {
    Tensor<T> hn = final_hidden(inputs, g);
    Tensor<T> last = B::template empty<T>(Shape{g.batch, args_.dim});
    for (std::int64_t b = 0; b < g.batch; ++b)
      for (std::int64_t j = 0; j < args_.dim; ++j) last[b * args_.dim + j] = hn[((b + 1) * g.seq_len - 1) * args_.dim + j];
    Tensor<T> z = head_.logits(last);
    free_head();
    return z;
  }

  /// Peak bytes of saved activations during the last forward_backward (checkpoint
  /// stashes and recomputes included).
  std::size_t saved_activation_bytes() const { return saved_bytes_peak_; }

  Block& layer(std::size_t i) { return layers_.at(i); }
  std::size_t n_layers() const { return layers_.size(); }

 private:
  void check_geometry(std::span<const std::int32_t> inputs, Geometry g) const {
    TESSERA_CHECK(g.batch > 0 && g.seq_len > 0 && static_cast<std::int64_t>(inputs.size()) == g.rows(), "model: ",
                  inputs.size(), " tokens for a batch of ", g.batch, " x ", g.seq_len);
    TESSERA_CHECK(g.seq_len <= args_.max_seq_len, "model: seq_len ", g.seq_len, " exceeds max_seq_len ",
                  args_.max_seq_len);
  }

  /// The final normed hidden state; a sharded model gathers and frees each unit in turn.
  /// With a sharded model every rank must call it together. The head's parameters stay
  /// gathered afterwards, for the logits; free_head() frees them.
  Tensor<T> final_hidden(std::span<const std::int32_t> inputs, Geometry g) {
    check_geometry(inputs, g);
    TESSERA_CHECK(sharded(), "model: inference before shard() on a data-parallel plan");
    if (embedding_unit_) embedding_unit_->unshard();
    Tensor<T> h = tok_embeddings_.forward(inputs);
    if (embedding_unit_ && !args_.tie_embeddings) embedding_unit_->reshard();
    for (auto& l : layers_) h = l.forward(Context<T>(g, nullptr), h);
    if (head_unit_) head_unit_->unshard();
    return norm_.forward(Context<T>(g, nullptr), h);
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

  void prefetch(Unit* u) {
    if (u && plan_.prefetch) u->prefetch();
  }

  template <class F>
  void for_each_unit(F&& f) {
    if (!embedding_unit_) return;
    f(*embedding_unit_);
    for (auto& l : layers_)
      if (Unit* u = unit_of(l)) f(*u);
    f(*head_unit_);
  }

  ModelArgs args_;
  parallel::Plan plan_;
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
  bool sharded_ = false;
};

}  // namespace tessera::nn
