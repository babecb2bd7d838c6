// One rank of llama-train, written once for every model type: the checks, the model,
// the data, the trainer loop, the saves and the closing sample. llama_train.cpp runs it
// over the CPU backend; llama_train_cuda.cpp over the CUDA backend, in bf16 or fp32.
// What needs the TOML parser or the tokenizer libraries is done by the caller and handed
// over in RunInputs, so the CUDA side needs neither.
#pragma once

#include <fcntl.h>
#include <omp.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/folder.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/flight_recorder.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/core/memory_history.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/instances.hpp"
#include "tessera/io/memory_snapshot.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/train/closing_sample.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/job_config.hpp"
#include "tessera/train/rank_log.hpp"
#include "tessera/train/trainer.hpp"
#include "tessera/train/validate.hpp"

namespace tessera::llama_train {

namespace fs = std::filesystem;

/// The model llama-train builds (train/dynamic_model.hpp): every choice read at run time from
/// the config, through the Plan.
using tessera::DynamicBlock;
using tessera::DynamicModel;

/// What the caller prepared for every rank.
struct RunInputs {
  const train::JobConfig* config = nullptr;
  std::string config_toml;            // the effective config, written to <dump_folder>/config.toml
  const io::Tokenizer* tokenizer = nullptr;
  /// Writes the tokenizer's file to the path given; false when it has none ("byte").
  std::function<bool(const std::string&)> save_tokenizer_file;
  double peak_flops = 0;              // per device, for MFU
  std::int64_t sample_tokens = -1;    // the closing sample's length (--sample-tokens); 0: none, -1: the
                                      // default (train::closing_sample)
  std::string peak_text;              // "peak 77.0 GFLOP/s (measured sgemm, OpenBLAS Haswell kernels)"
  /// What each rank computes with, asked when the header is printed (after run_rank has
  /// set a thread rank's OpenMP team): "2 OpenMP threads each", "on one NVIDIA H200 ...".
  std::function<std::string()> compute_text;
  /// What a recorded step's spans also tell a device profiler (NVTX ranges on a GPU).
  profile::Annotations annotations;
};

/// The stages of a pipeline, in order, each with the pipeline rank `schedule` places it on:
/// "embedding + layers 0-2 (pp rank 0); layers 3-5 + output (pp rank 1)".
inline std::string describe_stages(const std::vector<parallel::StageRange>& stages, const parallel::Schedule& schedule) {
  std::string out;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const parallel::StageRange& r = stages[s];
    std::string stage;
    auto add = [&](const std::string& part) { stage += (stage.empty() ? "" : " + ") + part; };
    if (r.embedding) add("embedding");
    if (r.blocks() == 1) add("layer " + std::to_string(r.first_block));
    if (r.blocks() > 1) add("layers " + std::to_string(r.first_block) + "-" + std::to_string(r.end_block - 1));
    if (r.output) add("output");
    const int rank = schedule.rank_of(static_cast<int>(s));
    out += (out.empty() ? "" : "; ") + stage + " (pp rank " + std::to_string(rank) + ")";
  }
  return out;
}

/// A whole fp32 copy of `model`'s parameters on the CPU (inside with_whole_parameters),
/// for rank 0 to sample from alone: a plain model, LoRA's adapters merged into its weights
/// (train::for_each_merged_parameter), each parameter found by name.
template <class Model>
std::unique_ptr<nn::Transformer<float, Cpu>> whole_copy_on_cpu(Model& model, const nn::ModelArgs& a) {
  using T = typename Model::scalar_type;
  auto whole = std::make_unique<nn::Transformer<float, Cpu>>(a);
  std::map<std::string, nn::Parameter<float>*> into;
  whole->for_each_parameter([&](nn::Parameter<float>& q) { into[q.name] = &q; });
  train::for_each_merged_parameter(model, [&](nn::Parameter<T>& q, const Tensor<T>& host) {
    const auto it = into.find(q.name);
    TESSERA_CHECK(it != into.end() && it->second->numel() == host.numel(), q.name,
                  ": no parameter of its shape in the sampling model");
    float* dst = it->second->value.data();
    for (std::int64_t k = 0; k < host.numel(); ++k) dst[k] = static_cast<float>(host[k]);
  });
  return whole;
}

