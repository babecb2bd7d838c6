// Tokenizers behind one interface, and the byte tokenizer.
//
// `Tokenizer` is what the data pipeline, the binaries and generation see: text to ids
// and back, the vocabulary size and the begin/end-of-text ids. It is a run-time
// interface (a virtual class), not a compile-time policy: which tokenizer a job uses is
// read from its config, and tokenizing is never on the training step's hot path.
// Implementations: ByteTokenizer (here), TiktokenTokenizer (Llama 3's BPE file format,
// io/tiktoken.hpp), SentencePieceTokenizer (Llama 2, io/sentencepiece.hpp) and
// HfTokenizer (Hugging Face's byte-level BPE tokenizer.json, io/hf_tokenizer.hpp);
// io/load_tokenizer.hpp picks one from a name or a file.
//
// The byte tokenizer is the simplest tokenizer that round-trips any text: ids 0..255
// are the raw bytes of the text (UTF-8 or anything else; no normalisation), 256 is
// <|bos|> and 257 is <|eos|>, so the vocabulary has 258 entries. It needs no files,
// which makes it the tokenizer of the tests and the smallest models.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/utf8.hpp"  // valid_utf8: decoded text made printable

namespace tessera::io {

struct EncodeOptions {
  bool bos = false;  // prepend the begin-of-text id
  bool eos = false;  // append the end-of-text id
  // Text spelling a special token ("<|eot_id|>") becomes that token. Off by default:
  // training data is ordinary text, and a document that happens to contain such a
  // string must not inject control tokens.
  bool allow_special = false;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  /// "byte", "tiktoken", "sentencepiece" or "tokenizer.json".
  virtual std::string_view kind() const = 0;

  /// Ids run over [0, vocab_size()), special tokens included.
  virtual std::int64_t vocab_size() const = 0;
  virtual std::uint32_t bos_id() const = 0;
  virtual std::uint32_t eos_id() const = 0;

  /// The ids of `text`, with BOS/EOS as `options` asks.
  virtual std::vector<std::uint32_t> encode(std::string_view text, EncodeOptions options) const = 0;

  std::vector<std::uint32_t> encode(std::string_view text, bool bos, bool eos) const {
    return encode(text, EncodeOptions{bos, eos, false});
  }

  /// The text of `ids` (raw bytes; a sequence cut inside a UTF-8 character gives the
  /// partial bytes, and valid_utf8 makes it printable). Special tokens (BOS, EOS, ...)
  /// are skipped. An id outside the vocabulary throws, naming its position.
  virtual std::string decode(std::span<const std::uint32_t> ids) const = 0;

  /// A printable form of one id: its bytes for an ordinary token, its name
  /// ("<|begin_of_text|>", "<s>") for a special one. An id outside the vocabulary throws.
  virtual std::string token_text(std::uint32_t id) const = 0;

  /// The id of the special token named `name` ("<|eot_id|>"), if there is one.
  virtual std::optional<std::uint32_t> special_id(std::string_view name) const = 0;

 protected:
  Tokenizer() = default;
  Tokenizer(const Tokenizer&) = default;
  Tokenizer& operator=(const Tokenizer&) = default;
};

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr std::uint32_t kBos = 256;
  static constexpr std::uint32_t kEos = 257;
  static constexpr std::int64_t kVocabSize = 258;

  using Tokenizer::encode;

  std::string_view kind() const override { return "byte"; }
  std::int64_t vocab_size() const override { return kVocabSize; }
  std::uint32_t bos_id() const override { return kBos; }
  std::uint32_t eos_id() const override { return kEos; }

  /// The bytes of `text` as ids. Special tokens are not spelled in text here:
  /// allow_special changes nothing.
  std::vector<std::uint32_t> encode(std::string_view text, EncodeOptions o) const override {
    std::vector<std::uint32_t> ids;
    ids.reserve(text.size() + (o.bos ? 1 : 0) + (o.eos ? 1 : 0));
    if (o.bos) ids.push_back(kBos);
    for (char c : text) ids.push_back(static_cast<unsigned char>(c));
    if (o.eos) ids.push_back(kEos);
    return ids;
  }

  std::string decode(std::span<const std::uint32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::uint32_t id = ids[i];
      TESSERA_CHECK(id < kVocabSize, "byte tokenizer: token id ", id, " at position ", i,
                    " is outside the vocabulary of ", kVocabSize);
      if (id < 256) text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    }
    return text;
  }

  std::string token_text(std::uint32_t id) const override {
    if (id == kBos) return "<|bos|>";
    if (id == kEos) return "<|eos|>";
    TESSERA_CHECK(id < 256, "byte tokenizer: token id ", id, " is outside the vocabulary of ", kVocabSize);
    return std::string(1, static_cast<char>(static_cast<unsigned char>(id)));
  }

  std::optional<std::uint32_t> special_id(std::string_view name) const override {
    if (name == "<|bos|>") return kBos;
    if (name == "<|eos|>") return kEos;
    return std::nullopt;
  }
};

}  // namespace tessera::io
