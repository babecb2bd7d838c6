// Pre-tokenization: cutting text into the pieces a BPE tokenizer merges within.
//
// Llama 3 (like tiktoken's cl100k encodings) never merges across the boundaries of a
// regular expression's matches: contractions ('s 'll ...), a word with at most one
// leading non-letter, runs of up to three digits, punctuation runs, newlines and
// whitespace each become separate pieces, and BPE runs inside each piece alone.
// `Pretokenizer` compiles such a pattern once with PCRE2 (UTF + UCP: Unicode
// properties) and splits text into the consecutive pieces that tiktoken's `findall`
// gives. Text need not be UTF-8: no match covers an invalid byte, each run of bytes
// between two matches becomes a piece of its own, and the pieces always concatenate
// back to the text, byte for byte. With PCRE2's JIT the pattern is compiled with
// MATCH_INVALID_UTF and run over the whole text; PCRE2 then never fails or reads out
// of bounds on bad bytes. Without a JIT the text is cut into its valid UTF-8 runs here
// and PCRE2's interpreter matches each run alone (its own check of invalid UTF-8
// rescans the rest of the text at every call, which is quadratic). Both give the same
// pieces, and both are linear in the length of the text.
//
// A compiled pattern is immutable; each call allocates its own match data, so any
// number of threads may split text with one Pretokenizer at once. PCRE2 errors become
// tessera::Error with PCRE2's message.
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera::io {

/// Llama 3's split pattern, in tiktoken's spelling (the pattern of Llama 3's reference
/// tokenizer and of tiktoken's cl100k_base).
inline constexpr std::string_view llama3_split_pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// The same pattern for PCRE2. tiktoken's regex engine reads `\s` as Unicode's
/// White_Space property; PCRE2's `\s` also takes U+180E (MONGOLIAN VOWEL SEPARATOR,
/// white space before Unicode 6.3), so each `\s` is spelled out as the White_Space
/// list: tab to carriage return, space, U+0085, U+00A0, U+1680, U+2000-U+200A,
/// U+2028, U+2029, U+202F, U+205F and U+3000.
inline constexpr std::string_view llama3_pcre2_pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d))"
    R"(|[^\r\n\p{L}\p{N}]?\p{L}+)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}\p{L}\p{N}]+[\r\n]*)"
    R"(|[\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]*[\r\n]+)"
    R"(|[\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]+(?![^\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]))"
    R"(|[\t-\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}]+)";

namespace detail {

/// PCRE2's text for an error code.
inline std::string pcre2_message(int code) {
  PCRE2_UCHAR8 buffer[256];
  int n = pcre2_get_error_message_8(code, buffer, sizeof(buffer));
  if (n < 0) return "PCRE2 error " + std::to_string(code);
  return std::string(reinterpret_cast<const char*>(buffer), static_cast<std::size_t>(n));
}

struct Pcre2CodeFree {
  void operator()(pcre2_code_8* code) const { pcre2_code_free_8(code); }
};
struct Pcre2MatchDataFree {
  void operator()(pcre2_match_data_8* data) const { pcre2_match_data_free_8(data); }
};
struct Pcre2MatchContextFree {
  void operator()(pcre2_match_context_8* context) const { pcre2_match_context_free_8(context); }
};

/// The length of the UTF-8 character at `text[i]` (1 to 4), or 0 when the bytes there
/// do not start a valid one: RFC 3629, as PCRE2 reads it (no overlong forms, no
/// surrogates, nothing above U+10FFFF).
inline std::size_t utf8_char_length(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const std::size_t left = text.size() - i;
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  const auto cont = [&](std::size_t k, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
    return byte(i + k) >= lo && byte(i + k) <= hi;
  };
  if (b0 >= 0xC2 && b0 <= 0xDF) return left >= 2 && cont(1) ? 1 + 1 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (left < 3) return 0;
    const bool second = b0 == 0xE0 ? cont(1, 0xA0) : b0 == 0xED ? cont(1, 0x80, 0x9F) : cont(1);
    return second && cont(2) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (left < 4) return 0;
    const bool second = b0 == 0xF0 ? cont(1, 0x90) : b0 == 0xF4 ? cont(1, 0x80, 0x8F) : cont(1);
    return second && cont(2) && cont(3) ? 4 : 0;
  }
  return 0;
}

}  // namespace detail

class Pretokenizer {
 public:
  /// Compiles `pattern` (UTF-8, Unicode properties). Throws with PCRE2's message and
  /// the offset when it does not compile.
  ///
  /// Two engines give the same pieces. With a JIT (`use_jit` and one exists for this
  /// machine) the pattern is compiled with PCRE2_MATCH_INVALID_UTF and matched over
  /// the whole text; invalid bytes simply never match. PCRE2's interpreter in that
  /// mode re-checks the rest of the subject at every call, which is quadratic over a
  /// text of many pieces, so without a JIT the text is cut into its valid UTF-8 runs
  /// here and each run is matched alone, without PCRE2's check. Tests compare them.
  explicit Pretokenizer(std::string_view pattern, bool use_jit = true) : pattern_(pattern) {
    if (use_jit) {
      compile(PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF);
      jit_ = pcre2_jit_compile_8(code_.get(), PCRE2_JIT_COMPLETE) == 0;
    }
    if (!jit_) compile(PCRE2_UTF | PCRE2_UCP);
    // PCRE2 stops a match after 10 million backtracking steps by default; a run of
    // that many spaces before a letter takes one step per space (\s*[\r\n]+ gives them
    // back one by one). The pattern is linear, so the limit only guards against
    // patterns that are not: raise it to the largest value PCRE2 takes.
    context_.reset(pcre2_match_context_create_8(nullptr));
    TESSERA_CHECK(context_ != nullptr, "pre-tokenizer: out of memory for a PCRE2 match context");
    pcre2_set_match_limit_8(context_.get(), std::numeric_limits<std::uint32_t>::max());
    pcre2_set_depth_limit_8(context_.get(), std::numeric_limits<std::uint32_t>::max());
  }

