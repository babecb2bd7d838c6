// Data loading: documents -> one token stream -> windows -> batches, sliced per rank.
//
// pack_documents concatenates documents as <|bos|> bytes <|eos|>. The DataLoader cuts a
// stream (a TokenCorpus: in memory, or token shards mapped from their files) into
// consecutive, non-overlapping windows of seq_len + 1 tokens, as torchtitan packs them:
// inputs are a window's first seq_len tokens, targets its last seq_len (the inputs
// shifted by one). A step consumes one GLOBAL batch of local_batch_size * dp_degree
// consecutive windows, and data-parallel rank r takes windows [r * local, (r + 1) * local)
// of it, so every data-parallel layout trains on the same global batch (DESIGN principle
// 4). Tokens left over after the last whole window are not used. When the windows run
// out the loader wraps to the first one and counts an epoch; a global batch may straddle
// the wrap.
//
// A weighted mix of several streams (Megatron's data blend, torchtitan's dataset mix)
// cuts each into its own windows and deals them out in one order: window i of the global
// order comes from the stream whose share so far lags its weight the most (the largest
// w_d (i + 1) - taken_d, the first on a tie), so after any n windows each stream has given
// its weight's share of them to within one window. Each stream wraps by itself: a small
// stream weighted high is read again while a large one is still in its first pass.
//
// First-fit packing (Packing::first_fit, torchtitan's FirstFitPacking for SFT) keeps
// documents whole instead: a document is the tokens from one BOS to the next, and each
// row of seq_len inputs holds whole documents (a document of L tokens fills L - 1 slots:
// its inputs, its targets shifted by one), placed in the first of 8 open rows with room
// (when none has, the oldest row is closed and a new one opened), the rest of a row
// padded with input 0 and no target. A document longer than a row is left out and
// counted. The rows are planned once, in order, at construction: a row is a window, and
// everything above (slicing, wrapping, mixing, resuming) is unchanged. With
// training.document_mask each row's documents then train exactly as they would alone: a
// chat's reply never arrives in a row without the prompt it answers.
//
// Shuffled (WindowOrder::shuffle, torchtitan's loader shuffles by default), each stream's
// windows are read in an order of their own each epoch: window j of epoch e is window
// p(j) for a permutation p drawn from the seed, the stream and e (a keyed Feistel network
// over the window indices, cycle-walked into range: no table, any window found in a few
// steps), the same on every rank and after every resume.
//
// A loss mask (io::TokenStream, chat data) travels with the tokens: a target whose token
// the mask leaves out (a prompt token of a chat) becomes Batch::ignore_index, so only
// the tokens the mask keeps (the assistant's replies) are predicted. The inputs are not
// masked: the model reads the whole conversation.
//
// position() counts the windows consumed since the start (all ranks together); saving it
// and calling seek() with it resumes the stream exactly, each stream's epoch included
// (a mix's order is replayed up to it: a few nanoseconds a window).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/data/corpus.hpp"
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

/// How a stream becomes windows: cut into consecutive windows (torchtitan's
/// ConcatThenSplit), or its documents packed whole into rows (first fit).
struct Packing {
  enum class Kind { concat, first_fit } kind = Kind::concat;
  std::int32_t document_start_id = -1;  // first_fit: the BOS id each document starts with
  std::int64_t open_rows = 8;           // first_fit: the rows a document may go into
};

/// The order windows are read in: as they come, or shuffled anew each epoch.
struct WindowOrder {
  bool shuffle = false;
  std::uint64_t seed = 0;
};

