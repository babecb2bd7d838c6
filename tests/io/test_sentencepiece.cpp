// The SentencePiece tokenizer (Llama 2's format) on a model trained here, and
// load_tokenizer's choice between the byte tokenizer, tiktoken files, SentencePiece
// models and Hugging Face directory layouts.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <sentencepiece_trainer.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/io/load_tokenizer.hpp"
#include "tessera/io/sentencepiece.hpp"
#include "tessera/io/tiktoken.hpp"

namespace test_sentencepiece {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using tessera::io::SentencePieceTokenizer;
using Ids = std::vector<std::uint32_t>;

using tessera::test::TempDir;

class Sentences : public sentencepiece::SentenceIterator {
 public:
  explicit Sentences(std::vector<std::string> sentences) : sentences_(std::move(sentences)) {}
  bool done() const override { return i_ >= sentences_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return sentences_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  std::vector<std::string> sentences_;
  std::size_t i_ = 0;
};

/// A small BPE model with Llama 2's settings (byte fallback, no normalization, a dummy
/// prefix, whitespace kept) and any `extra` trainer settings, serialized.
std::string train_model(const std::unordered_map<std::string, std::string>& extra) {
  std::vector<std::string> sentences;
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "tokenizer", "model"};
  std::mt19937 rng(1);
  for (int i = 0; i < 300; ++i) {
    std::string s;
    for (int k = 0; k < 8; ++k) s += std::string(k ? " " : "") + words[rng() % 10];
    sentences.push_back(s);
  }
  Sentences it(sentences);
  std::unordered_map<std::string, std::string> settings = {
      {"model_type", "bpe"},       {"vocab_size", "320"},
      {"byte_fallback", "true"},   {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"}, {"character_coverage", "1.0"},
      {"minloglevel", "2"}};
  for (const auto& [key, value] : extra) settings[key] = value;
  std::string serialized;
  const auto status = sentencepiece::SentencePieceTrainer::Train(settings, &it, &serialized);
  REQUIRE_MESSAGE(status.ok(), status.ToString());
  return serialized;
}

/// The model of most tests, trained once per run (milliseconds).
const std::string& tiny_model() {
  static const std::string model = train_model({});
  return model;
}

std::string write_file(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  return path.string();
}

/// A tiktoken rank file: the 256 single bytes and "ab".
std::string tiktoken_text() {
  std::string text;
  for (int b = 0; b < 256; ++b)
    text += tessera::io::detail::base64_encode(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  return text + "YWI= 256\n";
}

}  // namespace

TEST_CASE("sentencepiece: vocabulary, BOS/EOS and control pieces come from the model") {
  TempDir tmp;
  const std::string path = write_file(tmp.path / "tokenizer.model", tiny_model());
  const auto tok = SentencePieceTokenizer::load(path);
  CHECK(tok.kind() == "sentencepiece");
  CHECK(tok.source() == path);
  CHECK(tok.vocab_size() == 320);
  CHECK(tok.unk_id() == 0);
  CHECK(tok.bos_id() == 1);
  CHECK(tok.eos_id() == 2);
  CHECK(tok.special_id("<unk>") == 0u);
  CHECK(tok.special_id("<s>") == 1u);
  CHECK(tok.special_id("</s>") == 2u);
  CHECK_FALSE(tok.special_id("<|eot_id|>").has_value());
  // An ordinary piece is not special.
  CHECK_FALSE(tok.special_id(tok.token_text(300)).has_value());
  CHECK(tok.token_text(0) == "<unk>");
  CHECK(tok.token_text(1) == "<s>");
  CHECK(tok.token_text(3) == "<0x00>");  // byte fallback pieces follow the control pieces
  CHECK_ERROR_CONTAINS(tok.token_text(320), "token id 320 is outside the vocabulary of 320");
}

TEST_CASE("sentencepiece: encode and decode round-trip text, seen and unseen") {
  const auto tok = SentencePieceTokenizer::parse(tiny_model(), "tiny.model");
  for (const std::string text : {"the quick brown fox", "lazy  dog\tjumps\nover", " leading space", "",
                                 "unseen: \xC3\xA9t\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80 123!"}) {
    const Ids ids = tok.encode(text, false, false);
    for (std::uint32_t id : ids) CHECK(id < 320);
    CHECK(tok.decode(ids) == text);
  }
  // Known words become few pieces; characters never seen become bytes.
  CHECK(tok.encode("the fox", false, false).size() <= 3);
  const Ids unseen = tok.encode("\xC3\xA9", false, false);
  CHECK(unseen.size() >= 2);
  CHECK(tok.token_text(unseen.back()) == "<0xA9>");
}

TEST_CASE("sentencepiece: BOS/EOS on request, control text stays text, decode skips controls") {
  const auto tok = SentencePieceTokenizer::parse(tiny_model(), "tiny.model");
  const Ids plain = tok.encode("the dog", false, false);
  Ids both = plain;
  both.insert(both.begin(), 1);
  both.push_back(2);
  CHECK(tok.encode("the dog", true, true) == both);
  CHECK(tok.encode("", true, false) == Ids{1});
  CHECK(tok.decode(both) == "the dog");
  // "<s>" written in text is characters, even with allow_special.
  for (bool allow : {false, true}) {
    const Ids ids = tok.encode("<s>x</s>", tessera::io::EncodeOptions{false, false, allow});
    for (std::uint32_t id : ids) CHECK(id > 2);
    CHECK(tok.decode(ids) == "<s>x</s>");
  }
  // <unk> decodes as SentencePiece shows it.
  CHECK(tok.decode(Ids{0}) == " \xE2\x81\x87 ");
}

TEST_CASE("sentencepiece: an id outside the vocabulary is named with its position") {
  const auto tok = SentencePieceTokenizer::parse(tiny_model(), "tiny.model");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{5, 6, 320}), "SentencePiece model 'tiny.model': token id 320 at position 2");
  CHECK_ERROR_CONTAINS(tok.decode(Ids{4000000000u}), "token id 4000000000 at position 0 is outside the vocabulary of 320");
}

