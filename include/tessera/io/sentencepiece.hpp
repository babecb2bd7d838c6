// Llama 2's tokenizer: a SentencePiece model, run by the SentencePiece library.
//
// A `.model` file is a serialized SentencePiece ModelProto (pieces with scores and
// types, the trainer's and normalizer's settings). This wrapper loads one and puts it
// behind the Tokenizer interface: ids are SentencePiece's ids, the vocabulary size is
// the number of pieces, BOS and EOS are the model's (1 and 2 in Llama 2's model, where
// 0 is <unk>). Encoding is SentencePiece's EncodeAsIds (its normalization and its
// leading-space handling included); text never spells a control token, so
// allow_special changes nothing. Decoding is SentencePiece's DecodeIds: control tokens
// are dropped and <unk> reads as " ⁇ ".
//
// The loaded processor is immutable and shared between copies; SentencePiece's
// encode and decode are const and safe to call from many threads at once.
#pragma once

#include <sentencepiece_processor.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/io/tokenizer.hpp"

namespace tessera::io {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  using Tokenizer::encode;

  /// Loads the model at `path`. Errors name the file and carry SentencePiece's message.
  static SentencePieceTokenizer load(const std::string& path) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    TESSERA_CHECK(std::filesystem::exists(status), "SentencePiece model '", path, "': no such file");
    TESSERA_CHECK(std::filesystem::is_regular_file(status), "SentencePiece model '", path, "': not a regular file");
    auto processor = std::make_shared<sentencepiece::SentencePieceProcessor>();
    const auto result = processor->Load(path);
    TESSERA_CHECK(result.ok(), "SentencePiece model '", path, "': ", result.ToString());
    return SentencePieceTokenizer(std::move(processor), path);
  }

  /// Loads a model from its serialized bytes; `source` names it in errors.
  static SentencePieceTokenizer parse(std::string_view bytes, const std::string& source) {
    auto processor = std::make_shared<sentencepiece::SentencePieceProcessor>();
    const auto result = processor->LoadFromSerializedProto(bytes);
    TESSERA_CHECK(result.ok(), "SentencePiece model '", source, "': ", result.ToString());
    return SentencePieceTokenizer(std::move(processor), source);
  }

  std::string_view kind() const override { return "sentencepiece"; }
  std::int64_t vocab_size() const override { return processor_->GetPieceSize(); }
  std::uint32_t bos_id() const override { return static_cast<std::uint32_t>(processor_->bos_id()); }
  std::uint32_t eos_id() const override { return static_cast<std::uint32_t>(processor_->eos_id()); }
  /// The id of <unk>.
  std::uint32_t unk_id() const { return static_cast<std::uint32_t>(processor_->unk_id()); }
  const std::string& source() const { return source_; }

  std::vector<std::uint32_t> encode(std::string_view text, EncodeOptions options) const override {
    std::vector<int> pieces;
    const auto result = processor_->Encode(text, &pieces);
    TESSERA_CHECK(result.ok(), "SentencePiece model '", source_, "': encoding a ", text.size(),
                  "-byte text failed: ", result.ToString());
    std::vector<std::uint32_t> ids;
    ids.reserve(pieces.size() + 2);
    if (options.bos) ids.push_back(bos_id());
    for (int id : pieces) ids.push_back(static_cast<std::uint32_t>(id));
    if (options.eos) ids.push_back(eos_id());
    return ids;
  }

  std::string decode(std::span<const std::uint32_t> ids) const override {
    std::vector<int> pieces;
    pieces.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      TESSERA_CHECK(static_cast<std::int64_t>(ids[i]) < vocab_size(), "SentencePiece model '", source_,
                    "': token id ", ids[i], " at position ", i, " is outside the vocabulary of ", vocab_size());
      pieces.push_back(static_cast<int>(ids[i]));
    }
    std::string text;
    const auto result = processor_->Decode(pieces, &text);
    TESSERA_CHECK(result.ok(), "SentencePiece model '", source_, "': decoding ", ids.size(),
                  " ids failed: ", result.ToString());
    return text;
  }

  std::string token_text(std::uint32_t id) const override {
    TESSERA_CHECK(static_cast<std::int64_t>(id) < vocab_size(), "SentencePiece model '", source_, "': token id ", id,
                  " is outside the vocabulary of ", vocab_size());
    return processor_->IdToPiece(static_cast<int>(id));
  }

  /// The id of a control or unknown piece ("<s>", "</s>", "<unk>") named `name`.
  std::optional<std::uint32_t> special_id(std::string_view name) const override {
    const int id = processor_->PieceToId(name);
    if (id < 0 || id >= processor_->GetPieceSize()) return std::nullopt;
    if (!processor_->IsControl(id) && !processor_->IsUnknown(id)) return std::nullopt;
    // PieceToId answers <unk>'s id for a name it does not know.
    if (processor_->IdToPiece(id) != name) return std::nullopt;
    return static_cast<std::uint32_t>(id);
  }

 private:
  SentencePieceTokenizer(std::shared_ptr<const sentencepiece::SentencePieceProcessor> processor, std::string source)
      : processor_(std::move(processor)), source_(std::move(source)) {
    TESSERA_CHECK(processor_->GetPieceSize() > 0, "SentencePiece model '", source_, "': no pieces");
    TESSERA_CHECK(processor_->bos_id() >= 0 && processor_->eos_id() >= 0, "SentencePiece model '", source_,
                  "': the model has no begin-of-sentence or end-of-sentence piece (bos_id ", processor_->bos_id(),
                  ", eos_id ", processor_->eos_id(), ")");
  }

  std::shared_ptr<const sentencepiece::SentencePieceProcessor> processor_;
  std::string source_;
};

}  // namespace tessera::io