  Pretokenizer(Pretokenizer&&) noexcept = default;
  Pretokenizer& operator=(Pretokenizer&&) noexcept = default;
  Pretokenizer(const Pretokenizer&) = delete;
  Pretokenizer& operator=(const Pretokenizer&) = delete;

  const std::string& pattern() const { return pattern_; }
  /// Whether matching runs JIT-compiled code.
  bool jit() const { return jit_; }

  /// Calls `f(piece)` for each consecutive piece of `text`, in order; the pieces are
  /// non-empty and concatenate to `text`. Matches of the pattern are pieces; so is
  /// each run of bytes between two matches (invalid UTF-8, or characters the pattern
  /// does not match).
  template <class F>
  void for_each_piece(std::string_view text, F&& f) const {
    std::unique_ptr<pcre2_match_data_8, detail::Pcre2MatchDataFree> match(
        pcre2_match_data_create_from_pattern_8(code_.get(), nullptr));
    TESSERA_CHECK(match != nullptr, "pre-tokenizer: out of memory for PCRE2 match data");
    std::size_t gap = 0;  // start of the bytes not yet given to f
    // Matches `subject` (a part of text starting at `base`) from byte `pos` on, gives f
    // the gap before each match and the match; returns where matching stopped.
    const auto match_in = [&](std::string_view subject, std::size_t base, std::uint32_t options) {
      std::size_t pos = 0;
      while (pos < subject.size()) {
        // NOTEMPTY: a piece is never empty, whatever the pattern allows.
        const int rc = pcre2_match_8(code_.get(), reinterpret_cast<PCRE2_SPTR8>(subject.data()),
                                     subject.size(), pos, options | PCRE2_NOTEMPTY, match.get(), context_.get());
        if (rc == PCRE2_ERROR_NOMATCH) return;
        TESSERA_CHECK(rc >= 0, "pre-tokenizer: matching at byte ", base + pos, " of a ", text.size(),
                      "-byte text failed: ", detail::pcre2_message(rc));
        const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer_8(match.get());
        const std::size_t begin = ovector[0];
        const std::size_t end = ovector[1];
        TESSERA_CHECK(begin >= pos && end > begin && end <= subject.size(), "pre-tokenizer: PCRE2 returned the match [",
                      base + begin, ", ", base + end, ") when matching from byte ", base + pos);
        if (base + begin > gap) f(text.substr(gap, base + begin - gap));
        f(text.substr(base + begin, end - begin));
        gap = base + end;
        pos = end;
      }
    };
    if (jit_) {
      match_in(text, 0, 0);
    } else {
      std::size_t i = 0;
      while (i < text.size()) {
        std::size_t run = i;  // the valid run [i, run)
        for (std::size_t n; run < text.size() && (n = detail::utf8_char_length(text, run)) != 0;) run += n;
        if (run > i) match_in(text.substr(i, run - i), i, PCRE2_NO_UTF_CHECK);
        // Invalid bytes join the gap.
        while (run < text.size() && detail::utf8_char_length(text, run) == 0) ++run;
        i = run;
      }
    }
    if (gap < text.size()) f(text.substr(gap));
  }

  /// The pieces of `text` (views into it).
  std::vector<std::string_view> split(std::string_view text) const {
    std::vector<std::string_view> pieces;
    for_each_piece(text, [&](std::string_view piece) { pieces.push_back(piece); });
    return pieces;
  }

 private:
  void compile(std::uint32_t options) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_.reset(pcre2_compile_8(reinterpret_cast<PCRE2_SPTR8>(pattern_.data()), pattern_.size(), options, &error,
                                &offset, nullptr));
    TESSERA_CHECK(code_ != nullptr, "pre-tokenizer pattern does not compile at offset ", offset, ": ",
                  detail::pcre2_message(error));
  }

  std::string pattern_;
  std::unique_ptr<pcre2_code_8, detail::Pcre2CodeFree> code_;
  std::unique_ptr<pcre2_match_context_8, detail::Pcre2MatchContextFree> context_;  // shared, never modified
  bool jit_ = false;
};

/// Llama 3's pre-tokenizer, compiled on first use and shared by every thread.
inline const Pretokenizer& llama3_pretokenizer() {
  static const Pretokenizer instance(llama3_pcre2_pattern);
  return instance;
}

/// The pieces of `text` under Llama 3's pattern (views into `text`).
inline std::vector<std::string_view> pretokenize(std::string_view text) {
  return llama3_pretokenizer().split(text);
}

}  // namespace tessera::io
