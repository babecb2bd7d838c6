// Evaluation: the mean next-token cross-entropy of a model over a token stream.
//
// The stream is cut into consecutive, non-overlapping windows of seq_len tokens (the
// last one may be shorter); each window predicts its own next tokens, so a window of n
// tokens contributes n - 1 predictions (inputs are its first n - 1 tokens, targets its
// last n - 1). No token is predicted from context outside its window. This is the
// perplexity Hugging Face's documentation computes with stride = max_length.
// Full windows go through the model `batch` at a time; nothing is saved for backward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/layer/layer.hpp"

namespace tessera::train {

struct EvalResult {
  double loss_sum = 0;      // sum of token cross-entropies, in nats
  std::int64_t tokens = 0;  // predictions made
  double loss() const { return tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0; }
  double perplexity() const { return std::exp(loss()); }
};

/// Evaluates `model` over `tokens` in windows of `seq_len` (see above). `source` names
/// the stream in errors; `progress(done, total)` is called after each batch with the
/// predictions made so far and in all.
template <class Model>
EvalResult evaluate(Model& model, std::span<const std::uint32_t> tokens, std::int64_t seq_len, std::int64_t batch,
                    const std::string& source, const std::function<void(std::int64_t, std::int64_t)>& progress = {}) {
  const std::int64_t vocab = model.args().vocab_size;
  TESSERA_CHECK(seq_len >= 2, source, ": windows of ", seq_len, " tokens make no prediction (need at least 2)");
  TESSERA_CHECK(seq_len - 1 <= model.args().max_seq_len, source, ": windows of ", seq_len, " tokens need ",
                seq_len - 1, " positions, more than the model's ", model.args().max_seq_len);
  TESSERA_CHECK(batch >= 1, source, ": batch must be positive");
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TESSERA_CHECK(tokens[i] < static_cast<std::uint64_t>(vocab), source, ": token id ", tokens[i], " at index ", i,
                  " is outside the model's vocabulary of ", vocab);
  }
  const auto n = static_cast<std::int64_t>(tokens.size());
  const std::int64_t full = n / seq_len;
  const std::int64_t tail = n - full * seq_len;  // a last, shorter window
  const std::int64_t total = full * (seq_len - 1) + std::max<std::int64_t>(tail - 1, 0);

  EvalResult r;
  std::vector<std::int32_t> inputs, targets;
  auto run = [&](std::int64_t first, std::int64_t windows, std::int64_t len) {
    // `windows` windows of `len` tokens starting at token `first`.
    inputs.resize(static_cast<std::size_t>(windows * (len - 1)));
    targets.resize(inputs.size());
    for (std::int64_t w = 0; w < windows; ++w) {
      const std::uint32_t* win = tokens.data() + first + w * len;
      for (std::int64_t t = 0; t + 1 < len; ++t) {
        inputs[static_cast<std::size_t>(w * (len - 1) + t)] = static_cast<std::int32_t>(win[t]);
        targets[static_cast<std::size_t>(w * (len - 1) + t)] = static_cast<std::int32_t>(win[t + 1]);
      }
    }
    r.loss_sum += model.loss(inputs, targets, nn::Geometry{windows, len - 1});
    r.tokens += windows * (len - 1);
    if (progress) progress(r.tokens, total);
  };
  for (std::int64_t w = 0; w < full; w += batch) run(w * seq_len, std::min(batch, full - w), seq_len);
  if (tail >= 2) run(full * seq_len, 1, tail);
  return r;
}

}  // namespace tessera::train
