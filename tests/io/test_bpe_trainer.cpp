// The BPE trainer: merge order and tie-breaks, stopping rules, agreement with the
// tiktoken tokenizer built from its file, determinism, and writing the rank file.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/io/bpe_trainer.hpp"
#include "tessera/io/tiktoken.hpp"

namespace test_bpe_trainer {  // unity build: this file's names stay in here (tests/meson.build)

namespace {

namespace fs = std::filesystem;
using tessera::io::BpeTrainer;
using tessera::io::BpeTrainOptions;
using tessera::io::TiktokenTokenizer;
using tessera::io::train_bpe;
using Ids = std::vector<std::uint32_t>;
using Docs = std::vector<std::string>;

/// The tokens after the 256 single bytes.
std::vector<std::string> learned(const std::vector<std::string>& tokens) {
  return std::vector<std::string>(tokens.begin() + 256, tokens.end());
}

/// Text from a small random vocabulary of made-up words over few letters, so that
/// words share many pairs and pieces meet in every order.
Docs random_corpus(std::uint32_t seed, int documents, int words_per_document, int vocabulary = 300,
                   std::string_view letters = "aabbcdeer") {
  std::mt19937 rng(seed);
  std::vector<std::string> words;
  for (int i = 0; i < vocabulary; ++i) {
    std::string w;
    const int len = 1 + static_cast<int>(rng() % 9);
    for (int k = 0; k < len; ++k) w.push_back(letters[rng() % letters.size()]);
    if (rng() % 10 == 0) w = "'" + w;
    if (rng() % 10 == 0) w += std::to_string(rng() % 10000);
    if (rng() % 15 == 0) w += "\xC3\xA9\xE4\xB8\xAD";
    words.push_back(w);
  }
  const char* separators[] = {" ", " ", " ", "  ", "\n", ", ", ". ", "\n\n", "\t"};
  Docs docs;
  for (int d = 0; d < documents; ++d) {
    std::string doc;
    for (int k = 0; k < words_per_document; ++k) {
      // Zipf-like: low indices are frequent.
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      const auto i = static_cast<std::size_t>(std::min<double>(vocabulary - 1, vocabulary * u * u * u));
      doc += words[i];
      doc += separators[rng() % 9];
    }
    docs.push_back(doc);
  }
  return docs;
}

using tessera::test::TempDir;

}  // namespace

TEST_CASE("bpe trainer: starts from the bytes and merges the most frequent pair") {
  // Pieces "ab" and three " ab": "ab" occurs 4 times, " a" 3 times.
  const auto tokens = train_bpe(Docs{"ab ab ab ab"}, BpeTrainOptions{1000, 2});
  REQUIRE(tokens.size() == 258);
  for (int b = 0; b < 256; ++b) CHECK(tokens[static_cast<std::size_t>(b)] == std::string(1, static_cast<char>(b)));
  CHECK(learned(tokens) == std::vector<std::string>{"ab", " ab"});
}

TEST_CASE("bpe trainer: ties go to the smallest bytes; counts add up across documents") {
  // "cd" x2, " ab" x2: the pairs "cd", " a" and "ab" each occur twice.
  CHECK(learned(train_bpe(Docs{"cd ab", "cd ab"}, BpeTrainOptions{1000, 2})) ==
        std::vector<std::string>{" a", " ab", "cd"});
  // A pair counts in every piece it occurs in: "xy" (twice) and " xy" (once) give
  // "xy" 3 occurrences, ahead of "zw" with 2.
  CHECK(learned(train_bpe(Docs{"xy xy", "zw", "zw", "xy"}, BpeTrainOptions{257, 1})) ==
        std::vector<std::string>{"xy"});
}

TEST_CASE("bpe trainer: stops at vocab_size or when no pair reaches min_frequency") {
  const Docs docs = random_corpus(1, 20, 200);
  const auto small = train_bpe(docs, BpeTrainOptions{300, 2});
  CHECK(small.size() == 300);
  // Training is a sequence: a larger vocabulary extends a smaller one.
  const auto larger = train_bpe(docs, BpeTrainOptions{400, 2});
  REQUIRE(larger.size() == 400);
  CHECK(std::equal(small.begin(), small.end(), larger.begin()));
  CHECK(train_bpe(docs, BpeTrainOptions{256, 2}).size() == 256);
  // min_frequency: "ab" occurs 3 times, "cd" twice.
  CHECK(learned(train_bpe(Docs{"ab ab ab cd cd"}, BpeTrainOptions{1000, 3})) == std::vector<std::string>{"ab"});
  CHECK(learned(train_bpe(Docs{"ab ab ab cd cd"}, BpeTrainOptions{1000, 4})).empty());
  // Nothing to merge at all.
  CHECK(train_bpe(Docs{}, BpeTrainOptions{1000, 1}).size() == 256);
  // min_frequency 1: pairs seen once merge too, ties by bytes.
  CHECK(learned(train_bpe(Docs{"a b c"}, BpeTrainOptions{1000, 1})) == std::vector<std::string>{" b", " c"});
}

TEST_CASE("bpe trainer: the tokenizer built from its file segments every training piece as the trainer did") {
  TempDir tmp;
  const Docs docs = random_corpus(2, 40, 400);
  BpeTrainer trainer(docs, BpeTrainOptions{700, 2});
  trainer.run();
  REQUIRE(trainer.tokens().size() == 700);
  const std::string path = (tmp.path / "ranks.tiktoken").string();
  tessera::io::write_tiktoken(path, trainer.tokens());
  const auto tok = TiktokenTokenizer::load(path);
  REQUIRE(tok.num_base_tokens() == 700);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < trainer.num_pieces(); ++i) {
    Ids ids;
    tok.encode_ordinary(trainer.piece(i), ids);
    REQUIRE(ids == trainer.piece_ids(i));
    total += trainer.piece_count(i);
  }
  CHECK(total > 0);
  // Every learned token is used somewhere in the training text's segmentation or was
  // merged into a longer one; the text round-trips and needs fewer ids than bytes.
  for (const std::string& doc : docs) {
    const Ids ids = tok.encode(doc, false, false);
    CHECK(tok.decode(ids) == doc);
    CHECK(ids.size() * 2 < doc.size());
  }
}

