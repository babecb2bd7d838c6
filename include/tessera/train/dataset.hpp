// The token streams a job trains and validates on, from its config.
//
//   "synthetic"  the embedded corpus (data/synthetic.hpp), each document between BOS and
//                EOS: training reads documents 0 .. training.synthetic_documents - 1 of
//                training.seed; validation reads the validation.synthetic_documents
//                documents after them, which training never sees
//   "shard"      token shards made by llama-tokenize (io/token_shard.hpp), mapped where
//                they lie rather than loaded (io/mapped_token_shard.hpp), each one's loss
//                mask kept when it has one (a chat shard)
//   "chat"       JSON lines of conversations (io/chat.hpp), tokenized here, at the start,
//                in training.chat_format, with a loss mask over the assistants' replies
//
// dataset_path is a list: each entry a file or a glob pattern (its matches in name
// order). The entries are read one after another as one stream, or, with
// training.dataset_weights, each entry is a stream of its own and the DataLoader mixes
// them by weight. Every rank opens the same streams and the DataLoader takes its slice.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/data/corpus.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/data/tokenize.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/mapped_token_shard.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/train/dataset_files.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

/// Where a stream comes from; `section` ("training", "validation") names its keys in errors.
struct DatasetSpec {
  std::string section;
  std::string dataset;  // "synthetic", "shard" or "chat"
  std::vector<std::string> paths;
  std::vector<double> weights;  // one per path entry; empty: the entries as one stream
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

/// Every file `spec` reads, entry by entry.
inline std::vector<std::vector<std::string>> dataset_files(const DatasetSpec& spec) {
  return expand_entries(spec.paths, spec.section + ".dataset_path");
}

/// Every file `spec` reads, in order.
inline std::vector<std::string> flat_files(const DatasetSpec& spec) {
  std::vector<std::string> all;
  for (const auto& files : dataset_files(spec)) all.insert(all.end(), files.begin(), files.end());
  return all;
}

/// The streams `spec` names, tokenized by `tok` where they are text: one corpus per
/// dataset_path entry when the spec has weights, else one corpus of them all. Shards are
/// mapped (io::MappedTokenShard: checked as they are read), not loaded.
inline std::vector<data::TokenCorpus> open_corpora(const DatasetSpec& spec, const io::Tokenizer& tok) {
  check_readable(spec);
  std::vector<data::TokenCorpus> corpora;
  if (spec.dataset == "synthetic") {
    const auto docs = data::synthetic_corpus(spec.seed, spec.first_document, spec.documents);
    corpora.emplace_back(io::TokenStream{data::pack_documents(docs, tok), {}}, "the synthetic corpus");
    return corpora;
  }
  TESSERA_CHECK(!spec.paths.empty(), spec.section, ".dataset_path: required when ", spec.section, ".dataset = \"",
                spec.dataset, "\"");
  TESSERA_CHECK(spec.dataset == "shard" || spec.dataset == "chat", spec.section, ".dataset: unknown dataset '",
                spec.dataset, "' (expected synthetic, shard or chat)");
  const bool mixed = !spec.weights.empty();
  for (const std::vector<std::string>& files : dataset_files(spec)) {
    if (mixed || corpora.empty()) corpora.emplace_back();
    data::TokenCorpus& corpus = corpora.back();
    if (spec.dataset == "shard") {
      for (const std::string& f : files) corpus.append(io::MappedTokenShard::open(f));
      continue;
    }
    data::TokenizeOptions options;
    options.chat = io::resolve_chat_format(spec.chat_format, tok, "training.chat_format");
    std::vector<data::InputSource> inputs;
    for (const std::string& f : files) inputs.push_back(data::InputSource{f, data::InputFormat::jsonl});
    data::DocumentReader reader(inputs);
    io::TokenStream stream = data::tokenize_stream(reader, tok, options);
    TESSERA_CHECK(!stream.ids.empty(), files.front(), files.size() > 1 ? " (and the other files of its entry)" : "",
                  ": no conversations (", spec.section, ".dataset = \"chat\")");
    corpus.append(std::move(stream), files.size() == 1 ? files.front() : files.front() + " and its entry's other files");
  }
  return corpora;
}

/// The whole stream `spec` names, in memory: its entries one after another (a weighted
/// mix's entries too). For tools that want the tokens themselves; training reads
/// open_corpora's.
inline io::TokenStream load_token_stream(const DatasetSpec& spec, const io::Tokenizer& tok) {
  io::TokenStream out;
  for (const data::TokenCorpus& c : open_corpora(spec, tok)) {
    const auto at = out.ids.size();
    out.ids.resize(at + c.size());
    std::vector<std::uint8_t> keep(c.masked() ? c.size() : 0);
    c.read(0, c.size(), out.ids.data() + at, c.masked() ? keep.data() : nullptr);
    if (c.masked() && out.loss_mask.empty()) out.loss_mask.assign(at, 1);
    if (!keep.empty())
      out.loss_mask.insert(out.loss_mask.end(), keep.begin(), keep.end());
    else if (!out.loss_mask.empty())
      out.loss_mask.resize(out.ids.size(), 1);
  }
  return out;
}

inline DatasetSpec training_dataset(const JobConfig& c) {
  return DatasetSpec{"training",
                     c.training.dataset,
                     c.training.dataset_path,
                     c.training.dataset_weights,
                     c.training.chat_format,
                     static_cast<std::uint64_t>(c.training.seed),
                     0,
                     c.training.synthetic_documents};
}

inline DatasetSpec validation_dataset(const JobConfig& c) {
  return DatasetSpec{"validation",
                     c.validation.dataset,
                     c.validation.dataset_path,
                     {},
                     c.training.chat_format,
                     static_cast<std::uint64_t>(c.training.seed),
                     c.training.synthetic_documents,
                     c.validation.synthetic_documents};
}

/// The token stream [training] names, in memory.
inline io::TokenStream load_training_tokens(const JobConfig& c, const io::Tokenizer& tok) {
  return load_token_stream(training_dataset(c), tok);
}

/// The name of a stream in errors: its file (the first of several, and how many more),
/// or the embedded corpus.
inline std::string dataset_name(const DatasetSpec& spec) {
  if (spec.dataset == "synthetic") return "the synthetic corpus";
  if (spec.paths.size() == 1) return spec.paths.front();
  if (spec.paths.empty()) return spec.section + ".dataset_path (empty)";
  return tessera::detail::concat(spec.paths.front(), " and ", spec.paths.size() - 1, " more");
}

}  // namespace tessera::train
