// Hugging Face's `tokenizer.json` for byte-level BPE (Llama 3 and its derivatives).
//
// The file is what the `tokenizers` package (0.23) saves. tessera reads the shape Llama 3
// ships and encodes exactly as `tokenizers` does:
//
//   model          "BPE": `vocab` (token -> id), `merges` ("a b" strings or [a, b] pairs;
//                  a merge's priority is its index), `ignore_merges` (a pre-token that is
//                  itself in the vocabulary is that token), no byte_fallback, no dropout,
//                  no subword prefix or suffix
//   normalizer     none
//   pre_tokenizer  Sequence[Split{Regex, Isolated}, ..., ByteLevel{use_regex false}] (Llama 3)
//                  or ByteLevel{use_regex true} (GPT-2's pattern); add_prefix_space false
//   decoder        ByteLevel
//   added_tokens   matched in the text before anything else, leftmost and then longest
//                  first; special ones only with EncodeOptions::allow_special (as the
//                  tiktoken reader does; `tokenizers` always matches them), non-special ones
//                  always. Tokens with lstrip, rstrip or single_word are refused; normalized
//                  ones are matched in a second pass over what the first leaves (the
//                  normalizer being the identity, that is what `tokenizers` does)
//   post_processor TemplateProcessing: a leading SpecialToken is the BOS
//
// Byte level: each byte of the text stands for one character of GPT-2's alphabet (the
// printable Latin-1 bytes for themselves, the others for U+0100 on); vocabulary strings
// are read back into bytes here once, so BPE runs on bytes with the merge code of
// io/tiktoken.hpp, a merge ranked by the pair of tokens it names (not, as tiktoken, by
// the token they make), the lowest index first and the leftmost on ties. Split patterns
// go through io/pretokenize.hpp's PCRE2 Pretokenizer with `\s` spelled out as Unicode's
// White_Space (what Oniguruma, which `tokenizers` uses, and tiktoken read), so Llama 3's
// pattern becomes llama3_pcre2_pattern. Anything else is refused with one line naming the
// file and the key: Llama 2's SentencePiece-style tokenizer.json (Metaspace, byte
// fallback) is read from its tokenizer.model instead.
//
// BOS is the post-processor's leading special token (else tokenizer_config.json's
// bos_token, else <|begin_of_text|> or <s>); EOS is tokenizer_config.json's eos_token,
// from the file beside tokenizer.json, else <|end_of_text|> or </s>. Ids must cover
// [0, n) exactly once between the vocabulary and the added tokens. The parsed tables are
// immutable and shared between copies; encode and decode are const and thread-safe.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/error.hpp"
#include "tessera/io/pretokenize.hpp"
#include "tessera/io/tiktoken.hpp"
#include "tessera/io/tokenizer.hpp"

namespace tessera::io {

/// GPT-2's split pattern, as `tokenizers`' ByteLevel pre-tokenizer applies it with
/// use_regex true.
inline constexpr std::string_view gpt2_split_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace detail {

/// GPT-2's byte-level alphabet: the code point that stands for each byte.
inline const std::array<std::uint32_t, 256>& byte_level_code_points() {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    std::uint32_t next = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

/// The UTF-8 of code point `c` appended to `out`.
inline void append_utf8(std::string& out, std::uint32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

/// The byte-level string of `bytes` (each byte as its alphabet character, in UTF-8).
inline std::string to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) append_utf8(out, byte_level_code_points()[static_cast<unsigned char>(c)]);
  return out;
}

/// The bytes a byte-level string stands for, or nullopt when it has a character outside
/// the alphabet (or is not UTF-8).
inline std::optional<std::string> from_byte_level(std::string_view text) {
  static const std::array<int, 324> byte_of = [] {
    std::array<int, 324> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b) t[byte_level_code_points()[static_cast<std::size_t>(b)]] = b;
    return t;
  }();
  std::string out;
  std::size_t i = 0;
  while (i < text.size()) {
    const std::size_t n = utf8_char_length(text, i);
    if (n == 0) return std::nullopt;
    std::uint32_t c = static_cast<unsigned char>(text[i]);
    if (n == 2) c = ((c & 0x1F) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3F);
    if (n > 2 || c >= byte_of.size() || byte_of[c] < 0) return std::nullopt;
    out.push_back(static_cast<char>(byte_of[c]));
    i += n;
  }
  return out;
}

/// An Oniguruma/Rust regex as `tokenizers` writes it, for PCRE2: `\s` (PCRE2's takes
/// U+180E too) spelled out as Unicode's White_Space list, `\S` as its complement (not
/// inside a class, which PCRE2 cannot say). Everything else is left as it is; PCRE2
/// reports what it cannot compile. Throws (the caller adds the file) on `\S` in a class.
inline std::string pcre2_pattern_from_onig(std::string_view pattern) {
  static constexpr std::string_view ws =
      R"(\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        out += in_class ? std::string(ws) : "[" + std::string(ws) + "]";
      } else if (e == 'S') {
        TESSERA_CHECK(!in_class, "\\S inside a character class (at offset ", i - 1, ") has no PCRE2 spelling here");
        out += "[^" + std::string(ws) + "]";
      } else {
        out.push_back(c);
        out.push_back(e);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' (or '^]') right after the opening bracket is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

/// Hashes std::string keys and looks them up by std::string_view without a copy.
struct HfStringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using HfStringMap = std::unordered_map<std::string, V, HfStringHash, std::equal_to<>>;

/// An added token: text matched before pre-tokenization.
struct HfAddedToken {
  std::string content;
  std::uint32_t id = 0;
  bool special = false;
  bool normalized = false;
};

/// Leftmost-longest matching of a set of strings (Aho-Corasick's LeftmostLongest as
/// `tokenizers` uses it): a table of which bytes start one, and per length the strings.
struct HfTokenMatcher {
  std::array<bool, 256> starts{};
  std::vector<std::size_t> lengths;  // distinct, longest first
  HfStringMap<std::size_t> index;    // content -> position in the token list

