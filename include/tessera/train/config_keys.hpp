// The key table: every configuration key once, in the order of its section, with its
// field in JobConfig, its meaning and the values it accepts; and the key and the sections
// looked up by name.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/layer/args.hpp"
#include "tessera/parallel/schedule_kind.hpp"
#include "tessera/train/config_field.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::train {

namespace detail {

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
  /// A string list that may also be given as one plain string (a path: the list of it).
  KeyBuilder& or_one_string() {
    k.one_string_is_a_list = true;
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
  std::vector<std::string_view> schedule_names;
  for (parallel::ScheduleKind k : parallel::kScheduleKinds) schedule_names.emplace_back(parallel::name_of(k));
  for (parallel::ScheduleKind k : parallel::kFileScheduleKinds) schedule_names.emplace_back(parallel::name_of(k));
  std::vector<KeyBuilder> b = {
      // [job]
      make_key("job.dump_folder", field<&J::job, &JobSection::dump_folder>(),
               "Folder for everything the job writes (checkpoints, metrics, TensorBoard)."),
      make_key("job.description", field<&J::job, &JobSection::description>(), "Free text describing the job."),
      make_key("job.print_config", field<&J::job, &JobSection::print_config>(),
               "Print the effective configuration as TOML at start-up."),
      // [model]
      make_key("model.name", field<&J::model, &M::name>(),
               "torchtitan's model name: with \"llama3\", model.flavor may be torchtitan's \"8B\", \"70B\" or "
               "\"405B\" (Llama 3.1's shapes: llama3.1_8b, ...); with \"llama2\", \"7B\", \"13B\" or \"70B\". "
               "Empty: model.flavor is tessera's name.")
          .one_of({"", "llama3", "llama2"}),
      make_key("model.flavor", field<&J::model, &M::flavor>(),
               "Model flavor (debugmodel, llama2_7b, ..., llama3.1_405b, llama3.2_3b; torchtitan's with model.name)."),
      model_key<&M::dim, &A::dim>("model.dim", "Override: model width.").positive(),
      model_key<&M::n_layers, &A::n_layers>("model.n_layers", "Override: number of transformer blocks.")
          .positive(),
      model_key<&M::n_heads, &A::n_heads>("model.n_heads", "Override: attention heads (must divide dim).")
          .positive(),
      model_key<&M::n_kv_heads, &A::n_kv_heads>(
          "model.n_kv_heads",
          "Override: key/value heads for grouped-query attention (0: n_heads; must divide n_heads).")
          .at_least(0),
      model_key<&M::vocab_size, &A::vocab_size>("model.vocab_size", "Override: vocabulary size.").positive(),
      model_key<&M::multiple_of, &A::multiple_of>("model.multiple_of",
                                                  "Override: the feed-forward hidden size is rounded up to this.")
          .positive(),
      model_key<&M::ffn_dim_multiplier, &A::ffn_dim_multiplier>(
          "model.ffn_dim_multiplier", "Override: feed-forward hidden size multiplier (0: none).")
          .at_least(0),
      model_key<&M::ffn_hidden, &A::ffn_hidden>(
          "model.ffn_hidden",
          "Override: the feed-forward hidden size itself (Hugging Face's intermediate_size; 0: derived).")
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
               "(Llama 3) or SentencePiece (Llama 2) tokenizer.model file, or a Hugging Face model directory "
               "holding one."),
      make_key("model.hf_assets_path", field<&J::model, &M::hf_assets_path>(),
               "torchtitan's folder of Hugging Face assets: the tokenizer is read from it (tokenizer.json, "
               "tokenizer.model) unless model.tokenizer is given, and with checkpoint.initial_load_in_hf the weights "
               "unless checkpoint.initial_load_path is given."),
      make_key("model.converters", field<&J::model, &M::converters>(),
               "What is swapped into the model: \"float8\" trains the linear layers' GEMMs in float8 as "
               "[float8] says (a bfloat16 model: training.mixed_precision_param = \"bfloat16\"); \"lora\" adds "
               "LoRA adapters to the linear layers [lora] names and freezes everything else. Empty: nothing.")
          .one_of({"float8", "lora"}),
      make_key("model.fuse_projections", field<&J::model, &M::fuse_projections>(),
               "tessera's: attention's wq, wk and wv, and the feed-forward's w1 and w3, stored side by side and "
               "each group run as one GEMM a direction (checkpoints and exports unchanged). false: one GEMM a "
               "weight, as torchtitan runs them."),
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
      make_key("optimizer.early_step_in_backward", field<&J::optimizer, &OptimizerSection::early_step_in_backward>(),
               "torchtitan's optimizer in the backward: AdamW updates each sharding unit (the embedding, a block, "
               "the head) in the last micro-batch's backward as soon as the unit's gradient is reduced, and the "
               "unit's gradient shard is freed, so a step never holds the whole gradient (4 bytes a parameter "
               "less at the peak on one rank, 4 / the shard degree under FSDP). Nothing can be clipped, since "
               "the whole gradient's norm comes after the updates: needs training.max_norm = 0 (the norm is still "
               "reported). One rank, or TP or CP alone, runs as FSDP over itself. Refused with pipeline "
               "parallelism and training.cuda_graph. Without clipping, the same losses as without it, bit for bit."),
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
      make_key("training.cuda_graph", field<&J::training, &TrainingSection::cuda_graph>(),
               "Capture the second step as a CUDA graph and replay it for every later step: one launch in place "
               "of each step's thousand kernel launches. One rank (no data, tensor, pipeline or context "
               "parallelism) and batches of one shape; on the CPU backend the same capture runs as recorded "
               "calls. llama-plan prices the eager step."),
      make_key("training.enable_cpu_offload", field<&J::training, &TrainingSection::enable_cpu_offload>(),
               "FSDP's CPU offload (torchtitan's key): each rank's shards of the parameters, their gradients and "
               "AdamW's moments and masters live in host memory (page-locked on a GPU) and the optimizer step runs "
               "on the host's cores; each gather copies the shard to the device first, each reduced gradient "
               "shard goes back. The device keeps only what a step gathers and computes. Needs FSDP or HSDP "
               "(one rank counts as FSDP over itself); refused with DDP alone and with training.cuda_graph. "
               "The same losses as without it, bit for bit; llama-plan prices the copies at the host link's rate "
               "and the optimizer at the host's memory rate."),
      make_key("training.document_mask", field<&J::training, &TrainingSection::document_mask>(),
               "Packed documents do not see each other (torchtitan's document-masked attention): a document starts "
               "at each BOS input (and at each sequence's first token), attends only within itself, its RoPE "
               "positions restart at 0, and the target that is the next document's BOS is not counted. On the GPU "
               "cuDNN runs it as variable-length attention (each document one sequence) where training.attention "
               "chooses cuDNN; under context parallelism the ring's blocks run tessera's kernels."),
      make_key("training.mixed_precision_param", field<&J::training, &TrainingSection::mixed_precision_param>(),
               "Dtype of parameters in forward and backward: \"auto\" (the model's own: llama-train trains a "
               "bf16 model on a GPU and a float32 one on the CPU), \"bfloat16\" (bf16 values, float32 masters in "
               "the optimizer; on the CPU, bf16 values in float32 arithmetic) or \"float32\".")
          .one_of({"auto", "float32", "bfloat16"}),
      make_key("training.mixed_precision_reduce", field<&J::training, &TrainingSection::mixed_precision_reduce>(),
               "Dtype of gradient reductions across data-parallel ranks.")
          .one_of({"float32"}),
      make_key("training.dataset", field<&J::training, &TrainingSection::dataset>(),
               "\"synthetic\": the embedded corpus; \"shard\": a token shard file made by llama-tokenize "
               "(training.dataset_path; a chat shard's loss mask is kept); \"chat\": JSON lines of "
               "conversations ({\"messages\": [...]}, training.dataset_path) tokenized at the start in "
               "training.chat_format, the loss on the assistants' replies only. torchtitan's \"c4\" and "
               "\"c4_test\" are accepted in a config (llama-plan reads no data); a run refuses them, saying how to "
               "make a shard of the text.")
          .one_of({"synthetic", "shard", "chat", "c4", "c4_test"}),
      make_key("training.dataset_path", field<&J::training, &TrainingSection::dataset_path>(),
               "The token shards (dataset = \"shard\") or JSON lines files (dataset = \"chat\"): one path, or a "
               "list of them, each a file or a glob pattern (\"c4/*.tshard\": its files in name order). Read one "
               "after another as one stream, or mixed by dataset_weights. Shards are read where they lie (mapped, "
               "not loaded).")
          .or_one_string(),
      make_key("training.dataset_weights", field<&J::training, &TrainingSection::dataset_weights>(),
               "A weight per dataset_path entry: each global batch's windows are dealt from the entries in these "
               "proportions (in any units), each entry wrapping by itself; empty: the entries read in order, as "
               "one stream.")
          .positive(),
      make_key("training.packing", field<&J::training, &TrainingSection::packing>(),
               "How the data becomes rows of seq_len + 1 tokens, for training and validation: "
               "\"concat_then_split\" cuts the stream into consecutive windows (a document may span two); "
               "\"first_fit\" keeps each document (BOS to the next BOS) whole in one row, in the first of 8 "
               "open rows with room, the rest of a row padded and not counted, a document longer than a row left "
               "out (torchtitan's FirstFitPacking, what its fine-tuning uses). With training.document_mask the "
               "documents of a row then train as they would alone.")
          .one_of({"concat_then_split", "first_fit"}),
      make_key("training.shuffle", field<&J::training, &TrainingSection::shuffle>(),
               "Read each epoch's windows (or first-fit rows) in an order of their own drawn from training.seed, "
               "each dataset_path entry of a mix apart; false: in the order they lie. The same on every rank "
               "and after a resume. Validation is never shuffled."),
      make_key("training.chat_format", field<&J::training, &TrainingSection::chat_format>(),
               "Chat format of dataset = \"chat\": \"llama3\", \"llama2\", or \"auto\" (llama3 when the "
               "tokenizer has Llama 3's header tokens, else llama2).")
          .one_of({"auto", "llama3", "llama2"}),
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
      make_key("parallelism.tensor_parallel_degree",
               field<&J::parallelism, &ParallelismSection::tensor_parallel_degree>(),
               "Tensor-parallel ranks.")
          .at_least(1),
      make_key("parallelism.pipeline_parallel_degree",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_degree>(), "Pipeline stages.")
          .at_least(1),
      make_key("parallelism.context_parallel_degree",
               field<&J::parallelism, &ParallelismSection::context_parallel_degree>(),
               "Context-parallel ranks: each sequence split over them, attention as a ring. training.seq_len must be a "
               "multiple of 2 x the degree.")
          .at_least(1),
      make_key("parallelism.context_parallel_rotate_method",
               field<&J::parallelism, &ParallelismSection::context_parallel_rotate_method>(),
               "How context parallelism brings every rank's keys and values: \"alltoall\" round the ring, one "
               "neighbour's at a time beside the attention; \"allgather\" all at once (cp times the keys held).")
          .one_of({"alltoall", "allgather"}),
      make_key("parallelism.context_parallel_load_balancer",
               field<&J::parallelism, &ParallelismSection::context_parallel_load_balancer>(),
               "Which chunks of each sequence a context-parallel rank holds: \"headtail\" (of 2 x degree chunks, "
               "rank i the i-th and the i-th from the end, so under the causal mask every rank attends over as many "
               "keys) or \"none\" (rank i the i-th part, in order: the last rank attends over the most and sets the "
               "pace). torchtitan's key; its \"ptrr\" balances FlexAttention's masks and is refused.")
          .one_of({"headtail", "none"}),
      make_key("parallelism.disable_loss_parallel",
               field<&J::parallelism, &ParallelismSection::disable_loss_parallel>(),
               "Gather the logits before the loss instead of computing it on vocabulary shards."),
      make_key("parallelism.disable_sequence_parallel",
               field<&J::parallelism, &ParallelismSection::disable_sequence_parallel>(),
               "With tensor parallelism, hold every row on every rank between the blocks' regions (norms and "
               "residual adds on every row, all-reduces at the regions) instead of splitting the rows."),
      make_key("parallelism.enable_async_tensor_parallel",
               field<&J::parallelism, &ParallelismSection::enable_async_tensor_parallel>(),
               "With tensor and sequence parallelism, cut each region's all-gather and reduce-scatter into one "
               "transfer per peer, each beside the GEMM on the rows already there (torchtitan's asynchronous "
               "tensor parallelism)."),
      make_key("parallelism.pipeline_parallel_schedule",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_schedule>(), "Pipeline schedule.")
          .one_of(schedule_names),
      make_key("parallelism.pipeline_parallel_schedule_csv",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_schedule_csv>(),
               "A CSV file of each pipeline rank's actions in order (PyTorch's format: a row per rank, cells such as "
               "2F0, 1B3, 0I1, 0W1), run with pipeline_parallel_schedule = PipelineScheduleSingle or "
               "PipelineScheduleMulti; empty: none."),
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
      make_key("parallelism.pipeline_parallel_layers_per_stage",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_layers_per_stage>(),
               "Layers per pipeline stage (the embedding and the output counted by the two keys below): the stage "
               "count is the layers over this, rounded up, and must be a multiple of pipeline_parallel_degree.")
          .positive()
          .unset_means("the schedule file's stages per rank; else 1 for GPipe, 1F1B and PipelineScheduleSingle, 2 "
                       "for the others"),
      make_key("parallelism.pipeline_parallel_first_stage_less_layers",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_first_stage_less_layers>(),
               "How many layers the embedding counts as when the blocks are split over the stages: the first stage "
               "holds that many blocks fewer.")
          .at_least(0),
      make_key("parallelism.pipeline_parallel_last_stage_less_layers",
               field<&J::parallelism, &ParallelismSection::pipeline_parallel_last_stage_less_layers>(),
               "How many layers the output (final norm and head) counts as when the blocks are split over the "
               "stages: the last stage holds that many blocks fewer.")
          .at_least(0),
      // [activation_checkpoint]
      make_key("activation_checkpoint.mode", field<&J::activation_checkpoint, &ActivationCheckpointSection::mode>(),
               "Recompute activations in backward: none, full (every block) or selective.")
          .one_of({"none", "full", "selective"}),
      make_key("activation_checkpoint.selective_ac_option",
               field<&J::activation_checkpoint, &ActivationCheckpointSection::selective_ac_option>(),
               "Selective mode: \"op\" (keep matmul outputs, recompute the rest) or N (every N-th block)."),
      make_key("activation_checkpoint.recompute_swiglu",
               field<&J::activation_checkpoint, &ActivationCheckpointSection::recompute_swiglu>(),
               "Do not keep the feed-forward's SwiGLU output (w2's input) for the backward: make it again there "
               "from the two projections kept (one elementwise pass a block; a hidden size less a token a block)."),
      // [float8]
      make_key("float8.recipe_name", field<&J::float8, &Float8Section::recipe_name>(),
               "torchao's recipe: tensorwise (a scale per tensor; gradients in e5m2), rowwise (a scale per row or "
               "column along each GEMM's reduction, powers of two, all e4m3) or rowwise_with_gw_hp (rowwise, the "
               "weight gradient in the model's precision).")
          .one_of({"tensorwise", "rowwise", "rowwise_with_gw_hp"}),
      make_key("float8.enable_fsdp_float8_all_gather",
               field<&J::float8, &Float8Section::enable_fsdp_float8_all_gather>(),
               "Cast each FSDP shard to float8 before the all-gather (half the bytes; tensorwise only)."),
      make_key("float8.enable_tp_float8_all_gather",
               field<&J::float8, &Float8Section::enable_tp_float8_all_gather>(),
               "Under tensor parallelism with sequence parallelism (tensorwise): gather a float8 layer's input and "
               "wo's and w2's output gradients as float8 values, each rank's rows cast by the agreed scale (half "
               "the bytes; the same values as gathering then casting). tessera's."),
      make_key("float8.precompute_float8_dynamic_scale_for_fsdp",
               field<&J::float8, &Float8Section::precompute_float8_dynamic_scale_for_fsdp>(),
               "With the float8 all-gather: every weight's scale from one all-reduce of amaxes after the "
               "optimizer step."),
      make_key("float8.filter_fqns", field<&J::float8, &Float8Section::filter_fqns>(),
               "Layers kept in the model's precision: each whose name contains one of these. \"auto_filter_small_kn\" "
               "also keeps the layers torchao finds too small for float8 to pay, by the recipe."),
      make_key("float8.emulate", field<&J::float8, &Float8Section::emulate>(),
               "Emulate the float8 GEMMs: the operands cast to float8 exactly as on a GPU, multiplied in float32 "
               "(the CPU, and GPUs before sm_89)."),
      // [lora]
      make_key("lora.rank", field<&J::lora, &LoraSection::rank>(),
               "The adapters' rank r: A is r x in, B is out x r (torchtitan's default 8)."),
      make_key("lora.alpha", field<&J::lora, &LoraSection::alpha>(),
               "The adapters' output is scaled by alpha / rank (torchtitan's default 16)."),
      make_key("lora.target_modules", field<&J::lora, &LoraSection::target_modules>(),
               "The linear layers that gain adapters, by the last part of their name: wq, wk, wv, wo, w1, w2, w3, "
               "output. Empty: all of them (torchtitan's default).")
          .one_of({"wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"}),
      // [checkpoint]
      make_key("checkpoint.enable", field<&J::checkpoint, &CheckpointSection::enable>(),
               "Save checkpoints (and resume from the latest one)."),
      make_key("checkpoint.folder", field<&J::checkpoint, &CheckpointSection::folder>(),
               "Checkpoint folder, inside job.dump_folder."),
      make_key("checkpoint.interval", field<&J::checkpoint, &CheckpointSection::interval>(),
               "Save every this many steps.")
          .positive(),
      make_key("checkpoint.enable_first_step_checkpoint",
               field<&J::checkpoint, &CheckpointSection::enable_first_step_checkpoint>(),
               "Also save right after the first step: a new cluster or storage shows at once that saving works."),
      make_key("checkpoint.create_seed_checkpoint", field<&J::checkpoint, &CheckpointSection::create_seed_checkpoint>(),
               "Write the initialised model (its seed, or initial_load_path) and its fresh training state as "
               "<dump_folder>/<folder>/step-0, and exit without training: a run with this job.dump_folder starts "
               "from it under any layout. Needs checkpoint.enable; refused where the folder holds a checkpoint."),
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
               "while the state is copied to host memory (page-locked on a GPU, kept from one save to the next), "
               "and a background thread writes the files; async_with_pinned_mem: the same (torchtitan's name for "
               "its pinned variant, which tessera's async always is).")
          .one_of({"disabled", "async", "async_with_pinned_mem"}),
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
               "Require initial_load_path to be a Hugging Face Llama directory (config.json + safetensors); "
               "without initial_load_path, model.hf_assets_path is that directory (torchtitan's rule)."),
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
      make_key("metrics.enable_wandb", field<&J::metrics, &MetricsSection::enable_wandb>(),
               "torchtitan's Weights & Biases logging. Read so that its files load; true is refused (an online "
               "service: metrics.enable_tensorboard writes the same scalars to local files)."),
      make_key("metrics.disable_color_printing", field<&J::metrics, &MetricsSection::disable_color_printing>(),
               "torchtitan's: its log lines without colors. tessera's have none; read, and changes nothing."),
      // [profiling]
      make_key("profiling.enable_profiling", field<&J::profiling, &ProfilingSection::enable_profiling>(),
               "Record a timeline of every profile_freq-th step (the step, each layer's forward and backward, each "
               "collective and its wait, each pipeline action, the loss head, the optimizer, the memory in use), "
               "one Chrome trace file per rank: <dump_folder>/<save_traces_folder>/iteration_<step>/"
               "rank<r>_trace.json."),
      make_key("profiling.save_traces_folder", field<&J::profiling, &ProfilingSection::save_traces_folder>(),
               "Folder of the timelines, inside job.dump_folder."),
      make_key("profiling.profile_freq", field<&J::profiling, &ProfilingSection::profile_freq>(),
               "Record the steps that are multiples of this (timelines and memory snapshots).")
          .positive(),
      make_key("profiling.enable_memory_snapshot", field<&J::profiling, &ProfilingSection::enable_memory_snapshot>(),
               "Record every block the device allocator hands out and takes back, and each segment, from the "
               "start, with where it was asked for (what it holds and the spans open), and after every "
               "profile_freq-th step write PyTorch's memory snapshot, one pickle per rank: "
               "<dump_folder>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle "
               "(pytorch.org/memory_viz draws it); a step that runs out of memory writes iteration_<step>_exit/."),
      make_key("profiling.save_memory_snapshot_folder",
               field<&J::profiling, &ProfilingSection::save_memory_snapshot_folder>(),
               "Folder of the memory snapshots, inside job.dump_folder."),
      // [validation]
      make_key("validation.enable", field<&J::validation, &ValidationSection::enable>(),
               "Compute a validation loss every validation.freq steps (and after the last): the mean cross-entropy "
               "of held-out data, no gradients, under the training's layout; in metrics.jsonl and TensorBoard as "
               "validation_loss."),
      make_key("validation.dataset", field<&J::validation, &ValidationSection::dataset>(),
               "As training.dataset: \"synthetic\" (documents of the embedded corpus that training never reads), "
               "\"shard\" or \"chat\" (validation.dataset_path; training.chat_format); torchtitan's "
               "\"c4_validation\" and \"c4_test\" as training.dataset says.")
          .one_of({"synthetic", "shard", "chat", "c4_validation", "c4_test"}),
      make_key("validation.dataset_path", field<&J::validation, &ValidationSection::dataset_path>(),
               "The validation token shards or chat JSON lines files: one path or a list, each a file or a glob "
               "pattern, read one after another.")
          .or_one_string(),
      make_key("validation.freq", field<&J::validation, &ValidationSection::freq>(),
               "Validate every this many steps.")
          .positive(),
      make_key("validation.steps", field<&J::validation, &ValidationSection::steps>(),
               "Global batches per validation.")
          .positive()
          .or_minus_one("the whole set once, in whole global batches"),
      make_key("validation.local_batch_size", field<&J::validation, &ValidationSection::local_batch_size>(),
               "Sequences per data-parallel rank in a validation batch.")
          .positive(),
      make_key("validation.seq_len", field<&J::validation, &ValidationSection::seq_len>(),
               "Tokens per validation sequence.")
          .positive(),
      make_key("validation.synthetic_documents", field<&J::validation, &ValidationSection::synthetic_documents>(),
               "Held-out documents of the embedded corpus (validation.dataset = \"synthetic\").")
          .positive(),
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
               "read only after their wait, sends that wait for their receiver. Refused on GPUs, where NCCL itself "
               "runs."),
      make_key("comm.share_gpu", field<&J::comm, &CommSection::share_gpu>(),
               "For testing only: several NCCL processes on one GPU (a launch of more ranks than GPUs). Each rank "
               "tells NCCL it is a host of its own (NCCL_HOSTID, unless set), so NCCL accepts ranks on one GPU and "
               "moves data over sockets on the loopback interface (NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1): slow, "
               "but every NCCL call runs on the device. Off: more ranks than GPUs are refused."),
      make_key("comm.trace_buf_size", field<&J::comm, &CommSection::trace_buf_size>(),
               "The flight recorder: each rank keeps its last this many collectives (group, number on the group, "
               "operation, bytes, the layer or pipeline action that issued it, and whether it waited for it) and "
               "writes them when the run fails: <dump_folder>/<save_traces_folder>/rank<r>_trace.json, which "
               "tools/comm_trace.py sets side by side to name the rank that stopped and where. 0 records none.")
          .at_least(0),
      make_key("comm.save_traces_folder", field<&J::comm, &CommSection::save_traces_folder>(),
               "Folder of the flight recorder's files, inside job.dump_folder."),
      // [compile]
      make_key("compile.enable", field<&J::compile, &CompileSection::enable>(),
               "torchtitan's torch.compile switch, read so that its files load: tessera's step is compiled C++ "
               "already, and this changes nothing (llama-train's start-up line says so when it is true)."),
      make_key("compile.components", field<&J::compile, &CompileSection::components>(),
               "torchtitan's: what torch.compile compiles (\"model\", \"loss\"). Read, and changes nothing.")
          .one_of({"model", "loss"}),
      // [debug]
      make_key("debug.enable_structured_logging", field<&J::debug, &DebugSection::enable_structured_logging>(),
               "A per-rank log of the run's phases, torchtitan's structured logging: a JSON line as each step, its "
               "batch fetch, micro-batches and optimizer, each validation and checkpoint starts and ends, in "
               "<dump_folder>/structured_logs/rank_<r>.jsonl (torchtitan's event names and fields), flushed as "
               "written, so a rank that hangs or dies leaves its last phase open. tools/rank_log.py reads the "
               "ranks side by side: the slowest rank of each phase, and what a rank left unfinished."),
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

}  // namespace tessera::train
