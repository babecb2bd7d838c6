// The training job's configuration as plain structs: one per torchtitan TOML section,
// with torchtitan's defaults. Parsing, overrides and the key table are in
// train/config.hpp; code that only reads a JobConfig (the Trainer) includes this
// header alone, so it compiles without the TOML parser (under nvcc too).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/layer/args.hpp"

namespace tessera::train {

// ---------------------------------------------------------------------------------------
// The sections. Field names are the TOML keys; initial values are the defaults.

/// [job]
struct JobSection {
  std::string dump_folder = "./outputs";
  std::string description;
  bool print_config = false;
};

/// [model]: a flavor and optional overrides of its fields. `args` is not a key: it is
/// resolved by load_config / parse_config / finalize_config.
struct ModelSection {
  /// torchtitan's model name ("llama3", "llama2"): with it, `flavor` may be torchtitan's
  /// ("8B", "70B", "405B"; "7B", "13B", "70B"), resolved to tessera's in finalize. Empty: none.
  std::string name;
  std::string flavor = "debugmodel";
  std::optional<std::int64_t> dim;
  std::optional<std::int64_t> n_layers;
  std::optional<std::int64_t> n_heads;
  std::optional<std::int64_t> n_kv_heads;
  std::optional<std::int64_t> vocab_size;
  std::optional<std::int64_t> multiple_of;
  std::optional<double> ffn_dim_multiplier;
  std::optional<std::int64_t> ffn_hidden;
  std::optional<double> rope_theta;
  std::optional<double> norm_eps;
  std::optional<std::int64_t> max_seq_len;
  std::optional<bool> tie_embeddings;
  std::string tokenizer = "byte";
  /// torchtitan's folder of Hugging Face assets: the tokenizer's, unless model.tokenizer is given.
  std::string hf_assets_path;
  /// What is swapped into the model: "float8" trains its linear layers' GEMMs in float8
  /// as [float8] says (torchtitan's model.converters).
  std::vector<std::string> converters;
  /// tessera's: attention's wq, wk and wv, and the feed-forward's w1 and w3, stored side
  /// by side and run as one GEMM a direction (parallel::Plan::fuse_projections).
  bool fuse_projections = true;
  nn::ModelArgs args{};  // nn::model_flavor(flavor) with the overrides above applied
};

/// [optimizer]
struct OptimizerSection {
  std::string name = "AdamW";
  double lr = 8e-4;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  std::string state_dtype = "float32";  // dtype the AdamW moments are stored in
  bool early_step_in_backward = false;    // each unit updated as its gradient is reduced (Plan::early_step)
};

/// [lr_scheduler]: linear warmup, then (warmup-stable-decay) a decay phase.
struct LrSchedulerSection {
  std::int64_t warmup_steps = 200;
  std::optional<double> decay_ratio;  // unset: decay starts right after warmup
  std::string decay_type = "linear";
  double min_lr_factor = 0.0;
};

/// [training]
struct TrainingSection {
  std::int64_t local_batch_size = 8;
  std::int64_t global_batch_size = -1;  // -1: local_batch_size x data-parallel degree
  std::int64_t seq_len = 2048;
  std::int64_t steps = 10000;
  double max_norm = 1.0;  // <= 0: no gradient clipping
  std::int64_t seed = 0;
  bool deterministic = false;
  std::string device = "auto";  // "auto": cuda where built with CUDA and a GPU is visible, else cpu
  std::string attention = "auto";  // on the GPU: "auto" (cudnn where it can run), "cudnn" or "tessera"
  bool expandable_segments = true;  // on the GPU: the caching allocator's large pool grows one segment
  bool cuda_graph = false;           // steps after the first replay a captured graph of the step
  bool enable_cpu_offload = false;   // FSDP's shards, gradients and optimizer state in host memory
  bool document_mask = false;        // packed documents (split at BOS) do not attend to each other
  /// "auto": the model's element type, nothing rounded (llama-train: a bf16 model on a
  /// GPU, torchtitan's default; float32 on the CPU); "bfloat16" on a float32 model: bf16
  /// parameter values with float32 masters.
  std::string mixed_precision_param = "auto";
  std::string mixed_precision_reduce = "float32";
  std::string dataset = "synthetic";  // "synthetic" (embedded corpus), "shard" or "chat"
  // The token shards ("shard") or JSON lines files ("chat"), each a file or a glob pattern;
  // read one after another, or mixed by dataset_weights (one weight per entry).
  std::vector<std::string> dataset_path;
  std::vector<double> dataset_weights;  // empty: the entries read in order, as one stream
  std::string packing = "concat_then_split";  // or "first_fit": whole documents in each row
  bool shuffle = false;  // each epoch's windows in an order drawn from training.seed
  std::string chat_format = "auto";   // "chat": llama3, llama2, or auto (from the tokenizer)
  std::int64_t synthetic_documents = 20000;
};

/// [validation]: torchtitan's. A loss over held-out data every `freq` steps, without
/// gradients, under the training's layout.
struct ValidationSection {
  bool enable = false;
  std::string dataset = "synthetic";  // as training.dataset; "synthetic": documents training never reads
  std::vector<std::string> dataset_path;  // as training.dataset_path, read one after another
  std::int64_t freq = 10;
  std::int64_t steps = -1;  // -1: the whole set once, in whole global batches
  std::int64_t local_batch_size = 8;
  std::int64_t seq_len = 2048;
  std::int64_t synthetic_documents = 200;  // "synthetic": how many held-out documents
};

/// [parallelism]
struct ParallelismSection {
  std::int64_t data_parallel_replicate_degree = 1;
  std::int64_t data_parallel_shard_degree = -1;  // -1: the ranks the other degrees leave
  std::int64_t tensor_parallel_degree = 1;
  std::int64_t pipeline_parallel_degree = 1;
  std::int64_t context_parallel_degree = 1;
  std::string context_parallel_rotate_method = "alltoall";  // the ring; "allgather": every rank's keys at once
  std::string context_parallel_load_balancer = "headtail";  // "none": each rank a part of the sequence in order
  bool disable_loss_parallel = false;
  bool disable_sequence_parallel = false;
  bool enable_async_tensor_parallel = false;  // parallel::Plan::async_tensor_parallel
  std::string pipeline_parallel_schedule = "1F1B";
  std::string pipeline_parallel_schedule_csv;  // the order of PipelineScheduleSingle/Multi; "": none
  std::int64_t pipeline_parallel_microbatch_size = 1;
  std::string fsdp_reshard_after_forward = "default";
  std::vector<std::string> pipeline_parallel_split_points;  // empty: the even split
  std::optional<std::int64_t> pipeline_parallel_layers_per_stage;  // unset: the schedule's stages per rank
  std::int64_t pipeline_parallel_first_stage_less_layers = 1;  // the layers the embedding counts as
  std::int64_t pipeline_parallel_last_stage_less_layers = 1;   // the layers the output counts as
};

/// [activation_checkpoint]
struct ActivationCheckpointSection {
  std::string mode = "none";  // torchtitan defaults to selective; tessera to none until the Checkpoint policies land
  std::string selective_ac_option = "2";  // "op" or every N-th layer
  bool recompute_swiglu = false;          // tessera's: the feed-forward's SwiGLU output remade in the backward
};

/// [float8]: torchtitan's, read when model.converters holds "float8".
struct Float8Section {
  std::string recipe_name = "tensorwise";
  bool enable_fsdp_float8_all_gather = false;
  bool enable_tp_float8_all_gather = true;  // tessera's: the sequence-parallel gathers in float8
  bool precompute_float8_dynamic_scale_for_fsdp = false;
  std::vector<std::string> filter_fqns = {"output"};
  bool emulate = false;
};

/// [lora]: torchtitan's LoRA converter, read when model.converters holds "lora"
/// (layer/lora.hpp).
struct LoraSection {
  std::int64_t rank = 8;
  double alpha = 16.0;
  std::vector<std::string> target_modules;  // empty: every linear layer
};

/// [checkpoint]
struct CheckpointSection {
  bool enable = false;
  std::string folder = "checkpoint";
  std::int64_t interval = 500;
  std::int64_t load_step = -1;  // -1: the latest complete checkpoint
  bool enable_first_step_checkpoint = false;  // also save after the first step (checks saving works)
  bool create_seed_checkpoint = false;  // write step-0 (the initialised model and fresh state) and exit
  std::vector<std::string> exclude_from_loading;
  std::string async_mode = "disabled";
  bool last_save_model_only = true;
  std::string export_dtype = "float32";
  std::int64_t keep_latest_k = 10;
  std::string initial_load_path;
  bool initial_load_in_hf = false;
  bool last_save_in_hf = false;
};

/// [metrics]
struct MetricsSection {
  std::int64_t log_freq = 10;
  bool enable_tensorboard = false;
  std::string save_tb_folder = "tb";
  double peak_tflops = 0.0;  // 0: the device's known peak
  bool enable_wandb = false;            // torchtitan's: true is refused (an online service)
  bool disable_color_printing = false;  // torchtitan's: tessera's lines have no colors
};

/// [profiling]: a timeline of some steps, one file per rank (core/profile.hpp), and
/// memory snapshots (io/memory_snapshot.hpp).
struct ProfilingSection {
  bool enable_profiling = false;
  std::string save_traces_folder = "profile_trace";  // inside job.dump_folder
  std::int64_t profile_freq = 10;  // every this many steps (the steps that are multiples of it)
  bool enable_memory_snapshot = false;  // the device allocator's history and state (core/memory_history.hpp)
  std::string save_memory_snapshot_folder = "memory_snapshot";  // inside job.dump_folder
};

/// [comm]: how long the ranks wait for each other (torchtitan's keys), and the NCCL-rules check.
struct CommSection {
  /// The start: the rendezvous at MASTER_ADDR:MASTER_PORT, the NCCL id exchange,
  /// ncclCommInitRank and the mesh's communicator splits, each.
  std::int64_t init_timeout_seconds = 300;
  /// One collective, from its issue to its completion (NCCL's watchdog, the thread
  /// ranks' wait); past it every rank ends with an error naming the operation.
  std::int64_t train_timeout_seconds = 600;
  /// Hold the CPU engines (thread ranks, MPI) to what NCCL requires (comm/nccl_rules.hpp):
  /// device buffers only, no tags, results read only after their wait, sends that wait
  /// for their receiver. What runs this way will not deadlock or read garbage on NCCL.
  bool check_nccl_semantics = false;
  /// For testing only: several NCCL processes on one GPU (more ranks than GPUs). Each
  /// rank tells NCCL it is a host of its own (NCCL_HOSTID), so NCCL accepts them and
  /// moves data over sockets on the loopback interface: slow, but every NCCL call runs.
  bool share_gpu = false;
  /// The flight recorder: the last this many collectives of each rank, written when the
  /// run fails (comm/flight_recorder.hpp); 0 records none.
  std::int64_t trace_buf_size = 20000;
  std::string save_traces_folder = "comm_traces";  // inside job.dump_folder
};

/// torchtitan's [compile]: torch.compile of the model and the loss. tessera's step is
/// compiled C++ already; the keys are read so that torchtitan's files load, and do nothing.
struct CompileSection {
  bool enable = false;
  std::vector<std::string> components = {"model", "loss"};
};

/// [debug]: torchtitan's structured logging, a per-rank log of the run's phases
/// (train/rank_log.hpp).
struct DebugSection {
  bool enable_structured_logging = false;
};

/// torchtitan's datasets, which it streams from the Hugging Face Hub: a config may name
/// them (llama-plan reads no data); a run that would read one is refused
/// (train/dataset.hpp).
inline bool hub_dataset(std::string_view name) {
  return name == "c4" || name == "c4_test" || name == "c4_validation";
}

struct JobConfig {
  JobSection job;
  ModelSection model;
  OptimizerSection optimizer;
  LrSchedulerSection lr_scheduler;
  TrainingSection training;
  ParallelismSection parallelism;
  ActivationCheckpointSection activation_checkpoint;
  Float8Section float8;
  LoraSection lora;
  CheckpointSection checkpoint;
  MetricsSection metrics;
  ProfilingSection profiling;
  ValidationSection validation;
  CommSection comm;
  CompileSection compile;
  DebugSection debug;
};

/// Whether model.converters asks for float8 GEMMs ([float8]).
inline bool float8_enabled(const JobConfig& c) {
  for (const std::string& name : c.model.converters)
    if (name == "float8") return true;
  return false;
}

/// Whether model.converters asks for LoRA adapters ([lora]).
inline bool lora_enabled(const JobConfig& c) {
  for (const std::string& name : c.model.converters)
    if (name == "lora") return true;
  return false;
}

/// The parameters' dtype training.mixed_precision_param asks for; none for "auto" (the
/// model's own element type).
inline std::optional<DType> param_dtype(const JobConfig& c) {
  if (c.training.mixed_precision_param == "auto") return std::nullopt;
  return parse_dtype(c.training.mixed_precision_param, "training.mixed_precision_param");
}

/// training.mixed_precision_param with "auto" made what a binary trains: "bfloat16" for a
/// model on a GPU (a bf16 model, as torchtitan trains), "float32" on the CPU.
inline void resolve_mixed_precision(JobConfig& c, bool on_gpu) {
  if (c.training.mixed_precision_param == "auto") c.training.mixed_precision_param = on_gpu ? "bfloat16" : "float32";
}

}  // namespace tessera::train
