// libFuzzer target: the tiktoken file parser (io::TiktokenTokenizer::parse) and the
// tokenizer it builds.
//
// Input layout: the tiktoken file text, optionally followed by a NUL byte and a text to
// encode. Without a NUL, the last 48 bytes of the input are the text. When the file
// parses, a fixed string and that text are encoded (plain, with BOS/EOS, and with special
// tokens allowed) and the ids are checked: every id below vocab_size(), and decoding the
// ids of an encode without special tokens gives the text back byte for byte (a BPE
// tokenizer loses nothing). Ids outside the vocabulary must be refused by decode and
// token_text with tessera::Error.
//
// The two BPE merge loops the tokenizer picks between by piece length are also run side
// by side on every piece of the text, and must give the same merges.
//
// Contract: parsing, encoding and decoding either succeed or throw tessera::Error. Any
// other exception, a crash, a leak, undefined behaviour, a timeout, or a broken invariant
// above (reported on stderr, then abort) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/tiktoken.hpp"
#include "tessera/io/tokenizer.hpp"

namespace {

using tessera::io::EncodeOptions;
using tessera::io::Tokenizer;

[[noreturn]] void finding(const char* what, std::string_view text) {
  std::fprintf(stderr, "fuzz_tiktoken: %s (text of %zu bytes: '%.*s')\n", what, text.size(),
               static_cast<int>(text.size() < 200 ? text.size() : 200), text.data());
  std::abort();
}

void exercise(const Tokenizer& tok, std::string_view text) {
  const std::int64_t vocab = tok.vocab_size();
  for (EncodeOptions o : {EncodeOptions{false, false, false}, EncodeOptions{true, true, false},
                          EncodeOptions{false, false, true}}) {
    std::vector<std::uint32_t> ids;
    try {
      ids = tok.encode(text, o);
    } catch (const tessera::Error&) {
      continue;  // e.g. a byte the vocabulary cannot spell
    }
    for (std::uint32_t id : ids) {
      if (static_cast<std::int64_t>(id) >= vocab) finding("encode gave an id outside the vocabulary", text);
    }
    if (o.bos && (ids.empty() || ids.front() != tok.bos_id())) finding("encode with bos does not start with BOS", text);
    if (o.eos && (ids.empty() || ids.back() != tok.eos_id())) finding("encode with eos does not end with EOS", text);
    std::string decoded;
    try {
      decoded = tok.decode(ids);
      for (std::uint32_t id : ids) (void)tok.token_text(id);
    } catch (const tessera::Error&) {
      finding("decode or token_text refused ids that encode produced", text);
    }
    if (!o.allow_special && decoded != text) finding("decode(encode(text)) is not the text", text);
  }
  // Ids outside the vocabulary are refused with a message.
  if (vocab >= 0 && vocab < static_cast<std::int64_t>(UINT32_MAX)) {
    const auto outside = static_cast<std::uint32_t>(vocab);
    try {
      (void)tok.token_text(outside);
      finding("token_text accepted vocab_size() as an id", text);
    } catch (const tessera::Error&) {
    }
    const std::vector<std::uint32_t> bad{outside};
    try {
      (void)tok.decode(std::span<const std::uint32_t>(bad));
      finding("decode accepted vocab_size() as an id", text);
    } catch (const tessera::Error&) {
    }
  }
  if (static_cast<std::int64_t>(tok.bos_id()) >= vocab || static_cast<std::int64_t>(tok.eos_id()) >= vocab) {
    finding("bos_id or eos_id outside the vocabulary", text);
  }
  (void)tok.special_id("<|begin_of_text|>");
  (void)tok.special_id(text);
}

/// The two merge loops (the quadratic scan for short pieces, the heap for long ones) must
/// agree. Each piece of `text`, and `text` as one piece when it is short enough for the
/// scan to stay cheap, is merged both ways from single bytes. These are internals
/// (detail::), checked here because a long piece is rare in ordinary encode calls.
void compare_merges(const tessera::io::TiktokenTokenizer& tok, std::string_view text) {
  namespace d = tessera::io::detail;
  const auto rank_of = [&](std::string_view bytes) { return tok.rank_of(bytes).value_or(d::no_rank); };
  const auto check = [&](std::string_view piece) {
    std::vector<std::uint32_t> scan(piece.size() + 1), heap;
    for (std::uint32_t i = 0; i <= piece.size(); ++i) scan[i] = i;
    heap = scan;
    d::byte_pair_merge_scan(piece, scan, rank_of);
    d::byte_pair_merge_heap(piece, heap, rank_of);
    if (scan != heap) finding("byte_pair_merge_scan and byte_pair_merge_heap merge differently", piece);
  };
  tessera::io::llama3_pretokenizer().for_each_piece(text, check);
  if (text.size() <= 512) check(text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view file = input;
  std::string_view text;
  if (const std::size_t nul = input.find('\0'); nul != std::string_view::npos) {
    file = input.substr(0, nul);
    text = input.substr(nul + 1);
  } else {
    text = input.substr(input.size() > 48 ? input.size() - 48 : 0);
  }
  try {
    const tessera::io::TiktokenTokenizer tok = tessera::io::TiktokenTokenizer::parse(file, "fuzz.tiktoken");
    exercise(tok, "Hello, world! It's 2024: caf\xc3\xa9 \xf0\x9f\x99\x82\n\n\tdone  <|begin_of_text|>");
    exercise(tok, text);
    compare_merges(tok, text);
  } catch (const tessera::Error&) {
    // Refused with a message: the expected outcome for most inputs.
  }
  return 0;
}
