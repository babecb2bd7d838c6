// The byte tokenizer: ids, special tokens, round trips and out-of-range ids.
#include <doctest/doctest.h>

#include "../support/errors.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/io/tokenizer.hpp"

namespace test_tokenizer {  // unity build: this file's names stay in here (tests/meson.build)

namespace {


using tessera::io::ByteTokenizer;
using Ids = std::vector<std::uint32_t>;

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

}  // namespace test_tokenizer
