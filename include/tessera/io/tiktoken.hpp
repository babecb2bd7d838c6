// Llama 3's tokenizer: byte-level BPE over ranks read from a tiktoken file.
//
// The file (Llama 3's `tokenizer.model`, tiktoken's `.tiktoken`) has one line per base
// token: the base64 of the token's bytes, a space, and its rank. Ranks run 0..N-1, each
// once; the rank is the token's id and also its merge priority. Every single byte is a
// token, so any byte string can be encoded. After the N base tokens come Llama 3.1's
// 256 special tokens (<|begin_of_text|> = N, <|end_of_text|> = N + 1, ...).
//
// Encoding follows tiktoken exactly: the text is cut into pieces by Llama 3's pattern
// (io/pretokenize.hpp); a piece that is a token is that token; otherwise it starts as
// single bytes and the adjacent pair whose concatenation has the lowest rank is merged,
// the leftmost on ties, until no adjacent pair is a token. Short pieces use that scan
// directly (tiktoken's own loop); long ones (a run of 100k spaces is one piece) use a
// heap of candidate pairs over a linked list, which merges in the same order in
// O(n log n). With allow_special, text spelling a special token becomes that token.
//
// The parsed vocabulary is immutable and shared between copies; encode and decode are
// const and safe to call from many threads at once.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <queue>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/pretokenize.hpp"
#include "tessera/io/tokenizer.hpp"

namespace tessera::io {

/// How many special tokens follow the base tokens.
inline constexpr std::size_t llama3_num_special_tokens = 256;

/// The name of Llama 3.1's special token `i` (id = number of base tokens + i): the
/// eleven named ones, then <|reserved_special_token_3|> to <|reserved_special_token_247|>.
inline std::string llama3_special_token_name(std::size_t i) {
  static constexpr std::array<std::string_view, 11> named = {
      "<|begin_of_text|>",           "<|end_of_text|>",       "<|reserved_special_token_0|>",
      "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
      "<|start_header_id|>",         "<|end_header_id|>",     "<|eom_id|>",
      "<|eot_id|>",                  "<|python_tag|>"};
  TESSERA_CHECK(i < llama3_num_special_tokens, "Llama 3 special token index ", i, " is not below ",
                llama3_num_special_tokens);
  if (i < named.size()) return std::string(named[i]);
  return "<|reserved_special_token_" + std::to_string(i - named.size() + 3) + "|>";
}

namespace detail {

inline constexpr std::uint32_t no_rank = std::numeric_limits<std::uint32_t>::max();

/// The standard base64 alphabet's value of `c`, or -1.
inline int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/// Decodes standard padded base64 into `out`; returns false when `text` is not (a
/// length that is not a multiple of 4, a character outside the alphabet, or '=' other
/// than one or two at the very end).
inline bool base64_decode(std::string_view text, std::string& out) {
  out.clear();
  if (text.size() % 4 != 0) return false;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text[i + static_cast<std::size_t>(k)];
      if (c == '=' && last && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return false;  // a character after '='
      v[k] = base64_value(c);
      if (v[k] < 0) return false;
    }
    const std::uint32_t bits = (static_cast<std::uint32_t>(v[0]) << 18) | (static_cast<std::uint32_t>(v[1]) << 12) |
                               (static_cast<std::uint32_t>(v[2]) << 6) | static_cast<std::uint32_t>(v[3]);
    out.push_back(static_cast<char>((bits >> 16) & 0xFF));
    if (pad < 2) out.push_back(static_cast<char>((bits >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(bits & 0xFF));
  }
  return true;
}

/// Standard padded base64 of `bytes`.
inline std::string base64_encode(std::string_view bytes) {
  static constexpr char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < bytes.size(); i += 3) {
    const std::size_t n = std::min<std::size_t>(3, bytes.size() - i);
    std::uint32_t bits = 0;
    for (std::size_t k = 0; k < 3; ++k) {
      bits <<= 8;
      if (k < n) bits |= static_cast<unsigned char>(bytes[i + k]);
    }
    out.push_back(alphabet[(bits >> 18) & 63]);
    out.push_back(alphabet[(bits >> 12) & 63]);
    out.push_back(n > 1 ? alphabet[(bits >> 6) & 63] : '=');
    out.push_back(n > 2 ? alphabet[bits & 63] : '=');
  }
  return out;
}

/// A byte string for messages: printable ASCII as is, other bytes as \xNN.
inline std::string printable_bytes(std::string_view bytes) {
  static constexpr char hex[] = "0123456789ABCDEF";
  std::string out;
  for (char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    if (b >= 0x20 && b < 0x7F && b != '\\') {
      out.push_back(c);
    } else {
      out += "\\x";
      out.push_back(hex[b >> 4]);
      out.push_back(hex[b & 15]);
    }
  }
  return out;
}

/// Pieces up to this many parts use tiktoken's scan; longer ones use the heap.
inline constexpr std::size_t bpe_scan_limit = 64;

/// The rank of merging the parts [b0, b1) and [b1, b2) of `piece`: `rank_of(left,
/// right)` when the ranking takes the pair (Hugging Face BPE, io/hf_tokenizer.hpp: a
/// merge names its two tokens), else `rank_of(left + right)` (tiktoken: the rank of
/// the concatenation).
template <class RankOf>
std::uint32_t merge_rank(const RankOf& rank_of, std::string_view piece, std::uint32_t b0, std::uint32_t b1,
                         std::uint32_t b2) {
  if constexpr (std::is_invocable_v<const RankOf&, std::string_view, std::string_view>) {
    return rank_of(piece.substr(b0, b1 - b0), piece.substr(b1, b2 - b1));
  } else {
    return rank_of(piece.substr(b0, b2 - b0));
  }
}

/// Byte-pair merging of `piece`, tiktoken's way. `bounds` holds the start offsets of
/// its current parts followed by piece.size() (0, 1, ..., n for single bytes; the BPE
/// trainer passes a coarser split); on return it holds the parts after merging.
/// `rank_of(bytes)` gives the rank of a byte string or no_rank (or `rank_of(left, right)`
/// the rank of a pair, see merge_rank). Repeatedly merges the adjacent pair with the
/// lowest rank, the leftmost on ties.
/// This is the quadratic scan, for short pieces.
template <class RankOf>
void byte_pair_merge_scan(std::string_view piece, std::vector<std::uint32_t>& bounds, const RankOf& rank_of) {
  if (bounds.size() < 3) return;
  // ranks[i]: the rank of parts i and i+1 together.
  std::vector<std::uint32_t> ranks(bounds.size() - 2);
  const auto pair_rank = [&](std::size_t i) {
    return i + 2 < bounds.size() ? merge_rank(rank_of, piece, bounds[i], bounds[i + 1], bounds[i + 2]) : no_rank;
  };
  for (std::size_t i = 0; i < ranks.size(); ++i) ranks[i] = pair_rank(i);
  while (!ranks.empty()) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < ranks.size(); ++i)
      if (ranks[i] < ranks[best]) best = i;
    if (ranks[best] == no_rank) break;
    bounds.erase(bounds.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(best));
    if (best < ranks.size()) ranks[best] = pair_rank(best);
    if (best > 0) ranks[best - 1] = pair_rank(best - 1);
  }
}