  void add(const std::string& content, std::size_t i) {
    starts[static_cast<unsigned char>(content[0])] = true;
    if (std::find(lengths.begin(), lengths.end(), content.size()) == lengths.end()) lengths.push_back(content.size());
    std::sort(lengths.rbegin(), lengths.rend());
    index.emplace(content, i);
  }
  bool empty() const { return index.empty(); }

  struct Match {
    std::size_t at, length, token;  // length 0: none
  };
  /// The leftmost match at or after `from`, the longest there.
  Match find(std::string_view text, std::size_t from) const {
    if (index.empty()) return {text.size(), 0, 0};
    for (std::size_t at = from; at < text.size(); ++at) {
      if (!starts[static_cast<unsigned char>(text[at])]) continue;
      for (std::size_t n : lengths) {
        if (n > text.size() - at) continue;
        auto it = index.find(text.substr(at, n));
        if (it != index.end()) return {at, n, it->second};
      }
    }
    return {text.size(), 0, 0};
  }
};

/// The parsed tokenizer: immutable once built, shared by copies.
struct HfTokenizerData {
  std::string source;  // the file, for messages
  std::string json;    // the file's text, as read
  bool ignore_merges = false;
  std::vector<std::string> token_bytes;    // by id: what decode gives (the decoder's rule)
  std::vector<std::string> token_names;    // by id: the string in the file
  std::vector<char> is_special;            // by id
  HfStringMap<std::uint32_t> id_of_bytes;  // vocabulary tokens by their bytes
  HfStringMap<std::uint32_t> id_of_name;   // vocabulary and added tokens by their strings
  std::unordered_map<std::uint64_t, std::pair<std::uint32_t, std::uint32_t>> merges;  // (left, right) -> (rank, id)
  std::vector<HfAddedToken> added;
  HfTokenMatcher first_pass;         // added tokens with normalized false
  HfTokenMatcher second_pass;        // normalized true (the identity normalizer)
  std::vector<Pretokenizer> splits;  // applied in order; empty: the whole text is one piece
  std::uint32_t bos = 0;
  std::uint32_t eos = 0;

  std::uint32_t id_of(std::string_view bytes) const {
    auto it = id_of_bytes.find(bytes);
    return it == id_of_bytes.end() ? no_rank : it->second;
  }
};

}  // namespace detail

class HfTokenizer final : public Tokenizer {
 public:
  using Tokenizer::encode;

  /// Reads `path` (a tokenizer.json) and, when there is one beside it,
  /// tokenizer_config.json for the BOS and EOS tokens.
  static HfTokenizer load(const std::string& path) {
    return parse_beside_config(read_text(path, "tokenizer.json"), path);
  }

  /// Parses `text`, read from `path`, with the tokenizer_config.json beside `path` if any.
  static HfTokenizer parse_beside_config(std::string_view text, const std::string& path) {
    const std::filesystem::path config = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
    std::error_code ec;
    if (std::filesystem::is_regular_file(config, ec)) {
      const std::string config_text = read_text(config.string(), "tokenizer_config.json");
      return parse(text, path, config_text, config.string());
    }
    return parse(text, path);
  }

