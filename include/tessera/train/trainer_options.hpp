// What a Trainer is told besides its model and its batches, as named fields: the door
// for a C++ trainer of one's own, and the one llama-train goes through too
// (trainer_options turns a JobConfig into these).
//
//   train::TrainerOptions o;
//   o.optimizer.lr = 3e-3;
//   o.schedule.steps = 1000;
//   o.schedule.warmup_steps = 100;
//   o.global_batch_size = 64;            // sequences; gradient accumulation makes up the rest
//   o.peak_flops = 989e12;               // set: the step's metrics carry MFU
//   train::Trainer<Model> trainer(model, o, data::BatchSource::tokens(my_tokens, 2048, 8));
//
// Nothing is rounded unless asked: the parameters keep the model's element type unless
// optimizer.param_dtype says bfloat16 (bf16 values with float32 masters).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/optim/lr_schedule.hpp"
#include "tessera/train/dataset_files.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

/// Where a Trainer's settings came from, so that a message names what the user wrote:
/// the config key ("training.max_norm") or the option ("max_norm").
enum class SettingsFrom : std::uint8_t { code, config };

/// A setting a resumed run must keep (the data it read, say), checked by name when a
/// checkpoint is loaded, unless the part of the state it belongs to starts afresh.
struct KeptSetting {
  std::string name;      // as the refusal names it
  nlohmann::json value;  // as saved in the checkpoint's training state
  std::string part;      // "dataloader" or "model": the ResumeParts member that frees it
};

struct TrainerOptions {
  /// AdamW: lr is the peak rate the schedule scales. param_dtype unset: the model's
  /// element type (nothing rounded); bfloat16 on a float32 model: bf16 values, float32 masters.
  optim::AdamWOptions optimizer{};
  /// The learning-rate schedule; schedule.steps, the run's length, is required.
  optim::LrScheduleOptions schedule{};
  /// Sequences per optimizer step over every data-parallel rank; 0: one local batch per
  /// rank. A multiple of the local batch x the data-parallel degree: the rest is made up
  /// by gradient accumulation.
  std::int64_t global_batch_size = 0;
  /// The global gradient norm is clipped to this; <= 0: no clipping.
  double max_norm = 1.0;
  /// One device's peak FLOP/s, which MFU is measured against; unset: no MFU (StepMetrics'
  /// mfu_pct and mfu_causal_pct stay 0).
  std::optional<double> peak_flops;
  /// Each step after the first replays a graph of the second's work (backend/graph.hpp):
  /// on a GPU one launch in place of a thousand. One rank, no pipeline, a backend that
  /// captures (Cpu, Cuda), batches of one shape.
  bool graph = false;
  /// Packed documents masked apart (training.document_mask): a document starts at each
  /// input equal to this id (a BOS) and at each sequence's first token; each attends
  /// only within itself, with positions from its start, and a target equal to it (the
  /// next document's start) is not counted (data::mask_document_boundaries). -1: off.
  std::int32_t document_start_id = -1;
  /// Settings a resume must find unchanged besides the Trainer's own (the sequence
  /// length, the global batch and the parameters' dtype).
  std::vector<KeptSetting> keep_on_resume;
  /// How messages name these settings.
  SettingsFrom from = SettingsFrom::code;

  /// `config_key` when the settings came from a config, else `option`.
  std::string_view name(std::string_view config_key, std::string_view option) const {
    return from == SettingsFrom::config ? config_key : option;
  }
};

/// The BOS id that starts a document under training.document_mask (or `key`):
/// model.tokenizer's, checked against the model's vocabulary.
inline std::int32_t document_start_id(const JobConfig& c, std::string_view key = "training.document_mask") {
  const auto tok = data::make_tokenizer(c.model.tokenizer);
  const std::uint32_t bos = tok->bos_id();
  TESSERA_CHECK(static_cast<std::int64_t>(bos) < c.model.args.vocab_size, key, ": the BOS id ", bos,
                " of model.tokenizer ", c.model.tokenizer, " is outside the model's vocabulary of ",
                c.model.args.vocab_size, " (documents are found by their BOS token)");
  return static_cast<std::int32_t>(bos);
}

/// The options a job's config describes ([optimizer], [lr_scheduler], [training]), with
/// the data settings a resume must keep. training.mixed_precision_param = "auto" leaves
/// the parameters' dtype to the model. peak_flops is left unset: what the device offers
/// is the binary's to know.
inline TrainerOptions trainer_options(const JobConfig& c) {
  TrainerOptions o;
  o.from = SettingsFrom::config;
  o.optimizer.lr = c.optimizer.lr;
  o.optimizer.beta1 = c.optimizer.beta1;
  o.optimizer.beta2 = c.optimizer.beta2;
  o.optimizer.eps = c.optimizer.eps;
  o.optimizer.weight_decay = c.optimizer.weight_decay;
  o.optimizer.param_dtype = param_dtype(c);
  o.optimizer.state_dtype = parse_dtype(c.optimizer.state_dtype, "optimizer.state_dtype");
  o.schedule = {c.training.steps, c.lr_scheduler.warmup_steps, c.lr_scheduler.decay_ratio,
                optim::parse_decay_type(c.lr_scheduler.decay_type), c.lr_scheduler.min_lr_factor};
  o.global_batch_size = c.training.global_batch_size > 0 ? c.training.global_batch_size : 0;
  o.max_norm = c.training.max_norm;
  o.graph = c.training.cuda_graph;
  if (c.training.document_mask) o.document_start_id = document_start_id(c);
  auto keep = [&](const char* key, nlohmann::json value) { o.keep_on_resume.push_back({key, std::move(value), "dataloader"}); };
  keep("training.dataset", c.training.dataset);
  keep("model.tokenizer", c.model.tokenizer);
  if (c.training.dataset == "synthetic") {
    keep("training.seed", c.training.seed);  // the corpus is drawn from it
    keep("training.synthetic_documents", c.training.synthetic_documents);
  } else {
    // The files themselves, one as a string (as checkpoints saved before lists were): a
    // resume that would find others under a pattern is refused.
    keep("training.dataset_path", kept_files(c.training.dataset_path, !c.training.dataset_weights.empty(),
                                              "training.dataset_path"));
    keep("training.dataset_weights", c.training.dataset_weights);
  }
  keep("training.packing", c.training.packing);
  keep("training.shuffle", c.training.shuffle);
  if (c.training.shuffle && c.training.dataset != "synthetic") keep("training.seed", c.training.seed);  // the order
  return o;
}

}  // namespace tessera::train