/// The same merges in O(n log n): a doubly linked list of parts and a heap of
/// (rank, part, end of its right neighbour), stale entries skipped when popped. An
/// entry is current while its part is alive and the part after it still ends where it
/// did; the rank depends only on those bytes (and, parts only ever merging, the bound
/// between the two is still the one it was), so such an entry is exact.
template <class RankOf>
void byte_pair_merge_heap(std::string_view piece, std::vector<std::uint32_t>& bounds, const RankOf& rank_of) {
  if (bounds.size() < 3) return;
  const std::uint32_t m = static_cast<std::uint32_t>(bounds.size() - 1);  // parts; m is the end sentinel
  std::vector<std::uint32_t> next(m + 1), prev(m + 1);
  std::vector<char> alive(m + 1, 1);
  for (std::uint32_t k = 0; k <= m; ++k) {
    next[k] = k + 1;
    prev[k] = k == 0 ? m : k - 1;  // m: none
  }
  using Entry = std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>;  // rank, part, right end
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  const auto push = [&](std::uint32_t k) {
    if (k == m || next[k] == m) return;
    const std::uint32_t end = bounds[next[next[k]]];
    const std::uint32_t r = merge_rank(rank_of, piece, bounds[k], bounds[next[k]], end);
    if (r != no_rank) heap.emplace(r, k, end);
  };
  for (std::uint32_t k = 0; k + 1 < m; ++k) push(k);
  while (!heap.empty()) {
    const auto [r, k, end] = heap.top();
    heap.pop();
    if (!alive[k] || next[k] == m || bounds[next[next[k]]] != end) continue;
    const std::uint32_t j = next[k];
    alive[j] = 0;
    next[k] = next[j];
    prev[next[j]] = k;
    push(k);
    if (prev[k] != m) push(prev[k]);
  }
  std::vector<std::uint32_t> merged;
  for (std::uint32_t k = 0; k != m; k = next[k]) merged.push_back(bounds[k]);
  merged.push_back(bounds[m]);
  bounds = std::move(merged);
}

