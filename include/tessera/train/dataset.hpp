// The token streams a job trains and validates on, from its config.
//
//   "synthetic"  the embedded corpus (data/synthetic.hpp), each document between BOS and
//                EOS: training reads documents 0 .. training.synthetic_documents - 1 of
//                training.seed; validation reads the validation.synthetic_documents
//                documents after them, which training never sees
//   "shard"      a token shard made by llama-tokenize (io/token_shard.hpp), its loss
//                mask kept when it has one (a chat shard)
//   "chat"       JSON lines of conversations (io/chat.hpp), tokenized here, at the start,
//                in training.chat_format, with a loss mask over the assistants' replies
//
// Every rank loads the same stream and the DataLoader takes its slice.
#pragma once

#include <cstdint>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/data/tokenize.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

/// Where a stream comes from; `section` ("training", "validation") names its keys in errors.
struct DatasetSpec {
  std::string section;
  std::string dataset;  // "synthetic", "shard" or "chat"
  std::string path;
  std::string chat_format = "auto";
  std::uint64_t seed = 0;
  std::int64_t first_document = 0, documents = 0;  // "synthetic"
};

/// Refuses a stream tessera cannot read here (a Hub dataset), naming the key.
inline void check_readable(const DatasetSpec& spec) {
  TESSERA_CHECK(!hub_dataset(spec.dataset), spec.section, ".dataset = \"", spec.dataset,
                "\": torchtitan streams it from the Hugging Face Hub, and tessera reads local files: tokenize a copy "
                "with llama-tokenize and set ", spec.section, ".dataset = \"shard\" with ", spec.section,
                ".dataset_path (or \"chat\" for conversations, \"synthetic\" for the embedded corpus)");
}

/// The stream `spec` names, tokenized by `tok` where it is text.
inline io::TokenStream load_token_stream(const DatasetSpec& spec, const io::Tokenizer& tok) {
  check_readable(spec);
  if (spec.dataset == "synthetic") {
    const auto docs = data::synthetic_corpus(spec.seed, spec.first_document, spec.documents);
    return io::TokenStream{data::pack_documents(docs, tok), {}};
  }
  TESSERA_CHECK(!spec.path.empty(), spec.section, ".dataset_path: required when ", spec.section, ".dataset = \"",
                spec.dataset, "\"");
  if (spec.dataset == "shard") return io::read_token_stream(spec.path);
  TESSERA_CHECK(spec.dataset == "chat", spec.section, ".dataset: unknown dataset '", spec.dataset,
                "' (expected synthetic, shard or chat)");
  data::TokenizeOptions options;
  options.chat = io::resolve_chat_format(spec.chat_format, tok, "training.chat_format");
  data::DocumentReader reader({data::InputSource{spec.path, data::InputFormat::jsonl}});
  io::TokenStream stream = data::tokenize_stream(reader, tok, options);
  TESSERA_CHECK(!stream.ids.empty(), spec.path, ": no conversations (", spec.section, ".dataset = \"chat\")");
  return stream;
}

inline DatasetSpec training_dataset(const JobConfig& c) {
  return DatasetSpec{"training",
                     c.training.dataset,
                     c.training.dataset_path,
                     c.training.chat_format,
                     static_cast<std::uint64_t>(c.training.seed),
                     0,
                     c.training.synthetic_documents};
}

inline DatasetSpec validation_dataset(const JobConfig& c) {
  return DatasetSpec{"validation",
                     c.validation.dataset,
                     c.validation.dataset_path,
                     c.training.chat_format,
                     static_cast<std::uint64_t>(c.training.seed),
                     c.training.synthetic_documents,
                     c.validation.synthetic_documents};
}

/// The token stream [training] names.
inline io::TokenStream load_training_tokens(const JobConfig& c, const io::Tokenizer& tok) {
  return load_token_stream(training_dataset(c), tok);
}

/// The name of a stream in errors: its file, or the embedded corpus.
inline std::string dataset_name(const DatasetSpec& spec) {
  return spec.dataset == "synthetic" ? std::string("the synthetic corpus") : spec.path;
}

}  // namespace tessera::train
