// libFuzzer target: Hugging Face's tokenizer.json reader (io::HfTokenizer::parse, with a
// tokenizer_config.json beside it or not) and the byte-level BPE tokenizer it builds.
//
// Input layout: the tokenizer.json text; after a NUL byte, a text to encode (else a fixed
// one); after a second NUL byte, the tokenizer_config.json text. When the files parse,
// the text is encoded plain, with BOS and EOS, and with special tokens allowed, and:
//   - every id is inside the vocabulary; BOS first and EOS last when asked for;
//   - encoding is deterministic (a second encode gives the same ids);
//   - the BPE alone (encode_ordinary) decodes back to the text byte for byte, unless it
//     gave a special token's id (decode drops those): every byte is a token, so byte-level
//     BPE loses nothing;
//   - decode and token_text of each id succeed, and ids past the vocabulary are refused
//     with tessera::Error.
//
// Contract: parsing, encoding and decoding either succeed or throw tessera::Error naming
// the file (and the key). Any other exception, a crash, a leak, undefined behaviour, a
// timeout, or a broken invariant above (reported on stderr, then abort) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/hf_tokenizer.hpp"
#include "tessera/io/tokenizer.hpp"

namespace {

using tessera::io::EncodeOptions;
using tessera::io::HfTokenizer;

[[noreturn]] void finding(const char* what, std::string_view text) {
  std::fprintf(stderr, "fuzz_hf_tokenizer: %s (text of %zu bytes: '%.*s')\n", what, text.size(),
               static_cast<int>(text.size() < 200 ? text.size() : 200), text.data());
  std::abort();
}

void exercise(const HfTokenizer& tok, std::string_view text) {
  const std::int64_t vocab = tok.vocab_size();
  for (EncodeOptions o : {EncodeOptions{false, false, false}, EncodeOptions{true, true, false},
                          EncodeOptions{false, false, true}}) {
    const std::vector<std::uint32_t> ids = tok.encode(text, o);
    for (std::uint32_t id : ids)
      if (static_cast<std::int64_t>(id) >= vocab) finding("encode gave an id outside the vocabulary", text);
    if (o.bos && (ids.empty() || ids.front() != tok.bos_id())) finding("encode with bos does not start with BOS", text);
    if (o.eos && (ids.empty() || ids.back() != tok.eos_id())) finding("encode with eos does not end with EOS", text);
    if (tok.encode(text, o) != ids) finding("two encodes of the same text differ", text);
    (void)tok.decode(ids);
    for (std::uint32_t id : ids) (void)tok.token_text(id);
  }
  std::vector<std::uint32_t> bpe;
  tok.encode_ordinary(text, bpe);
  bool special = false;
  for (std::uint32_t id : bpe) {
    if (static_cast<std::int64_t>(id) >= vocab) finding("the BPE gave an id outside the vocabulary", text);
    special = special || tok.is_special(id);
  }
  if (!special && tok.decode(bpe) != text) finding("the BPE's ids do not decode to the text", text);

  const std::uint32_t past = static_cast<std::uint32_t>(vocab);
  bool refused = false;
  try {
    (void)tok.decode(std::vector<std::uint32_t>{past});
  } catch (const tessera::Error&) {
    refused = true;
  }
  if (!refused) finding("decode took an id outside the vocabulary", text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view json = input;
  std::string_view text = "Hello, world! 123 tessera <s> caf\xC3\xA9 \xF0\x9F\x98\x80\n\n  x";
  std::optional<std::string_view> config;
  if (const std::size_t nul = input.find('\0'); nul != std::string_view::npos) {
    json = input.substr(0, nul);
    text = input.substr(nul + 1);
    if (const std::size_t second = text.find('\0'); second != std::string_view::npos) {
      config = text.substr(second + 1);
      text = text.substr(0, second);
    }
  }
  try {
    const HfTokenizer tok = HfTokenizer::parse(json, "fuzz/tokenizer.json", config, "fuzz/tokenizer_config.json");
    exercise(tok, text);
  } catch (const tessera::Error& e) {
    const std::string_view what = e.what();
    if (what.find("fuzz/tokenizer") == std::string_view::npos) finding("an error that names no file", what);
  }
  return 0;
}
