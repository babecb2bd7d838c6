// Parity of the tokenizers with tiktoken and SentencePiece.
//
// tools/make_fixtures.py trained a Llama 3 style BPE (tiktoken's file format, Llama 3's
// pre-tokenizer pattern and its 256 special tokens) and a Llama 2 style SentencePiece
// model, and recorded the ids tiktoken and SentencePiece give for every string of
// tests/fixtures/tokenizers/corpus.json: Unicode in many scripts, emoji sequences,
// whitespace runs, digit runs, contractions, code and special-token text. tessera's
// tokenizers must give exactly the same ids, and decoding them must give the string back.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/io/sentencepiece.hpp"
#include "tessera/io/tiktoken.hpp"
#include "tessera/io/tokenizer.hpp"

namespace test_tokenizer_parity {  // unity build: this file's names stay in here (tests/meson.build)

#ifndef TESSERA_FIXTURES
#error "TESSERA_FIXTURES must name the tests/fixtures folder (tests/parity/meson.build defines it)"
#endif

namespace fs = std::filesystem;
using namespace tessera;
using Ids = std::vector<std::uint32_t>;

namespace {

std::string tokenizer_file(const std::string& name) {
  return (fs::path(TESSERA_FIXTURES) / "tokenizers" / name).string();
}

nlohmann::json read_json(const std::string& name) {
  std::ifstream in(tokenizer_file(name), std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open ", tokenizer_file(name));
  return nlohmann::json::parse(in);
}

std::vector<std::string> corpus() {
  const nlohmann::json j = read_json("corpus.json");
  REQUIRE(j.is_array());
  std::vector<std::string> out = j.get<std::vector<std::string>>();
  REQUIRE(out.size() >= 40);
  return out;
}

/// Ids around position `at`, for a message.
std::string window(const Ids& ids, std::size_t at) {
  const std::size_t begin = at >= 3 ? at - 3 : 0, end = std::min(ids.size(), at + 4);
  std::string s = begin > 0 ? "[... " : "[";
  for (std::size_t i = begin; i < end; ++i) s += (i > begin ? ", " : "") + std::to_string(ids[i]);
  return s + (end < ids.size() ? " ...]" : "]");
}

/// Empty when equal; otherwise one line naming the tokenizer, the string and the first
/// position where the ids differ.
std::string mismatch(const std::string& what, std::size_t index, const std::string& text, const Ids& got,
                     const Ids& want) {
  if (got == want) return {};
  const std::size_t at =
      static_cast<std::size_t>(std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first - got.begin());
  std::ostringstream m;
  m << what << ": corpus[" << index << "] " << nlohmann::json(text).dump() << ": ids differ at position " << at
    << " (tessera " << got.size() << " ids, reference " << want.size() << "): tessera " << window(got, at)
    << ", reference " << window(want, at);
  return m.str();
}

}  // namespace

TEST_CASE("tiktoken-format BPE gives tiktoken's ids for every corpus string") {
  const std::vector<std::string> texts = corpus();
  const nlohmann::json ref = read_json("tiktoken_ids.json");
  const auto& encodings = ref.at("encodings");
  REQUIRE(encodings.size() == texts.size());
  const std::uint32_t num_base = ref.at("num_base_tokens").get<std::uint32_t>();

  const auto tok = io::TiktokenTokenizer::load(tokenizer_file("bpe.tiktoken"));
  CHECK(tok.kind() == "tiktoken");
  CHECK(tok.vocab_size() == num_base + ref.at("num_special_tokens").get<std::int64_t>());
  CHECK(tok.special_id("<|begin_of_text|>") == num_base);
  CHECK(tok.special_id("<|end_of_text|>") == num_base + 1);
  CHECK(tok.special_id("<|finetune_right_pad_id|>") == num_base + 4);
  CHECK(tok.special_id("<|eot_id|>") == num_base + 9);
  CHECK(tok.special_id("<|python_tag|>") == num_base + 10);
  CHECK(tok.special_id("<|reserved_special_token_3|>") == num_base + 11);
  CHECK(tok.special_id("<|reserved_special_token_247|>") == num_base + 255);
  CHECK_FALSE(tok.special_id("<|reserved_special_token_248|>").has_value());

  std::size_t merged = 0, specials = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::string& s = texts[i];
    const Ids ordinary = encodings[i].at("ordinary").get<Ids>();
    const Ids allowed = encodings[i].at("allow_special").get<Ids>();
    const Ids got = tok.encode(s, io::EncodeOptions{.bos = false, .eos = false, .allow_special = false});
    const std::string m1 = mismatch("tiktoken (special text as ordinary text)", i, s, got, ordinary);
    CHECK_MESSAGE(m1.empty(), m1);
    const std::string m2 = mismatch("tiktoken (special tokens allowed)", i, s,
                                    tok.encode(s, io::EncodeOptions{.bos = false, .eos = false, .allow_special = true}),
                                    allowed);
    CHECK_MESSAGE(m2.empty(), m2);
    CHECK_MESSAGE(tok.decode(got) == s, "tiktoken: decode(encode(corpus[", i, "])) != ", nlohmann::json(s).dump());
    merged += ordinary.size() < s.size();
    specials += allowed != ordinary;
  }
  // The fixture exercises what it claims to: merges, and special tokens found in text.
  CHECK(merged > texts.size() / 2);
  CHECK(specials >= 4);
}

TEST_CASE("SentencePiece model gives SentencePiece's ids for every corpus string") {
  const std::vector<std::string> texts = corpus();
  const nlohmann::json ref = read_json("sentencepiece_ids.json");
  const auto& ids = ref.at("ids");
  REQUIRE(ids.size() == texts.size());

  const auto tok = io::SentencePieceTokenizer::load(tokenizer_file("sp.model"));
  CHECK(tok.kind() == "sentencepiece");
  CHECK(tok.vocab_size() == ref.at("vocab_size").get<std::int64_t>());
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);

  std::size_t byte_fallback = 0;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::string& s = texts[i];
    const Ids want = ids[i].get<Ids>();
    const Ids got = tok.encode(s, io::EncodeOptions{.bos = false, .eos = false, .allow_special = false});
    const std::string m = mismatch("sentencepiece", i, s, got, want);
    CHECK_MESSAGE(m.empty(), m);
    CHECK_MESSAGE(tok.decode(got) == s, "sentencepiece: decode(encode(corpus[", i, "])) != ", nlohmann::json(s).dump());
    byte_fallback += std::any_of(want.begin(), want.end(), [](std::uint32_t id) { return id >= 3 && id < 259; });
  }
  CHECK(byte_fallback >= 10);  // characters outside the vocabulary go through <0xNN> pieces
}

}  // namespace test_tokenizer_parity
