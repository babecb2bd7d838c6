// The byte tokenizer: ids, special tokens, round trips and out-of-range ids; and
// valid_utf8, which makes decoded text printable.
#include <doctest/doctest.h>

#include "../support/errors.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/io/tokenizer.hpp"
#include "tessera/io/utf8.hpp"
#include "tessera/nn/generate.hpp"

namespace test_tokenizer {  // unity build: this file's names stay in here (tests/meson.build)

namespace {


using tessera::io::ByteTokenizer;
using tessera::io::valid_utf8;
using Ids = std::vector<std::uint32_t>;

// U+FFFD in UTF-8.
const std::string R = "\xEF\xBF\xBD";

// A stand-in for a model, for generate_text: its i-th call puts all the weight on
// script[i], so greedy sampling emits the script.
struct ScriptedModel {
  struct Args {
    std::int64_t max_seq_len = 64;
  };
  struct Logits {
    std::vector<float> v;
    const float* data() const { return v.data(); }
    std::int64_t size(int) const { return static_cast<std::int64_t>(v.size()); }
  };
  std::vector<std::uint32_t> script;
  std::size_t calls = 0;

  Args args() const { return {}; }
  template <class Window>
  Logits last_logits(const Window&, tessera::nn::Geometry) {
    Logits l{std::vector<float>(ByteTokenizer::kVocabSize, 0.0f)};
    l.v[script.at(calls++)] = 10.0f;
    return l;
  }
};

}  // namespace

TEST_CASE("byte tokenizer: vocabulary and special ids") {
  ByteTokenizer tok;
  CHECK(tok.vocab_size() == 258);
  CHECK(tok.bos_id() == 256);
  CHECK(tok.eos_id() == 257);
  CHECK(tok.kind() == "byte");
  CHECK(tok.special_id("<|eos|>") == 257u);
  CHECK_FALSE(tok.special_id("<|eot_id|>").has_value());
}

TEST_CASE("byte tokenizer: encode maps bytes to ids and adds specials on request") {
  ByteTokenizer tok;
  CHECK(tok.encode("hi", false, false) == Ids{104, 105});
  CHECK(tok.encode("hi", true, false) == Ids{256, 104, 105});
  CHECK(tok.encode("hi", false, true) == Ids{104, 105, 257});
  CHECK(tok.encode("hi", true, true) == Ids{256, 104, 105, 257});
  CHECK(tok.encode("", true, true) == Ids{256, 257});
  CHECK(tok.encode("", false, false).empty());
  // Bytes above 127 are ids above 127, not negative chars: "é" in UTF-8 is C3 A9.
  CHECK(tok.encode("\xC3\xA9", false, false) == Ids{0xC3, 0xA9});
  // A NUL byte inside the text is a byte like any other.
  CHECK(tok.encode(std::string_view("a\0b", 3), false, false) == Ids{97, 0, 98});
}

TEST_CASE("byte tokenizer: every byte round-trips and specials are skipped by decode") {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  Ids ids = tok.encode(all, true, true);
  REQUIRE(ids.size() == 258);
  for (int b = 0; b < 256; ++b) CHECK(ids[static_cast<std::size_t>(b) + 1] == static_cast<std::uint32_t>(b));
  CHECK(tok.decode(ids) == all);
  CHECK(tok.decode(Ids{256, 72, 257, 256, 105, 257}) == "Hi");
  CHECK(tok.decode(Ids{}).empty());
}

TEST_CASE("byte tokenizer: decode rejects an id outside the vocabulary, naming id and position") {
  ByteTokenizer tok;
  CHECK_THROWS_AS(tok.decode(Ids{72, 258}), tessera::Error);
  CHECK_ERROR_CONTAINS(tok.decode(Ids{72, 105, 258}), "token id 258 at position 2");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{4000000000u}), "token id 4000000000 at position 0");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{4000000000u}), "vocabulary of 258");
}

TEST_CASE("byte tokenizer: token_text") {
  ByteTokenizer tok;
  CHECK(tok.token_text(ByteTokenizer::kBos) == "<|bos|>");
  CHECK(tok.token_text(ByteTokenizer::kEos) == "<|eos|>");
  CHECK(tok.token_text(97) == "a");
  CHECK(tok.token_text(0) == std::string(1, '\0'));
  CHECK(tok.token_text(255) == std::string(1, '\xFF'));
  CHECK_THROWS_AS(tok.token_text(258), tessera::Error);
  CHECK_ERROR_CONTAINS(tok.token_text(300), "token id 300");
}

