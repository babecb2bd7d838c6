// Llama model arguments, the flavors torchtitan and Meta ship, and their derived sizes.
//
// A flavor is a named ModelArgs; a config may override any field after picking one.
// validate() rejects shapes that do not divide, naming the fields involved, and models past
// 2^48 parameters (max_params), before anything counts them in integers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/ops/rope.hpp"

namespace tessera::nn {

/// Llama 3.1 RoPE frequency scaling, a model argument (its arithmetic is ops/rope.hpp's).
using RopeScaling = ops::RopeScaling;

/// Training FLOPs per token by torchtitan's formula: 6 x the parameters that are not the
/// token embedding (a lookup, not a matmul) plus `attention_flops`, the attention term of
/// every layer (matmuls between activations, which the parameters do not count), halved
/// on request: causal attention computes half of the T x T square. Both ModelArgs (the
/// Llama model, for the plan) and nn::Transformer (any block) count by it.
/// `frozen_params` (of the non-embedding ones, counted apart from `non_embedding_params`):
/// frozen weights (LoRA) count 4, their forward and their input's gradient, since no
/// gradient of theirs is computed.
inline double training_flops_per_token(std::int64_t non_embedding_params, double attention_flops,
                                       bool causal_halved, std::int64_t frozen_params = 0) {
  return 6.0 * static_cast<double>(non_embedding_params) + 4.0 * static_cast<double>(frozen_params) +
         (causal_halved ? attention_flops / 2 : attention_flops);
}

struct ModelArgs {
  std::string flavor = "debugmodel";
  std::int64_t dim = 256;
  std::int64_t n_layers = 6;
  std::int64_t n_heads = 16;
  std::int64_t n_kv_heads = 0;  // 0: same as n_heads
  std::int64_t vocab_size = 260;
  std::int64_t multiple_of = 256;
  double ffn_dim_multiplier = 0.0;  // 0: none
  std::int64_t ffn_hidden = 0;       // > 0: the SwiGLU hidden size as given (Hugging Face's
                                     // intermediate_size); 0: derived from the two above
  double norm_eps = 1e-5;
  double rope_theta = 500000.0;
  RopeScaling rope_scaling{};
  std::int64_t max_seq_len = 2048;
  bool tie_embeddings = false;
  bool depth_init = true;  // torchtitan: output projections scaled by layer depth

  /// The largest model validate() lets through: 2^48 parameters (about 700 times Llama 3.1
  /// 405B), so that the counts, bytes and FLOPs derived from a model's sizes stay far
  /// inside 64-bit integers whatever a config file claims.
  static constexpr double max_params = 281474976710656.0;

  std::int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  std::int64_t head_dim() const { return dim / n_heads; }

  /// The SwiGLU hidden size: ffn_hidden when set, else 2/3 of 4*dim, times
  /// ffn_dim_multiplier, rounded up to multiple_of (Meta's and torchtitan's rule).
  std::int64_t ffn_hidden_dim() const {
    if (ffn_hidden > 0) return ffn_hidden;
    auto hidden = static_cast<std::int64_t>(2 * (4 * dim) / 3);
    if (ffn_dim_multiplier > 0) hidden = static_cast<std::int64_t>(ffn_dim_multiplier * static_cast<double>(hidden));
    return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
  }

  /// The parameter count in `N`'s arithmetic for a SwiGLU hidden size `ffn` (num_params in
  /// integers; validate() in doubles, which cannot overflow, before any integer count).
  template <class N>
  N params_with(N ffn) const {
    const N d = static_cast<N>(dim), h = static_cast<N>(n_heads), hd = static_cast<N>(head_dim());
    const N kv = static_cast<N>(kv_heads()), v = static_cast<N>(vocab_size), layers = static_cast<N>(n_layers);
    const N attn = d * h * hd + N(2) * d * kv * hd + h * hd * d;
    const N block = attn + N(3) * d * ffn + N(2) * d;
    const N head = tie_embeddings ? N(0) : v * d;
    return v * d + layers * block + d + head;
  }

