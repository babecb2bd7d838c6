// Sampling text from a model: temperature and top-k over the last position's logits,
// with a counter-based generator (the draw for token i depends only on seed and i).
//
// The model sees the last `context` tokens. Where it decodes through a KV cache
// (Transformer::decodes_with_kv_cache: tessera's blocks on the CPU backend) the window's
// tokens are cached as they come, so each new token's forward runs over its own row; once
// the sequence outgrows the window, the window moves on by a token each step and runs
// again whole, as without a cache (the positions of its tokens change). The cache changes
// what a token costs, never the text: the logits are the same to rounding. Elsewhere each
// new token reruns the model over the whole window.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/layer/kv_cache.hpp"
#include "tessera/layer/layer.hpp"

namespace tessera::nn {

struct SampleOptions {
  std::int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0: greedy
  std::int64_t top_k = 0;    // 0: the whole vocabulary
  std::uint64_t seed = 0;
  std::int64_t context = 256;                // tokens the model sees at most
  std::int64_t stop_token = -1;              // stop after emitting this id
  std::int64_t vocab_limit = 0;              // sample ids below this only (the tokenizer's size); 0: all
  bool kv_cache = true;                      // decode through a KV cache where the model can (false: run
                                             // the whole window for each token)
};

/// Picks one id from logits: argmax at temperature 0, else a draw from the softmax of
/// logits / temperature restricted to the top_k largest.
template <class T>
std::int32_t sample_token(const T* logits, std::int64_t vocab, const SampleOptions& o, std::uint64_t draw_index) {
  if (o.vocab_limit > 0) vocab = std::min(vocab, o.vocab_limit);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  auto by_logit = [&](std::int32_t a, std::int32_t b) { return logits[a] > logits[b]; };
  if (o.temperature <= 0) return *std::min_element(ids.begin(), ids.end(), by_logit);
  std::int64_t k = o.top_k > 0 ? std::min(o.top_k, vocab) : vocab;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
  std::vector<double> p(static_cast<std::size_t>(k));
  const double m = static_cast<double>(logits[ids[0]]);
  double sum = 0;
  for (std::int64_t i = 0; i < k; ++i) sum += p[i] = std::exp((static_cast<double>(logits[ids[i]]) - m) / o.temperature);
  std::uint32_t w[4];
  Philox4x32(mix64(o.seed)).draw(draw_index, 1, 0, w);
  double u = uniform_open(w[0], w[1]) * sum;
  for (std::int64_t i = 0; i < k; ++i) {
    u -= p[i];
    if (u <= 0) return ids[i];
  }
  return ids[k - 1];
}

namespace detail {
/// The sampling loop over `prompt` (not empty): logits_after(ids, start) gives the logits
/// (1, vocab) after the window ids[start, end), the last `context` tokens.
template <class LogitsAfter>
std::vector<std::int32_t> sample_tokens(std::vector<std::int32_t> prompt, const SampleOptions& o,
                                        std::int64_t context, LogitsAfter&& logits_after) {
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < o.max_new_tokens; ++i) {
    const std::size_t n = std::min<std::size_t>(prompt.size(), static_cast<std::size_t>(context));
    const auto logits = logits_after(std::span<const std::int32_t>(prompt), prompt.size() - n);
    const std::int32_t next = sample_token(logits.data(), logits.size(1), o, static_cast<std::uint64_t>(i));
    out.push_back(next);
    prompt.push_back(next);
    if (next == o.stop_token) break;
  }
  return out;
}
}  // namespace detail

/// Continues `prompt` (not empty) by up to max_new_tokens ids; returns the new ids.
template <class Model>
std::vector<std::int32_t> generate(Model& model, std::vector<std::int32_t> prompt, const SampleOptions& o) {
  TESSERA_CHECK(!prompt.empty(), "generate: the prompt needs at least one token (e.g. BOS)");
  TESSERA_CHECK(o.context > 0, "generate: a context of ", o.context, " tokens");
  const std::int64_t context = std::min(o.context, model.args().max_seq_len);
  if constexpr (requires { model.decodes_with_kv_cache(); })
    if (o.kv_cache && model.decodes_with_kv_cache()) {
      // Room for every token the window can hold in this call.
      const auto most = static_cast<std::int64_t>(prompt.size()) + o.max_new_tokens;
      KvCache<typename Model::scalar_type> cache(std::max<std::int64_t>(1, std::min(context, most)));
      std::size_t cached_from = 0;  // where in the sequence the cache's tokens begin
      return detail::sample_tokens(std::move(prompt), o, context,
                                   [&](std::span<const std::int32_t> ids, std::size_t start) {
                                     if (start != cached_from) {  // the window moved on: its positions changed
                                       cache.clear();
                                       cached_from = start;
                                     }
                                     return model.cached_last_logits(
                                         ids.subspan(start + static_cast<std::size_t>(cache.length())), cache);
                                   });
    }
  return detail::sample_tokens(std::move(prompt), o, context, [&](std::span<const std::int32_t> ids, std::size_t start) {
    const auto n = static_cast<std::int64_t>(ids.size() - start);
    return model.last_logits(ids.subspan(start), Geometry{1, n});
  });
}

/// Samples a continuation of the text `prompt` (after a BOS token) and decodes it, with
/// any io::Tokenizer. Sampling stops at EOS and never picks an id the tokenizer cannot
/// decode. The text is valid UTF-8: a small model's ids need not spell whole characters,
/// and each ill-formed piece becomes U+FFFD as in Python's decode(errors="replace").
template <class Model>
std::string generate_text(Model& model, const io::Tokenizer& tok, std::string_view prompt, SampleOptions o) {
  std::vector<std::int32_t> ids;
  for (auto t : tok.encode(prompt, true, false)) ids.push_back(static_cast<std::int32_t>(t));
  o.stop_token = static_cast<std::int64_t>(tok.eos_id());
  o.vocab_limit = tok.vocab_size();
  const std::vector<std::int32_t> out = generate(model, std::move(ids), o);
  return io::valid_utf8(tok.decode(std::vector<std::uint32_t>(out.begin(), out.end())));
}

/// The assistant's answer to `messages` (ending with a user message) in a chat format:
/// the conversation's ids with the generation prompt (io::chat_tokens), continued until
/// the turn ends (<|eot_id|> in llama3, EOS in llama2), decoded without its end and
/// stripped of the white space the format puts around a reply.
template <class Model>
std::string generate_chat_reply(Model& model, const io::Tokenizer& tok, io::ChatFormat format,
                                std::span<const io::ChatMessage> messages, SampleOptions o) {
  TESSERA_CHECK(!messages.empty() && messages.back().role == "user",
                "generate_chat_reply: the conversation must end with a user message");
  const io::ChatTokens prompt = io::chat_tokens(format, tok, messages, "the chat prompt", true);
  o.stop_token = format == io::ChatFormat::llama3 ? *tok.special_id("<|eot_id|>") : tok.eos_id();
  o.vocab_limit = tok.vocab_size();
  const std::vector<std::int32_t> out =
      generate(model, std::vector<std::int32_t>(prompt.ids.begin(), prompt.ids.end()), o);
  return io::valid_utf8(std::string(io::python_strip(tok.decode(std::vector<std::uint32_t>(out.begin(), out.end())))));
}

}  // namespace tessera::nn
