// The training job's configuration, in torchtitan's TOML sections and keys.
//
// JobConfig holds one plain struct per section ([job], [model], [optimizer],
// [lr_scheduler], [training], [parallelism], [activation_checkpoint], [checkpoint],
// [metrics], [comm]) with torchtitan's defaults. ONE table, config_keys(), describes every key
// once: its "section.key" name, its type, where it lives in JobConfig, what it means and
// which values it accepts. TOML parsing, --section.key overrides, to_toml() and
// config_help() all walk that table, so a key added there is parsed, overridable,
// dumped, listed and checked at once.
//
// A key holds an int, a float, a bool, a string or a list of strings. A list is a TOML
// array of strings in the file (["layers.4", "layers.8"]) and comma-separated items on
// the command line (--section.key layers.4,layers.8; an empty value is the empty list).
//
// Loading a config resolves model.args (the flavor with the [model] overrides applied,
// then nn::ModelArgs::validate) and checks every value. Each error is one line naming
// where the value came from ("file.toml:LINE:COL" or "command line") and the key.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <toml++/toml.h>  // toml++ v3 (Debian ships this name, not toml.hpp)

#include "tessera/core/error.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

// ---------------------------------------------------------------------------------------
// The key table.

enum class KeyType { Int, Float, Bool, String, StringList };

inline const char* key_type_name(KeyType t) {
  switch (t) {
    case KeyType::Int: return "int";
    case KeyType::Float: return "float";
    case KeyType::Bool: return "bool";
    case KeyType::String: return "string";
    case KeyType::StringList: return "string list";
  }
  return "?";
}

namespace detail {

/// Where one key's field lives: accessors generated from two member pointers.
template <class T>
struct FieldRef {
  T& (*get)(JobConfig&);
  const T& (*cget)(const JobConfig&);
};

using AnyField = std::variant<FieldRef<std::int64_t>, FieldRef<double>, FieldRef<bool>, FieldRef<std::string>,
                              FieldRef<std::vector<std::string>>, FieldRef<std::optional<std::int64_t>>,
                              FieldRef<std::optional<double>>, FieldRef<std::optional<bool>>>;

template <auto Section, auto Field>
auto& field_get(JobConfig& c) {
  return (c.*Section).*Field;
}
template <auto Section, auto Field>
const auto& field_cget(const JobConfig& c) {
  return (c.*Section).*Field;
}
template <auto Section, auto Field>
AnyField field() {
  using T = std::remove_cvref_t<decltype(field_get<Section, Field>(std::declval<JobConfig&>()))>;
  return FieldRef<T>{&field_get<Section, Field>, &field_cget<Section, Field>};
}

/// One value as read from TOML or the command line; monostate means "unset".
using Value = std::variant<std::monostate, std::int64_t, double, bool, std::string, std::vector<std::string>>;

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class T>
KeyType key_type_of() {
  if constexpr (is_optional<T>::value) {
    return key_type_of<typename T::value_type>();
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return KeyType::Int;
  } else if constexpr (std::is_same_v<T, double>) {
    return KeyType::Float;
  } else if constexpr (std::is_same_v<T, bool>) {
    return KeyType::Bool;
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return KeyType::StringList;
  } else {
    static_assert(std::is_same_v<T, std::string>, "config fields are int64, double, bool, string or string list");
    return KeyType::String;
  }
}

}  // namespace detail

/// One configuration key: everything the parser, the overrides, the dump and the help need.
struct ConfigKey {
  std::string_view name;  // "section.key"
  KeyType type = KeyType::Int;
  bool optional = false;  // may be left unset (std::optional field)
  std::string_view help;
  // Accepted values: numbers within [min, max] (bounds open where *_open), -1 as well
  // when minus_one_means is set; strings among `choices` when it is not empty.
  std::optional<double> min, max;
  bool min_open = false, max_open = false;
  std::string_view minus_one_means;
  std::vector<std::string_view> choices;
  std::string_view unset_means;  // for optional keys
  detail::AnyField field;
  // [model] overrides: copies the set value into model.args, and reads the flavor's value.
  void (*apply_to_args)(JobConfig&) = nullptr;
  std::string (*args_value)(const JobConfig&) = nullptr;

  std::string_view section() const { return name.substr(0, name.find('.')); }
  std::string_view key() const { return name.substr(name.find('.') + 1); }
};

namespace detail {

/// The shortest text that reads back as exactly `v`: plain digits for everyday
/// magnitudes, else "1e-8" style; always a TOML float (never "3", always "3.0").
inline std::string format_float(double v) {
  char buf[64];
  double mag = std::fabs(v);
  bool plain = mag == 0 || (mag >= 1e-4 && mag < 1e15);
  auto res = plain ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed)
                   : std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  if (auto e = s.find('e'); e != std::string::npos) {  // "1e-08" -> "1e-8", "1e+20" -> "1e20"
    std::string out = s.substr(0, e + 1);
    std::size_t i = e + 1;
    if (s[i] == '-') out.push_back('-');
    if (s[i] == '-' || s[i] == '+') ++i;
    while (i + 1 < s.size() && s[i] == '0') ++i;
    out.append(s, i, std::string::npos);
    return out;
  }
  if (s.find('.') == std::string::npos) s += ".0";
  return s;
}

/// A TOML basic string literal.
inline std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    auto c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          static const char* hex = "0123456789ABCDEF";
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

