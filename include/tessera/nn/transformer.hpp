// The Llama model: token embedding, a stack of blocks, final norm, output head and loss.
//
// Transformer<T, B, Block> takes any Block satisfying the Layer concept and
// constructible from BlockArgs, so a user's own block type gets the same model,
// trainer and policies. One training micro-step is
//   h = embed(ids) -> block_0 ... block_{L-1} -> norm -> fused head + loss (+ dh)
//   then norm, blocks (in reverse) and embedding backward,
// each block's saved activations released as soon as its backward ran.
#pragma once

#include <cstdint>
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

namespace tessera::nn {

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
  static_assert(Layer<Block>, "tessera: Transformer<T, B, Block>: Block must satisfy tessera::nn::Layer "
                              "(forward, backward over a Context, for_each_parameter)");
  static_assert(std::is_constructible_v<Block, const BlockArgs<T, B>&>,
                "tessera: Transformer<T, B, Block>: Block must be constructible from BlockArgs<T, B>");

 public:
  using scalar_type = T;
  using backend_type = B;
  using block_type = Block;

  explicit Transformer(const ModelArgs& args)
      : args_((args.validate(), args)),
        rope_(std::make_shared<RopeTable<T, B>>(args.head_dim(), args.rope_theta, args.rope_scaling)),
        tok_embeddings_("tok_embeddings", args.vocab_size, args.dim,
                        args.tie_embeddings ? Init::truncated_normal(0.02) : Init::normal(1.0)),
        norm_("norm", args.dim, args.norm_eps) {
    layers_.reserve(static_cast<std::size_t>(args.n_layers));
    for (std::int64_t i = 0; i < args.n_layers; ++i)
      layers_.emplace_back(BlockArgs<T, B>{args_, i, "layers." + std::to_string(i), rope_});
    if (!args.tie_embeddings) {
      const double std = 1.0 / std::sqrt(static_cast<double>(args.dim));
      output_ = std::make_unique<Parameter<T>>("output.weight", Shape{args.vocab_size, args.dim},
                                               Init::truncated_normal(std, -3 * std, 3 * std));
    }
    head_ = ChunkedCrossEntropyHead<T, B>(output_ ? output_.get() : &tok_embeddings_.weight());
    stores_.resize(layers_.size());
  }
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelArgs& args() const { return args_; }

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

  void zero_grad() {
    for_each_parameter([](Parameter<T>& p) { B::for_each(p.numel(), ops::Fill<T>{T(0), p.grad.data()}); });
  }

  std::int64_t num_params() {
    std::int64_t n = 0;
    for_each_parameter([&](Parameter<T>& p) { n += p.numel(); });
    return n;
  }

  /// Forward and backward of one micro-batch; accumulates gradients of
  /// loss_scale * (sum of token losses) and returns the sum of token losses.
  double forward_backward(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g,
                          double loss_scale) {
    check_geometry(inputs, g);
    Tensor<T> h = tok_embeddings_.forward(inputs);
    for (std::size_t i = 0; i < layers_.size(); ++i) h = layers_[i].forward(Context<T>(g, &stores_[i]), h);
    ActivationStore<T> norm_store;
    Tensor<T> hn = norm_.forward(Context<T>(g, &norm_store), h);
    h.release();
    Tensor<T> dhn = B::template empty<T>(hn.shape());
    double loss = head_.forward(hn, targets, static_cast<T>(loss_scale), &dhn);
    hn.release();
    saved_bytes_peak_ = saved_bytes() + norm_store.bytes();
    Tensor<T> dh = norm_.backward(Context<T>(g, &norm_store), dhn);
    norm_store.clear();
    dhn.release();
    for (std::size_t i = layers_.size(); i-- > 0;) {
      dh = layers_[i].backward(Context<T>(g, &stores_[i]), dh);
      stores_[i].clear();
    }
    tok_embeddings_.backward(inputs, dh);
    return loss;
  }

  /// Sum of token losses, no gradients and nothing saved.
  double loss(std::span<const std::int32_t> inputs, std::span<const std::int32_t> targets, Geometry g) {
    return head_.forward(final_hidden(inputs, g), targets, T(0), nullptr);
  }

  /// Logits (batch * seq_len, vocab) at every position; for evaluation and checks on
  /// small inputs (a whole (rows, vocab) matrix is made at once).
  Tensor<T> logits(std::span<const std::int32_t> inputs, Geometry g) { return head_.logits(final_hidden(inputs, g)); }

  /// Logits (batch, vocab) at the last position of each sequence.
  Tensor<T> last_logits(std::span<const std::int32_t> inputs, Geometry g) {
    Tensor<T> hn = final_hidden(inputs, g);
    Tensor<T> last = B::template empty<T>(Shape{g.batch, args_.dim});
    for (std::int64_t b = 0; b < g.batch; ++b)
      for (std::int64_t j = 0; j < args_.dim; ++j) last[b * args_.dim + j] = hn[((b + 1) * g.seq_len - 1) * args_.dim + j];
    return head_.logits(last);
  }

  /// Bytes of activations the last forward_backward held at the loss (its peak).
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

  Tensor<T> final_hidden(std::span<const std::int32_t> inputs, Geometry g) {
    check_geometry(inputs, g);
    Tensor<T> h = tok_embeddings_.forward(inputs);
    for (auto& l : layers_) h = l.forward(Context<T>(g, nullptr), h);
    return norm_.forward(Context<T>(g, nullptr), h);
  }

  std::size_t saved_bytes() const {
    std::size_t n = 0;
    for (const auto& s : stores_) n += s.bytes();
    return n;
  }

  ModelArgs args_;
  std::shared_ptr<RopeTable<T, B>> rope_;
  Embedding<T, B> tok_embeddings_;
  std::vector<Block> layers_;
  RmsNorm<T, B> norm_;
  std::unique_ptr<Parameter<T>> output_;
  ChunkedCrossEntropyHead<T, B> head_{nullptr};
  std::vector<ActivationStore<T>> stores_;
  std::size_t saved_bytes_peak_ = 0;
};

}  // namespace tessera::nn
