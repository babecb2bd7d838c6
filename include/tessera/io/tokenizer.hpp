// The byte tokenizer: the simplest tokenizer that round-trips any text.
//
// Ids 0..255 are the raw bytes of the text (UTF-8 or anything else; no normalisation),
// 256 is <|bos|> and 257 is <|eos|>, so the vocabulary has 258 entries. It needs no
// files, which makes it the tokenizer of the tests, the synthetic corpus and the small
// models trained on it. Llama's own tokenizers (tiktoken, SentencePiece) live beside it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera::io {

class ByteTokenizer {
 public:
  static constexpr std::uint32_t bos_id = 256;
  static constexpr std::uint32_t eos_id = 257;

  /// 256 byte ids and the two special ids.
  std::int64_t vocab_size() const { return 258; }

  /// The bytes of `text` as ids, preceded by <|bos|> when `bos` and followed by <|eos|>
  /// when `eos`.
  std::vector<std::uint32_t> encode(std::string_view text, bool bos, bool eos) const {
    std::vector<std::uint32_t> ids;
    ids.reserve(text.size() + (bos ? 1 : 0) + (eos ? 1 : 0));
    if (bos) ids.push_back(bos_id);
    for (char c : text) ids.push_back(static_cast<unsigned char>(c));
    if (eos) ids.push_back(eos_id);
    return ids;
  }

  /// The bytes of `ids`; special ids are skipped. An id outside the vocabulary throws.
  std::string decode(std::span<const std::uint32_t> ids) const {
    std::string text;
    text.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::uint32_t id = ids[i];
      check_id(id, i);
      if (id < 256) text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    }
    return text;
  }

  /// A printable form of one id: its byte for 0..255, "<|bos|>" / "<|eos|>" for the
  /// special ids. An id outside the vocabulary throws.
  std::string token_text(std::uint32_t id) const {
    if (id == bos_id) return "<|bos|>";
    if (id == eos_id) return "<|eos|>";
    TESSERA_CHECK(id < 256, "byte tokenizer: token id ", id, " is outside the vocabulary of ",
                  vocab_size());
    return std::string(1, static_cast<char>(static_cast<unsigned char>(id)));
  }

 private:
  void check_id(std::uint32_t id, std::size_t position) const {
    TESSERA_CHECK(static_cast<std::int64_t>(id) < vocab_size(), "byte tokenizer: token id ", id,
                  " at position ", position, " is outside the vocabulary of ", vocab_size());
  }
};

}  // namespace tessera::io