inline std::string format_value(const Value& v) {
  struct {
    std::string operator()(std::monostate) const { return "unset"; }
    std::string operator()(std::int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const { return format_float(x); }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return quote(x); }
    std::string operator()(const std::vector<std::string>& xs) const {  // a TOML array: ["a", "b"]
      std::string out = "[";
      for (std::size_t i = 0; i < xs.size(); ++i) out += (i > 0 ? ", " : "") + quote(xs[i]);
      return out + "]";
    }
  } visitor;
  return std::visit(visitor, v);
}

template <auto SectionField, auto ArgsField>
void apply_model_override(JobConfig& c) {
  if (const auto& v = c.model.*SectionField) c.model.args.*ArgsField = *v;
}
template <auto ArgsField>
std::string model_args_value(const JobConfig& c) {
  using T = std::remove_cvref_t<decltype(c.model.args.*ArgsField)>;
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, double>) {
    return format_value(Value{c.model.args.*ArgsField});
  } else {
    return format_value(Value{static_cast<std::int64_t>(c.model.args.*ArgsField)});
  }
}

struct KeyBuilder {
  ConfigKey k;
  KeyBuilder& positive() {
    k.min = 0;
    k.min_open = true;
    return *this;
  }
  KeyBuilder& at_least(double v) {
    k.min = v;
    return *this;
  }
  KeyBuilder& at_most(double v) {
    k.max = v;
    return *this;
  }
  KeyBuilder& below(double v) {
    k.max = v;
    k.max_open = true;
    return *this;
  }
  KeyBuilder& or_minus_one(std::string_view meaning) {
    k.minus_one_means = meaning;
    return *this;
  }
  KeyBuilder& one_of(std::vector<std::string_view> values) {
    k.choices = std::move(values);
    return *this;
  }
  KeyBuilder& unset_means(std::string_view text) {
    k.unset_means = text;
    return *this;
  }
};

inline KeyBuilder make_key(std::string_view name, AnyField field, std::string_view help) {
  KeyBuilder b;
  b.k.name = name;
  b.k.help = help;
  b.k.field = field;
  std::visit(
      [&](auto ref) {
        using T = std::remove_cvref_t<decltype(ref.get(std::declval<JobConfig&>()))>;
        b.k.type = key_type_of<T>();
        b.k.optional = is_optional<T>::value;
      },
      field);
  return b;
}

template <auto SectionField, auto ArgsField>
KeyBuilder model_key(std::string_view name, std::string_view help) {
  auto b = make_key(name, field<&JobConfig::model, SectionField>(), help);
  b.k.apply_to_args = &apply_model_override<SectionField, ArgsField>;
  b.k.args_value = &model_args_value<ArgsField>;
  b.k.unset_means = "the flavor's value";
  return b;
}