TEST_CASE("bpe trainer: the same documents give the same file, in any order") {
  Docs docs = random_corpus(3, 30, 300);
  docs.push_back(std::string("bytes \xFF\xFE that are not UTF-8 \xFF\xFE"));
  const std::string a = tessera::io::to_tiktoken_text(train_bpe(docs, BpeTrainOptions{600, 2}));
  std::reverse(docs.begin(), docs.end());
  const std::string b = tessera::io::to_tiktoken_text(train_bpe(docs, BpeTrainOptions{600, 2}));
  CHECK(a == b);
  // Invalid UTF-8 trains like any bytes.
  const auto tokens = train_bpe(Docs{"\xFF\xFE \xFF\xFE \xFF\xFE"}, BpeTrainOptions{1000, 2});
  CHECK(std::find(tokens.begin(), tokens.end(), std::string("\xFF\xFE")) != tokens.end());
}

TEST_CASE("bpe trainer: a megabyte of text trains to 2048 tokens quickly") {
  // A guard against quadratic behaviour: this takes a fraction of a second.
  const Docs docs = random_corpus(4, 100, 2000, 20000, "abcdefghijklmnopqrstuvwxyz");
  std::size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  CHECK(bytes > 500000);
  const auto tokens = train_bpe(docs, BpeTrainOptions{2048, 2});
  CHECK(tokens.size() == 2048);
}

TEST_CASE("bpe trainer: rank-file text and writing it") {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  tokens.push_back("ab");
  const std::string text = tessera::io::to_tiktoken_text(tokens);
  CHECK(text.substr(0, 7) == "AA== 0\n");
  CHECK(text.substr(text.size() - 9) == "YWI= 256\n");
  CHECK(std::count(text.begin(), text.end(), '\n') == 257);

  TempDir tmp;
  const std::string path = (tmp.path / "out.tiktoken").string();
  tessera::io::write_tiktoken(path, tokens);
  CHECK_FALSE(fs::exists(path + ".tmp"));
  std::ifstream in(path, std::ios::binary);
  std::ostringstream read;
  read << in.rdbuf();
  CHECK(read.str() == text);
  // Writing again replaces the file whole.
  tokens.push_back("abc");
  tessera::io::write_tiktoken(path, tokens);
  CHECK(TiktokenTokenizer::load(path).num_base_tokens() == 258);

  // A directory in the way: the rename fails and the temporary file is removed.
  const std::string blocked = (tmp.path / "blocked").string();
  fs::create_directories(fs::path(blocked) / "inside");
  CHECK_ERROR_CONTAINS(tessera::io::write_tiktoken(blocked, tokens),
                       "write_tiktoken '" + blocked + "': cannot rename '" + blocked + ".tmp' to it");
  CHECK_FALSE(fs::exists(blocked + ".tmp"));

  const std::string nowhere = (tmp.path / "no" / "such" / "dir" / "x.tiktoken").string();
  CHECK_ERROR_CONTAINS(tessera::io::write_tiktoken(nowhere, tokens), "write_tiktoken '" + nowhere + "': cannot open");
  CHECK_ERROR_CONTAINS(tessera::io::write_tiktoken(nowhere, tokens), "(its directory does not exist)");
}

TEST_CASE("bpe trainer: bad tokens and options are refused with the reason") {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  auto with = [&](std::vector<std::string> extra) {
    auto t = tokens;
    t.insert(t.end(), extra.begin(), extra.end());
    return t;
  };
  CHECK_ERROR_CONTAINS(tessera::io::to_tiktoken_text(with({""})), "tiktoken ranks: token 256 is empty");
  CHECK_ERROR_CONTAINS(tessera::io::to_tiktoken_text(with({"ab", "ab"})), "token 257 ('ab') repeats token 256");
  CHECK_ERROR_CONTAINS(tessera::io::to_tiktoken_text(std::vector<std::string>(tokens.begin() + 1, tokens.end())),
                       "the single byte \\x00 is not a token");
  TempDir tmp;
  const std::string path = (tmp.path / "bad.tiktoken").string();
  CHECK_ERROR_CONTAINS(tessera::io::write_tiktoken(path, with({"ab", "ab"})), "write_tiktoken '" + path + "': ");
  CHECK_FALSE(fs::exists(path));
  CHECK_ERROR_CONTAINS(train_bpe(Docs{"x"}, BpeTrainOptions{255, 2}), "vocab_size 255 is below 256");
  CHECK_ERROR_CONTAINS(train_bpe(Docs{"x"}, BpeTrainOptions{1000, 0}), "min_frequency 0 must be at least 1");
}

}  // namespace test_bpe_trainer