  /// Rejects arguments no model can be built from; `where` names their source.
  void validate(std::string_view where = "model") const {
    auto positive = [&](std::int64_t v, const char* key) {
      TESSERA_CHECK(v > 0, where, ": ", key, " must be positive, got ", v);
    };
    positive(dim, "dim");
    positive(n_layers, "n_layers");
    positive(n_heads, "n_heads");
    positive(vocab_size, "vocab_size");
    positive(multiple_of, "multiple_of");
    positive(max_seq_len, "max_seq_len");
    // Sizes past 2^48 parameters are refused before anything counts in integers: the
    // SwiGLU hidden size and the count are estimated in doubles first.
    const auto within = [&](double v, const char* what) {
      TESSERA_CHECK(v <= max_params, where, ": ", what, " is ", v, ", past the ", max_params,
                    " (2^48) parameters tessera takes for a whole model");
    };
    for (auto [v, key] : {std::pair{dim, "dim"}, std::pair{n_layers, "n_layers"}, std::pair{n_heads, "n_heads"},
                          std::pair{n_kv_heads, "n_kv_heads"}, std::pair{vocab_size, "vocab_size"},
                          std::pair{multiple_of, "multiple_of"}, std::pair{ffn_hidden, "ffn_hidden"},
                          std::pair{max_seq_len, "max_seq_len"}})
      within(static_cast<double>(v), key);
    TESSERA_CHECK(std::isfinite(ffn_dim_multiplier), where, ": ffn_dim_multiplier must be finite");
    const double ffn = ffn_hidden > 0 ? static_cast<double>(ffn_hidden)
                                      : static_cast<double>(multiple_of) +
                                            std::max(ffn_dim_multiplier, 1.0) * 8.0 * static_cast<double>(dim) / 3.0;
    within(ffn, "the feed-forward hidden size");
    within(params_with<double>(ffn), "the parameter count");
    TESSERA_CHECK(ffn_hidden >= 0, where, ": ffn_hidden must not be negative, got ", ffn_hidden);
    TESSERA_CHECK(n_kv_heads >= 0, where, ": n_kv_heads must not be negative, got ", n_kv_heads);
    TESSERA_CHECK(dim % n_heads == 0, where, ": n_heads (", n_heads, ") does not divide dim (", dim, ")");
    TESSERA_CHECK(n_heads % kv_heads() == 0, where, ": n_kv_heads (", kv_heads(),
                  ") does not divide n_heads (", n_heads, ")");
    TESSERA_CHECK(head_dim() % 2 == 0, where, ": head dim dim/n_heads = ", head_dim(),
                  " must be even for rotary embeddings");
    TESSERA_CHECK(ffn_dim_multiplier >= 0, where, ": ffn_dim_multiplier must not be negative");
    TESSERA_CHECK(norm_eps > 0, where, ": norm_eps must be positive");
    TESSERA_CHECK(rope_theta > 0, where, ": rope_theta must be positive");
    if (rope_scaling.enabled) {
      TESSERA_CHECK(rope_scaling.factor >= 1 && rope_scaling.high_freq_factor > rope_scaling.low_freq_factor &&
                        rope_scaling.original_max_position > 0,
                    where, ": rope_scaling needs factor >= 1, high_freq_factor > low_freq_factor and a "
                    "positive original_max_position");
    }
  }

  /// Parameters in the whole Llama model (nn::Transformer::num_params counts any block's).
  std::int64_t num_params() const { return params_with<std::int64_t>(ffn_hidden_dim()); }

  /// Parameters of the token embedding (torchtitan leaves them out of the FLOP count).
  std::int64_t num_embedding_params() const { return vocab_size * dim; }

  /// torchtitan's attention term of one layer, per token: 12 H hd T (q k^T and p v over
  /// the whole T x T square, forward and backward), with no causal halving.
  double attention_flops_per_token(std::int64_t seq_len) const {
    return 12.0 * static_cast<double>(n_heads) * static_cast<double>(head_dim()) * static_cast<double>(seq_len);
  }