inline std::vector<ConfigKey> build_config_keys() {
  using J = JobConfig;
  using M = ModelSection;
  using A = nn::ModelArgs;
  const std::vector<std::string_view> dtypes = {"float32", "bfloat16"};
  std::vector<KeyBuilder> b = {
      // [job]
      make_key("job.dump_folder", field<&J::job, &JobSection::dump_folder>(),
               "Folder for everything the job writes (checkpoints, metrics, TensorBoard)."),
      make_key("job.description", field<&J::job, &JobSection::description>(), "Free text describing the job."),
      make_key("job.print_config", field<&J::job, &JobSection::print_config>(),
               "Print the effective configuration as TOML at start-up."),
      // [model]
      make_key("model.flavor", field<&J::model, &M::flavor>(),
               "Model flavor (debugmodel, llama2_7b, ..., llama3.1_405b, llama3.2_3b)."),
      model_key<&M::dim, &A::dim>("model.dim", "Override: model width.").positive(),
      model_key<&M::n_layers, &A::n_layers>("model.n_layers", "Override: number of transformer blocks.")
          .positive(),
      model_key<&M::n_heads, &A::n_heads>("model.n_heads", "Override: attention heads (must divide dim).")
          .positive(),
      model_key<&M::n_kv_heads, &A::n_kv_heads>(
          "model.n_kv_heads", "Override: key/value heads for grouped-query attention (0: n_heads; must divide n_heads).")
          .at_least(0),
      model_key<&M::vocab_size, &A::vocab_size>("model.vocab_size", "Override: vocabulary size.").positive(),
      model_key<&M::multiple_of, &A::multiple_of>("model.multiple_of",
                                                  "Override: the feed-forward hidden size is rounded up to this.")
          .positive(),
      model_key<&M::ffn_dim_multiplier, &A::ffn_dim_multiplier>(
          "model.ffn_dim_multiplier", "Override: feed-forward hidden size multiplier (0: none).")
          .at_least(0),
      model_key<&M::ffn_hidden, &A::ffn_hidden>(
          "model.ffn_hidden", "Override: the feed-forward hidden size itself (Hugging Face's intermediate_size; 0: derived).")
          .at_least(0),
      model_key<&M::rope_theta, &A::rope_theta>("model.rope_theta", "Override: RoPE base frequency.").positive(),
      model_key<&M::norm_eps, &A::norm_eps>("model.norm_eps", "Override: RMSNorm epsilon.").positive(),
      model_key<&M::max_seq_len, &A::max_seq_len>("model.max_seq_len",
                                                  "Override: longest sequence the model is built for.")
          .positive(),
      model_key<&M::tie_embeddings, &A::tie_embeddings>(
          "model.tie_embeddings", "Override: share the token embedding with the output projection."),
      make_key("model.tokenizer", field<&J::model, &M::tokenizer>(),
               "Tokenizer: \"byte\", \"synthetic_bpe\" (the embedded corpus's BPE vocabulary), a tiktoken-format "
               "(Llama 3) or SentencePiece (Llama 2) tokenizer.model file, or a Hugging Face model directory holding one."),
      // [optimizer]
      make_key("optimizer.name", field<&J::optimizer, &OptimizerSection::name>(), "Optimizer.").one_of({"AdamW"}),
      make_key("optimizer.lr", field<&J::optimizer, &OptimizerSection::lr>(), "Peak learning rate.").at_least(0),
      make_key("optimizer.eps", field<&J::optimizer, &OptimizerSection::eps>(),
               "AdamW epsilon added to the denominator.")
          .positive(),
      make_key("optimizer.weight_decay", field<&J::optimizer, &OptimizerSection::weight_decay>(),
               "Decoupled weight decay.")
          .at_least(0),
      make_key("optimizer.beta1", field<&J::optimizer, &OptimizerSection::beta1>(),
               "Decay rate of the first moment.")
          .at_least(0)
          .below(1),
      make_key("optimizer.beta2", field<&J::optimizer, &OptimizerSection::beta2>(),
               "Decay rate of the second moment.")
          .at_least(0)
          .below(1),
      make_key("optimizer.state_dtype", field<&J::optimizer, &OptimizerSection::state_dtype>(),
               "Dtype the AdamW moments are stored in (updated in float32 arithmetic either way; bfloat16 saves 4 "
               "bytes per parameter).")
          .one_of(dtypes),
      // [lr_scheduler]
      make_key("lr_scheduler.warmup_steps", field<&J::lr_scheduler, &LrSchedulerSection::warmup_steps>(),
               "Steps of linear warmup from near zero to optimizer.lr.")
          .at_least(0),
      make_key("lr_scheduler.decay_ratio", field<&J::lr_scheduler, &LrSchedulerSection::decay_ratio>(),
               "Fraction of training.steps spent decaying at the end (warmup-stable-decay).")
          .at_least(0)
          .at_most(1)
          .unset_means("decay starts right after warmup"),
      make_key("lr_scheduler.decay_type", field<&J::lr_scheduler, &LrSchedulerSection::decay_type>(),
               "Shape of the decay phase.")
          .one_of({"linear", "sqrt", "cosine"}),
      make_key("lr_scheduler.min_lr_factor", field<&J::lr_scheduler, &LrSchedulerSection::min_lr_factor>(),
               "The decay ends at min_lr_factor x optimizer.lr.")
          .at_least(0)
          .at_most(1),
      // [training]
      make_key("training.local_batch_size", field<&J::training, &TrainingSection::local_batch_size>(),
               "Sequences per data-parallel rank per step.")
          .positive(),
      make_key("training.global_batch_size", field<&J::training, &TrainingSection::global_batch_size>(),
               "Sequences per step over all ranks; more than local x data-parallel degree accumulates gradients.")
          .positive()
          .or_minus_one("local_batch_size x data-parallel degree"),
      make_key("training.seq_len", field<&J::training, &TrainingSection::seq_len>(),
               "Tokens per sequence (at most model.max_seq_len).")
          .positive(),
      make_key("training.steps", field<&J::training, &TrainingSection::steps>(), "Optimizer steps to train.")
          .positive(),
      make_key("training.max_norm", field<&J::training, &TrainingSection::max_norm>(),
               "Clip the global gradient norm to this (<= 0: no clipping)."),
      make_key("training.seed", field<&J::training, &TrainingSection::seed>(),
               "Seed of parameter initialisation and synthetic data.")
          .at_least(0),
      make_key("training.deterministic", field<&J::training, &TrainingSection::deterministic>(),
               "Use only deterministic kernels (on the GPU: cuDNN attention's deterministic backward; tessera's own "
               "kernels always are)."),
      make_key("training.device", field<&J::training, &TrainingSection::device>(),
               "Where to train: \"cpu\", \"cuda\" (one GPU a process: bf16 activations and parameters with "
               "mixed_precision_param = \"bfloat16\"), or \"auto\" (cuda where built with CUDA and a GPU is "
               "visible).")
          .one_of({"auto", "cpu", "cuda"}),
      make_key("training.attention", field<&J::training, &TrainingSection::attention>(),
               "Attention on the GPU: \"cudnn\" (cuDNN's fused SDPA: a bf16 model on sm_80 or newer, a build with "
               "the cuDNN frontend, libcudnn.so.9 at run time), \"tessera\" (the project's flash kernels), or "
               "\"auto\" (cudnn where it can run, else tessera; the start-up line says which and why). "
               "training.deterministic asks cuDNN for its deterministic backward.")
          .one_of({"auto", "cudnn", "tessera"}),
      make_key("training.expandable_segments", field<&J::training, &TrainingSection::expandable_segments>(),
               "On the GPU, the caching allocator keeps its large blocks in one segment that grows at its end "
               "(CUDA virtual memory, as PyTorch's expandable_segments, which torchtitan's launch script sets) "
               "instead of a cudaMalloc for each block no free one fits: less memory lost between blocks. "
               "false: a segment per block. llama-plan replays either."),
      make_key("training.mixed_precision_param", field<&J::training, &TrainingSection::mixed_precision_param>(),
               "Dtype of parameters in forward and backward (the optimizer keeps float32 masters).")
          .one_of(dtypes),
      make_key("training.mixed_precision_reduce", field<&J::training, &TrainingSection::mixed_precision_reduce>(),
               "Dtype of gradient reductions across data-parallel ranks.")
          .one_of({"float32"}),
      make_key("training.dataset", field<&J::training, &TrainingSection::dataset>(),
               "\"synthetic\": the embedded corpus; \"shard\": a token shard file (training.dataset_path).")
          .one_of({"synthetic", "shard"}),
      make_key("training.dataset_path", field<&J::training, &TrainingSection::dataset_path>(),
               "Token shard file made by llama-tokenize (required when dataset = \"shard\")."),
      make_key("training.synthetic_documents", field<&J::training, &TrainingSection::synthetic_documents>(),
               "Documents of the embedded corpus to generate.")
          .positive(),
      // [parallelism]
      make_key("parallelism.data_parallel_replicate_degree",
               field<&J::parallelism, &ParallelismSection::data_parallel_replicate_degree>(),
               "Data-parallel replicas (DDP, or HSDP's replicate dimension).")
          .at_least(1),
      make_key("parallelism.data_parallel_shard_degree",
               field<&J::parallelism, &ParallelismSection::data_parallel_shard_degree>(),
               "Ranks parameters are sharded over (FSDP).")
          .at_least(1)
          .or_minus_one("the ranks the other degrees leave"),
      make_key("parallelism.tensor_parallel_degree", field<&J::parallelism, &ParallelismSection::tensor_parallel_degree>(),
               "Tensor-parallel ranks.")
          .at_least(1),
      make_key("parallelism.pipeline_parallel_degree",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_degree>(), "Pipeline stages.")
          .at_least(1),
      make_key("parallelism.context_parallel_degree",
               field<&J::parallelism, &ParallelismSection::context_parallel_degree>(),
               "Context-parallel ranks (sequence split).")
          .at_least(1),
      make_key("parallelism.disable_loss_parallel", field<&J::parallelism, &ParallelismSection::disable_loss_parallel>(),
               "Gather the logits before the loss instead of computing it on vocabulary shards."),
      make_key("parallelism.disable_sequence_parallel",
               field<&J::parallelism, &ParallelismSection::disable_sequence_parallel>(),
               "With tensor parallelism, hold every row on every rank between the blocks' regions (norms and "
               "residual adds on every row, all-reduces at the regions) instead of splitting the rows."),
      make_key("parallelism.pipeline_parallel_schedule",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_schedule>(), "Pipeline schedule.")
          .one_of({"1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble"}),
      make_key("parallelism.pipeline_parallel_microbatch_size",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_microbatch_size>(),
               "Sequences per pipeline microbatch.")
          .positive(),
      make_key("parallelism.fsdp_reshard_after_forward",
               field<&J::parallelism, &ParallelismSection::fsdp_reshard_after_forward>(),
               "Free gathered parameters after forward: \"default\" (yes, except with pipelining), "
               "\"always\" or \"never\".")
          .one_of({"default", "always", "never"}),
      make_key("parallelism.pipeline_parallel_split_points",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_split_points>(),
               "Blocks where each pipeline stage after the first begins (\"layers.N\"), one fewer than the stages "
               "(pipeline_parallel_degree x stages per rank); empty: stages of equal size."),
      // [activation_checkpoint]
      make_key("activation_checkpoint.mode", field<&J::activation_checkpoint, &ActivationCheckpointSection::mode>(),
               "Recompute activations in backward: none, full (every block) or selective.")
          .one_of({"none", "full", "selective"}),
      make_key("activation_checkpoint.selective_ac_option",
               field<&J::activation_checkpoint, &ActivationCheckpointSection::selective_ac_option>(),
               "Selective mode: \"op\" (keep matmul outputs, recompute the rest) or N (every N-th block)."),
      // [checkpoint]
      make_key("checkpoint.enable", field<&J::checkpoint, &CheckpointSection::enable>(),
               "Save checkpoints (and resume from the latest one)."),
      make_key("checkpoint.folder", field<&J::checkpoint, &CheckpointSection::folder>(),
               "Checkpoint folder, inside job.dump_folder."),
      make_key("checkpoint.interval", field<&J::checkpoint, &CheckpointSection::interval>(),
               "Save every this many steps.")
          .positive(),
      make_key("checkpoint.load_step", field<&J::checkpoint, &CheckpointSection::load_step>(),
               "Resume from the checkpoint of this step (it must be there and complete).")
          .at_least(0)
          .or_minus_one("the latest complete checkpoint in the folder, if any"),
      make_key("checkpoint.exclude_from_loading", field<&J::checkpoint, &CheckpointSection::exclude_from_loading>(),
               "What a resume does not load, starting it afresh instead: model (the weights, and the optimizer's "
               "fp32 masters), optimizer (moments, step count), lr_scheduler (its position), dataloader (the "
               "position in the data), train_state (the step count).")
          .one_of({"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}),
      make_key("checkpoint.async_mode", field<&J::checkpoint, &CheckpointSection::async_mode>(),
               "disabled: a save holds the step until its files are on the disk; async: the step holds only "
               "while the state is copied to host memory, and a background thread writes the files.")
          .one_of({"disabled", "async"}),
      make_key("checkpoint.last_save_model_only", field<&J::checkpoint, &CheckpointSection::last_save_model_only>(),
               "At the last step save only the model weights (in export_dtype)."),
      make_key("checkpoint.export_dtype", field<&J::checkpoint, &CheckpointSection::export_dtype>(),
               "Dtype of the weights saved by a model-only save.")
          .one_of(dtypes),
      make_key("checkpoint.keep_latest_k", field<&J::checkpoint, &CheckpointSection::keep_latest_k>(),
               "Keep this many latest checkpoints (0: keep all).")
          .at_least(0),
      make_key("checkpoint.initial_load_path", field<&J::checkpoint, &CheckpointSection::initial_load_path>(),
               "Model to start from when the folder has none (\"\": none): a model.safetensors written by tessera, or "
               "a Hugging Face Llama directory, whose config.json then defines the model."),
      make_key("checkpoint.initial_load_in_hf", field<&J::checkpoint, &CheckpointSection::initial_load_in_hf>(),
               "Require initial_load_path to be a Hugging Face Llama directory (config.json + safetensors)."),
      make_key("checkpoint.last_save_in_hf", field<&J::checkpoint, &CheckpointSection::last_save_in_hf>(),
               "Also save the final model as a Hugging Face Llama directory, <dump_folder>/hf."),
      // [metrics]
      make_key("metrics.log_freq", field<&J::metrics, &MetricsSection::log_freq>(),
               "Log metrics every this many steps.")
          .positive(),
      make_key("metrics.enable_tensorboard", field<&J::metrics, &MetricsSection::enable_tensorboard>(),
               "Write TensorBoard event files."),
      make_key("metrics.save_tb_folder", field<&J::metrics, &MetricsSection::save_tb_folder>(),
               "TensorBoard folder, inside job.dump_folder."),
      make_key("metrics.peak_tflops", field<&J::metrics, &MetricsSection::peak_tflops>(),
               "Peak TFLOP/s per device that MFU is computed against (0: the device's known peak).")
          .at_least(0),
      // [comm]
      make_key("comm.init_timeout_seconds", field<&J::comm, &CommSection::init_timeout_seconds>(),
               "Seconds the ranks may take to start: the rendezvous at MASTER_ADDR:MASTER_PORT, the NCCL id "
               "exchange, ncclCommInitRank and each communicator split.")
          .positive(),
      make_key("comm.train_timeout_seconds", field<&J::comm, &CommSection::train_timeout_seconds>(),
               "Seconds one collective may take to complete; past it (a rank died or hangs) every rank ends with "
               "an error naming the operation.")
          .positive(),
      make_key("comm.check_nccl_semantics", field<&J::comm, &CommSection::check_nccl_semantics>(),
               "Hold the CPU engines (--thread-ranks, mpirun) to NCCL's rules: device buffers only, no tags, results "
               "read only after their wait, sends that wait for their receiver. Refused on GPUs, where NCCL itself runs."),
  };
  std::vector<ConfigKey> keys;
  keys.reserve(b.size());
  for (auto& kb : b) keys.push_back(std::move(kb.k));
  return keys;
}

}  // namespace detail

/// Every configuration key, in the order of the sections above.
inline const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = detail::build_config_keys();
  return keys;
}

