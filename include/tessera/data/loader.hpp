// Data loading: documents -> one token stream -> windows -> batches, sliced per rank.
//
// pack_documents concatenates documents as <|bos|> bytes <|eos|>. The DataLoader cuts the
// stream into consecutive, non-overlapping windows of seq_len + 1 tokens, as torchtitan
// packs them: inputs are a window's first seq_len tokens, targets its last seq_len (the
// inputs shifted by one). A step consumes one GLOBAL batch of local_batch_size * dp_degree
// consecutive windows, and data-parallel rank r takes windows [r * local, (r + 1) * local)
// of it, so every data-parallel layout trains on the same global batch (DESIGN principle
// 4). Tokens left over after the last whole window are not used. When the windows run
// out the loader wraps to the first one and counts an epoch; a global batch may straddle
// the wrap.
//
// A loss mask (io::TokenStream, chat data) travels with the tokens: a target whose token
// the mask leaves out (a prompt token of a chat) becomes Batch::ignore_index, so only
// the tokens the mask keeps (the assistant's replies) are predicted. The inputs are not
// masked: the model reads the whole conversation.
//
// position() counts the windows consumed since the start of epoch 0 (all ranks together);
// saving it and calling seek() with it resumes the stream exactly, epoch included.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/token_shard.hpp"  // TokenStream
#include "tessera/io/tokenizer.hpp"

namespace tessera::data {

/// Each document as BOS + its tokens + EOS, concatenated.
inline std::vector<std::uint32_t> pack_documents(const std::vector<std::string>& docs, const io::Tokenizer& tok) {
  std::size_t total = 0;
  for (const auto& d : docs) total += d.size() / 4 + 2;
  std::vector<std::uint32_t> tokens;
  tokens.reserve(total);
  for (const auto& d : docs) {
    auto ids = tok.encode(d, true, true);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
  }
  return tokens;
}

struct Batch {
  std::int64_t batch = 0, seq_len = 0;
  std::vector<std::int32_t> inputs, targets;  // row-major (batch, seq_len)
  std::int64_t n_targets = 0;                 // targets != ignore_index
  static constexpr std::int32_t ignore_index = -100;
};

/// The number of targets of `b` that are not Batch::ignore_index.
inline std::int64_t count_targets(const Batch& b) {
  std::int64_t n = 0;
  for (std::int32_t t : b.targets) n += (t != Batch::ignore_index) ? 1 : 0;
  return n;
}

class DataLoader {
 public:
  DataLoader(std::vector<std::uint32_t> tokens, std::int64_t seq_len, std::int64_t local_batch_size,
             std::int64_t dp_rank = 0, std::int64_t dp_degree = 1)
      : DataLoader(io::TokenStream{std::move(tokens), {}}, seq_len, local_batch_size, dp_rank, dp_degree) {}

