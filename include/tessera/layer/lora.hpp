// LoRA: low-rank adapters beside frozen linear layers (torchtitan's "lora" converter).
//
// A linear layer y = x W^T the policy takes gains two small weights, A (rank x in) and
// B (out x rank), and computes
//
//   y = x W^T + s (x A^T) B^T,   s = alpha / rank,
//
// with W frozen: only A and B train. A starts as torch.nn.Linear's default
// (kaiming_uniform_ with a = sqrt(5): uniform on +-1/sqrt(in)), B at zero, so the model
// starts as the one the adapters were added to. Every other parameter of the model (the
// embedding, the norms, the layers the policy does not take) is frozen too: it keeps its
// value, has no gradient, and the optimizer holds nothing for it. The adapters are named
// after their layer as torchtitan names them: "layers.0.attention.wq.lora_a.weight".
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/layer/args.hpp"

namespace tessera::nn {

struct LoraPolicy {
  bool enabled = false;
  /// The adapters' rank r (lora.rank).
  std::int64_t rank = 8;
  /// The adapters' output is scaled by alpha / rank (lora.alpha).
  double alpha = 16.0;
  /// The layers that gain adapters, by the last part of their name ("wq", "w2",
  /// "output"); empty: every linear layer (torchtitan's None). lora.target_modules.
  std::vector<std::string> target_modules;

  /// Whether the linear layer `name` ("layers.3.attention.wq", "output") gains adapters.
  bool applies(std::string_view name) const {
    if (!enabled) return false;
    if (target_modules.empty()) return true;
    const std::size_t dot = name.rfind('.');
    const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
    return std::find(target_modules.begin(), target_modules.end(), last) != target_modules.end();
  }
  /// s = alpha / rank.
  float scaling() const { return static_cast<float>(alpha / static_cast<double>(rank)); }
};

/// Whether `name` is a LoRA adapter's weight ("....wq.lora_a.weight", "output.lora_b.weight").
inline bool is_lora_name(std::string_view name) {
  return name.ends_with(".lora_a.weight") || name.ends_with(".lora_b.weight");
}

/// The linear layers' names the policy may take, as target_modules names them.
inline const std::vector<std::string>& lora_target_names() {
  static const std::vector<std::string> names{"wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"};
  return names;
}

/// The adapters' parameters `policy` adds to the Llama model `a`: rank x (in + out) for
/// each linear layer it takes (nn::Transformer counts any block's as made).
inline std::int64_t lora_params(const ModelArgs& a, const LoraPolicy& policy) {
  if (!policy.enabled) return 0;
  const std::int64_t d = a.dim, q = a.n_heads * a.head_dim(), kv = a.kv_heads() * a.head_dim(), h = a.ffn_hidden_dim();
  struct Layer {
    const char* name;
    std::int64_t in, out;
  };
  const std::array<Layer, 7> block{{{"wq", d, q}, {"wk", d, kv}, {"wv", d, kv}, {"wo", q, d}, {"w1", d, h},
                                    {"w2", h, d}, {"w3", d, h}}};
  std::int64_t per_block = 0;
  for (const Layer& l : block)
    if (policy.applies(l.name)) per_block += policy.rank * (l.in + l.out);
  const std::int64_t head = !a.tie_embeddings && policy.applies("output") ? policy.rank * (d + a.vocab_size) : 0;
  return a.n_layers * per_block + head;
}

/// Training FLOPs per token of the Llama model `a` under `policy` (ModelArgs::flops_per_token
/// without LoRA): every weight of the model frozen (4 a parameter: training_flops_per_token),
/// the adapters trained (6).
inline double training_flops_per_token(const ModelArgs& a, const LoraPolicy& policy, std::int64_t seq_len,
                                       bool causal_halved = false) {
  if (!policy.enabled) return a.flops_per_token(seq_len, causal_halved);
  return training_flops_per_token(lora_params(a, policy),
                                  static_cast<double>(a.n_layers) * a.attention_flops_per_token(seq_len), causal_halved,
                                  a.num_params() - a.num_embedding_params());
}

}  // namespace tessera::nn