/// The key called "section.key", or nullptr.
inline const ConfigKey* find_config_key(std::string_view name) {
  for (const auto& k : config_keys())
    if (k.name == name) return &k;
  return nullptr;
}

/// The sections, in order.
inline std::vector<std::string_view> config_sections() {
  std::vector<std::string_view> out;
  for (const auto& k : config_keys())
    if (std::find(out.begin(), out.end(), k.section()) == out.end()) out.push_back(k.section());
  return out;
}

namespace detail {

inline Value read_value(const ConfigKey& key, const JobConfig& c) {
  return std::visit(
      [&](auto ref) -> Value {
        const auto& v = ref.cget(c);
        using T = std::remove_cvref_t<decltype(v)>;
        if constexpr (is_optional<T>::value) {
          if (!v) return std::monostate{};
          return Value{*v};
        } else {
          return Value{v};
        }
      },
      key.field);
}

/// Stores `v`, whose alternative matches key.type (or is monostate for optional keys).
inline void write_value(const ConfigKey& key, JobConfig& c, const Value& v) {
  std::visit(
      [&](auto ref) {
        auto& dst = ref.get(c);
        using T = std::remove_cvref_t<decltype(dst)>;
        if constexpr (is_optional<T>::value) {
          if (std::holds_alternative<std::monostate>(v))
            dst.reset();
          else
            dst = std::get<typename T::value_type>(v);
        } else {
          dst = std::get<T>(v);
        }
      },
      key.field);
}

inline bool same_value(const ConfigKey& key, const JobConfig& a, const JobConfig& b) {
  return read_value(key, a) == read_value(key, b);
}

/// Optimal string alignment distance (edits, with adjacent transpositions).
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

inline bool close_enough(std::string_view typed, std::size_t distance) {
  return distance <= std::max<std::size_t>(1, typed.size() / 3);
}

/// The known key closest to `name` ("section.key"), or "" when none is close.
inline std::string suggest_key(std::string_view name) {
  auto dot = name.find('.');
  std::string_view sec = dot == std::string_view::npos ? std::string_view{} : name.substr(0, dot);
  std::string_view key = dot == std::string_view::npos ? name : name.substr(dot + 1);
  const ConfigKey* best = nullptr;
  std::size_t best_d = 0;
  for (const auto& k : config_keys()) {
    std::size_t d = edit_distance(name, k.name);
    if (!best || d < best_d) best = &k, best_d = d;
  }
  if (best && close_enough(key.empty() ? name : key, best_d)) return std::string(best->name);
  // The right key in the wrong section ("training.lr" for "optimizer.lr").
  for (const auto& k : config_keys())
    if (k.key() == key && k.section() != sec) return std::string(k.name);
  return {};
}

inline std::string suggest_section(std::string_view name) {
  std::string_view best;
  std::size_t best_d = 0;
  for (auto s : config_sections()) {
    std::size_t d = edit_distance(name, s);
    if (best.empty() || d < best_d) best = s, best_d = d;
  }
  return close_enough(name, best_d) ? std::string(best) : std::string{};
}

inline std::string join(const std::vector<std::string_view>& items, std::string_view sep) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += sep;
    out += items[i];
  }
  return out;
}