/// The run's model arguments (an initial Hugging Face directory's config.json, else
/// [model]) once the inputs every rank reads alike are checked: that directory, the
/// sequence length and the tokenizer against the model, and a token shard's header (its
/// ids are checked as they are loaded). llama-train calls it before anything slow (the
/// CPU's MFU peak is measured after it: a bad path is reported at once) and each rank
/// again, on the same files.
inline nn::ModelArgs checked_model_args(const train::JobConfig& c, const io::Tokenizer& tok) {
  const std::string& init = c.checkpoint.initial_load_path;
  const bool init_hf = !init.empty() && train::is_hf_directory(init);
  std::error_code ec;
  TESSERA_CHECK(init.empty() || init_hf || !fs::is_directory(init, ec), "checkpoint.initial_load_path '", init,
                "': a directory without config.json (expected a Hugging Face model directory or a model.safetensors; "
                "a run's own checkpoints resume from its job.dump_folder)");
  // The folders the run writes to, before anything slow: a file in their place fails at once.
  const fs::path dump = c.job.dump_folder, ckpt = dump / c.checkpoint.folder;
  for (const auto& [path, key] : {std::pair{dump, "job.dump_folder"}, std::pair{ckpt, "checkpoint.folder"}})
    TESSERA_CHECK(!fs::exists(path, ec) || fs::is_directory(path, ec), path.string(), ": not a directory (", key,
                  " names the folder the run writes to)");
  TESSERA_CHECK(!c.checkpoint.initial_load_in_hf || init_hf, "checkpoint.initial_load_in_hf = true: initial_load_path '",
                init, "' is not a Hugging Face model directory (a folder with config.json)");
  // A Hugging Face directory brings its own model arguments: its config.json.
  const nn::ModelArgs a = init_hf ? train::read_hf_config(init) : c.model.args;
  TESSERA_CHECK(c.training.seq_len <= a.max_seq_len, "training.seq_len = ", c.training.seq_len, " exceeds the model's ",
                init_hf ? "max_position_embeddings (" + init + "/config.json) = " : "max_seq_len = ", a.max_seq_len);
  TESSERA_CHECK(tok.vocab_size() <= a.vocab_size, "model.tokenizer '", c.model.tokenizer, "' has ", tok.vocab_size(),
                " ids, more than the model's vocabulary of ", a.vocab_size,
                init_hf ? " (vocab_size in " + init + "/config.json)" : " (model.vocab_size)");
  // The files every rank will read, before anything slow: a missing one fails at once.
  for (const train::DatasetSpec& d : {train::training_dataset(c), train::validation_dataset(c)}) {
    if (d.section == "validation" && !c.validation.enable) continue;
    if (d.dataset == "synthetic") continue;
    train::check_readable(d);
    TESSERA_CHECK(!d.paths.empty(), d.section, ".dataset_path: required when ", d.section, ".dataset = \"", d.dataset, "\"");
    for (const std::vector<std::string>& files : train::dataset_files(d))
      for (const std::string& f : files) {
        if (d.dataset == "shard") io::read_token_shard_header(f);
        if (d.dataset == "chat")
          TESSERA_CHECK(std::ifstream(f).good(), d.section, ".dataset_path '", f,
                        "': cannot open (JSON lines of conversations)");
      }
    if (d.dataset == "chat") {
      const io::ChatFormat f = io::resolve_chat_format(c.training.chat_format, tok, "training.chat_format");
      TESSERA_CHECK(f != io::ChatFormat::llama3 || io::chat_format_for(tok) == io::ChatFormat::llama3,
                    "training.chat_format = llama3: model.tokenizer '", c.model.tokenizer,
                    "' lacks Llama 3's <|start_header_id|>, <|end_header_id|> and <|eot_id|> (llama2 needs only BOS and EOS)");
    }
  }
  return a;
}

/// One run at a time writes to a dump folder: an advisory lock (flock) on the folder
/// itself, held by the lead rank until the run ends, released by the system if it dies.
/// Two runs in one folder would prune and overwrite each other's checkpoints.
class FolderLock {
 public:
  explicit FolderLock(const fs::path& folder) : fd_(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {
    TESSERA_CHECK(fd_ >= 0, folder.string(), ": cannot open to lock it: ", std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd_);
      TESSERA_CHECK(err != EWOULDBLOCK, folder.string(), ": another run is writing to this folder (job.dump_folder); "
                    "give this one its own, or wait for that one to end");
      fail(folder.string(), ": cannot lock: ", std::strerror(err));
    }
  }
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  ~FolderLock() { ::close(fd_); }

 private:
  int fd_ = -1;
};

/// Runs `f`; memory running out in it is an error saying what the run was doing and the
/// keys that size it: tessera's allocators' OutOfMemory (host or device, with the bytes
/// and the tensor) and std::bad_alloc (host, naming nothing).
template <class F>
decltype(auto) sized_by(const std::string& what, F&& f) {
  try {
    return f();
  } catch (const OutOfMemory& e) {
    fail_out_of_memory(e.what(), ", while ", what);
  } catch (const std::bad_alloc&) {
    fail_out_of_memory("out of host memory, while ", what);
  }
}