/// A permutation of [0, n) drawn from `key`: a 4-round Feistel network over the smallest
/// even power of two at least n, each result outside [0, n) fed back in (cycle walking:
/// the domain is under 4 n, so a few steps on average).
inline std::int64_t permute(std::int64_t j, std::int64_t n, std::uint64_t key) {
  int bits = 2;
  while ((std::int64_t{1} << bits) < n) bits += 2;
  const int half = bits / 2;
  const std::uint64_t mask = (std::uint64_t{1} << half) - 1;
  auto x = static_cast<std::uint64_t>(j);
  do {
    std::uint64_t left = x >> half, right = x & mask;
    for (std::uint64_t round = 0; round < 4; ++round) {
      const std::uint64_t f = mix64(key ^ mix64(right + (round << 56))) & mask;
      const std::uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<std::uint64_t>(n));
  return static_cast<std::int64_t>(x);
}

/// The rows first-fit packing makes of a corpus: each a list of whole documents.
struct PackedRows {
  std::vector<std::uint64_t> start;  // the documents' first tokens, row after row
  std::vector<std::uint32_t> length;  // their tokens
  std::vector<std::uint64_t> row_begin;  // row r holds documents [row_begin[r], row_begin[r + 1])
  std::int64_t documents = 0;             // documents found
  std::int64_t too_long = 0;              // left out: longer than a row (seq_len + 1 tokens)
  std::int64_t padding = 0;               // slots of all rows without a document

  std::int64_t rows() const { return static_cast<std::int64_t>(row_begin.size()) - 1; }

  /// Plans the rows of `corpus` for windows of seq_len inputs.
  static PackedRows plan(const TokenCorpus& corpus, std::int64_t seq_len, const Packing& p) {
    TESSERA_CHECK(p.document_start_id >= 0, "first-fit packing needs the id documents start with (the BOS id)");
    TESSERA_CHECK(p.open_rows > 0, "first-fit packing: open_rows must be positive, got ", p.open_rows);
    std::vector<std::uint64_t> starts = corpus.find_all(static_cast<std::uint32_t>(p.document_start_id));
    if (starts.empty() || starts.front() != 0) starts.insert(starts.begin(), 0);  // tokens before the first BOS
    PackedRows out;
    out.row_begin.push_back(0);
    struct Row {
      std::vector<std::pair<std::uint64_t, std::uint32_t>> docs;
      std::int64_t used = 0;
    };
    std::vector<Row> open;
    auto close_first = [&] {
      for (const auto& [start, length] : open.front().docs) {
        out.start.push_back(start);
        out.length.push_back(length);
      }
      out.padding += seq_len - open.front().used;
      out.row_begin.push_back(out.start.size());
      open.erase(open.begin());
    };
    for (std::size_t i = 0; i < starts.size(); ++i) {
      const std::uint64_t end = i + 1 < starts.size() ? starts[i + 1] : corpus.size();
      const std::uint64_t tokens = end - starts[i];
      ++out.documents;
      if (tokens < 2) continue;  // nothing to predict
      const auto slots = static_cast<std::int64_t>(std::min<std::uint64_t>(tokens - 1, std::uint64_t{1} << 62));
      if (slots > seq_len) {
        ++out.too_long;
        continue;
      }
      auto fits = std::find_if(open.begin(), open.end(), [&](const Row& r) { return r.used + slots <= seq_len; });
      if (fits == open.end()) {
        if (static_cast<std::int64_t>(open.size()) == p.open_rows) close_first();
        open.emplace_back();
        fits = open.end() - 1;
      }
      fits->docs.emplace_back(starts[i], static_cast<std::uint32_t>(tokens));
      fits->used += slots;
    }
    while (!open.empty()) close_first();
    return out;
  }
};

class DataLoader {
 public:
  /// One stream of each stream's windows in a mix: its corpus, its share of the windows.
  struct Stream {
    TokenCorpus corpus;
    double weight = 1;  // normalised: the weights of a mix add up to 1
    std::int64_t windows = 0;
    std::shared_ptr<const PackedRows> rows;  // first-fit packing's rows; null: consecutive windows
  };

  DataLoader(std::vector<std::uint32_t> tokens, std::int64_t seq_len, std::int64_t local_batch_size,
             std::int64_t dp_rank = 0, std::int64_t dp_degree = 1)
      : DataLoader(io::TokenStream{std::move(tokens), {}}, seq_len, local_batch_size, dp_rank, dp_degree) {}

  /// A token stream with its loss mask (empty: every target counts).
  DataLoader(io::TokenStream stream, std::int64_t seq_len, std::int64_t local_batch_size, std::int64_t dp_rank = 0,
             std::int64_t dp_degree = 1)
      : DataLoader(TokenCorpus(std::move(stream)), seq_len, local_batch_size, dp_rank, dp_degree) {}

  /// A corpus: in memory, mapped shards, or both.
  DataLoader(TokenCorpus corpus, std::int64_t seq_len, std::int64_t local_batch_size, std::int64_t dp_rank = 0,
             std::int64_t dp_degree = 1)
      : DataLoader(one(std::move(corpus)), {1.0}, seq_len, local_batch_size, dp_rank, dp_degree) {}

  /// A weighted mix of `corpora` (weights positive, one per corpus, in any units).
  /// `packing` says how each corpus becomes windows.
  DataLoader(std::vector<TokenCorpus> corpora, std::vector<double> weights, std::int64_t seq_len,
             std::int64_t local_batch_size, std::int64_t dp_rank = 0, std::int64_t dp_degree = 1,
             const Packing& packing = {}, const WindowOrder& order = {})
      : order_(order),
        seq_len_(seq_len), local_batch_size_(local_batch_size), dp_rank_(dp_rank), dp_degree_(dp_degree) {
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
    TESSERA_CHECK(!corpora.empty(), "DataLoader: no token stream to read");
    TESSERA_CHECK(weights.size() == corpora.size(), "DataLoader: ", corpora.size(), " token streams but ",
                  weights.size(), " weights");
    double total = 0;
    for (std::size_t d = 0; d < weights.size(); ++d) {
      TESSERA_CHECK(std::isfinite(weights[d]) && weights[d] > 0, "DataLoader: the weight of ",
                    stream_name(corpora[d], d), " is ", weights[d], "; weights are positive numbers");
      total += weights[d];
    }
    const auto window = static_cast<std::uint64_t>(seq_len) + 1;
    for (std::size_t d = 0; d < corpora.size(); ++d) {
      TokenCorpus& c = corpora[d];
      const std::string name = stream_name(c, d);
      TESSERA_CHECK(c.size() >= window, "DataLoader: ", name, " has ", c.size(), " tokens, fewer than one window of seq_len + 1 = ",
                    window);
      constexpr auto int32_max = static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max());
      if (c.max_id() > int32_max) {
        const std::uint64_t at = c.first_above(int32_max);
        std::uint32_t id = 0;
        c.read(at, 1, &id, nullptr);
        fail("DataLoader: ", name, ": token id ", id, " at index ", at, " does not fit in int32");
      }
      if (packing.kind == Packing::Kind::first_fit) {
        auto rows = std::make_shared<const PackedRows>(PackedRows::plan(c, seq_len, packing));
        TESSERA_CHECK(rows->rows() > 0, "DataLoader: ", name, ": every one of its ", rows->documents,
                      " documents is longer than a row of seq_len + 1 = ", window,
                      " tokens (first-fit packing leaves those out)");
        if (c.masked()) {
          bool any = false;
          for (std::size_t k = 0; k < rows->start.size() && !any; ++k)
            any = c.any_target(rows->start[k] + 1, rows->length[k] - 1);
          TESSERA_CHECK(any, "DataLoader: ", name, ": the loss mask leaves no target in the ", rows->rows(),
                        " packed rows of the stream (no assistant reply to learn from?)");
        }
        const std::int64_t n = rows->rows();
        streams_.push_back(Stream{std::move(c), weights[d] / total, n, std::move(rows)});
        continue;
      }
      const auto windows = static_cast<std::int64_t>(c.size() / window);
      if (c.masked())
        TESSERA_CHECK(c.any_target(0, static_cast<std::uint64_t>(windows) * window), "DataLoader: ", name,
                      ": the loss mask leaves no target in the ", windows,
                      " windows of the stream (no assistant reply to learn from?)");
      streams_.push_back(Stream{std::move(c), weights[d] / total, windows, nullptr});
    }
    taken_.assign(streams_.size(), 0);
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
    const std::int64_t mine = position_ + dp_rank_ * local_batch_size_;  // this rank's first window
    if (streams_.size() > 1) advance_to(position_);
    std::vector<std::uint32_t> ids(static_cast<std::size_t>(seq_len_) + 1);
    std::vector<std::uint8_t> keep;
    for (std::int64_t i = position_; i < position_ + global_batch_size(); ++i) {
      std::size_t d = 0;
      std::int64_t k = i;  // the stream's windows read before this one
      if (streams_.size() > 1) {
        d = pick(i);
        k = taken_[d]++;
      }
      const std::int64_t w = window_of(d, k);
      if (i < mine || i >= mine + local_batch_size_) continue;
      const Stream& s = streams_[d];
      if (!s.rows) {
        const auto window = static_cast<std::size_t>(seq_len_) + 1;
        append_pairs(s.corpus, static_cast<std::uint64_t>(w) * window, window, ids, keep, b);
        continue;
      }
      // A packed row: its documents one after another, then padding.
      const std::size_t row_end = b.inputs.size() + static_cast<std::size_t>(seq_len_);
      const auto first = static_cast<std::size_t>(s.rows->row_begin[static_cast<std::size_t>(w)]);
      const auto last = static_cast<std::size_t>(s.rows->row_begin[static_cast<std::size_t>(w) + 1]);
      for (std::size_t doc = first; doc < last; ++doc)
        append_pairs(s.corpus, s.rows->start[doc], s.rows->length[doc], ids, keep, b);
      b.inputs.resize(row_end, 0);
      b.targets.resize(row_end, Batch::ignore_index);
    }
    b.n_targets = count_targets(b);
    position_ += global_batch_size();
    if (streams_.size() > 1) blend_position_ = position_;
    return b;
  }

  /// Completed passes over the windows: position() / windows_per_epoch() for one
  /// stream; for a mix, the passes of the stream that has made the fewest.
  std::int64_t epoch() const {
    if (streams_.size() == 1) return position_ / streams_[0].windows;
    const std::vector<std::int64_t> taken = windows_taken(position_);
    std::int64_t e = std::numeric_limits<std::int64_t>::max();
    for (std::size_t d = 0; d < streams_.size(); ++d) e = std::min(e, taken[d] / streams_[d].windows);
    return e;
  }

  /// Each stream's windows among the first `position` of the global order.
  std::vector<std::int64_t> windows_taken(std::int64_t position) const {
    if (streams_.size() == 1) return {position};
    DataLoader replay = *this;
    replay.advance_to(position);
    return replay.taken_;
  }

  /// Windows consumed since the start, by all ranks together.
  std::int64_t position() const { return position_; }

  /// Resumes at a value position() returned (any window_index >= 0).
  void seek(std::int64_t window_index) {
    TESSERA_CHECK(window_index >= 0, "DataLoader::seek: window index ", window_index, " is negative");
    position_ = window_index;
  }

  /// Whole windows of seq_len + 1 tokens in the stream (a mix: in all its streams).
  std::int64_t windows_per_epoch() const {
    std::int64_t n = 0;
    for (const Stream& s : streams_) n += s.windows;
    return n;
  }

  /// The streams read, in order, with their normalised weights and windows.
  const std::vector<Stream>& streams() const { return streams_; }

  std::int64_t seq_len() const { return seq_len_; }
  std::int64_t local_batch_size() const { return local_batch_size_; }
  std::int64_t global_batch_size() const { return local_batch_size_ * dp_degree_; }
  std::int64_t dp_rank() const { return dp_rank_; }
  std::int64_t dp_degree() const { return dp_degree_; }
  std::int64_t num_tokens() const {
    std::uint64_t n = 0;
    for (const Stream& s : streams_) n += s.corpus.size();
    return static_cast<std::int64_t>(n);
  }
  /// Whether a loss mask decides which targets count.
  bool masked() const {
    return std::any_of(streams_.begin(), streams_.end(), [](const Stream& s) { return s.corpus.masked(); });
  }

 private:
  static std::vector<TokenCorpus> one(TokenCorpus c) {
    std::vector<TokenCorpus> v;
    v.push_back(std::move(c));
    return v;
  }

  static std::string stream_name(const TokenCorpus& c, std::size_t d) {
    const std::vector<std::string> names = c.names();
    if (names.size() == 1) return names[0];
    if (names.empty()) return tessera::detail::concat("token stream ", d, " (empty)");
    return tessera::detail::concat("token stream ", d, " (", names.front(), " and ", names.size() - 1, " more)");
  }

  // Appends tokens [first, first + n) of `corpus` to `b` as n - 1 (input, target) pairs:
  // the inputs its first n - 1 tokens, the targets its last n - 1, a target the loss mask
  // leaves out ignore_index. Ids fit in int32 (checked at construction): the conversion
  // keeps them.
  static void append_pairs(const TokenCorpus& corpus, std::uint64_t first, std::size_t n,
                           std::vector<std::uint32_t>& ids, std::vector<std::uint8_t>& keep, Batch& b) {
    const bool masked = corpus.masked();
    if (ids.size() < n) ids.resize(n);
    keep.resize(masked ? n : 0);
    corpus.read(first, n, ids.data(), masked ? keep.data() : nullptr);
    b.inputs.insert(b.inputs.end(), ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n - 1));
    const std::size_t at = b.targets.size();
    b.targets.insert(b.targets.end(), ids.begin() + 1, ids.begin() + static_cast<std::ptrdiff_t>(n));
    if (masked)
      for (std::size_t j = 0; j + 1 < n; ++j)
        if (!keep[j + 1]) b.targets[at + j] = Batch::ignore_index;
  }

  // The window stream d reads k-th: in order, or shuffled within k's epoch.
  std::int64_t window_of(std::size_t d, std::int64_t k) const {
    const std::int64_t n = streams_[d].windows, j = k % n;
    if (!order_.shuffle) return j;
    const std::uint64_t key = mix64(order_.seed ^ mix64(static_cast<std::uint64_t>(d) + 0x5157) ^
                                    mix64(static_cast<std::uint64_t>(k / n) + 0xe90c));
    return permute(j, n, key);
  }

  // The stream window `i` of the global order comes from, given taken_ at i.
  std::size_t pick(std::int64_t i) const {
    std::size_t best = 0;
    double lag = -std::numeric_limits<double>::infinity();
    for (std::size_t d = 0; d < streams_.size(); ++d) {
      const double l = streams_[d].weight * static_cast<double>(i + 1) - static_cast<double>(taken_[d]);
      if (l > lag) lag = l, best = d;
    }
    return best;
  }

  // Brings taken_ to the start of window `position` of the global order.
  void advance_to(std::int64_t position) {
    if (position < blend_position_) {
      std::fill(taken_.begin(), taken_.end(), 0);
      blend_position_ = 0;
    }
    for (; blend_position_ < position; ++blend_position_) ++taken_[pick(blend_position_)];
  }

  std::vector<Stream> streams_;
  WindowOrder order_;
  std::int64_t seq_len_, local_batch_size_, dp_rank_, dp_degree_;
  std::int64_t position_ = 0;
  // A mix's order so far: each stream's windows dealt before window blend_position_.
  std::vector<std::int64_t> taken_;
  std::int64_t blend_position_ = 0;
};

}  // namespace tessera::data