  /// Parses tokenizer.json text; `source` names it in errors ("tokenizer.json '<source>':
  /// <key>: ..."). `config` is tokenizer_config.json's text, if any (`config_source` names it).
  static HfTokenizer parse(std::string_view text, const std::string& source,
                           std::optional<std::string_view> config = std::nullopt,
                           const std::string& config_source = "") {
    // Every value is checked for its type before it is read; should a check be missing,
    // nlohmann's exception still becomes an error naming the file.
    try {
      return parse_checked(text, source, config, config_source);
    } catch (const nlohmann::json::exception& e) {
      fail("tokenizer.json '", source, "'", config ? " (or tokenizer_config.json '" + config_source + "')" : "",
           ": a value of an unexpected type: ", e.what());
    }
  }

  std::string_view kind() const override { return "tokenizer.json"; }
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(d_->token_names.size()); }
  std::uint32_t bos_id() const override { return d_->bos; }
  std::uint32_t eos_id() const override { return d_->eos; }

  /// The file the tokenizer came from, and its text as read.
  const std::string& source() const { return d_->source; }
  const std::string& json() const { return d_->json; }
  /// The token's string as the file spells it (byte-level characters for a vocabulary token).
  const std::string& token_name(std::uint32_t id) const {
    check_id(id, std::nullopt);
    return d_->token_names[id];
  }
  /// Whether `id` is a special added token.
  bool is_special(std::uint32_t id) const {
    check_id(id, std::nullopt);
    return d_->is_special[id] != 0;
  }
  /// The added tokens, in the file's order.
  const std::vector<detail::HfAddedToken>& added_tokens() const { return d_->added; }

  std::vector<std::uint32_t> encode(std::string_view text, EncodeOptions options) const override {
    std::vector<std::uint32_t> ids;
    ids.reserve(text.size() / 3 + 2);
    if (options.bos) ids.push_back(d_->bos);
    // First pass: tokens with normalized false; the text between them (special tokens'
    // text too, without allow_special) goes to the second pass: tokens with normalized
    // true, and BPE on what is left.
    split_on_added(d_->first_pass, text, options, ids, [&](std::string_view between) {
      split_on_added(d_->second_pass, between, options, ids,
                     [&](std::string_view rest) { encode_ordinary(rest, ids); });
    });
    if (options.eos) ids.push_back(d_->eos);
    return ids;
  }

  /// Appends the BPE ids of `text` (no added tokens in it) to `ids`.
  void encode_ordinary(std::string_view text, std::vector<std::uint32_t>& ids) const {
    if (text.empty()) return;
    std::vector<std::uint32_t> bounds;
    const detail::HfTokenizerData& d = *d_;
    const auto rank_of = [&d](std::string_view left, std::string_view right) {
      const std::uint32_t a = d.id_of(left);
      const std::uint32_t b = d.id_of(right);
      if (a == detail::no_rank || b == detail::no_rank) return detail::no_rank;
      auto it = d.merges.find((static_cast<std::uint64_t>(a) << 32) | b);
      return it == d.merges.end() ? detail::no_rank : it->second.first;
    };
    const auto bpe = [&](std::string_view piece) {
      if (d.ignore_merges) {
        const std::uint32_t whole = d.id_of(piece);
        if (whole != detail::no_rank) {
          ids.push_back(whole);
          return;
        }
      }
      detail::append_merged_piece(piece, bounds, rank_of, [&d](std::string_view part) { return d.id_of(part); }, ids);
    };
    split(text, 0, bpe);
  }

  std::string decode(std::span<const std::uint32_t> ids) const override {
    std::string text;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      check_id(ids[i], i);
      if (!d_->is_special[ids[i]]) text += d_->token_bytes[ids[i]];
    }
    return text;
  }

  std::string token_text(std::uint32_t id) const override {
    check_id(id, std::nullopt);
    return d_->is_special[id] ? d_->token_names[id] : d_->token_bytes[id];
  }

  std::optional<std::uint32_t> special_id(std::string_view name) const override {
    for (const detail::HfAddedToken& t : d_->added)
      if (t.special && t.content == name) return t.id;
    return std::nullopt;
  }

 private:
  explicit HfTokenizer(std::shared_ptr<const detail::HfTokenizerData> d) : d_(std::move(d)) {}

  static std::string read_text(const std::string& path, const char* what) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    TESSERA_CHECK(std::filesystem::exists(status), what, " '", path, "': no such file");
    TESSERA_CHECK(std::filesystem::is_regular_file(status), what, " '", path, "': not a regular file");
    std::ifstream in(path, std::ios::binary);
    TESSERA_CHECK(in.is_open(), what, " '", path, "': cannot open for reading");
    std::ostringstream text;
    text << in.rdbuf();
    TESSERA_CHECK(!in.bad(), what, " '", path, "': read error");
    return text.str();
  }

  static HfTokenizer parse_checked(std::string_view text, const std::string& source,
                                   std::optional<std::string_view> config, const std::string& config_source) {
    using nlohmann::json;
    auto d = std::make_shared<detail::HfTokenizerData>();
    d->source = source;
    d->json = std::string(text);
    const std::string where = "tokenizer.json '" + source + "': ";
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {
      fail(where, "not JSON: ", e.what());
    }
    TESSERA_CHECK(j.is_object(), where, "not a JSON object");
    const auto is_true = [](const json& v, const char* key) {
      return v.is_object() && v.contains(key) && v[key].is_boolean() && v[key].get<bool>();
    };
    static constexpr std::string_view reads =
        "tessera reads byte-level BPE (model \"BPE\", ByteLevel pre-tokenizer and decoder, as Llama 3 ships it)";
    static constexpr std::string_view llama2 = "this is SentencePiece-style BPE (Llama 2): use tokenizer.model";

    // model
    TESSERA_CHECK(j.contains("model") && j["model"].is_object(), where, "model: missing (", reads, ")");
    const json& model = j["model"];
    const std::string model_type = type_of(model);
    TESSERA_CHECK(model_type == "BPE", where, "model.type: \"", model_type.empty() ? "(none)" : model_type,
                  "\" is not read; ", reads);
    TESSERA_CHECK(!is_true(model, "byte_fallback"), where, "model.byte_fallback: true: ", llama2);
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const bool none = !model.contains(key) || model[key].is_null() ||
                        (model[key].is_string() && model[key].get<std::string>().empty());
      TESSERA_CHECK(none, where, "model.", key, ": not read (byte-level BPE has none)");
    }
    if (model.contains("dropout") && !model["dropout"].is_null())
      TESSERA_CHECK(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0, where,
                    "model.dropout: BPE dropout is not read (null or 0 only)");
    if (model.contains("ignore_merges")) {
      TESSERA_CHECK(model["ignore_merges"].is_boolean(), where, "model.ignore_merges: not true or false");
      d->ignore_merges = model["ignore_merges"].get<bool>();
    }

    // normalizer
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const json& n = j["normalizer"];
      const std::string t = type_of(n);
      bool sentencepiece = t == "Prepend" || t == "Replace";
      if (t == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array())
        for (const json& s : n["normalizers"])
          sentencepiece = sentencepiece || type_of(s) == "Prepend" || type_of(s) == "Replace";
      TESSERA_CHECK(!sentencepiece, where, "normalizer: \"", t, "\": ", llama2);
      fail(where, "normalizer: \"", t, "\" is not read; ", reads, " with no normalizer");
    }

    // pre_tokenizer
    TESSERA_CHECK(j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null(), where, "pre_tokenizer: missing; ",
                  reads);
    {
      const json& p = j["pre_tokenizer"];
      std::vector<const json*> steps;
      if (type_of(p) == "Sequence") {
        TESSERA_CHECK(p.contains("pretokenizers") && p["pretokenizers"].is_array(), where,
                      "pre_tokenizer.pretokenizers: not a list");
        for (const json& s : p["pretokenizers"]) steps.push_back(&s);
      } else {
        steps.push_back(&p);
      }
      bool byte_level = false;
      for (std::size_t k = 0; k < steps.size(); ++k) {
        const json& s = *steps[k];
        const std::string t = type_of(s);
        const std::string key = steps.size() > 1 ? tessera::detail::concat("pre_tokenizer.pretokenizers[", k, "]")
                                                 : std::string("pre_tokenizer");
        TESSERA_CHECK(t != "Metaspace", where, key, ": \"Metaspace\": ", llama2);
        TESSERA_CHECK(!byte_level, where, key, ": \"", t, "\" after ByteLevel is not read (ByteLevel must be last)");
        if (t == "Split") {
          TESSERA_CHECK(s.contains("pattern") && s["pattern"].is_object() && s["pattern"].contains("Regex") &&
                            s["pattern"]["Regex"].is_string(),
                        where, key, ".pattern: not read (a {\"Regex\": ...} pattern only)");
          const std::string behavior = text_of(s, "behavior");
          TESSERA_CHECK(behavior == "Isolated", where, key, ".behavior: \"", behavior,
                        "\" is not read (Isolated only)");
          TESSERA_CHECK(!is_true(s, "invert"), where, key, ".invert: true is not read");
          add_split(*d, s["pattern"]["Regex"].get<std::string>(), where + key + ".pattern.Regex");
        } else if (t == "ByteLevel") {
          TESSERA_CHECK(!is_true(s, "add_prefix_space"), where, key, ".add_prefix_space: true is not read");
          // use_regex defaults to true in `tokenizers`.
          if (!s.contains("use_regex") || is_true(s, "use_regex"))
            add_split(*d, std::string(gpt2_split_pattern), where + key + " (GPT-2's pattern)");
          byte_level = true;
        } else {
          fail(where, key, ": \"", t, "\" is not read; ", reads,
               " (Split with a Regex, Isolated, then ByteLevel; or ByteLevel alone)");
        }
      }
      TESSERA_CHECK(byte_level, where, "pre_tokenizer: no ByteLevel step; ", reads);
    }

    // decoder
    {
      const std::string t = j.contains("decoder") ? type_of(j["decoder"]) : "";
      const bool sentencepiece =
          t == "Metaspace" || (t == "Sequence" && j["decoder"].dump().find("ByteFallback") != std::string::npos);
      TESSERA_CHECK(!sentencepiece, where, "decoder: \"", t, "\": ", llama2);
      TESSERA_CHECK(t == "ByteLevel", where, "decoder: \"", t.empty() ? "(none)" : t, "\" is not read; ", reads);
    }

    // vocabulary
    TESSERA_CHECK(model.contains("vocab") && model["vocab"].is_object(), where,
                  "model.vocab: not an object of token -> id");
    std::unordered_map<std::uint32_t, std::string> name_of_id;
    std::uint64_t max_id = 0;
    const auto claim = [&](std::uint32_t id, const std::string& name, const char* key) {
      auto [it, fresh] = name_of_id.emplace(id, name);
      TESSERA_CHECK(fresh, where, key, ": id ", id, " is given twice ('", detail::printable_bytes(it->second),
                    "' and '", detail::printable_bytes(name), "')");
      max_id = std::max<std::uint64_t>(max_id, id);
    };
    detail::HfStringMap<std::uint32_t> vocab;  // the model's tokens only
    for (const auto& item : model["vocab"].items()) {
      const std::string& name = item.key();
      TESSERA_CHECK(item.value().is_number_unsigned() && item.value().get<std::uint64_t>() < detail::no_rank, where,
                    "model.vocab: '", detail::printable_bytes(name), "' has no valid id");
      const auto id = static_cast<std::uint32_t>(item.value().get<std::uint64_t>());
      claim(id, name, "model.vocab");
      vocab.emplace(name, id);
    }
    d->id_of_name = vocab;

    // added tokens
    if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
      TESSERA_CHECK(j["added_tokens"].is_array(), where, "added_tokens: not a list");
      for (const json& a : j["added_tokens"]) {
        TESSERA_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_unsigned() && a.contains("content") &&
                          a["content"].is_string() && !a["content"].get<std::string>().empty(),
                      where, "added_tokens: an entry without an id and a non-empty content");
        detail::HfAddedToken t;
        t.content = a["content"].get<std::string>();
        TESSERA_CHECK(a["id"].get<std::uint64_t>() < detail::no_rank, where, "added_tokens: '", t.content,
                      "' has no valid id");
        t.id = static_cast<std::uint32_t>(a["id"].get<std::uint64_t>());
        t.special = is_true(a, "special");
        t.normalized = is_true(a, "normalized");
        for (const char* key : {"lstrip", "rstrip", "single_word"})
          TESSERA_CHECK(!is_true(a, key), where, "added_tokens: '", detail::printable_bytes(t.content), "' has ", key,
                        " true, which is not read");
        // A token of the vocabulary may be added too (a trained tokenizer's specials), under its own id.
        auto known = d->id_of_name.find(t.content);
        if (known != d->id_of_name.end()) {
          TESSERA_CHECK(known->second == t.id, where, "added_tokens: '", detail::printable_bytes(t.content),
                        "' has id ", t.id, " but is already token ", known->second);
          TESSERA_CHECK(vocab.count(t.content), where, "added_tokens: '", detail::printable_bytes(t.content),
                        "' is given twice");
        } else {
          claim(t.id, t.content, "added_tokens");
          d->id_of_name.emplace(t.content, t.id);
        }
        d->added.push_back(std::move(t));
      }
    }

    // ids cover [0, n)
    const std::uint64_t n = name_of_id.empty() ? 0 : max_id + 1;
    TESSERA_CHECK(n > 0, where, "model.vocab: empty");
    if (name_of_id.size() != n) {
      std::uint32_t missing = 0;
      while (name_of_id.count(missing)) ++missing;
      fail(where, "ids must run 0..", n - 1, " without gaps between model.vocab and added_tokens (id ", missing,
           " is missing)");
    }
    d->token_bytes.resize(n);
    d->token_names.resize(n);
    d->is_special.assign(n, 0);
    for (auto& [id, name] : name_of_id) {
      d->token_names[id] = name;
      // The ByteLevel decoder: a token of alphabet characters is their bytes, any other
      // is its own text.
      std::optional<std::string> bytes = detail::from_byte_level(name);
      d->token_bytes[id] = bytes ? *bytes : name;
    }
    for (const auto& [name, id] : vocab)
      if (std::optional<std::string> bytes = detail::from_byte_level(name)) d->id_of_bytes.emplace(*bytes, id);
    for (int b = 0; b < 256; ++b) {
      const std::string byte(1, static_cast<char>(static_cast<unsigned char>(b)));
      TESSERA_CHECK(d->id_of_bytes.count(byte), where, "model.vocab: the byte ", detail::printable_bytes(byte),
                    " (byte-level '", detail::to_byte_level(byte), "') is not a token; every byte must be one");
    }
    for (std::size_t i = 0; i < d->added.size(); ++i) {
      const detail::HfAddedToken& t = d->added[i];
      if (t.special) d->is_special[t.id] = 1;
      (t.normalized ? d->second_pass : d->first_pass).add(t.content, i);
    }

    // merges
    TESSERA_CHECK(model.contains("merges") && model["merges"].is_array(), where, "model.merges: not a list");
    const json& merges = model["merges"];
    d->merges.reserve(merges.size());
    for (std::size_t r = 0; r < merges.size(); ++r) {
      const json& m = merges[r];
      std::string left, right;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const std::size_t space = s.find(' ');
        TESSERA_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos, where, "model.merges[",
                      r, "]: '", detail::printable_bytes(s), "' is not two tokens separated by one space");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {
        TESSERA_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), where, "model.merges[", r,
                      "]: neither \"a b\" nor [\"a\", \"b\"]");
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      }
      const auto id_in_vocab = [&](const std::string& token) {
        auto it = vocab.find(token);
        TESSERA_CHECK(it != vocab.end(), where, "model.merges[", r, "]: '", detail::printable_bytes(left), " ",
                      detail::printable_bytes(right), "' names '", detail::printable_bytes(token),
                      "', which is not in model.vocab");
        return it->second;
      };
      const std::uint32_t a = id_in_vocab(left);
      const std::uint32_t b = id_in_vocab(right);
      const std::uint32_t ab = id_in_vocab(left + right);
      // A pair given twice keeps its last rank, as `tokenizers`' map does.
      d->merges[(static_cast<std::uint64_t>(a) << 32) | b] = {static_cast<std::uint32_t>(r), ab};
    }

    // BOS and EOS
    std::optional<json> cfg;
    if (config) {
      try {
        cfg = json::parse(*config);
      } catch (const json::exception& e) {
        fail("tokenizer_config.json '", config_source, "': not JSON: ", e.what());
      }
      TESSERA_CHECK(cfg->is_object(), "tokenizer_config.json '", config_source, "': not a JSON object");
    }
    const auto config_token = [&](const char* key) -> std::optional<std::string> {
      if (!cfg || !cfg->contains(key) || (*cfg)[key].is_null()) return std::nullopt;
      const json& v = (*cfg)[key];
      if (v.is_string()) return v.get<std::string>();
      TESSERA_CHECK(v.is_object() && v.contains("content") && v["content"].is_string(), "tokenizer_config.json '",
                    config_source, "': ", key, ": neither a string nor {\"content\": ...}");
      return v["content"].get<std::string>();
    };
    const auto named = [&](const std::string& name, const std::string& from) {
      auto it = d->id_of_name.find(name);
      TESSERA_CHECK(it != d->id_of_name.end(), from, ": '", detail::printable_bytes(name), "' is not a token of '",
                    source, "'");
      return it->second;
    };
    const auto fallback = [&](std::initializer_list<const char*> names) -> std::optional<std::uint32_t> {
      for (const char* name : names) {
        auto it = d->id_of_name.find(name);
        if (it != d->id_of_name.end()) return it->second;
      }
      return std::nullopt;
    };
    std::optional<std::uint32_t> bos = template_bos(j, where);
    if (bos)
      TESSERA_CHECK(*bos < n, where, "post_processor.special_tokens: the BOS token's id ", *bos,
                    " is outside the vocabulary of ", n);
    if (!bos) {
      if (auto name = config_token("bos_token"))
        bos = named(*name, "tokenizer_config.json '" + config_source + "': bos_token");
    }
    if (!bos) bos = fallback({"<|begin_of_text|>", "<s>"});
    TESSERA_CHECK(bos.has_value(), where,
                  "no BOS token: no TemplateProcessing post_processor starting with a special token, no "
                  "tokenizer_config.json bos_token, and neither <|begin_of_text|> nor <s> is a token");
    std::optional<std::uint32_t> eos;
    if (auto name = config_token("eos_token"))
      eos = named(*name, "tokenizer_config.json '" + config_source + "': eos_token");
    if (!eos) eos = fallback({"<|end_of_text|>", "</s>"});
    TESSERA_CHECK(eos.has_value(), where,
                  "no EOS token: no tokenizer_config.json eos_token beside it, and neither <|end_of_text|> nor </s> "
                  "is a token");
    d->bos = *bos;
    d->eos = *eos;
    return HfTokenizer(std::move(d));
  }

  /// `v[key]`'s text: a string as it is, nothing for a key absent (or v not an object) or
  /// null, any other value as JSON (so a message can show it).
  static std::string text_of(const nlohmann::json& v, const char* key) {
    if (!v.is_object() || !v.contains(key) || v[key].is_null()) return "";
    return v[key].is_string() ? v[key].get<std::string>() : v[key].dump();
  }
  /// An object's "type" when it is a string, else nothing.
  static std::string type_of(const nlohmann::json& v) {
    return v.is_object() && v.contains("type") && v["type"].is_string() ? v["type"].get<std::string>() : "";
  }

  static void add_split(detail::HfTokenizerData& d, const std::string& pattern, const std::string& where) {
    std::string pcre2;
    try {
      pcre2 = pattern == llama3_split_pattern ? std::string(llama3_pcre2_pattern)
                                              : detail::pcre2_pattern_from_onig(pattern);
      d.splits.emplace_back(pcre2);
    } catch (const Error& e) {
      fail(where, ": '", pattern, "' is not a pattern PCRE2 reads: ", e.what());
    }
  }

  /// The id of the first SpecialToken of a TemplateProcessing post-processor's `single`
  /// template (in a Sequence too), if it starts with one.
  static std::optional<std::uint32_t> template_bos(const nlohmann::json& j, const std::string& where) {
    if (!j.contains("post_processor") || !j["post_processor"].is_object()) return std::nullopt;
    std::vector<const nlohmann::json*> processors{&j["post_processor"]};
    const nlohmann::json& p = j["post_processor"];
    if (type_of(p) == "Sequence" && p.contains("processors") && p["processors"].is_array()) {
      processors.clear();
      for (const auto& q : p["processors"]) processors.push_back(&q);
    }
    for (const nlohmann::json* q : processors) {
      if (type_of(*q) != "TemplateProcessing" || !q->contains("single"))
        continue;
      const nlohmann::json& single = (*q)["single"];
      if (!single.is_array() || single.empty() || !single[0].is_object() || !single[0].contains("SpecialToken"))
        return std::nullopt;
      const nlohmann::json& st = single[0]["SpecialToken"];
      TESSERA_CHECK(st.contains("id") && st["id"].is_string(), where, "post_processor: a SpecialToken without an id");
      const std::string name = st["id"].get<std::string>();
      TESSERA_CHECK(q->contains("special_tokens"), where, "post_processor: no special_tokens");
      const nlohmann::json& specials = (*q)["special_tokens"];
      TESSERA_CHECK(specials.is_object() && specials.contains(name) && specials[name].contains("ids") &&
                        specials[name]["ids"].is_array() && specials[name]["ids"].size() == 1 &&
                        specials[name]["ids"][0].is_number_unsigned(),
                    where, "post_processor.special_tokens: '", name, "' has not exactly one id");
      return static_cast<std::uint32_t>(specials[name]["ids"][0].get<std::uint64_t>());
    }
    return std::nullopt;
  }

  void check_id(std::uint32_t id, std::optional<std::size_t> position) const {
    if (static_cast<std::int64_t>(id) < vocab_size()) return;
    if (position)
      fail("tokenizer.json '", d_->source, "': token id ", id, " at position ", *position,
           " is outside the vocabulary of ", vocab_size());
    fail("tokenizer.json '", d_->source, "': token id ", id, " is outside the vocabulary of ", vocab_size());
  }

  /// Appends the ids of `text`: the added tokens `matcher` finds (special ones only with
  /// allow_special), and `between(piece)` for the text before, between and after them.
  template <class F>
  void split_on_added(const detail::HfTokenMatcher& matcher, std::string_view text, EncodeOptions options,
                      std::vector<std::uint32_t>& ids, F&& between) const {
    std::size_t gap = 0;
    for (std::size_t pos = 0; pos < text.size();) {
      const auto m = matcher.find(text, pos);
      if (m.length == 0) break;
      pos = m.at + m.length;
      const detail::HfAddedToken& t = d_->added[m.token];
      if (t.special && !options.allow_special) continue;
      between(text.substr(gap, m.at - gap));
      ids.push_back(t.id);
      gap = pos;
    }
    between(text.substr(gap));
  }

  /// Calls f on each piece of `text` after the split patterns from `level` on.
  template <class F>
  void split(std::string_view text, std::size_t level, F& f) const {
    if (level == d_->splits.size()) {
      f(text);
      return;
    }
    d_->splits[level].for_each_piece(text, [&](std::string_view piece) { split(piece, level + 1, f); });
  }

  std::shared_ptr<const detail::HfTokenizerData> d_;
};

