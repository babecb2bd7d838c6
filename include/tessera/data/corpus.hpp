// A token corpus: one stream of token ids and their loss mask, made of segments read
// one after another, each either held in memory (a TokenStream: the embedded corpus,
// chat data tokenized at the start) or a token shard mapped from its file
// (io::MappedTokenShard), whose tokens are copied out only as a window is read.
//
// Segments join end to end with nothing between them, so a corpus of shards a, b, c reads
// exactly as one shard of a's tokens, then b's, then c's: a window may straddle two. A
// segment without a loss mask counts every target, beside one with a mask (chat data)
// that counts only the assistants' replies.
//
// Copies share the segments (they are never written), so a corpus is cheap to copy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_shard.hpp"

namespace tessera::data {

class TokenCorpus {
 public:
  TokenCorpus() = default;

  /// A corpus of one stream held in memory; `name` names it in errors.
  explicit TokenCorpus(io::TokenStream stream, std::string name = "the token stream") {
    append(std::move(stream), std::move(name));
  }

  /// Appends a stream held in memory.
  void append(io::TokenStream stream, std::string name) {
    TESSERA_CHECK(stream.loss_mask.empty() || stream.loss_mask.size() == stream.ids.size(), name, ": ",
                  stream.ids.size(), " tokens but ", stream.loss_mask.size(), " loss mask values");
    Segment s;
    s.begin = size_;
    s.size = stream.ids.size();
    s.max_id = stream.ids.empty() ? 0 : *std::max_element(stream.ids.begin(), stream.ids.end());
    s.name = std::move(name);
    s.memory = std::make_shared<const io::TokenStream>(std::move(stream));
    add(std::move(s));
  }

  /// Appends a mapped token shard (checked when it was opened).
  void append(io::MappedTokenShard shard) {
    Segment s;
    s.begin = size_;
    s.size = shard.size();
    s.max_id = shard.max_id();
    s.name = shard.path();
    s.shard = std::make_shared<const io::MappedTokenShard>(std::move(shard));
    add(std::move(s));
  }

  /// Tokens in the corpus.
  std::uint64_t size() const { return size_; }
  /// Whether some segment has a loss mask (then not every target counts).
  bool masked() const {
    return std::any_of(segments_.begin(), segments_.end(), [](const Segment& s) { return s.masked(); });
  }
  /// The largest token id (0 for an empty corpus).
  std::uint32_t max_id() const {
    std::uint32_t m = 0;
    for (const Segment& s : segments_) m = std::max(m, s.max_id);
    return m;
  }
  /// The segments' names (a shard's path), in order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const Segment& s : segments_) out.push_back(s.name);
    return out;
  }
  /// Tokens of mapped shards of version 1 or 2, which were read whole to be checked when
  /// they were opened (a version 3 shard's chunks are checked as they are read).
  std::uint64_t tokens_checked_at_open() const {
    std::uint64_t n = 0;
    for (const Segment& s : segments_) n += s.shard && !s.shard->checked_as_read() ? s.size : 0;
    return n;
  }
  /// Tokens held in this process's memory (the mapped shards' are the page cache's).
  std::uint64_t resident_tokens() const {
    std::uint64_t n = 0;
    for (const Segment& s : segments_) n += s.memory ? s.size : 0;
    return n;
  }