TEST_CASE("valid_utf8: ill-formed sequences become U+FFFD as Python's decode(errors='replace') makes them") {
  // Each expected value is Python's: b"...".decode("utf-8", "replace").encode("utf-8").
  // A lead byte and a valid continuation cut off by the end: one U+FFFD.
  CHECK(valid_utf8("\xE2\x82") == R);
  CHECK(valid_utf8("\xF0\x9F\x98") == R);
  CHECK(valid_utf8("\xE0\xA0") == R);
  CHECK(valid_utf8("\xC2") == R);
  CHECK(valid_utf8("\xF0\x9F\x98\x80\xE2\x82") == "\xF0\x9F\x98\x80" + R);
  // Cut off by a byte that cannot continue it, which then starts what follows.
  CHECK(valid_utf8("\xE2\x28\xA1") == R + "(" + R);
  // Overlong forms, a surrogate, above U+10FFFF: no well-formed sequence starts this
  // way, so one U+FFFD per byte.
  CHECK(valid_utf8("\xC0\x80") == R + R);
  CHECK(valid_utf8("\xE0\x80\x80") == R + R + R);
  CHECK(valid_utf8("\xF0\x80") == R + R);
  CHECK(valid_utf8("\xED\xA0\x80") == R + R + R);
  CHECK(valid_utf8("\xF4\x90\x80\x80") == R + R + R + R);
  CHECK(valid_utf8("\xF5\x80") == R + R);
  // Stray continuation bytes and bytes that never occur in UTF-8.
  CHECK(valid_utf8("\x80\x80") == R + R);
  CHECK(valid_utf8("a\xFF" "b") == "a" + R + "b");
  // The Unicode standard's example of maximal subparts (chapter 3, table 3-8):
  // 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64.
  CHECK(valid_utf8("a\xF1\x80\x80\xE1\x80\xC2" "b\x80" "c\x80\xBF" "d") ==
        "a" + R + R + R + "b" + R + "c" + R + R + "d");
}

TEST_CASE("valid_utf8: valid text comes back unchanged") {
  CHECK(valid_utf8("").empty());
  CHECK(valid_utf8("plain ASCII, with a tab\t") == "plain ASCII, with a tab\t");
  const std::string text = "\xC3\xA9t\xC3\xA9 \xE2\x82\xAC \xE4\xB8\xAD \xF0\x9F\x98\x80 \xEF\xBF\xBD";
  CHECK(valid_utf8(text) == text);
  // The edges of each range: U+007F, U+0080, U+07FF, U+0800, U+D7FF, U+E000, U+FFFF,
  // U+10000, U+10FFFF.
  const std::string edges = "\x7F\xC2\x80\xDF\xBF\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF"
                            "\xF0\x90\x80\x80\xF4\x8F\xBF\xBF";
  CHECK(valid_utf8(edges) == edges);
  // A NUL is a character like any other.
  CHECK(valid_utf8(std::string_view("a\0b", 3)) == std::string("a\0b", 3));
}

TEST_CASE("generate_text returns valid UTF-8 when the model's bytes are not") {
  ByteTokenizer tok;
  // "hi", E2 28 A1, and a character cut short by EOS: E2 82.
  ScriptedModel model{{'h', 'i', 0xE2, 0x28, 0xA1, 0xE2, 0x82, ByteTokenizer::kEos}};
  tessera::nn::SampleOptions o;
  o.temperature = 0;  // greedy: the script
  o.max_new_tokens = 20;
  // Python: b"hi\xe2(\xa1\xe2\x82".decode("utf-8", "replace") is "hi\ufffd(\ufffd\ufffd".
  CHECK(tessera::nn::generate_text(model, tok, "", o) == "hi" + R + "(" + R + R);
  CHECK(model.calls == 8);  // stopped at EOS
  // decode itself still gives the raw bytes.
  CHECK(tok.decode(Ids{'h', 'i', 0xE2, 0x82}) == "hi\xE2\x82");

  ScriptedModel clean{{0xC3, 0xA9, 't', 0xC3, 0xA9, ByteTokenizer::kEos}};
  CHECK(tessera::nn::generate_text(clean, tok, "", o) == "\xC3\xA9t\xC3\xA9");
}

}  // namespace test_tokenizer
