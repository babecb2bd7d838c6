// Training a byte-level BPE vocabulary, written as a tiktoken rank file.
//
// The training text is cut into pieces by Llama 3's pattern (io/pretokenize.hpp) and
// the distinct pieces are counted. The vocabulary starts as the 256 single bytes
// (ranks 0..255 in byte order); each step adds, as the next rank, the byte string that
// is most often the concatenation of two adjacent tokens across all pieces (weighted by
// how often each piece occurs; ties go to the lexicographically smallest bytes), until
// the vocabulary has `vocab_size` tokens or no concatenation occurs `min_frequency`
// times.
//
// The trainer keeps every piece segmented exactly as TiktokenTokenizer would segment it
// with the ranks so far: after a new token is added, each piece that contains it as an
// adjacent pair is merged further by the tokenizer's own rule (lowest rank first), which
// may also merge the new token with its neighbours. Pairs are therefore counted by their
// concatenated bytes, not by which two tokens spell them: tiktoken's encoder only asks
// whether a concatenation has a rank. As a result a tokenizer built from the written
// file reproduces the trainer's segmentation of every training piece (a test checks it).
//
// Counts are kept incrementally: each pair knows the pieces it occurs in, a step
// re-segments only those, and a max-heap with lazily discarded stale entries finds the
// next pair. Training is deterministic: the same documents give the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/pretokenize.hpp"
#include "tessera/io/tiktoken.hpp"

namespace tessera::io {

struct BpeTrainOptions {
  std::int64_t vocab_size = 1024;  // base tokens, the 256 single bytes included
  std::int64_t min_frequency = 2;  // a new token must occur at least this often
};

namespace detail {

/// Hashing std::string keys by their view, so lookups need no temporary string.
struct StringViewHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

}  // namespace detail

class BpeTrainer {
 public:
  /// Pre-tokenizes and counts `documents`; no merges yet.
  BpeTrainer(std::span<const std::string> documents, const BpeTrainOptions& options) : options_(options) {
    TESSERA_CHECK(options.vocab_size >= 256, "BPE training: vocab_size ", options.vocab_size,
                  " is below 256 (the single bytes are tokens)");
    TESSERA_CHECK(options.vocab_size <= std::numeric_limits<std::uint32_t>::max() - 256, "BPE training: vocab_size ",
                  options.vocab_size, " is too large");
    TESSERA_CHECK(options.min_frequency >= 1, "BPE training: min_frequency ", options.min_frequency,
                  " must be at least 1");
    for (int b = 0; b < 256; ++b) add_token(std::string(1, static_cast<char>(static_cast<unsigned char>(b))));

    std::unordered_map<std::string_view, std::int64_t> counts;
    const Pretokenizer& pretokenizer = llama3_pretokenizer();
    for (const std::string& document : documents)
      pretokenizer.for_each_piece(document, [&](std::string_view piece) { ++counts[piece]; });
    words_.reserve(counts.size());
    for (const auto& [piece, count] : counts) {
      Word word{std::string(piece), count, {}};
      word.bounds.resize(piece.size() + 1);
      for (std::uint32_t i = 0; i <= piece.size(); ++i) word.bounds[i] = i;
      words_.push_back(std::move(word));
    }
    word_stamp_.assign(words_.size(), 0);
    for (std::uint32_t w = 0; w < words_.size(); ++w) add_pairs(w);
    push_changed();
  }

  // The heap's order refers to this object's pair list: not copied or moved.
  BpeTrainer(const BpeTrainer&) = delete;
  BpeTrainer& operator=(const BpeTrainer&) = delete;