  /// Copies tokens [first, first + n) into `ids` and, where `keep` is given, whether each
  /// counts as a target.
  void read(std::uint64_t first, std::size_t n, std::uint32_t* ids, std::uint8_t* keep) const {
    TESSERA_CHECK(first <= size_ && n <= size_ - first, "TokenCorpus: tokens [", first, ", ", first + n,
                  ") are past its ", size_, " tokens");
    for (std::size_t i = segment_of(first); n > 0; ++i) {
      const Segment& s = segments_[i];
      const std::uint64_t offset = first - s.begin;
      const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(n, s.size - offset));
      if (s.shard) {
        s.shard->read(offset, take, ids, keep);
      } else {
        const auto at = static_cast<std::ptrdiff_t>(offset);
        std::copy_n(s.memory->ids.begin() + at, take, ids);
        if (keep) {
          if (s.memory->masked())
            std::copy_n(s.memory->loss_mask.begin() + at, take, keep);
          else
            std::fill_n(keep, take, std::uint8_t{1});
        }
      }
      first += take, n -= take, ids += take;
      if (keep) keep += take;
    }
  }

  /// The index of the first token whose id is above `limit`, or size() when none is.
  std::uint64_t first_above(std::uint32_t limit) const {
    std::uint64_t at = size_;
    if (max_id() > limit)
      scan([&](std::uint64_t k, const std::uint32_t* ids, std::size_t n) {
        const auto* hit = std::find_if(ids, ids + n, [&](std::uint32_t id) { return id > limit; });
        if (hit == ids + n) return false;
        at = k + static_cast<std::uint64_t>(hit - ids);
        return true;
      });
    return at;
  }

  /// The index of every token whose id is `id`, in order.
  std::vector<std::uint64_t> find_all(std::uint32_t id) const {
    std::vector<std::uint64_t> at;
    scan([&](std::uint64_t k, const std::uint32_t* ids, std::size_t n) {
      for (std::size_t i = 0; i < n; ++i)
        if (ids[i] == id) at.push_back(k + i);
      return false;
    });
    return at;
  }

  /// Whether any token of [first, first + n) counts as a target.
  bool any_target(std::uint64_t first, std::uint64_t n) const {
    for (std::size_t i = n > 0 ? segment_of(first) : segments_.size(); n > 0 && i < segments_.size(); ++i) {
      const Segment& s = segments_[i];
      const std::uint64_t offset = first - s.begin;
      const std::uint64_t take = std::min<std::uint64_t>(n, s.size - offset);
      if (take > 0) {
        if (s.shard) {
          if (s.shard->any_target(offset, take)) return true;
        } else if (!s.memory->masked()) {
          return true;
        } else {
          const auto at = s.memory->loss_mask.begin() + static_cast<std::ptrdiff_t>(offset);
          if (std::any_of(at, at + static_cast<std::ptrdiff_t>(take), [](std::uint8_t m) { return m != 0; }))
            return true;
        }
      }
      first += take, n -= take;
    }
    return false;
  }

 private:
  struct Segment {
    std::uint64_t begin = 0, size = 0;  // tokens [begin, begin + size) of the corpus
    std::uint32_t max_id = 0;
    std::string name;
    std::shared_ptr<const io::TokenStream> memory;     // or
    std::shared_ptr<const io::MappedTokenShard> shard;
    bool masked() const { return shard ? shard->masked() : memory->masked(); }
  };

  void add(Segment s) {
    if (s.size == 0) return;  // an empty segment holds nothing to read
    size_ += s.size;
    segments_.push_back(std::move(s));
  }

  // Calls visit(first token's index, ids, count) over the corpus in chunks, in order,
  // until it returns true.
  template <class Visit>
  void scan(Visit&& visit) const {
    constexpr std::size_t chunk = 1 << 14;
    std::vector<std::uint32_t> buf(chunk);
    for (std::uint64_t k = 0; k < size_; k += chunk) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk, size_ - k));
      read(k, n, buf.data(), nullptr);
      if (visit(k, static_cast<const std::uint32_t*>(buf.data()), n)) return;
    }
  }

  // The segment holding token `k` (< size_).
  std::size_t segment_of(std::uint64_t k) const {
    const auto it = std::upper_bound(segments_.begin(), segments_.end(), k,
                                     [](std::uint64_t v, const Segment& s) { return v < s.begin; });
    return static_cast<std::size_t>(it - segments_.begin()) - 1;
  }

  std::vector<Segment> segments_;
  std::uint64_t size_ = 0;
};

}  // namespace tessera::data