  /// A token stream with its loss mask (empty: every target counts).
  DataLoader(io::TokenStream stream, std::int64_t seq_len, std::int64_t local_batch_size, std::int64_t dp_rank = 0,
             std::int64_t dp_degree = 1)
      : tokens_(std::move(stream.ids)),
        mask_(std::move(stream.loss_mask)),
        seq_len_(seq_len),
        local_batch_size_(local_batch_size),
        dp_rank_(dp_rank),
        dp_degree_(dp_degree) {
    TESSERA_CHECK(seq_len > 0, "DataLoader: seq_len must be positive, got ", seq_len);
    TESSERA_CHECK(local_batch_size > 0, "DataLoader: local_batch_size must be positive, got ", local_batch_size);
    TESSERA_CHECK(dp_degree > 0, "DataLoader: dp_degree must be positive, got ", dp_degree);
    TESSERA_CHECK(dp_rank >= 0 && dp_rank < dp_degree, "DataLoader: dp_rank ", dp_rank,
                  " is out of range for dp_degree ", dp_degree);
    TESSERA_CHECK(local_batch_size <= std::numeric_limits<std::int64_t>::max() / dp_degree,
                  "DataLoader: global batch local_batch_size x dp_degree = ", local_batch_size, " x ",
                  dp_degree, " overflows");
    TESSERA_CHECK(seq_len <= std::numeric_limits<std::int64_t>::max() / local_batch_size,
                  "DataLoader: batch local_batch_size x seq_len = ", local_batch_size, " x ", seq_len,
                  " overflows");
    const auto window = static_cast<std::uint64_t>(seq_len) + 1;
    TESSERA_CHECK(tokens_.size() >= window, "DataLoader: the token stream has ", tokens_.size(),
                  " tokens, fewer than one window of seq_len + 1 = ", window);
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      TESSERA_CHECK(tokens_[i] <= static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()),
                    "DataLoader: token id ", tokens_[i], " at index ", i, " does not fit in int32");
    }
    windows_per_epoch_ = static_cast<std::int64_t>(tokens_.size() / window);
    if (!mask_.empty()) {
      TESSERA_CHECK(mask_.size() == tokens_.size(), "DataLoader: ", tokens_.size(), " tokens but ", mask_.size(),
                    " loss mask values");
      const auto used = static_cast<std::size_t>(windows_per_epoch_) * window;
      TESSERA_CHECK(std::any_of(mask_.begin(), mask_.begin() + static_cast<std::ptrdiff_t>(used),
                                [](std::uint8_t m) { return m != 0; }),
                    "DataLoader: the loss mask leaves no target in the ", windows_per_epoch_,
                    " windows of the stream (no assistant reply to learn from?)");
    }
  }

  /// This rank's slice of the next global batch; advances every rank's position alike.
  Batch next() {
    Batch b;
    b.batch = local_batch_size_;
    b.seq_len = seq_len_;
    const auto n = static_cast<std::size_t>(local_batch_size_ * seq_len_);
    // Appended row by row, not zero-filled first and then overwritten: a third of the
    // bytes written (a dry run of a large batch spends its time here).
    b.inputs.reserve(n);
    b.targets.reserve(n);
    TESSERA_CHECK(position_ <= std::numeric_limits<std::int64_t>::max() - global_batch_size(),
                  "DataLoader: position ", position_, " overflows");
    // Each term below windows_per_epoch, so the sum cannot overflow.
    const std::int64_t wpe = windows_per_epoch_;
    const std::int64_t first = position_ % wpe + (dp_rank_ * local_batch_size_) % wpe;
    for (std::int64_t row = 0; row < local_batch_size_; ++row) {
      const std::int64_t w = (first + row % wpe) % wpe;
      // Ids fit in int32 (checked at construction): the conversion keeps every value.
      const std::uint32_t* src = tokens_.data() + w * (seq_len_ + 1);
      b.inputs.insert(b.inputs.end(), src, src + seq_len_);
      b.targets.insert(b.targets.end(), src + 1, src + seq_len_ + 1);
      if (!mask_.empty()) {
        const std::uint8_t* keep = mask_.data() + w * (seq_len_ + 1) + 1;
        std::int32_t* row_targets = b.targets.data() + row * seq_len_;
        for (std::int64_t j = 0; j < seq_len_; ++j)
          if (!keep[j]) row_targets[j] = Batch::ignore_index;
      }
    }
    b.n_targets = count_targets(b);
    position_ += local_batch_size_ * dp_degree_;
    return b;
  }

  /// Completed passes over the windows: position() / windows_per_epoch().
  std::int64_t epoch() const { return position_ / windows_per_epoch_; }

  /// Windows consumed since the start of epoch 0, by all ranks together.
  std::int64_t position() const { return position_; }

  /// Resumes at a value position() returned (any window_index >= 0).
  void seek(std::int64_t window_index) {
    TESSERA_CHECK(window_index >= 0, "DataLoader::seek: window index ", window_index, " is negative");
    position_ = window_index;
  }

  /// Whole windows of seq_len + 1 tokens in the stream.
  std::int64_t windows_per_epoch() const { return windows_per_epoch_; }

  std::int64_t seq_len() const { return seq_len_; }
  std::int64_t local_batch_size() const { return local_batch_size_; }
  std::int64_t global_batch_size() const { return local_batch_size_ * dp_degree_; }
  std::int64_t dp_rank() const { return dp_rank_; }
  std::int64_t dp_degree() const { return dp_degree_; }
  std::int64_t num_tokens() const { return static_cast<std::int64_t>(tokens_.size()); }
  /// Whether a loss mask decides which targets count.
  bool masked() const { return !mask_.empty(); }

 private:
  std::vector<std::uint32_t> tokens_;
  std::vector<std::uint8_t> mask_;  // per token; empty: every target counts
  std::int64_t seq_len_, local_batch_size_, dp_rank_, dp_degree_;
  std::int64_t windows_per_epoch_ = 0;
  std::int64_t position_ = 0;
};

}  // namespace tessera::data