/// The tokenizer.json of a tiktoken tokenizer, as transformers' TikTokenConverter makes
/// it for Llama 3 (and `tokenizers` saves it): the vocabulary in byte-level strings; as
/// merges, every split of a token into two tokens, ordered by the token's rank and then
/// by the ranks of the two halves; Split on Llama 3's pattern then ByteLevel;
/// ignore_merges (a piece that is a token is that token, as tiktoken does); the special
/// tokens as added tokens; <|begin_of_text|> prepended by the post-processor. HfTokenizer
/// reads it back to the same ids as `tok`.
inline std::string tiktoken_tokenizer_json(const TiktokenTokenizer& tok) {
  using ordered = nlohmann::ordered_json;
  const std::uint32_t n = tok.num_base_tokens();
  ordered added = ordered::array();
  for (std::size_t i = 0; i < llama3_num_special_tokens; ++i)
    added.push_back({{"id", n + i},
                     {"content", llama3_special_token_name(i)},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  ordered vocab = ordered::object();
  ordered merges = ordered::array();
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::size_t>> splits;  // rank left, rank right, at
  for (std::uint32_t r = 0; r < n; ++r) {
    const std::string bytes(tok.token_text(r));
    vocab[detail::to_byte_level(bytes)] = r;
    splits.clear();
    for (std::size_t i = 1; i < bytes.size(); ++i) {
      const auto left = tok.rank_of(std::string_view(bytes).substr(0, i));
      const auto right = tok.rank_of(std::string_view(bytes).substr(i));
      if (left && right) splits.emplace_back(*left, *right, i);
    }
    std::sort(splits.begin(), splits.end());
    for (const auto& [left, right, i] : splits)
      merges.push_back(
          ordered::array({detail::to_byte_level(bytes.substr(0, i)), detail::to_byte_level(bytes.substr(i))}));
  }
  const std::string bos = llama3_special_token_name(0);
  const auto special = [&](int type_id) { return ordered{{"SpecialToken", {{"id", bos}, {"type_id", type_id}}}}; };
  const auto sequence = [](const char* id, int type_id) {
    return ordered{{"Sequence", {{"id", id}, {"type_id", type_id}}}};
  };
  ordered j = ordered::object();
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = std::move(added);
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       ordered::array(
           {ordered{{"type", "Split"},
                    {"pattern", {{"Regex", std::string(llama3_split_pattern)}}},
                    {"behavior", "Isolated"},
                    {"invert", false}},
            ordered{
                {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}};
  j["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       ordered::array(
           {ordered{{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false}, {"use_regex", true}},
            ordered{{"type", "TemplateProcessing"},
                    {"single", ordered::array({special(0), sequence("A", 0)})},
                    {"pair", ordered::array({special(0), sequence("A", 0), special(0), sequence("B", 1)})},
                    {"special_tokens",
                     {{bos, {{"id", bos}, {"ids", ordered::array({n})}, {"tokens", ordered::array({bos})}}}}}}})}};
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", true},
                {"vocab", std::move(vocab)},
                {"merges", std::move(merges)}};
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::strict) + "\n";
}

}  // namespace tessera::io