/// Where each key's value came from, for error messages.
struct Origins {
  std::string fallback;  // keys left at their defaults
  std::map<std::string, std::string, std::less<>> by_key;
  const std::string& of(std::string_view key) const {
    auto it = by_key.find(key);
    return it == by_key.end() ? fallback : it->second;
  }
};

// ---- values from TOML ----------------------------------------------------------------

inline const char* toml_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

inline const char* expected_name(KeyType t) {
  switch (t) {
    case KeyType::Int: return "an integer";
    case KeyType::Float: return "a number";
    case KeyType::Bool: return "a boolean (true or false)";
    case KeyType::String: return "a string";
    case KeyType::StringList: return "an array of strings";
  }
  return "?";
}

inline std::string position(std::string_view source, const toml::source_region& r) {
  std::string s(source);
  if (r.begin.line > 0) s += tessera::detail::concat(":", r.begin.line, ":", r.begin.column);
  return s;
}

inline Value value_from_toml(const ConfigKey& key, const toml::node& n, const std::string& where) {
  auto wrong = [&]() -> Value {
    fail(where, ": ", key.name, ": expected ", expected_name(key.type), ", got ", toml_type_name(n));
  };
  switch (key.type) {
    case KeyType::Int:
      if (auto v = n.as_integer()) return v->get();
      return wrong();
    case KeyType::Float: {
      double d;
      if (auto v = n.as_floating_point())
        d = v->get();
      else if (auto i = n.as_integer())
        d = static_cast<double>(i->get());
      else
        return wrong();
      TESSERA_CHECK(std::isfinite(d), where, ": ", key.name, ": expected a finite number, got ", d);
      return d;
    }
    case KeyType::Bool:
      if (auto v = n.as_boolean()) return v->get();
      return wrong();
    case KeyType::String:
      if (auto v = n.as_string()) return v->get();
      return wrong();
    case KeyType::StringList: {
      const auto* array = n.as_array();
      if (!array) return wrong();
      std::vector<std::string> items;
      items.reserve(array->size());
      for (std::size_t i = 0; i < array->size(); ++i) {
        const toml::node& item = *array->get(i);
        const auto* s = item.as_string();
        if (!s) {
          // Point at the item itself: an array may span several lines.
          const auto& r = item.source();
          std::string item_where = where;
          if (r.path && r.begin.line > 0) item_where = position(*r.path, r);
          fail(item_where, ": ", key.name, ": expected ", expected_name(key.type), ", got ", toml_type_name(item),
               " at index ", i);
        }
        items.push_back(s->get());
      }
      return items;
    }
  }
  return wrong();
}