  /// Training FLOPs per token of the Llama model by torchtitan's formula, 6 N_non-embedding
  /// + 12 L H hd T, with no causal halving; `causal_halved` gives the attention term
  /// halved (nn::Transformer::flops_per_token counts any block's).
  double flops_per_token(std::int64_t seq_len, bool causal_halved = false) const {
    return training_flops_per_token(num_params() - num_embedding_params(),
                                    static_cast<double>(n_layers) * attention_flops_per_token(seq_len), causal_halved);
  }
};

/// Every flavor tessera knows, by the names torchtitan and Hugging Face use.
inline std::vector<ModelArgs> model_flavors() {
  std::vector<ModelArgs> f;
  auto add = [&](const char* name, auto&& edit) {
    ModelArgs a;
    a.flavor = name;
    edit(a);
    f.push_back(a);
  };
  RopeScaling llama31{true, 8.0, 1.0, 4.0, 8192};
  RopeScaling llama32{true, 32.0, 1.0, 4.0, 8192};
  // debugmodel: torchtitan's debug shape, with the byte tokenizer's vocabulary.
  add("debugmodel", [](ModelArgs& a) {
    a.dim = 256, a.n_layers = 6, a.n_heads = 16, a.vocab_size = 260, a.rope_theta = 500000, a.max_seq_len = 2048;
  });
  add("llama2_7b", [](ModelArgs& a) {
    a.dim = 4096, a.n_layers = 32, a.n_heads = 32, a.vocab_size = 32000, a.multiple_of = 256,
    a.rope_theta = 10000, a.max_seq_len = 4096;
  });
  add("llama2_13b", [](ModelArgs& a) {
    a.dim = 5120, a.n_layers = 40, a.n_heads = 40, a.vocab_size = 32000, a.multiple_of = 256,
    a.rope_theta = 10000, a.max_seq_len = 4096;
  });
  add("llama2_70b", [](ModelArgs& a) {
    a.dim = 8192, a.n_layers = 80, a.n_heads = 64, a.n_kv_heads = 8, a.vocab_size = 32000,
    a.multiple_of = 4096, a.ffn_dim_multiplier = 1.3, a.rope_theta = 10000, a.max_seq_len = 4096;
  });
  auto llama3 = [](std::int64_t dim, std::int64_t layers, std::int64_t heads, std::int64_t mult,
                   double ffn_mult, RopeScaling scaling, std::int64_t max_seq) {
    return [=](ModelArgs& a) {
      a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.n_kv_heads = 8, a.vocab_size = 128256,
      a.multiple_of = mult, a.ffn_dim_multiplier = ffn_mult, a.rope_theta = 500000,
      a.rope_scaling = scaling, a.max_seq_len = max_seq;
    };
  };
  add("llama3_8b", llama3(4096, 32, 32, 1024, 1.3, {}, 8192));
  add("llama3_70b", llama3(8192, 80, 64, 4096, 1.3, {}, 8192));
  add("llama3.1_8b", llama3(4096, 32, 32, 1024, 1.3, llama31, 131072));
  add("llama3.1_70b", llama3(8192, 80, 64, 4096, 1.3, llama31, 131072));
  add("llama3.1_405b", llama3(16384, 126, 128, 4096, 1.2, llama31, 131072));
  add("llama3.2_1b", [&](ModelArgs& a) {
    llama3(2048, 16, 32, 256, 1.5, llama32, 131072)(a);
    a.tie_embeddings = true;
  });
  add("llama3.2_3b", [&](ModelArgs& a) {
    llama3(3072, 28, 24, 256, 1.0, llama32, 131072)(a);
    a.tie_embeddings = true;
  });
  return f;
}

/// The flavor called `name`; the error lists the known ones.
inline ModelArgs model_flavor(std::string_view name) {
  std::string known;
  for (const auto& a : model_flavors()) {
    if (a.flavor == name) return a;
    known += (known.empty() ? "" : ", ") + a.flavor;
  }
  fail("model.flavor: unknown flavor '", name, "' (known: ", known, ")");
}

}  // namespace tessera::nn
