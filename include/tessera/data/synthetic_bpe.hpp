// The embedded corpus's own BPE vocabulary: tokenizer "synthetic_bpe".
//
// A tiktoken-format BPE (io/tiktoken.hpp, Llama 3's pre-tokenizer and special tokens)
// trained by io::train_bpe on a fixed sample of the embedded corpus: documents
// 0..kSyntheticBpeDocuments-1 of seed 0, to kSyntheticBpeBaseTokens tokens. Nothing is
// stored: the sample is generated and the vocabulary trained when first asked for (a
// fraction of a second), and the result is the same on every machine, whatever the
// training run's own seed. With the 256 special tokens the vocabulary has exactly
// kSyntheticBpeVocabSize ids. llama-train writes it out as tokenizer.model beside the
// models it saves, so other programs read it as an ordinary tiktoken file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/data/synthetic.hpp"
#include "tessera/io/bpe_trainer.hpp"
#include "tessera/io/tiktoken.hpp"

namespace tessera::data {

inline constexpr std::int64_t kSyntheticBpeDocuments = 2000;
inline constexpr std::int64_t kSyntheticBpeBaseTokens = 768;
inline constexpr std::int64_t kSyntheticBpeVocabSize = kSyntheticBpeBaseTokens + io::llama3_num_special_tokens;

/// The trained tokens in rank order (the byte strings of a tiktoken file).
inline const std::vector<std::string>& synthetic_bpe_tokens() {
  static const std::vector<std::string> tokens = [] {
    const std::vector<std::string> docs = synthetic_corpus(0, kSyntheticBpeDocuments);
    auto t = io::train_bpe(docs, io::BpeTrainOptions{kSyntheticBpeBaseTokens, 2});
    TESSERA_CHECK(static_cast<std::int64_t>(t.size()) == kSyntheticBpeBaseTokens, "synthetic_bpe: the corpus gave ",
                  t.size(), " tokens, expected ", kSyntheticBpeBaseTokens);
    return t;
  }();
  return tokens;
}

/// The vocabulary as a tiktoken rank file's text.
inline std::string synthetic_bpe_file_text() { return io::to_tiktoken_text(synthetic_bpe_tokens()); }

inline io::TiktokenTokenizer synthetic_bpe_tokenizer() {
  return io::TiktokenTokenizer::parse(synthetic_bpe_file_text(), "synthetic_bpe");
}

}  // namespace tessera::data