inline void apply_toml(JobConfig& c, Origins& origins, std::string_view text, std::string_view source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail(position(source, e.source()), ": TOML syntax error: ", e.description());
  }
  for (auto&& [section_key, section_node] : root) {
    std::string section(section_key.str());
    std::string where = position(source, section_key.source());
    auto sections = config_sections();
    bool known_section = std::find(sections.begin(), sections.end(), section) != sections.end();
    auto* table = section_node.as_table();
    if (!table) {
      if (known_section) fail(where, ": [", section, "] must be a table, got ", toml_type_name(section_node));
      const ConfigKey* elsewhere = nullptr;
      for (const auto& k : config_keys())
        if (k.key() == section) elsewhere = elsewhere ? elsewhere : &k;
      if (elsewhere) fail(where, ": key '", section, "' is outside any section (did you mean '", elsewhere->name, "'?)");
      fail(where, ": key '", section, "' is outside any section (keys go under [job], [model], [training], ...)");
    }
    if (!known_section) {
      std::string hint = suggest_section(section);
      if (!hint.empty()) fail(where, ": unknown section [", section, "] (did you mean [", hint, "]?)");
      fail(where, ": unknown section [", section, "] (known: ", join(sections, ", "), ")");
    }
    for (auto&& [key, node] : *table) {
      std::string name = tessera::detail::concat(section, ".", key.str());
      std::string key_where = position(source, key.source());
      const ConfigKey* k = find_config_key(name);
      if (!k) {
        std::string hint = suggest_key(name);
        if (!hint.empty()) fail(key_where, ": unknown key '", name, "' (did you mean '", hint, "'?)");
        fail(key_where, ": unknown key '", name, "'");
      }
      std::string value_where = position(source, node.source());
      write_value(*k, c, value_from_toml(*k, node, value_where));
      origins.by_key[std::string(k->name)] = value_where;
    }
  }
}

// ---- values from the command line ----------------------------------------------------

struct Override {
  const ConfigKey* key;
  std::string value;
};