TEST_CASE("sentencepiece: bad files are named, with SentencePiece's reason") {
  TempDir tmp;
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::load((tmp.path / "none.model").string()), "none.model': no such file");
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::load(tmp.path.string()), "not a regular file");
  const std::string garbage = write_file(tmp.path / "garbage.model", "\x0A\x05garbage and more");
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::load(garbage), "SentencePiece model '" + garbage + "': ");
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::load(garbage), "ParseFromArray");
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::parse("not a model", "x.model"), "SentencePiece model 'x.model': ");
  // A model without BOS cannot serve: bos_id() has nothing to answer.
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::parse(train_model({{"bos_id", "-1"}, {"eos_id", "1"}}), "nobos.model"),
                       "SentencePiece model 'nobos.model': the model has no begin-of-sentence or end-of-sentence "
                       "piece (bos_id -1, eos_id 1)");
  // A truncated model.
  CHECK_ERROR_CONTAINS(SentencePieceTokenizer::parse(tiny_model().substr(0, tiny_model().size() / 2), "half.model"),
                       "SentencePiece model 'half.model'");
}

// ---------------------------------------------------------------- load_tokenizer

TEST_CASE("load_tokenizer: byte, files sniffed by content, and Hugging Face directories") {
  using tessera::io::load_tokenizer;
  TempDir tmp;
  CHECK(load_tokenizer("byte")->kind() == "byte");

  const std::string tiktoken_file = write_file(tmp.path / "llama3.model", tiktoken_text());
  const std::string sp_file = write_file(tmp.path / "llama2.model", tiny_model());
  auto t = load_tokenizer(tiktoken_file);
  CHECK(t->kind() == "tiktoken");
  CHECK(t->vocab_size() == 257 + 256);
  CHECK(t->encode("abab", false, false) == Ids{256, 256});
  auto s = load_tokenizer(sp_file);
  CHECK(s->kind() == "sentencepiece");
  CHECK(s->vocab_size() == 320);

  // A directory: tokenizer.model first, then original/tokenizer.model.
  write_file(tmp.path / "hf3" / "original" / "tokenizer.model", tiktoken_text());
  CHECK(load_tokenizer((tmp.path / "hf3").string())->kind() == "tiktoken");
  write_file(tmp.path / "hf3" / "tokenizer.model", tiny_model());
  CHECK(load_tokenizer((tmp.path / "hf3").string())->kind() == "sentencepiece");
  write_file(tmp.path / "hf2" / "tokenizer.model", tiny_model());
  CHECK(load_tokenizer((tmp.path / "hf2").string())->kind() == "sentencepiece");
  // CRLF line ends still read as a tiktoken file.
  std::string crlf = tiktoken_text();
  for (std::size_t pos = 0; (pos = crlf.find('\n', pos)) != std::string::npos; pos += 2) crlf.insert(pos, 1, '\r');
  CHECK(load_tokenizer(write_file(tmp.path / "crlf.model", crlf))->kind() == "tiktoken");
}

TEST_CASE("load_tokenizer: what it cannot use is named, with what was expected") {
  using tessera::io::load_tokenizer;
  TempDir tmp;
  CHECK_ERROR_CONTAINS(load_tokenizer("bytes"), "tokenizer 'bytes': not a built-in tokenizer (\"byte\") and no such file or directory");
  CHECK_ERROR_CONTAINS(load_tokenizer(""), "not a built-in tokenizer");
  fs::create_directories(tmp.path / "empty");
  CHECK_ERROR_CONTAINS(load_tokenizer((tmp.path / "empty").string()),
                       "the directory has none of tokenizer.model, tokenizer.json, original/tokenizer.model");
  const std::string text = write_file(tmp.path / "notes.txt", "hello world\n");
  CHECK_ERROR_CONTAINS(load_tokenizer(text), "'" + text + "' is not a tokenizer file; expected a tiktoken rank file");
  CHECK_ERROR_CONTAINS(load_tokenizer(text), ", a SentencePiece model (Llama 2) or a Hugging Face tokenizer.json");
  const std::string empty = write_file(tmp.path / "empty.model", "");
  CHECK_ERROR_CONTAINS(load_tokenizer(empty), "is empty; expected");
  // Files that look like one kind and are broken get that kind's error.
  const std::string broken_tiktoken = write_file(tmp.path / "broken.tiktoken", "YWI= 0\nYWI= 1\n");
  CHECK_ERROR_CONTAINS(load_tokenizer(broken_tiktoken), "tiktoken file '" + broken_tiktoken + "' line 2");
  const std::string broken_sp = write_file(tmp.path / "broken.model", "\x0A\x05garbage and more");
  CHECK_ERROR_CONTAINS(load_tokenizer(broken_sp), "SentencePiece model '" + broken_sp + "'");
  // A directory whose tokenizer.model is broken names the file inside it.
  write_file(tmp.path / "hf" / "original" / "tokenizer.model", "junk");
  CHECK_ERROR_CONTAINS(load_tokenizer((tmp.path / "hf").string()), "original/tokenizer.model' is not a tokenizer file");
}

}  // namespace test_sentencepiece
