// The checks: each key's value against its range or choices, model.args resolved from
// the flavor and the [model] overrides, and the rules that tie keys together.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/train/config_field.hpp"
#include "tessera/train/config_keys.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

namespace detail {

inline void check_key(const ConfigKey& k, const JobConfig& c, const std::string& where) {
  Value v = read_value(k, c);
  if (std::holds_alternative<std::monostate>(v)) return;
  if (k.type == KeyType::Int || k.type == KeyType::Float) {
    double x = k.type == KeyType::Int ? static_cast<double>(std::get<std::int64_t>(v)) : std::get<double>(v);
    if (!k.minus_one_means.empty() && k.type == KeyType::Int && std::get<std::int64_t>(v) == -1) return;
    bool ok = std::isfinite(x);
    if (k.min) ok = ok && (k.min_open ? x > *k.min : x >= *k.min);
    if (k.max) ok = ok && (k.max_open ? x < *k.max : x <= *k.max);
    if (ok) return;
    if (!k.minus_one_means.empty())
      fail(where, ": ", k.name, " must be -1 (", k.minus_one_means, ") or ", describe_range(k), ", got ",
           format_value(v));
    fail(where, ": ", k.name, " must be ", describe_range(k), ", got ", format_value(v));
  }
  if (k.type == KeyType::String && !k.choices.empty()) {
    const auto& s = std::get<std::string>(v);
    if (std::find(k.choices.begin(), k.choices.end(), s) == k.choices.end())
      fail(where, ": ", k.name, " must be one of ", join(k.choices, ", "), "; got ", quote(s));
  }
  if (k.type == KeyType::FloatList) {
    for (const double x : std::get<std::vector<double>>(v)) {
      bool ok = std::isfinite(x);
      if (k.min) ok = ok && (k.min_open ? x > *k.min : x >= *k.min);
      if (k.max) ok = ok && (k.max_open ? x < *k.max : x <= *k.max);
      if (!ok) fail(where, ": ", k.name, ": each item must be ", describe_range(k), ", got ", format_float(x));
    }
  }
  if (k.type == KeyType::StringList) {
    const auto& items = std::get<std::vector<std::string>>(v);
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), items[i]) == k.choices.end())
        fail(where, ": ", k.name, ": each item must be one of ", join(k.choices, ", "), "; got ", quote(items[i]));
      if (std::find(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(i), items[i]) != items.begin() + static_cast<std::ptrdiff_t>(i))
        fail(where, ": ", k.name, ": ", quote(items[i]), " is given twice");
    }
  }
}

/// tessera's flavor for torchtitan's model.name and model.flavor ("llama3" and "8B":
/// llama3.1_8b, torchtitan's Llama 3 shapes being Llama 3.1's, RoPE scaling and 131,072
/// positions); without a name, `flavor` is tessera's own.
inline std::string tessera_flavor(const std::string& name, const std::string& flavor) {
  if (name.empty()) return flavor;
  static const std::map<std::pair<std::string, std::string>, std::string> torchtitan = {
      {{"llama3", "debugmodel"}, "debugmodel"}, {{"llama3", "8B"}, "llama3.1_8b"},
      {{"llama3", "70B"}, "llama3.1_70b"},      {{"llama3", "405B"}, "llama3.1_405b"},
      {{"llama2", "debugmodel"}, "debugmodel"}, {{"llama2", "7B"}, "llama2_7b"},
      {{"llama2", "13B"}, "llama2_13b"},        {{"llama2", "70B"}, "llama2_70b"}};
  if (const auto it = torchtitan.find({name, flavor}); it != torchtitan.end()) return it->second;
  // A tessera flavor name is taken as it is beside a model name.
  for (const auto& a : nn::model_flavors())
    if (a.flavor == flavor) return flavor;
  std::string known;
  for (const auto& [key, ours] : torchtitan)
    if (key.first == name) known += (known.empty() ? "" : ", ") + key.second;
  fail("model.flavor: '", flavor, "' is not a flavor of model.name = \"", name, "\" (torchtitan's: ", known,
       "; or one of tessera's, as model.flavor says)");
}