template <class RankOf>
void byte_pair_merge(std::string_view piece, std::vector<std::uint32_t>& bounds, const RankOf& rank_of) {
  if (bounds.size() <= bpe_scan_limit + 1) {
    byte_pair_merge_scan(piece, bounds, rank_of);
  } else {
    byte_pair_merge_heap(piece, bounds, rank_of);
  }
}

/// Appends the ids of one pre-tokenized piece: its bytes merged by rank (rank_of on
/// two adjacent parts), then each part's id (id_of on its bytes). `bounds` is scratch.
template <class RankOf, class IdOf>
void append_merged_piece(std::string_view piece, std::vector<std::uint32_t>& bounds, const RankOf& rank_of,
                         const IdOf& id_of, std::vector<std::uint32_t>& ids) {
  bounds.resize(piece.size() + 1);
  for (std::uint32_t i = 0; i <= piece.size(); ++i) bounds[i] = i;
  byte_pair_merge(piece, bounds, rank_of);
  for (std::size_t k = 0; k + 1 < bounds.size(); ++k)
    ids.push_back(id_of(piece.substr(bounds[k], bounds[k + 1] - bounds[k])));
}

/// The parsed vocabulary: immutable once built, shared by copies of the tokenizer.
struct TiktokenVocab {
  std::string source;                // the file, for messages
  std::string blob;                  // every base token's bytes, back to back, by rank
  std::vector<std::uint32_t> begin;  // token r is blob[begin[r], begin[r + 1])
  std::unordered_map<std::string_view, std::uint32_t> rank;  // views into blob
  std::vector<std::string> special_names;                     // index i: id num_base + i
  std::unordered_map<std::string, std::uint32_t> special_ids;
  std::size_t longest_special = 0;

  std::uint32_t num_base() const { return static_cast<std::uint32_t>(begin.size() - 1); }
  std::string_view bytes(std::uint32_t r) const { return std::string_view(blob).substr(begin[r], begin[r + 1] - begin[r]); }
  std::uint32_t rank_of(std::string_view bytes) const {
    auto it = rank.find(bytes);
    return it == rank.end() ? no_rank : it->second;
  }
};

/// Parses the decimal rank of a line: digits only, at most 4294967295.
inline bool parse_rank(std::string_view text, std::uint64_t& value) {
  if (text.empty() || text.size() > 10) return false;
  value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return value <= std::numeric_limits<std::uint32_t>::max();
}

}  // namespace detail

class TiktokenTokenizer final : public Tokenizer {
 public:
  using Tokenizer::encode;