  /// Adds one token. Returns false, adding nothing, once the vocabulary has vocab_size
  /// tokens or no adjacent pair occurs min_frequency times.
  bool step() {
    if (static_cast<std::int64_t>(tokens_.size()) >= options_.vocab_size) return false;
    std::uint32_t best = 0;
    for (;;) {
      if (heap_.empty()) return false;
      const auto [count, pair] = heap_.top();
      heap_.pop();
      if (count == pair_count_[pair] && count >= options_.min_frequency && !token_rank_.contains(pair_bytes_[pair])) {
        best = pair;
        break;
      }
    }
    add_token(pair_bytes_[best]);
    ++stamp_;
    std::vector<std::uint32_t> affected = std::move(pair_words_[best]);
    pair_words_[best].clear();
    const auto rank_of = [this](std::string_view bytes) {
      auto it = token_rank_.find(bytes);
      return it == token_rank_.end() ? detail::no_rank : it->second;
    };
    for (std::uint32_t w : affected) {
      if (word_stamp_[w] == stamp_) continue;
      word_stamp_[w] = stamp_;
      remove_pairs(w);
      detail::byte_pair_merge(words_[w].bytes, words_[w].bounds, rank_of);
      add_pairs(w);
    }
    push_changed();
    return true;
  }

  /// Steps until done.
  void run() {
    while (step()) {
    }
  }

  /// The tokens so far, by rank: the 256 single bytes, then one per step.
  const std::vector<std::string>& tokens() const { return tokens_; }

  /// The distinct pieces of the training text.
  std::size_t num_pieces() const { return words_.size(); }
  std::string_view piece(std::size_t i) const { return words_.at(i).bytes; }
  /// How often piece `i` occurs in the training text.
  std::int64_t piece_count(std::size_t i) const { return words_.at(i).count; }
  /// The ranks that piece `i` is segmented into with the tokens so far.
  std::vector<std::uint32_t> piece_ids(std::size_t i) const {
    const Word& word = words_.at(i);
    std::vector<std::uint32_t> ids;
    for (std::size_t k = 0; k + 1 < word.bounds.size(); ++k)
      ids.push_back(token_rank_.find(std::string_view(word.bytes).substr(word.bounds[k], word.bounds[k + 1] - word.bounds[k]))
                        ->second);
    return ids;
  }

 private:
  struct Word {
    std::string bytes;
    std::int64_t count;
    std::vector<std::uint32_t> bounds;  // start offsets of its tokens, then bytes.size()
  };
  struct HeapOrder {
    const std::vector<std::string>* bytes;
    // Lower priority: fewer occurrences, or as many and larger bytes.
    bool operator()(const std::pair<std::int64_t, std::uint32_t>& a, const std::pair<std::int64_t, std::uint32_t>& b) const {
      if (a.first != b.first) return a.first < b.first;
      return (*bytes)[a.second] > (*bytes)[b.second];
    }
  };

  void add_token(std::string bytes) {
    const auto rank = static_cast<std::uint32_t>(tokens_.size());
    token_rank_.emplace(bytes, rank);
    tokens_.push_back(std::move(bytes));
  }

  std::uint32_t pair_id(std::string_view bytes) {
    auto it = pair_index_.find(bytes);
    if (it != pair_index_.end()) return it->second;
    const auto id = static_cast<std::uint32_t>(pair_bytes_.size());
    pair_index_.emplace(std::string(bytes), id);
    pair_bytes_.emplace_back(bytes);
    pair_count_.push_back(0);
    pair_words_.emplace_back();
    pair_stamp_.push_back(0);
    return id;
  }

  void mark_changed(std::uint32_t pair) {
    if (pair_stamp_[pair] == stamp_ + 1) return;
    pair_stamp_[pair] = stamp_ + 1;
    changed_.push_back(pair);
  }

  void add_pairs(std::uint32_t w) {
    const Word& word = words_[w];
    const std::string_view bytes = word.bytes;
    for (std::size_t k = 0; k + 2 < word.bounds.size(); ++k) {
      const std::uint32_t pair = pair_id(bytes.substr(word.bounds[k], word.bounds[k + 2] - word.bounds[k]));
      pair_count_[pair] += word.count;
      pair_words_[pair].push_back(w);
      mark_changed(pair);
    }
  }