/// One rank's run; every rank of `world` calls it with the same inputs.
template <class Model>
int run_rank_steps(comm::Communicator world, const RunInputs& in) {
  const train::JobConfig& c = *in.config;
  const bool lead = world.rank() == 0;  // rank 0 writes the files and the metrics
  // The same checks on every rank, before any collective: a bad layout fails alike everywhere.
  const comm::MeshShape shape = train::mesh_shape(c, world.size());
  const std::int64_t dp = shape.dp(), local = c.training.local_batch_size;
  const std::int64_t global = c.training.global_batch_size > 0 ? c.training.global_batch_size : local * dp;
  TESSERA_CHECK(global % (local * dp) == 0, "training.global_batch_size (", global,
                ") must be a multiple of training.local_batch_size x the data-parallel degree (", local, " x ", dp,
                " = ", local * dp, ")");
  // Thread ranks on the CPU share this process's cores.
  if constexpr (std::is_same_v<typename Model::backend_type, Cpu>)
    if (world.size() > 1 && world.engine_name().starts_with("threads"))
      omp_set_num_threads(std::max(1, Cpu::threads() / world.size()));
  comm::DeviceMesh mesh(world, shape);
  const parallel::Plan plan = train::make_plan(c, &mesh);
  const fs::path dump = c.job.dump_folder;

  const std::string& init = c.checkpoint.initial_load_path;
  const bool init_hf = !init.empty() && train::is_hf_directory(init);
  const io::Tokenizer& tok = *in.tokenizer;
  const nn::ModelArgs a = checked_model_args(c, tok);
  // profiling.enable_memory_snapshot: this rank's device allocator records from before
  // the model's first parameter, so a snapshot's events replay to what it holds.
  using B = typename Model::backend_type;
  if (c.profiling.enable_memory_snapshot) B::record_memory_history(MemoryHistory::kDefaultEntries);
  Model model =
      sized_by("building the model (model.dim, model.n_layers, model.vocab_size)", [&] { return Model(a, plan); });
  // The model has checked its heads, hidden units and vocabulary against the tp degree,
  // and its stages against the pipeline degree; now the batch against both (rows over
  // the tp ranks; microbatches the schedule can run), before any file is written.
  model.check_batch(local, c.training.seq_len);
  const int pp = model.pipeline_degree();
  std::string pipeline_line;
  if (pp > 1) {
    const std::int64_t mb = c.parallelism.pipeline_parallel_microbatch_size;
    const parallel::Schedule& schedule = model.schedule(static_cast<int>(local / mb));
    const std::string& file = c.parallelism.pipeline_parallel_schedule_csv;
    pipeline_line = "  pipeline: " + parallel::describe(schedule) + " (simulated)" +
                    (parallel::from_file(schedule.kind) ? " | order from " + file : std::string()) + " | microbatch " +
                    std::to_string(mb) +
                    " x seq " + std::to_string(c.training.seq_len) +
                    " | stages: " + describe_stages(model.stages(), schedule) + "\n";
  }
  // A rerun of a job whose folder holds checkpoints resumes from the latest complete one
  // (or checkpoint.load_step's); initial_load_path only starts a job that has none.
  const fs::path ckpt = dump / c.checkpoint.folder;
  const train::ResumeParts parts = train::ResumeParts::excluding(c.checkpoint.exclude_from_loading);
  std::optional<train::SavedStep> resume;
  if (c.checkpoint.enable)
    resume = train::resume_point(ckpt, c.checkpoint.load_step, [&](const train::SavedStep& s) {
      if (lead)
        std::fprintf(stderr, "warning: %s: %s, skipped\n", s.path.string().c_str(),
                     s.partial ? "a save that never finished" : "incomplete (no COMPLETE marker: its save did not finish)");
    });
  // checkpoint.create_seed_checkpoint starts a job: it never writes over saved work.
  TESSERA_CHECK(!c.checkpoint.create_seed_checkpoint || !resume, "checkpoint.create_seed_checkpoint = true: ",
                resume ? resume->path.string() : std::string(), " is already there: a seed checkpoint starts a job "
                "(give this one its own job.dump_folder, or remove the folder's checkpoints)");
  if (resume && !c.checkpoint.create_seed_checkpoint) train::check_resume(ckpt, *resume, c.training.steps);
  // LoRA on a saved model: the file holds the base model, the adapters start from the seed.
  const std::optional<std::uint64_t> adapter_seed =
      plan.lora.enabled ? std::optional<std::uint64_t>(static_cast<std::uint64_t>(c.training.seed)) : std::nullopt;
  if (resume && parts.model) {
    // The checkpoint gives each rank its share: nothing to initialise.
  } else if (init_hf) {
    train::load_hf_model(model, init, adapter_seed);
  } else if (!init.empty()) {
    const nn::ModelArgs saved = train::read_model_args(init);
    TESSERA_CHECK(saved.num_params() == a.num_params() && saved.dim == a.dim && saved.n_layers == a.n_layers, init,
                  ": the checkpoint's model (", saved.flavor, ", ", saved.num_params(),
                  " parameters) does not match [model] (", a.flavor, ", ", a.num_params(), " parameters)");
    train::load_model(model, init, adapter_seed);
  } else {
    model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  }

  // Each stream's ids are checked against the model before any step reads them.
  auto load = [&](const train::DatasetSpec& d) {
    std::vector<data::TokenCorpus> corpora = train::open_corpora(d, tok);
    for (const data::TokenCorpus& s : corpora) {
      const auto limit = static_cast<std::uint32_t>(a.vocab_size - 1);
      const std::uint64_t i = s.first_above(limit);
      if (i == s.size()) continue;
      std::uint32_t id = 0;
      s.read(i, 1, &id, nullptr);
      const std::vector<std::string> names = s.names();
      fail(names.size() == 1 ? names.front() : train::dataset_name(d), ": token id ", id, " at index ", i,
           names.size() == 1 ? "" : " of the stream", " is outside the model's vocabulary (model.vocab_size = ",
           a.vocab_size, ")");
    }
    return corpora;
  };
  // A stream too large for the host, too short for one window, or whose loss mask leaves
  // no target is named with the keys that made it.
  auto loader_of = [&](const train::DatasetSpec& d, std::int64_t seq_len, std::int64_t local_batch,
                       data::WindowOrder order) {
    const std::string keys = tessera::detail::concat(
        d.section, ".dataset = \"", d.dataset, "\"",
        d.dataset == "synthetic" ? tessera::detail::concat(", ", d.section, ".synthetic_documents = ", d.documents)
                                 : std::string());
    std::vector<data::TokenCorpus> corpora =
        sized_by(tessera::detail::concat("loading ", train::dataset_name(d), " (", keys, ")"), [&] { return load(d); });
    std::vector<double> weights = d.weights;
    if (weights.empty()) weights.assign(corpora.size(), 1.0);
    data::Packing packing;
    if (c.training.packing == "first_fit") {
      packing.kind = data::Packing::Kind::first_fit;
      packing.document_start_id = train::document_start_id(c, "training.packing = \"first_fit\"");
    }
    try {
      return data::DataLoader(std::move(corpora), std::move(weights), seq_len, local_batch, mesh.dp_rank(),
                              mesh.dp_degree(), packing, order);
    } catch (const Error& e) {
      fail(train::dataset_name(d), " (", keys, ", ", d.section, ".seq_len = ", seq_len, "): ", e.what());
    }
  };
  data::DataLoader loader = loader_of(train::training_dataset(c), c.training.seq_len, c.training.local_batch_size,
                                      {c.training.shuffle, static_cast<std::uint64_t>(c.training.seed)});
  std::optional<train::Validator> validator;
  if (c.validation.enable) {
    const train::DatasetSpec d = train::validation_dataset(c);
    model.check_batch(c.validation.local_batch_size, c.validation.seq_len);
    validator.emplace(loader_of(d, c.validation.seq_len, c.validation.local_batch_size, {}),
                      c.validation.steps, c.training.document_mask ? train::document_start_id(c) : -1,
                      train::dataset_name(d));
  }

  if (lead)
    std::fprintf(stderr,
                 "tessera llama-train: %s | %lld layers, dim %lld, %lld heads (%lld kv), vocab %lld | %.2fM parameters\n"
                 "  %lld tokens/step (global batch %lld x seq %lld), %lld windows per epoch | %s\n"
                 "  %d rank%s %s: %s%s%s over the %s engine, %s | activation checkpointing: %s%s\n%s",
                 a.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
                 static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
                 static_cast<long long>(a.vocab_size), static_cast<double>(a.num_params()) / 1e6,
                 static_cast<long long>(global * c.training.seq_len), static_cast<long long>(global),
                 static_cast<long long>(c.training.seq_len), static_cast<long long>(loader.windows_per_epoch()),
                 in.peak_text.c_str(), world.size(), world.size() == 1 ? "" : "s",
                 (shape.str() + (plan.async_tensor_parallel && plan.tp_degree() > 1
                                     ? " (asynchronous TP: its gathers and reduce-scatters cut into the GEMMs)"
                                     : ""))
                     .c_str(),
                 parallel::name_of(plan.dynamic_sharding()),
                 plan.cpu_offload ? " (CPU offload: shards, gradients and AdamW state in host memory, AdamW on the host)" : "",
                 plan.early_step ? " (early step: each unit updated as its gradient is reduced, no clipping)" : "",
                 std::string(world.engine_name()).c_str(),
                 in.compute_text().c_str(), plan.checkpoint.str().c_str(),
                 c.optimizer.state_dtype == "float32" ? "" : (" | AdamW moments: " + c.optimizer.state_dtype).c_str(),
                 pipeline_line.c_str());
  if (lead && plan.lora.enabled) {
    const std::string targets =
        plan.lora.target_modules.empty() ? std::string("every linear layer") : [&] {
          std::string t;
          for (const std::string& m : plan.lora.target_modules) t += (t.empty() ? "" : ", ") + m;
          return t;
        }();
    const std::int64_t adapters = nn::lora_params(a, plan.lora);
    std::fprintf(stderr, "  LoRA: rank %lld, alpha %g on %s: %.3fM trainable parameters (%.3f%%), the rest frozen\n",
                 static_cast<long long>(plan.lora.rank), plan.lora.alpha, targets.c_str(),
                 static_cast<double>(adapters) / 1e6,
                 100.0 * static_cast<double>(adapters) / static_cast<double>(a.num_params() + adapters));
  }
  if (lead && (loader.streams().size() > 1 || loader.streams().front().corpus.names().size() > 1)) {
    // Which files feed the windows, and in what shares.
    std::string line = loader.streams().size() > 1 ? "  data: a mix of" : "  data:";
    const auto& streams = loader.streams();
    for (std::size_t i = 0; i < streams.size(); ++i) {
      const std::vector<std::string> names = streams[i].corpus.names();
      line += tessera::detail::concat(i == 0 ? " " : "; ", names.front(),
                                      names.size() > 1 ? tessera::detail::concat(" and ", names.size() - 1,
                                                                               names.size() == 2 ? " more file" : " more files")
                                                       : std::string(),
                                      " (", streams[i].corpus.size(), " tokens, ", streams[i].windows, " windows");
      if (streams.size() > 1) {
        char share[32];
        std::snprintf(share, sizeof share, ", %.1f%% of them", 100 * streams[i].weight);
        line += share;
      }
      line += ")";
    }
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  if (lead) {
    // Shards written before version 3 cost a pass over each at every start: say so once.
    std::uint64_t whole = 0;
    for (const auto& stream : loader.streams()) whole += stream.corpus.tokens_checked_at_open();
    if (validator)
      for (const auto& stream : validator->loader().streams()) whole += stream.corpus.tokens_checked_at_open();
    if (whole > 0)
      std::fprintf(stderr,
                   "  data: %llu tokens in shards of version 1 or 2, read whole at every start to check them "
                   "(llama-tokenize --upgrade gives them a CRC per chunk, checked as read)\n",
                   static_cast<unsigned long long>(whole));
  }
  if (lead && c.training.shuffle)
    std::fprintf(stderr, "  order: each epoch's windows shuffled (training.shuffle, training.seed = %lld)\n",
                 static_cast<long long>(c.training.seed));
  if (lead && c.training.packing == "first_fit") {
    std::int64_t documents = 0, too_long = 0, rows = 0, padding = 0;
    for (const auto& s : loader.streams()) {
      documents += s.rows->documents, too_long += s.rows->too_long, rows += s.rows->rows(), padding += s.rows->padding;
    }
    std::fprintf(stderr, "  packing: first fit, %lld documents in %lld rows (%.1f%% padding)%s\n",
                 static_cast<long long>(documents), static_cast<long long>(rows),
                 100.0 * static_cast<double>(padding) / static_cast<double>(rows * c.training.seq_len),
                 too_long > 0 ? tessera::detail::concat(", ", too_long, " longer than a row of ", c.training.seq_len + 1,
                                                        " tokens left out")
                                    .c_str()
                              : "");
  }
  if (lead && c.compile.enable)
    std::fprintf(stderr, "  compile.enable = true (torchtitan's torch.compile): tessera's step is compiled C++ "
                         "already; the key changes nothing\n");
  if (lead && (loader.masked() || validator))
    std::fprintf(stderr, "%s%s%s",
                 loader.masked() ? "  loss mask: the assistants' replies only (chat data)\n" : "",
                 validator ? tessera::detail::concat("  validation: every ", c.validation.freq, " steps, ",
                                                     validator->steps(), " global batch",
                                                     validator->steps() == 1 ? "" : "es", " of ",
                                                     c.validation.local_batch_size * dp, " x seq ",
                                                     c.validation.seq_len, " from ",
                                                     train::dataset_name(train::validation_dataset(c)))
                                 .c_str()
                           : "",
                 validator ? "\n" : "");

  // Only now, with every input checked, does the run touch its dump folder.
  const std::string tokenizer_copy = (dump / "tokenizer.model").string();
  bool has_tokenizer_file = false;
  std::optional<FolderLock> lock;  // held to the run's end
  if (lead) {
    fs::create_directories(dump);
    lock.emplace(dump);
    std::ofstream out(dump / "config.toml");
    out << in.config_toml;
    TESSERA_CHECK(out.good(), (dump / "config.toml").string(), ": cannot write");
    // The tokenizer travels with the models saved here (none for "byte").
    has_tokenizer_file = in.save_tokenizer_file(tokenizer_copy);
  }
  // debug.enable_structured_logging: this rank's phases, from the checkpoint load on.
  std::optional<train::RankLog> rank_log;
  if (c.debug.enable_structured_logging) rank_log.emplace(dump / "structured_logs", world.rank());
  const profile::PhaseLogging phases(rank_log ? &*rank_log : nullptr);
  train::TrainerOptions options = train::trainer_options(c);
  if (in.peak_flops > 0) options.peak_flops = in.peak_flops;
  train::Trainer<Model> trainer = sized_by(
      "setting up the optimizer (AdamW's moments and masters: the model's size, optimizer.state_dtype)",
      [&] { return train::Trainer<Model>(model, std::move(options), std::move(loader)); });
  if (resume) {
    const std::vector<std::string> changed = sized_by("loading " + resume->path.string(), [&] {
      const profile::Span span("step", "checkpoint load");
      return trainer.load_checkpoint(resume->path.string(), parts);
    });
    if (lead) {
      for (const std::string& change : changed)
        std::fprintf(stderr, "warning: %s: %s: the run goes on with the new value\n", resume->path.string().c_str(),
                     change.c_str());
      std::string excluded;
      for (const std::string& x : c.checkpoint.exclude_from_loading) excluded += (excluded.empty() ? "" : ", ") + x;
      std::fprintf(stderr, "resumed from %s: step %lld of %lld, data position %lld%s\n", resume->path.string().c_str(),
                   static_cast<long long>(trainer.steps_done()), static_cast<long long>(c.training.steps),
                   static_cast<long long>(trainer.batches().position()),
                   excluded.empty() ? "" : (" (started afresh: " + excluded + ")").c_str());
    }
  }
  if (c.checkpoint.create_seed_checkpoint) {
    // The initialised model and the training state before any step (AdamW's moments at
    // zero, the schedule and the data at their start): a run in this folder resumes from
    // it as from any checkpoint, under any layout, and trains as if it had initialised
    // the model itself.
    const std::string dir = train::step_path(ckpt, 0).string();
    trainer.start_checkpoint(dir);
    const std::string written = trainer.poll_checkpoint(true);
    if (lead && !written.empty())
      std::fprintf(stderr, "seed checkpoint %s written: a run with job.dump_folder = %s starts from it\n",
                   written.c_str(), dump.string().c_str());
    return 0;
  }
  std::unique_ptr<train::MetricsLogger> log;
  if (lead)
    log = std::make_unique<train::MetricsLogger>(
        (dump / "metrics.jsonl").string(), c.training.steps, c.metrics.log_freq, isatty(STDERR_FILENO) != 0,
        trainer.steps_done(), c.metrics.enable_tensorboard ? (dump / c.metrics.save_tb_folder).string() : "");
  const DType export_dtype = parse_dtype(c.checkpoint.export_dtype, "checkpoint.export_dtype");
  const bool async = c.checkpoint.async_mode != "disabled";  // "async" or "async_with_pinned_mem": one path
  // Saving gathers the whole parameters on every rank (a collective: data-parallel shards,
  // tensor-parallel pieces and the other pipeline stages' parameters); rank 0 writes.
  auto save = [&](auto&& write) {
    model.with_whole_parameters([&] {
      if (lead) write();
    });
    world.barrier();  // the files are complete before any rank goes on:
    Model::backend_type::synchronize();  // a barrier orders the stream; this holds the host (NCCL)
  };
  // A committed checkpoint is what keep_latest_k counts; rank 0 prunes, after the commit.
  auto committed = [&](const std::string& dir) {
    if (dir.empty() || !lead) return;
    std::fprintf(stderr, "checkpoint %s written\n", dir.c_str());
    train::prune_checkpoints(ckpt, c.checkpoint.keep_latest_k);
  };
  const std::string step_size = tessera::detail::concat(
      "in a step (a rank's batch: training.local_batch_size x training.seq_len = ", local, " x ", c.training.seq_len,
      " tokens", c.validation.enable ? "; validation.local_batch_size x validation.seq_len for validation" : "", ")");
  // profiling.enable_profiling: every profile_freq-th step recorded on this rank's thread
  // (core/profile.hpp), its timeline written by every rank beside the others'.
  profile::Recorder recorder([] { return memory_stats(Model::backend_type::device).now(); });
  recorder.annotate(in.annotations);
  auto write_profile = [&](std::int64_t s) {
    const fs::path dir = dump / c.profiling.save_traces_folder / ("iteration_" + std::to_string(s));
    const fs::path file = dir / ("rank" + std::to_string(world.rank()) + "_trace.json");
    std::error_code ec;
    fs::create_directories(dir, ec);
    TESSERA_CHECK(!ec, "profiling.save_traces_folder: cannot create ", dir.string(), ": ", ec.message());
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out << profile::chrome_trace(recorder, world.rank(), "rank " + std::to_string(world.rank()));
    out.close();
    TESSERA_CHECK(out.good(), "profiling.save_traces_folder: cannot write ", file.string());
    recorder.clear();
    if (lead)
      std::fprintf(stderr, "profile of step %lld: %s (rank<r>_trace.json for each of the %d ranks)\n",
                   static_cast<long long>(s), dir.string().c_str(), world.size());
  };
  // profiling.enable_memory_snapshot: every profile_freq-th step, and a step that ran out
  // of memory, written by every rank (io/memory_snapshot.hpp). On the steps not profiled a
  // recorder of the spans alone gives the allocations, and the flight recorder's
  // collectives (comm.trace_buf_size), the layer or action that asked for them.
  profile::Recorder where;
  const bool spans_for_context = c.profiling.enable_memory_snapshot || c.comm.trace_buf_size > 0;
  auto write_memory_snapshot = [&](const std::string& iteration) {
    const fs::path dir = dump / c.profiling.save_memory_snapshot_folder / iteration;
    const fs::path file = dir / ("rank" + std::to_string(world.rank()) + "_memory_snapshot.pickle");
    std::error_code ec;
    fs::create_directories(dir, ec);
    TESSERA_CHECK(!ec, "profiling.save_memory_snapshot_folder: cannot create ", dir.string(), ": ", ec.message());
    const bool expandable = B::device == Device::cuda && c.training.expandable_segments;
    io::write_memory_snapshot(
        file.string(), io::torch_memory_snapshot(B::memory_state(), B::memory_history(), B::memory_device(), expandable),
        "profiling.save_memory_snapshot_folder");
    if (lead)
      std::fprintf(stderr, "memory snapshot: %s (rank<r>_memory_snapshot.pickle for each of the %d ranks)\n",
                   dir.string().c_str(), world.size());
  };
  if (rank_log) {
    rank_log->set_step(trainer.steps_done());
    rank_log->instant("training_start");
  }
  for (std::int64_t s = trainer.steps_done() + 1; s <= c.training.steps; ++s) sized_by(step_size, [&] {
    if (rank_log) rank_log->set_step(s);
    const bool profiled = c.profiling.enable_profiling && s % c.profiling.profile_freq == 0;
    const bool snapshot = c.profiling.enable_memory_snapshot && s % c.profiling.profile_freq == 0;
    try {
      const profile::Recording recording(profiled ? &recorder : spans_for_context ? &where : nullptr);
      const profile::Span step_span("step", [&] { return "step " + std::to_string(s); });
      train::StepMetrics m = trainer.step();
      const bool last = s == c.training.steps;
      if (validator && (s % c.validation.freq == 0 || last)) {
        const profile::Span span("step", "validation");
        const train::ValidationResult v = validator->run(model);
        m.validation_loss = v.loss;
        m.validation_tokens = v.tokens;
      }
      // The training state after every interval-th step and the last (at the last with
      // last_save_model_only, the model alone: <dump_folder>/model.safetensors below), and
      // after the first with enable_first_step_checkpoint.
      const bool first = s == 1 && c.checkpoint.enable_first_step_checkpoint;
      if (c.checkpoint.enable && (s % c.checkpoint.interval == 0 || last || first) &&
          !(last && !first && c.checkpoint.last_save_model_only)) {
        const profile::Span span("step", "checkpoint");
        const std::string dir = train::step_path(ckpt, s).string();
        const auto t0 = std::chrono::steady_clock::now();
        m.checkpoint_seconds = trainer.start_checkpoint(dir);
        if (!async) {  // the step waits for the files too
          trainer.wait_checkpoint_written();
          m.checkpoint_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
      }
      // The step's line is written before any checkpoint commits after it: a run killed
      // between the two resumes from an earlier checkpoint and logs the step again, never
      // from this one with its line missing.
      if (log) log->log(m);
      if (trainer.checkpoint_pending()) committed(trainer.poll_checkpoint(last || !async));
    } catch (const OutOfMemory&) {
      // The snapshot of a step that ran out of memory (its events end at the request that
      // failed), then the error as it was.
      if (c.profiling.enable_memory_snapshot) try {
          write_memory_snapshot("iteration_" + std::to_string(s) + "_exit");
        } catch (const std::exception& e) {
          std::fprintf(stderr, "warning: no memory snapshot of the step that ran out of memory: %s\n", e.what());
        }
      throw;
    }
    where.clear();
    if (profiled) write_profile(s);
    if (snapshot) write_memory_snapshot("iteration_" + std::to_string(s));
  });
  if (trainer.checkpoint_pending()) committed(trainer.poll_checkpoint(true));
  if (rank_log) rank_log->instant("training_end");
  const std::string final_path = (dump / "model.safetensors").string();
  save([&] {
    train::save_model(model, final_path, export_dtype);
    std::fprintf(stderr, "saved %s\n", final_path.c_str());
  });
  if (c.checkpoint.last_save_in_hf) {
    const std::string hf_dir = (dump / "hf").string();
    save([&] {
      train::save_hf_model(model, hf_dir, {export_dtype, 5'000'000'000ull, has_tokenizer_file ? tokenizer_copy : ""});
      std::fprintf(stderr, "saved %s (Hugging Face Llama directory)\n", hf_dir.c_str());
    });
  }

  // A sample from the trained model, seeded from the run's seed. With several ranks,
  // rank 0 copies the whole parameters into a CPU model of its own and samples alone
  // (a sharded or pipelined model's every forward would be a collective). So does one
  // rank whose float8 GEMMs are emulated on the CPU: sampling reruns the forward for each
  // token, and each forward would cast every weight to float8 again in software (the
  // debug model's 300 tokens took 26 s, against 2.7 s from the copy). The copy samples
  // with float32 GEMMs, as the sample of several ranks always has. By default none is
  // drawn from a copy larger than 8 GiB (train/closing_sample.hpp); --sample-tokens 0:
  // none, and no copy.
  const bool emulated_float8 = B::device == Device::cpu && train::float8_enabled(c) && c.float8.emulate;
  const train::ClosingSample closing =
      train::closing_sample(in.sample_tokens, world.size() > 1 || emulated_float8, a.num_params());
  if (closing.tokens == 0) {
    if (lead && !closing.declined.empty())
      std::fprintf(stderr,
                   "no closing sample: %s; `llama-generate --checkpoint %s` samples the saved model (--device cuda on "
                   "one GPU), or --sample-tokens N draws it here\n",
                   closing.declined.c_str(), final_path.c_str());
    return 0;
  }
  std::unique_ptr<nn::Transformer<float, Cpu>> whole;
  if (closing.cpu_copy)
    model.with_whole_parameters([&] {
      if (lead) whole = whole_copy_on_cpu(model, a);
    });
  if (lead) {
    nn::SampleOptions o;
    o.max_new_tokens = closing.tokens;
    o.temperature = 0.7;
    o.seed = static_cast<std::uint64_t>(c.training.seed);
    o.context = c.training.seq_len;
    const std::string sample = whole ? nn::generate_text(*whole, tok, "", o) : nn::generate_text(model, tok, "", o);
    std::printf("--- sample (temperature %.1f) ---\n%s\n", o.temperature, sample.c_str());
  }
  return 0;
}

/// One rank's run (run_rank_steps); every rank of `world` calls it with the same inputs.
/// With comm.trace_buf_size > 0 the rank's collectives go to a flight recorder
/// (comm/flight_recorder.hpp), which a run that fails after the rank's first collective
/// writes to <dump_folder>/<comm.save_traces_folder>/rank<r>_trace.json before the error
/// goes on (bad input, refused before any collective, leaves the dump folder alone).
template <class Model>
int run_rank(comm::Communicator world, const RunInputs& in) {
  const train::JobConfig& c = *in.config;
  const int rank = world.rank();
  std::shared_ptr<comm::FlightRecorder> flight;
  if (c.comm.trace_buf_size > 0) {
    flight = std::make_shared<comm::FlightRecorder>(static_cast<std::size_t>(c.comm.trace_buf_size), rank,
                                                    world.size());
    flight->dump_to(
        (fs::path(c.job.dump_folder) / c.comm.save_traces_folder / ("rank" + std::to_string(rank) + "_trace.json"))
            .string());
    world.record_flights(flight);
  }
  try {
    return run_rank_steps<Model>(std::move(world), in);
  } catch (const std::exception& e) {
    if (flight && flight->total() > 0)
      if (const std::string path = flight->dump(e.what()); !path.empty())
        std::fprintf(stderr, "rank %d: its last collectives: %s (tools/comm_trace.py reads the ranks' files)\n", rank,
                     path.c_str());
    throw;
  }
}

}  // namespace tessera::llama_train