  /// Reads and parses the rank file at `path`.
  static TiktokenTokenizer load(const std::string& path) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    TESSERA_CHECK(std::filesystem::exists(status), "tiktoken file '", path, "': no such file");
    TESSERA_CHECK(std::filesystem::is_regular_file(status), "tiktoken file '", path, "': not a regular file");
    std::ifstream in(path, std::ios::binary);
    TESSERA_CHECK(in.is_open(), "tiktoken file '", path, "': cannot open for reading");
    std::ostringstream text;
    text << in.rdbuf();
    TESSERA_CHECK(!in.bad(), "tiktoken file '", path, "': read error");
    return parse(text.str(), path);
  }

  /// Parses rank-file text; `source` names it in errors ("tiktoken file '<source>' line
  /// L: ..."). Throws tessera::Error for anything that is not a valid rank file: a line
  /// without a space, bad base64, an empty token, a rank that is not a decimal number,
  /// a token or rank given twice, ranks that do not run 0..N-1, a missing single byte.
  static TiktokenTokenizer parse(std::string_view text, const std::string& source) {
    auto vocab = std::make_shared<detail::TiktokenVocab>();
    vocab->source = source;
    struct Line {
      std::uint32_t rank;
      std::size_t line;
      std::uint32_t begin;  // in tokens_blob
      std::uint32_t size;
    };
    std::vector<Line> lines;
    std::string tokens_blob;
    std::string token;
    std::unordered_map<std::uint64_t, std::size_t> line_of_rank;
    const auto where = [&](std::size_t line) { return tessera::detail::concat("tiktoken file '", source, "' line ", line, ": "); };

    std::size_t pos = 0;
    std::size_t line_no = 0;
    while (pos < text.size()) {
      ++line_no;
      std::size_t eol = text.find('\n', pos);
      if (eol == std::string_view::npos) eol = text.size();
      std::string_view line = text.substr(pos, eol - pos);
      pos = eol + 1;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      TESSERA_CHECK(!line.empty(), where(line_no), "empty line (a rank file has one '<base64> <rank>' per line)");
      const std::size_t space = line.find(' ');
      TESSERA_CHECK(space != std::string_view::npos, where(line_no),
                    "expected '<base64 of the token> <rank>', found no space");
      const std::string_view b64 = line.substr(0, space);
      const std::string_view rank_text = line.substr(space + 1);
      TESSERA_CHECK(!b64.empty(), where(line_no), "empty token (nothing before the space)");
      TESSERA_CHECK(detail::base64_decode(b64, token), where(line_no), "'", detail::printable_bytes(b64.substr(0, 64)),
                    "' is not valid base64");
      TESSERA_CHECK(!token.empty(), where(line_no), "empty token");
      std::uint64_t rank = 0;
      TESSERA_CHECK(detail::parse_rank(rank_text, rank), where(line_no), "rank '",
                    detail::printable_bytes(rank_text.substr(0, 32)), "' is not a decimal number below 2^32");
      auto [it, fresh] = line_of_rank.emplace(rank, line_no);
      TESSERA_CHECK(fresh, where(line_no), "rank ", rank, " is given twice (also on line ", it->second, ")");
      TESSERA_CHECK(tokens_blob.size() + token.size() <= std::numeric_limits<std::uint32_t>::max(), where(line_no),
                    "the tokens exceed 4 GiB");
      lines.push_back(Line{static_cast<std::uint32_t>(rank), line_no, static_cast<std::uint32_t>(tokens_blob.size()),
                           static_cast<std::uint32_t>(token.size())});
      tokens_blob += token;
    }
    const std::size_t n = lines.size();
    TESSERA_CHECK(n > 0, "tiktoken file '", source, "': no tokens");
    TESSERA_CHECK(n <= std::numeric_limits<std::uint32_t>::max() - llama3_num_special_tokens, "tiktoken file '", source,
                  "': ", n, " tokens leave no room for the special tokens' ids");

    // Ranks are distinct; they are 0..n-1 exactly when none is n or more.
    for (const Line& l : lines) {
      if (l.rank >= n) {
        std::uint32_t missing = 0;
        while (line_of_rank.count(missing)) ++missing;
        fail(where(l.line), "rank ", l.rank, " is out of range: the file has ", n,
             " tokens, so ranks must run 0..", n - 1, " without gaps (rank ", missing, " is missing)");
      }
    }
    std::vector<const Line*> by_rank(n);
    for (const Line& l : lines) by_rank[l.rank] = &l;
    vocab->blob.reserve(tokens_blob.size());
    vocab->begin.reserve(n + 1);
    for (const Line* l : by_rank) {
      vocab->begin.push_back(static_cast<std::uint32_t>(vocab->blob.size()));
      vocab->blob.append(tokens_blob, l->begin, l->size);
    }
    vocab->begin.push_back(static_cast<std::uint32_t>(vocab->blob.size()));
    vocab->rank.reserve(n);
    for (std::uint32_t r = 0; r < n; ++r) {
      auto [it, fresh] = vocab->rank.emplace(vocab->bytes(r), r);
      if (!fresh) {
        const std::size_t first = std::min(by_rank[r]->line, by_rank[it->second]->line);
        const std::size_t second = std::max(by_rank[r]->line, by_rank[it->second]->line);
        fail(where(second), "token '", detail::printable_bytes(vocab->bytes(r)), "' is given twice (also on line ",
             first, ")");
      }
    }
    for (int b = 0; b < 256; ++b) {
      const char c = static_cast<char>(static_cast<unsigned char>(b));
      TESSERA_CHECK(vocab->rank.count(std::string_view(&c, 1)), "tiktoken file '", source,
                    "': the single byte ", detail::printable_bytes(std::string_view(&c, 1)),
                    " has no rank; every byte must be a token");
    }
    for (std::size_t i = 0; i < llama3_num_special_tokens; ++i) {
      vocab->special_names.push_back(llama3_special_token_name(i));
      vocab->special_ids.emplace(vocab->special_names.back(), static_cast<std::uint32_t>(n + i));
      vocab->longest_special = std::max(vocab->longest_special, vocab->special_names.back().size());
    }
    return TiktokenTokenizer(std::move(vocab));
  }

  std::string_view kind() const override { return "tiktoken"; }
  std::int64_t vocab_size() const override {
    return static_cast<std::int64_t>(num_base_tokens() + llama3_num_special_tokens);
  }
  std::uint32_t bos_id() const override { return num_base_tokens(); }
  std::uint32_t eos_id() const override { return num_base_tokens() + 1; }

  /// The number of base (non-special) tokens: N in the rank file.
  std::uint32_t num_base_tokens() const { return vocab_->num_base(); }
  /// The file (or source name) the ranks came from.
  const std::string& source() const { return vocab_->source; }

  /// The rank of the base token with these bytes, if there is one.
  std::optional<std::uint32_t> rank_of(std::string_view bytes) const {
    const std::uint32_t r = vocab_->rank_of(bytes);
    if (r == detail::no_rank) return std::nullopt;
    return r;
  }

  std::vector<std::uint32_t> encode(std::string_view text, EncodeOptions options) const override {
    std::vector<std::uint32_t> ids;
    ids.reserve(text.size() / 3 + 2);
    if (options.bos) ids.push_back(bos_id());
    if (options.allow_special) {
      std::size_t pos = 0;
      while (pos < text.size()) {
        const auto [at, length, id] = find_special(text, pos);
        encode_ordinary(text.substr(pos, at - pos), ids);
        if (length == 0) break;
        ids.push_back(id);
        pos = at + length;
      }
    } else {
      encode_ordinary(text, ids);
    }
    if (options.eos) ids.push_back(eos_id());
    return ids;
  }

  /// Appends the ids of `text` to `ids`, reading special-token text as ordinary text.
  void encode_ordinary(std::string_view text, std::vector<std::uint32_t>& ids) const {
    std::vector<std::uint32_t> bounds;
    const auto rank_of = [this](std::string_view bytes) { return vocab_->rank_of(bytes); };
    llama3_pretokenizer().for_each_piece(text, [&](std::string_view piece) {
      const std::uint32_t whole = vocab_->rank_of(piece);
      if (whole != detail::no_rank) {
        ids.push_back(whole);
        return;
      }
      detail::append_merged_piece(piece, bounds, rank_of, rank_of, ids);
    });
  }

  std::string decode(std::span<const std::uint32_t> ids) const override {
    std::string text;
    const std::uint32_t n = num_base_tokens();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::uint32_t id = ids[i];
      if (id < n) {
        text += vocab_->bytes(id);
        continue;
      }
      TESSERA_CHECK(static_cast<std::int64_t>(id) < vocab_size(), "tiktoken tokenizer '", vocab_->source,
                    "': token id ", id, " at position ", i, " is outside the vocabulary of ", vocab_size());
    }
    return text;
  }

  std::string token_text(std::uint32_t id) const override {
    const std::uint32_t n = num_base_tokens();
    if (id < n) return std::string(vocab_->bytes(id));
    TESSERA_CHECK(static_cast<std::int64_t>(id) < vocab_size(), "tiktoken tokenizer '", vocab_->source, "': token id ",
                  id, " is outside the vocabulary of ", vocab_size());
    return vocab_->special_names[id - n];
  }

  std::optional<std::uint32_t> special_id(std::string_view name) const override {
    auto it = vocab_->special_ids.find(std::string(name));
    if (it == vocab_->special_ids.end()) return std::nullopt;
    return it->second;
  }

 private:
  explicit TiktokenTokenizer(std::shared_ptr<const detail::TiktokenVocab> vocab) : vocab_(std::move(vocab)) {}

  struct SpecialMatch {
    std::size_t at;      // text.size() when there is none
    std::size_t length;  // 0 when there is none
    std::uint32_t id;
  };

  /// The leftmost special token in text[from, ...). Every Llama special is "<|" name
  /// "|>" with no "|>" inside the name, so the only candidate starting at a "<|" ends
  /// at the first "|>" after it; a failed candidate's "|>" is reused by the next "<|"
  /// that lies before it, which keeps the search linear.
  SpecialMatch find_special(std::string_view text, std::size_t from) const {
    std::size_t close = std::string_view::npos;
    for (std::size_t open = text.find("<|", from); open != std::string_view::npos; open = text.find("<|", open + 1)) {
      if (close == std::string_view::npos || close < open + 2) {
        close = text.find("|>", open + 2);
        if (close == std::string_view::npos) break;
      }
      const std::size_t length = close + 2 - open;
      if (length > vocab_->longest_special) continue;
      auto it = vocab_->special_ids.find(std::string(text.substr(open, length)));
      if (it != vocab_->special_ids.end()) return {open, length, it->second};
    }
    return {text.size(), 0, 0};
  }

  std::shared_ptr<const detail::TiktokenVocab> vocab_;
};

}  // namespace tessera::io
