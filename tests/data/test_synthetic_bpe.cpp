// The embedded corpus's BPE vocabulary: its size, determinism, compression, and that the
// file llama-train writes out reads back as the same tokenizer.
#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "tessera/data/synthetic_bpe.hpp"
#include "tessera/io/load_tokenizer.hpp"
#include "tessera/data/tokenizers.hpp"

namespace test_synthetic_bpe {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

TEST_CASE("synthetic_bpe: 768 trained tokens plus 256 specials, the same every time") {
  const auto& tokens = data::synthetic_bpe_tokens();
  REQUIRE(static_cast<std::int64_t>(tokens.size()) == data::kSyntheticBpeBaseTokens);
  for (int b = 0; b < 256; ++b) CHECK(tokens[static_cast<std::size_t>(b)] == std::string(1, static_cast<char>(b)));
  const io::TiktokenTokenizer tok = data::synthetic_bpe_tokenizer();
  CHECK(tok.vocab_size() == data::kSyntheticBpeVocabSize);
  CHECK(tok.vocab_size() == 1024);
  // Retraining from scratch gives the same ranks (the vocabulary is a constant of the corpus).
  const auto again = io::train_bpe(data::synthetic_corpus(0, data::kSyntheticBpeDocuments),
                                   io::BpeTrainOptions{data::kSyntheticBpeBaseTokens, 2});
  CHECK(again == tokens);
}

TEST_CASE("synthetic_bpe: documents of another seed round-trip and compress well") {
  const io::TiktokenTokenizer tok = data::synthetic_bpe_tokenizer();
  std::size_t bytes = 0, ids = 0;
  for (const std::string& doc : data::synthetic_corpus(12345, 50)) {
    const auto e = tok.encode(doc, true, true);
    CHECK(e.front() == tok.bos_id());
    CHECK(e.back() == tok.eos_id());
    CHECK(tok.decode(e) == doc);
    bytes += doc.size();
    ids += e.size() - 2;
  }
  // Whole words of the corpus's language are single tokens: more than 3 bytes a token.
  CHECK(static_cast<double>(bytes) / static_cast<double>(ids) > 3.0);
}

TEST_CASE("the tokenizer file llama-train saves loads back as the same tokenizer") {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("tessera_bpe_" + std::to_string(::getpid()) + ".model")).string();
  REQUIRE(data::save_tokenizer_file("synthetic_bpe", path));
  const auto from_file = io::load_tokenizer(path);
  const auto built_in = data::make_tokenizer("synthetic_bpe");
  CHECK(from_file->kind() == "tiktoken");
  const std::string text = "Maria said that the fox was beside the hill. <|eot_id|> 12345";
  CHECK(from_file->encode(text, true, true) == built_in->encode(text, true, true));
  CHECK_FALSE(data::save_tokenizer_file("byte", path + ".none"));
  CHECK_FALSE(std::filesystem::exists(path + ".none"));
  std::filesystem::remove(path);
}

}  // namespace test_synthetic_bpe