  void remove_pairs(std::uint32_t w) {
    const Word& word = words_[w];
    const std::string_view bytes = word.bytes;
    for (std::size_t k = 0; k + 2 < word.bounds.size(); ++k) {
      const std::uint32_t pair = pair_id(bytes.substr(word.bounds[k], word.bounds[k + 2] - word.bounds[k]));
      pair_count_[pair] -= word.count;
      mark_changed(pair);
    }
  }

  void push_changed() {
    for (std::uint32_t pair : changed_)
      if (pair_count_[pair] >= options_.min_frequency) heap_.emplace(pair_count_[pair], pair);
    changed_.clear();
  }

  BpeTrainOptions options_;
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, std::uint32_t, detail::StringViewHash, std::equal_to<>> token_rank_;
  std::vector<Word> words_;
  std::vector<std::uint32_t> word_stamp_;
  // Pairs, by the bytes of the two adjacent tokens together.
  std::unordered_map<std::string, std::uint32_t, detail::StringViewHash, std::equal_to<>> pair_index_;
  std::vector<std::string> pair_bytes_;
  std::vector<std::int64_t> pair_count_;
  std::vector<std::vector<std::uint32_t>> pair_words_;  // pieces it occurs in (may hold stale ones)
  std::vector<std::uint32_t> pair_stamp_;
  std::vector<std::uint32_t> changed_;
  std::uint32_t stamp_ = 0;
  std::priority_queue<std::pair<std::int64_t, std::uint32_t>, std::vector<std::pair<std::int64_t, std::uint32_t>>,
                      HeapOrder>
      heap_{HeapOrder{&pair_bytes_}};
};

/// The tokens of a BPE vocabulary trained on `documents`, by rank.
inline std::vector<std::string> train_bpe(std::span<const std::string> documents, const BpeTrainOptions& options) {
  BpeTrainer trainer(documents, options);
  trainer.run();
  return trainer.tokens();
}

/// `tokens` (by rank) as tiktoken rank-file text: "<base64> <rank>\n" per token. Every
/// token must be non-empty and distinct, and the 256 single bytes must be among them,
/// so that the text is a file TiktokenTokenizer reads.
inline std::string to_tiktoken_text(std::span<const std::string> tokens) {
  std::unordered_map<std::string_view, std::size_t> rank_of;
  rank_of.reserve(tokens.size());
  std::string text;
  for (std::size_t r = 0; r < tokens.size(); ++r) {
    TESSERA_CHECK(!tokens[r].empty(), "tiktoken ranks: token ", r, " is empty");
    auto [it, fresh] = rank_of.emplace(tokens[r], r);
    TESSERA_CHECK(fresh, "tiktoken ranks: token ", r, " ('", detail::printable_bytes(tokens[r]),
                  "') repeats token ", it->second);
    text += detail::base64_encode(tokens[r]);
    text += ' ';
    text += std::to_string(r);
    text += '\n';
  }
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(static_cast<unsigned char>(b));
    TESSERA_CHECK(rank_of.count(std::string_view(&c, 1)), "tiktoken ranks: the single byte ",
                  detail::printable_bytes(std::string_view(&c, 1)), " is not a token");
  }
  return text;
}

/// Writes `tokens` as a tiktoken rank file at `path`, by way of `path + ".tmp"` and a
/// rename, so `path` never holds a partial file.
inline void write_tiktoken(const std::string& path, std::span<const std::string> tokens) {
  std::string text;
  try {
    text = to_tiktoken_text(tokens);
  } catch (const Error& e) {
    fail("write_tiktoken '", path, "': ", e.what());
  }
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out.is_open()) {
      auto parent = std::filesystem::path(tmp).parent_path();
      const bool missing_dir = !parent.empty() && !std::filesystem::is_directory(parent, ec);
      fail("write_tiktoken '", path, "': cannot open '", tmp, "' for writing",
           missing_dir ? " (its directory does not exist)" : "");
    }
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      fail("write_tiktoken '", path, "': writing '", tmp, "' failed (disk full?)");
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    fail("write_tiktoken '", path, "': cannot rename '", tmp, "' to it: ", ec.message());
  }
}

}  // namespace tessera::io