inline void finalize(JobConfig& c, const Origins& o, std::string_view model_where) {
  for (const auto& k : config_keys()) check_key(k, c, o.of(k.name));

  // [model]: the flavor, the overrides on top, then the shape checks.
  try {
    c.model.args = nn::model_flavor(tessera_flavor(c.model.name, c.model.flavor));
  } catch (const Error& e) {
    fail(o.of("model.flavor"), ": ", e.what());
  }
  // torchtitan's folder of Hugging Face assets holds the tokenizer it reads.
  if (!c.model.hf_assets_path.empty() && !o.by_key.contains("model.tokenizer")) c.model.tokenizer = c.model.hf_assets_path;
  // ... and the Hugging Face weights a run starts from, where initial_load_in_hf asks for them
  // and initial_load_path names none (torchtitan's rule).
  if (c.checkpoint.initial_load_in_hf && c.checkpoint.initial_load_path.empty() && !c.model.hf_assets_path.empty())
    c.checkpoint.initial_load_path = c.model.hf_assets_path;
  for (const auto& k : config_keys())
    if (k.apply_to_args) k.apply_to_args(c);
  // The shape's errors name where its keys came from: the file, and the command line's
  // overrides of [model] beside it.
  std::string overrides;
  for (const auto& [key, origin] : o.by_key)
    if (key.starts_with("model.") && origin == "command line" && model_where != origin)
      overrides += (overrides.empty() ? "--" : ", --") + key;
  c.model.args.validate(overrides.empty() ? tessera::detail::concat(model_where, ": [model]")
                                          : tessera::detail::concat(model_where, " with ", overrides,
                                                                    " from the command line: [model]"));
  TESSERA_CHECK(!c.metrics.enable_wandb, o.of("metrics.enable_wandb"),
                ": metrics.enable_wandb = true: Weights & Biases is an online service this build does not reach; "
                "metrics.enable_tensorboard = true writes the same scalars to local files");
  TESSERA_CHECK(!c.parallelism.enable_async_tensor_parallel || !c.parallelism.disable_sequence_parallel,
                o.of("parallelism.enable_async_tensor_parallel"),
                ": parallelism.enable_async_tensor_parallel = true cuts the sequence-parallel gathers and "
                "reduce-scatters into the GEMMs beside them, and parallelism.disable_sequence_parallel = true "
                "leaves none (all-reduces instead); turn one of them off");
  TESSERA_CHECK(!c.job.dump_folder.empty(), o.of("job.dump_folder"),
                ": job.dump_folder is empty (the folder the job writes its checkpoints, metrics and models to)");
  TESSERA_CHECK(!c.checkpoint.folder.empty(), o.of("checkpoint.folder"),
                ": checkpoint.folder is empty (the checkpoints' folder inside job.dump_folder)");
  TESSERA_CHECK(!c.checkpoint.create_seed_checkpoint || c.checkpoint.enable, o.of("checkpoint.create_seed_checkpoint"),
                ": checkpoint.create_seed_checkpoint = true writes a checkpoint: it needs checkpoint.enable = true");

  // Rules that tie keys together.
  const auto& t = c.training;
  TESSERA_CHECK(t.seq_len <= c.model.args.max_seq_len, o.of("training.seq_len"), ": training.seq_len (", t.seq_len,
                ") exceeds the model's max_seq_len (", c.model.args.max_seq_len, ") of flavor ", c.model.flavor,
                "; raise model.max_seq_len or lower training.seq_len");
  TESSERA_CHECK(t.dataset != "shard" || !t.dataset_path.empty(), o.of("training.dataset"),
                ": training.dataset_path is required when training.dataset = \"shard\" (a token shard made by "
                "llama-tokenize)");
  TESSERA_CHECK(t.dataset != "chat" || !t.dataset_path.empty(), o.of("training.dataset"),
                ": training.dataset_path is required when training.dataset = \"chat\" (JSON lines of "
                "{\"messages\": [...]})");
  if (!t.dataset_weights.empty()) {
    TESSERA_CHECK(t.dataset == "shard" || t.dataset == "chat", o.of("training.dataset_weights"),
                  ": training.dataset_weights mixes the files of training.dataset_path, and training.dataset = \"",
                  t.dataset, "\" reads none");
    TESSERA_CHECK(t.dataset_weights.size() == t.dataset_path.size(), o.of("training.dataset_weights"),
                  ": training.dataset_weights has ", t.dataset_weights.size(), " weight",
                  t.dataset_weights.size() == 1 ? "" : "s", " and training.dataset_path ", t.dataset_path.size(),
                  " entr", t.dataset_path.size() == 1 ? "y" : "ies", ": one weight per entry");
  }
  const auto& v = c.validation;
  if (v.enable) {
    TESSERA_CHECK(v.dataset == "synthetic" || hub_dataset(v.dataset) || !v.dataset_path.empty(), o.of("validation.dataset"),
                  ": validation.dataset_path is required when validation.dataset = \"", v.dataset, "\"");
    TESSERA_CHECK(v.seq_len <= c.model.args.max_seq_len, o.of("validation.seq_len"), ": validation.seq_len (",
                  v.seq_len, ") exceeds the model's max_seq_len (", c.model.args.max_seq_len, ")");
    const std::int64_t cp = c.parallelism.context_parallel_degree;
    TESSERA_CHECK(cp <= 1 || v.seq_len % (2 * cp) == 0, o.of("validation.seq_len"), ": validation.seq_len (",
                  v.seq_len, ") must be a multiple of 2 x parallelism.context_parallel_degree (", 2 * cp,
                  "): each context-parallel rank holds two chunks of every sequence");
  }
  TESSERA_CHECK(t.global_batch_size == -1 || t.global_batch_size % t.local_batch_size == 0,
                o.of("training.global_batch_size"), ": training.global_batch_size (", t.global_batch_size,
                ") must be a multiple of training.local_batch_size (", t.local_batch_size, ")");
  // The split points' names here, so the error says where they came from; their count and
  // range depend on the pipeline and the model and are checked when it is laid out.
  try {
    (void)parallel::parse_split_points(c.parallelism.pipeline_parallel_split_points);
  } catch (const Error& e) {
    fail(o.of("parallelism.pipeline_parallel_split_points"), ": ", e.what());
  }
  const auto& option = c.activation_checkpoint.selective_ac_option;
  if (option != "op") {
    std::int64_t every = 0;
    auto [ptr, ec] = std::from_chars(option.data(), option.data() + option.size(), every);
    TESSERA_CHECK(ec == std::errc{} && ptr == option.data() + option.size() && !option.empty() && every > 0,
                  o.of("activation_checkpoint.selective_ac_option"),
                  ": activation_checkpoint.selective_ac_option must be \"op\" or a positive integer, got ",
                  quote(option));
  }
}

}  // namespace detail

}  // namespace tessera::train