struct CommandLine {
  std::optional<std::string> config_file;
  std::vector<Override> overrides;
};

inline bool is_option(const std::string& word) { return word.size() >= 2 && word.compare(0, 2, "--") == 0; }

inline CommandLine parse_command_line(const std::vector<std::string>& args) {
  CommandLine out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& word = args[i];
    TESSERA_CHECK(is_option(word) && word.size() > 2, "command line: unexpected argument '", word,
                  "' (settings look like --section.key value)");
    std::string name = word.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    bool next_is_value = i + 1 < args.size() && !is_option(args[i + 1]);
    if (name == "config" || name == "job.config_file") {
      if (!value && next_is_value) value = args[++i];
      TESSERA_CHECK(value && !value->empty(), "command line: --", name, " needs a value (the TOML file)");
      out.config_file = *value;
      continue;
    }
    const ConfigKey* key = find_config_key(name);
    if (!key) {
      std::string hint = suggest_key(name);
      if (!hint.empty()) fail("command line: unknown option --", name, " (did you mean --", hint, "?)");
      fail("command line: unknown option --", name, " (see --help for the keys)");
    }
    if (!value) {
      if (next_is_value)
        value = args[++i];
      else if (key->type == KeyType::Bool)
        value = "true";  // a bare boolean flag
      else
        fail("command line: --", name, " needs a value");
    }
    out.overrides.push_back({key, *value});
  }
  return out;
}

/// A string list from the command line: items separated by commas, each without the
/// spaces around it ("layers.4, layers.8"); "" is the empty list. An empty item (",,",
/// a comma at either end) is an error: an item cannot itself hold a comma.
inline std::vector<std::string> split_list(const ConfigKey& key, const std::string& text, const std::string& where) {
  std::vector<std::string> items;
  if (text.find_first_not_of(" \t") == std::string::npos) return items;
  std::size_t begin = 0;
  while (true) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    std::string_view item(text.data() + begin, comma - begin);
    const auto first = item.find_first_not_of(" \t");
    TESSERA_CHECK(first != std::string_view::npos, where, ": --", key.name,
                  ": expected comma-separated strings (a,b,c; empty for none), got an empty item in '", text, "'");
    item = item.substr(first, item.find_last_not_of(" \t") - first + 1);
    items.emplace_back(item);
    if (comma == text.size()) break;
    begin = comma + 1;
  }
  return items;
}

inline Value value_from_text(const ConfigKey& key, const std::string& text, const std::string& where) {
  auto wrong = [&]() -> Value {
    fail(where, ": --", key.name, ": expected ", expected_name(key.type), ", got '", text, "'");
  };
  if (key.optional && (text == "none" || text == "None")) return std::monostate{};
  const char* first = text.data();
  const char* last = text.data() + text.size();
  switch (key.type) {
    case KeyType::Int: {
      std::int64_t v = 0;
      auto [ptr, ec] = std::from_chars(first, last, v);
      if (ec != std::errc{} || ptr != last || text.empty()) return wrong();
      return v;
    }
    case KeyType::Float: {
      double v = 0;
      auto [ptr, ec] = std::from_chars(first, last, v);
      if (ec != std::errc{} || ptr != last || text.empty() || !std::isfinite(v)) return wrong();
      return v;
    }
    case KeyType::Bool:
      if (text == "true") return true;
      if (text == "false") return false;
      return wrong();
    case KeyType::String:
      return text;
    case KeyType::StringList:
      return split_list(key, text, where);
  }
  return wrong();
}

inline void apply_command_line(JobConfig& c, Origins& origins, const CommandLine& cl) {
  const std::string where = "command line";
  for (const auto& o : cl.overrides) {
    write_value(*o.key, c, value_from_text(*o.key, o.value, where));
    origins.by_key[std::string(o.key->name)] = where;
  }
}

// ---- checks ---------------------------------------------------------------------------

inline std::string describe_range(const ConfigKey& k) {
  std::ostringstream s;
  if (k.min && k.max) {
    s << "in " << (k.min_open ? "(" : "[") << *k.min << ", " << *k.max << (k.max_open ? ")" : "]");
  } else if (k.min) {
    if (*k.min == 0 && k.min_open)
      s << "positive";
    else
      s << (k.min_open ? "> " : ">= ") << *k.min;
  } else if (k.max) {
    s << (k.max_open ? "< " : "<= ") << *k.max;
  }
  return s.str();
}

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
  if (k.type == KeyType::StringList && !k.choices.empty())  // each item among the choices
    for (const std::string& s : std::get<std::vector<std::string>>(v))
      if (std::find(k.choices.begin(), k.choices.end(), s) == k.choices.end())
        fail(where, ": ", k.name, ": each item must be one of ", join(k.choices, ", "), "; got ", quote(s));
}

inline void finalize(JobConfig& c, const Origins& o, std::string_view model_where) {
  for (const auto& k : config_keys()) check_key(k, c, o.of(k.name));

  // [model]: the flavor, the overrides on top, then the shape checks.
  try {
    c.model.args = nn::model_flavor(c.model.flavor);
  } catch (const Error& e) {
    fail(o.of("model.flavor"), ": ", e.what());
  }
  for (const auto& k : config_keys())
    if (k.apply_to_args) k.apply_to_args(c);
  c.model.args.validate(tessera::detail::concat(model_where, ": [model]"));

  // Rules that tie keys together.
  const auto& t = c.training;
  TESSERA_CHECK(t.seq_len <= c.model.args.max_seq_len, o.of("training.seq_len"), ": training.seq_len (", t.seq_len,
                ") exceeds the model's max_seq_len (", c.model.args.max_seq_len, ") of flavor ", c.model.flavor,
                "; raise model.max_seq_len or lower training.seq_len");
  TESSERA_CHECK(t.dataset != "shard" || !t.dataset_path.empty(), o.of("training.dataset"),
                ": training.dataset_path is required when training.dataset = \"shard\" (a token shard made by "
                "llama-tokenize)");
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

inline JobConfig build(std::string_view text, std::string_view source, const CommandLine& cl) {
  JobConfig c;
  Origins origins;
  origins.fallback = source.empty() ? "command line" : std::string(source);
  if (!source.empty() || !text.empty()) apply_toml(c, origins, text, source.empty() ? "config" : source);
  apply_command_line(c, origins, cl);
  finalize(c, origins, origins.fallback);
  return c;
}

}  // namespace detail

/// Resolves config.model.args from the flavor and the [model] overrides and checks every
/// value, for a JobConfig built in code; errors name `source`.
inline void finalize_config(JobConfig& config, std::string_view source = "config") {
  detail::Origins origins;
  origins.fallback = std::string(source);
  detail::finalize(config, origins, source);
}

/// A config from TOML text (errors name `source_name`), then the --section.key overrides
/// in `args`. --config / --job.config_file are not accepted here: use load_config.
inline JobConfig parse_config(std::string_view toml_text, std::string_view source_name,
                              const std::vector<std::string>& args = {}) {
  auto cl = detail::parse_command_line(args);
  TESSERA_CHECK(!cl.config_file, "command line: --config is only read by load_config");
  return detail::build(toml_text, source_name, cl);
}

/// A config from the TOML file `path` (may be empty: defaults only), then the command-line
/// words `args` (after the program name): --section.key value, --section.key=value, bare
/// boolean --section.key, and --config PATH / --job.config_file PATH, which select the
/// file instead of `path`.
inline JobConfig load_config(const std::string& path, const std::vector<std::string>& args = {}) {
  auto cl = detail::parse_command_line(args);
  std::string file = cl.config_file ? *cl.config_file : path;
  if (file.empty()) return detail::build({}, {}, cl);
  std::error_code ec;
  auto status = std::filesystem::status(file, ec);
  TESSERA_CHECK(std::filesystem::exists(status), file, ": config file not found");
  TESSERA_CHECK(!std::filesystem::is_directory(status), file, ": is a folder, not a TOML config file");
  std::ifstream in(file, std::ios::binary);
  TESSERA_CHECK(in.good(), file, ": cannot open config file");
  std::ostringstream text;
  text << in.rdbuf();
  TESSERA_CHECK(!in.bad(), file, ": cannot read config file");
  return detail::build(text.str(), file, cl);
}

/// True when every key has the same value (model.args follows from them).
inline bool operator==(const JobConfig& a, const JobConfig& b) {
  for (const auto& k : config_keys())
    if (!detail::same_value(k, a, b)) return false;
  return true;
}

/// The effective configuration as TOML, every key; load_config reads it back equal.
/// Unset optional keys are written as comments saying what unset means.
inline std::string to_toml(const JobConfig& c) {
  std::string out = "# tessera job configuration: every key, with its effective value.\n";
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section() != section) {
      section = k.section();
      out += tessera::detail::concat("\n[", section, "]\n");
    }
    detail::Value v = detail::read_value(k, c);
    if (std::holds_alternative<std::monostate>(v)) {
      out += tessera::detail::concat("# ", k.key(), ": unset, ", k.unset_means);
      if (k.args_value) out += tessera::detail::concat(" (", k.args_value(c), ")");
      out += "\n";
    } else {
      out += tessera::detail::concat(k.key(), " = ", detail::format_value(v), "\n");
    }
  }
  return out;
}

/// Every key with its type, default and meaning (for --help).
inline std::string config_help() {
  const JobConfig defaults;
  std::string out =
      "Configuration: a TOML file given with --config FILE (or --job.config_file FILE), then\n"
      "--section.key VALUE or --section.key=VALUE on the command line, which win over the file.\n"
      "A boolean may be given bare (--section.key means true). An optional key takes 'none'.\n"
      "A string list takes comma-separated items (--section.key a,b); an empty value is the empty list.\n";
  std::string_view section;
  for (const auto& k : config_keys()) {
    if (k.section() != section) {
      section = k.section();
      out += tessera::detail::concat("\n[", section, "]\n");
    }
    detail::Value v = detail::read_value(k, defaults);
    std::string def = std::holds_alternative<std::monostate>(v)
                          ? tessera::detail::concat("unset: ", k.unset_means)
                          : detail::format_value(v);
    out += tessera::detail::concat("  --", k.name, " <", key_type_name(k.type), k.optional ? ", optional" : "", ">  (default ",
                                   def, ")\n");
    out += tessera::detail::concat("      ", k.help);
    if (!k.choices.empty()) out += tessera::detail::concat(" One of: ", detail::join(k.choices, ", "), ".");
    std::string range = detail::describe_range(k);
    if (!range.empty())
      out += tessera::detail::concat(" Must be ", k.minus_one_means.empty() ? "" : "-1 (", k.minus_one_means,
                                     k.minus_one_means.empty() ? "" : ") or ", range, ".");
    out += "\n";
  }
  return out;
}

}  // namespace tessera::train
