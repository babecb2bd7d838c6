// llama-plan: what one training step of a config will cost, on one GPU or on a cluster,
// before running it.
//
//   llama-plan --config examples/configs/llama3_8b.toml --machine h100-sxm
//   llama-plan --config examples/configs/llama3_8b.toml --machine h100-sxm --gpus 64
//              --parallelism.tensor_parallel_degree 8
//   llama-plan --config CFG [--machine h100-sxm|h200|a100-80gb-sxm|a100-80gb-p4de|cpu|FILE.toml] [--gpus N]
//              [--section.key value ...] [--json] [--emit-config FILE.toml] [--emit-schedule FILE.csv]
//
// Reads the same TOML and command-line keys as llama-train, traces one training step of
// that model on the dry-run backend (plan/dry_run.hpp: nothing computed, nothing stored),
// and prices the trace on the machine (plan/cost.hpp): the step's time by class, tokens/s,
// MFU (torchtitan's formula and causally halved), the memory peak with its breakdown and
// whether it fits. GPU machines are the profiles in examples/machines (built in, each
// figure with its source) or any FILE.toml of that form; `cpu` measures this machine's CPU
// on the step's own GEMMs and kernels (plan/cpu.hpp) and predicts llama-train's CPU step.
// A GPU step is traced for the model llama-train would train there: bf16 with
// mixed_precision_param = "bfloat16", else float32; the CPU's is float32 (bf16 parameter
// values with "bfloat16").
//
// On N GPUs (--gpus, or the product of the [parallelism] degrees) the layout's ranks are
// traced one per pipeline position, their peers phantoms (plan/phantom.hpp), and replayed
// together on the machine's [network] (plan/timeline.hpp, plan/cluster.hpp): the step,
// tokens/s per GPU, MFU, and each position's memory peak, compute, exposed communication
// and pipeline wait. With context parallelism (parallelism.context_parallel_degree) each
// rank's trace holds its part of every sequence and its ring attention: the blocks of its
// chunks, the keys and values passed round beside them, the gradients' ring backward.
//
// The whole run: training.steps steps of the priced step, and the validations [validation]
// asks for, each global batch of them priced from its own trace (plan/run_cost.hpp): the
// run's length, its GPU-hours, and with --plan.gpu_hour_price its price.
//
// Float8 (model.converters = ["float8"]): with float8.emulate = false the trace holds the
// GPU's float8 GEMMs, priced at the profile's float8 rates (refused by name on a profile
// without them); MFU stays against the bf16 peak, and the report says so.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "builtin_machines.hpp"
#include "step_trace.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/io/memory_snapshot.hpp"
#include "tessera/io/token_shard.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/cpu.hpp"
#include "tessera/plan/layout.hpp"
#include "tessera/plan/machine.hpp"
#include "tessera/plan/run_cost.hpp"
#include "tessera/plan/scaling_memory.hpp"
#include "tessera/plan/scaling_time.hpp"
#include "tessera/plan/search.hpp"
#include "tessera/plan/torchtitan_time.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/dataset.hpp"

using namespace tessera;

namespace {

void usage() {
  std::printf(
      "usage: llama-plan [--config FILE.toml] [--machine NAME|FILE.toml] [--gpus N] [--json]\n"
      "                  [--emit-config FILE.toml] [--emit-schedule FILE.csv] [--emit-memory-snapshot FILE.pickle]\n"
      "                  [--section.key value ...]\n\n"
      "Predicts one training step of the config on a machine, from a trace of the very code llama-train runs:\n"
      "time by class, tokens/s, MFU, peak memory and its breakdown, and whether it fits; and the whole run\n"
      "(training.steps steps and their validations): its length and GPU-hours.\n\n"
      "  --machine NAME   %s, or cpu (this machine, measured), or a machine profile FILE.toml\n"
      "                   (default h100-sxm)\n"
      "  --gpus N         the layout's ranks, in nodes of the machine file's [network] gpus_per_node\n"
      "                   (default: the product of the [parallelism] degrees, data_parallel_shard_degree\n"
      "                   -1 counting 1). Each pipeline position is traced and the positions are replayed\n"
      "                   together with their collectives priced on the machine's network\n"
      "  --json           one JSON object instead of the table\n"
      "  --emit-config F  write the layout planned (with --search: the first), every key, as a llama-train\n"
      "                   config to F\n"
      "  --emit-schedule F  write the pipeline schedule of the layout planned (with --search: the first) to F:\n"
      "                   each pipeline rank's actions in order, PyTorch's CSV (a row per rank, cells such as\n"
      "                   2F0), which parallelism.pipeline_parallel_schedule_csv runs with\n"
      "                   parallelism.pipeline_parallel_schedule = PipelineScheduleMulti\n"
      "  --emit-memory-snapshot F  write the memory snapshot of the layout planned (with --search: the first)\n"
      "                   to F: its first rank's step as the CUDA allocator it replays holds it, and every\n"
      "                   allocation from the model's first parameter on, with the spans open at it, in\n"
      "                   PyTorch's format (pytorch.org/memory_viz; tools/memory_snapshot.py summary)\n"
      "  --search         every layout of the model on --gpus N, ranked by tokens/s: replicate x shard x\n"
      "                   context x tensor x pipeline degrees (tensor parallelism within a node; context\n"
      "                   parallelism where each rank keeps at least 8192 tokens of a sequence, in 2 cp equal\n"
      "                   chunks), pipeline schedules, microbatch sizes (up to --search.max_microbatch,\n"
      "                   default 8), activation checkpoint modes and FSDP reshard policies, the global batch\n"
      "                   held (training.global_batch_size, or what the config's own degrees make of it on N\n"
      "                   GPUs). Each layout is traced small and extrapolated in depth and batch; the first\n"
      "                   is then predicted in full\n"
      "  --search.float8 R  with --search: float8 as a dimension, each layout also with its linear layers'\n"
      "                   GEMMs in float8 (model.converters = [\"float8\"], float8.emulate = false) by each recipe\n"
      "                   of R: a comma-separated list of tensorwise, rowwise, rowwise_with_gw_hp, or all. A\n"
      "                   bfloat16 model on a profile with float8 rates ([compute.fp8_tflops]) only\n"
      "  --plan.zero1 true  account the data-parallel ranks as ZeRO-1 (Megatron's distributed optimizer):\n"
      "                   bf16 parameters and gradients whole on every rank, optimizer states and fp32\n"
      "                   masters sharded over them; to compare with published ZeRO-1 runs. tessera's\n"
      "                   runtime does not run this mode (it runs FSDP, HSDP and DDP)\n"
      "  --plan.runtime scaling  the memory as Aleph Alpha's scaling (the runtime of Hagemann et al.'s published\n"
      "                   ZeRO-1 layout sheets) holds it, counted from what its code keeps (plan/scaling_memory.hpp),\n"
      "                   its stages split as it splits them, its tensor parallelism without sequence\n"
      "                   parallelism; the time is tessera's trace's rewritten as that runtime runs it: its\n"
      "                   eager PyTorch kernels, a tensor-parallel all-reduce per linear, its gradient\n"
      "                   accumulation and its fp32 gradient all-reduce after the backward\n"
      "                   (plan/scaling_time.hpp). Implies plan.zero1 and\n"
      "                   parallelism.disable_sequence_parallel; to check the planner against those sheets\n"
      "  --plan.runtime torchtitan  the time as torchtitan's eager FSDP2 step of its published table runs it\n"
      "                   (plan/torchtitan_time.hpp: eager kernels, FSDP2's copies); the memory is tessera's\n"
      "                   trace's; FSDP, HSDP and DDP layouts only; to check the planner against that table\n"
      "  --plan.attention K  with plan.runtime scaling: its attention kernel, torch, fused, flash1 or flash2\n"
      "                   (default flash2)\n"
      "  --plan.rmsnorm K    the runtime's RMSNorm: torch (eager) or fused (with plan.runtime scaling flash-attn's\n"
      "                   kernel, default torch; with plan.runtime torchtitan its Triton kernel, default fused)\n"
      "  --plan.fragmentation F  with plan.runtime scaling: the share of PyTorch's caching allocator's reservation\n"
      "                   its live tensors leave unfilled at the peak, 0 to 1 (default 0.15, GMLake's average on\n"
      "                   A100 80GB; plan/scaling_memory.hpp): the stage fits where its peak / (1 - F) does\n"
      "  --plan.top N     how many of the costliest kinds of operation to list (default 12)\n"
      "  --plan.balance_stages true  with a pipeline of stages of equal size: the layout also priced with the\n"
      "                   embedding counted as 0-2 layers and the output as 0-4 (parallelism.pipeline_parallel_\n"
      "                   first_stage_less_layers, _last_stage_less_layers), fastest first; --emit-config\n"
      "                   writes the fastest that fits\n"
      "  --plan.gpu_hour_price P  what one GPU-hour costs (any currency): the run's price beside its GPU-hours\n\n"
      "Config keys are llama-train's (llama-train --help lists them).\n",
      builtin_machine_names().c_str());
}

std::string gib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", bytes / double(1ull << 30));
  return s;
}

/// Bytes in GiB, or MiB below one GiB (a message that compares small sizes).
std::string size_text(double bytes) {
  if (bytes >= double(1ull << 30)) return gib(bytes);
  char s[32];
  std::snprintf(s, sizeof s, "%.1f MiB", bytes / double(1ull << 20));
  return s;
}

std::string seconds_text(double s) {
  char t[32];
  if (s >= 1) std::snprintf(t, sizeof t, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(t, sizeof t, "%.2f ms", s * 1e3);
  else std::snprintf(t, sizeof t, "%.1f us", s * 1e6);
  return t;
}

/// A run's length: seconds, minutes, hours or days.
std::string duration_text(double s) {
  char t[32];
  if (s < 120) std::snprintf(t, sizeof t, "%.1f s", s);
  else if (s < 2 * 3600) std::snprintf(t, sizeof t, "%.1f min", s / 60);
  else if (s < 2 * 86400) std::snprintf(t, sizeof t, "%.1f h", s / 3600);
  else std::snprintf(t, sizeof t, "%.1f days", s / 86400);
  return t;
}

struct Target {
  std::unique_ptr<plan::Pricer> pricer;
  std::string origin;          // "built in", a file, or "measured"
  double reserved_bytes = 0;   // taken before the first tensor (GPUs)
  std::size_t device_bytes = 0;  // the GPU's memory in all (0: the CPU, host memory)
  plan::AttentionChoice attention;  // the GPU's attention kernels (training.attention)
  std::optional<plan::Network> network;  // how the machine's GPUs are joined, if the profile says
  bool cpu = false;
  std::string description;
  int sm_count = 0;  // the GPU's multiprocessors
};

/// The ranks of one machine trade data through shared memory: every rank on one node,
/// its links as fast as two copies (into the shared segment and out of it).
plan::Network cpu_network(const plan::CpuProfile& p, int world) {
  // The measured bandwidth counts a copy's reads and writes: a copy moves half of it.
  const double copies_gbs = p.bandwidth.back().second / 2 / 1e9 / 2;
  const plan::Sourced link{copies_gbs, "measured: this machine's copy bandwidth at 256 MiB, over two copies"};
  const plan::Sourced latency{1.0, "Open MPI's shared-memory transport: about a microsecond a message (assumed)"};
  return plan::Network{{static_cast<double>(world), "this machine: every rank"}, link, latency, link, latency, std::nullopt};
}

/// The machine --machine names; for `cpu`, measured on the step's own work, and shared by
/// `world` ranks (each with its share of the memory, joined as cpu_network says). On a GPU
/// the attention kernels are those `attention` (training.attention) picks for a model of
/// `dtype` (`documents`: training.document_mask; `context_parallel`: its ring, whose
/// blocks only tessera's kernels mask).
Target resolve_machine(const std::string& name, const trace::Trace& step_trace, const std::string& attention,
                       DType dtype, std::int64_t head_dim, int world = 1, bool documents = false,
                       bool context_parallel = false) {
  Target t;
  if (name == "cpu") {
    t.cpu = true;
    t.origin = "measured";
    plan::CpuProfile profile = plan::measure_cpu(step_trace);
    profile.memory_bytes /= world;  // the ranks of one machine share its memory
    t.network = cpu_network(profile, world);
    t.description = "this machine's CPU";
    t.pricer = std::make_unique<plan::CpuPricer>(std::move(profile));
    return t;
  }
  // A profile's base is a built-in profile by that name, else a file beside the profile.
  const plan::MachineResolver resolve = [](std::string_view base, std::string_view from) {
    if (const char* text = builtin_machine(base))
      return std::optional(plan::MachineText{text, std::string(base) + ".toml (built in)"});
    return plan::machine_beside(base, from);
  };
  plan::Machine m;
  const bool file = name.find('/') != std::string::npos || (name.size() > 5 && name.substr(name.size() - 5) == ".toml");
  if (file) {
    m = plan::load_machine(name, resolve);
  } else {
    const char* text = builtin_machine(name);
    TESSERA_CHECK(text != nullptr, "--machine ", name, ": unknown machine (known: ", builtin_machine_names(),
                  ", cpu; or a profile FILE.toml)");
    m = plan::parse_machine(text, name + ".toml (built in)", resolve);
  }
  t.origin = m.origin;
  t.reserved_bytes = m.reserved_bytes.value;
  t.device_bytes = static_cast<std::size_t>(m.capacity_bytes.value);
  t.description = m.description;
  t.attention = plan::choose_attention(attention, dtype, head_dim, m, documents, context_parallel);
  t.network = m.network;
  t.sm_count = static_cast<int>(m.sm_count.value);
  t.pricer = std::make_unique<plan::GpuPricer>(std::move(m), t.attention.kernel);
  return t;
}

/// activation_checkpoint.mode, and the SwiGLU output's recompute where it is on.
std::string checkpointing_text(const train::JobConfig& c) {
  return c.activation_checkpoint.mode + (c.activation_checkpoint.recompute_swiglu ? ", SwiGLU output recomputed" : "");
}

/// The keys that make a layout, under llama-train's names.
nlohmann::json layout_keys(const train::JobConfig& c) {
  const auto& p = c.parallelism;
  nlohmann::json j;
  j["parallelism.data_parallel_replicate_degree"] = p.data_parallel_replicate_degree;
  j["parallelism.data_parallel_shard_degree"] = p.data_parallel_shard_degree;
  j["parallelism.tensor_parallel_degree"] = p.tensor_parallel_degree;
  j["parallelism.context_parallel_degree"] = p.context_parallel_degree;
  j["parallelism.disable_sequence_parallel"] = p.disable_sequence_parallel;
  j["parallelism.pipeline_parallel_degree"] = p.pipeline_parallel_degree;
  j["parallelism.pipeline_parallel_schedule"] = p.pipeline_parallel_schedule;
  j["parallelism.pipeline_parallel_microbatch_size"] = p.pipeline_parallel_microbatch_size;
  j["parallelism.fsdp_reshard_after_forward"] = p.fsdp_reshard_after_forward;
  j["activation_checkpoint.mode"] = c.activation_checkpoint.mode;
  j["activation_checkpoint.selective_ac_option"] = c.activation_checkpoint.selective_ac_option;
  j["activation_checkpoint.recompute_swiglu"] = c.activation_checkpoint.recompute_swiglu;
  j["training.local_batch_size"] = c.training.local_batch_size;
  j["training.global_batch_size"] = c.training.global_batch_size;
  j["training.seq_len"] = c.training.seq_len;
  j["model.converters"] = c.model.converters;
  if (train::float8_enabled(c)) {
    j["float8.recipe_name"] = c.float8.recipe_name;
    j["float8.emulate"] = c.float8.emulate;
  }
  return j;
}

/// What MFU is measured against: on a GPU the peak of the parameters' dtype, which for a
/// float8 run (`float8`: its float8 GEMMs) is the bf16 peak, though its float8 GEMMs run
/// at up to twice that; on the CPU the fastest GEMM measured.
std::string mfu_peak_text(const plan::StepShape& shape, std::int64_t float8, const Target& t) {
  if (t.cpu) return "the fastest GEMM measured";
  const std::string peak = shape.dtype == DType::bf16 ? "bf16 peak" : "fp32 peak";
  return float8 > 0 ? tessera::detail::concat(peak, ", its ", float8, " float8 GEMMs included") : peak;
}

/// The float8 GEMMs of a layout's positions.
std::int64_t float8_gemms(const plan::LayoutPrediction& l) {
  std::int64_t n = 0;
  for (const auto& p : l.positions) n += p.compute.float8_gemms;
  return n;
}

/// The run's validation as llama-plan prices it: the global batches of a pass (0 where it
/// cannot), and why not.
struct ValidationPlan {
  std::int64_t batches = 0;
  std::string unpriced;
};

/// [validation] of `c` on `dp` data-parallel ranks: validation.steps, or, for -1, the whole
/// set counted as llama-train reads it (a token shard by its header, else the stream made
/// with model.tokenizer); where that cannot be done here (a file this machine lacks), why,
/// and the key that prices it without the data. `runtime`: another runtime's step
/// (plan.runtime, plan.zero1), whose validation is not traced.
ValidationPlan plan_validation(const train::JobConfig& c, int dp, const std::string& runtime) {
  ValidationPlan v;
  if (!c.validation.enable) return v;
  if (!runtime.empty()) {
    v.unpriced = runtime + " prices that runtime's training step, not its validation";
    return v;
  }
  if (c.validation.steps > 0) {
    v.batches = c.validation.steps;
    return v;
  }
  if (c.training.packing == "first_fit") {
    v.unpriced = "validation.steps = -1 reads the whole validation set, whose rows under training.packing = "
                 "\"first_fit\" are counted only by reading its documents: give validation.steps";
    return v;
  }
  try {
    const train::DatasetSpec d = train::validation_dataset(c);
    std::uint64_t tokens = 0;
    if (d.dataset == "shard") {
      for (const std::string& f : train::flat_files(d)) tokens += io::read_token_shard_header(f).count;
    } else {
      tokens = train::load_token_stream(d, *data::make_tokenizer(c.model.tokenizer)).ids.size();
    }
    v.batches = plan::validation_batches(c, tokens, dp);
  } catch (const std::exception& e) {
    v.unpriced = tessera::detail::concat("validation.steps = -1 reads the whole validation set, which cannot be counted "
                                         "here (", e.what(), "): give validation.steps");
  }
  return v;
}

/// The run at `step_seconds` a step, its validation priced at `batch_seconds` a global
/// batch where `v` has batches.
plan::RunCost price_run(const train::JobConfig& c, double step_seconds, std::int64_t tokens_per_step, int gpus,
                        const ValidationPlan& v, double batch_seconds) {
  plan::RunCost r = plan::run_cost(c, step_seconds, tokens_per_step, gpus);
  r.validation_batches = v.batches;
  r.validation_batch_seconds = v.batches > 0 ? batch_seconds : 0;
  r.validation_unpriced = v.unpriced;
  return r;
}

nlohmann::json run_json(const plan::RunCost& r, std::optional<double> price) {
  nlohmann::json j = {{"steps", r.steps},
                      {"step_seconds", r.step_seconds},
                      {"tokens", r.tokens},
                      {"training_seconds", r.training_seconds()},
                      {"validations", r.validations},
                      {"validation_batches", r.validation_batches},
                      {"validation_batch_seconds", r.validation_batch_seconds},
                      {"validation_seconds", r.validation_seconds()},
                      {"seconds", r.seconds()},
                      {"gpus", r.gpus},
                      {"gpu_hours", r.gpu_hours()}};
  if (!r.validation_unpriced.empty()) j["validation_unpriced"] = r.validation_unpriced;
  if (price) {
    j["gpu_hour_price"] = *price;
    j["price"] = *price * r.gpu_hours();
  }
  return j;
}

/// The run, two lines: its steps and validation, then its length, GPU-hours and price.
/// On the CPU (`cpu`), the run's length alone.
void print_run(const plan::RunCost& r, std::optional<double> price, bool cpu) {
  std::printf("run: %lld steps (training.steps) x %s = %s, %.2fM tokens", static_cast<long long>(r.steps),
              seconds_text(r.step_seconds).c_str(), duration_text(r.training_seconds()).c_str(),
              static_cast<double>(r.tokens) / 1e6);
  if (r.validation && r.validation_batches > 0)
    std::printf("; validation: %lld passes x %lld global batch%s x %s = %s", static_cast<long long>(r.validations),
                static_cast<long long>(r.validation_batches), r.validation_batches == 1 ? "" : "es",
                seconds_text(r.validation_batch_seconds).c_str(), duration_text(r.validation_seconds()).c_str());
  if (cpu) {
    std::printf("\n  %s on this machine", duration_text(r.seconds()).c_str());
  } else {
    const double h = r.gpu_hours();
    char hours[32];
    std::snprintf(hours, sizeof hours, h < 100 ? "%.3g" : "%.0f", h);
    std::printf("\n  %s on %d GPU%s = %s GPU-hours", duration_text(r.seconds()).c_str(), r.gpus, r.gpus == 1 ? "" : "s",
                hours);
    if (price) std::printf(", at %g a GPU-hour: %.2f", *price, *price * h);
  }
  std::printf(" (checkpoint saves and start-up not counted)\n");
  if (r.validation && r.validation_batches == 0)
    std::printf("  validation not priced: %s\n", r.validation_unpriced.c_str());
  std::printf("\n");
}

/// The figures every prediction gives (one device's, a layout's, a searched layout's).
template <class P>
void put_figures(nlohmann::json& j, const P& p) {
  j["step_seconds"] = p.step_seconds;
  j["tokens_per_sec"] = p.tokens_per_sec;
  j["mfu_pct"] = p.mfu_pct;
  j["peak_memory_bytes"] = p.peak_memory_bytes;
  j["reserved_memory_bytes"] = p.reserved_memory_bytes;
  j["fits"] = p.fits;
}

/// "33.75 GiB (34.43 GiB reserved by the caching allocator)", or the live peak alone
/// where the allocator holds no more (the host's memory, another runtime's count).
template <class P>
std::string peak_text(const P& p) {
  std::string t = gib(static_cast<double>(p.peak_memory_bytes));
  if (p.reserved_memory_bytes > p.peak_memory_bytes)
    t += " (" + gib(static_cast<double>(p.reserved_memory_bytes)) + " reserved by the caching allocator)";
  return t;
}

/// "fits", "does NOT fit", or, where the live peak fits and only the expandable segment's
/// reservation does not (training.expandable_segments), what a run would do then.
template <class P>
std::string fit_text(const P& p, const train::JobConfig& c) {
  if (p.fits) return "fits";
  if (c.training.expandable_segments && p.reserved_memory_bytes > p.peak_memory_bytes &&
      static_cast<double>(p.peak_memory_bytes) <= p.usable_bytes)
    return "does NOT fit as planned (its live peak does: the run would unmap the free pages of its expandable "
           "segment and map them again each step, at a cost not priced here)";
  return "does NOT fit";
}

/// The figures one device's prediction and a layout's share, under the same names.
template <class P>
void put_summary(nlohmann::json& j, const P& p, const Target& t) {
  put_figures(j, p);
  j["mfu_causal_pct"] = p.mfu_causal_pct;
  j["usable_memory_bytes"] = p.usable_bytes;
  if (!t.cpu) j["attention"] = {{"kernel", plan::attention_name(t.attention.kernel)}, {"why", t.attention.why}};
}

/// The costliest kinds of operation, costliest first (predict's `top`).
nlohmann::json costliest_json(const plan::Prediction& p) {
  nlohmann::json top = nlohmann::json::array();
  for (const auto& o : p.top) top.push_back({{"what", o.what}, {"class", o.cls}, {"seconds", o.seconds}, {"count", o.count}});
  return top;
}

void print_costliest(const plan::Prediction& p, double step_seconds) {
  for (const auto& o : p.top)
    std::printf("  %10s  %5.1f%%  x%-6lld %s\n", seconds_text(o.seconds).c_str(),
                step_seconds > 0 ? 100 * o.seconds / step_seconds : 0.0, static_cast<long long>(o.count),
                o.what.c_str());
}

/// Under the classes: how much of the host's loops (CPU offload's) ran beside the
/// device's work, which the step does not wait for.
void print_hidden_host(double host_seconds, double hidden_seconds) {
  if (hidden_seconds <= 0) return;
  std::printf("  of the host's loops (%s), %s ran beside the device's work: the step is that much shorter than "
              "the classes' sum\n", seconds_text(host_seconds).c_str(), seconds_text(hidden_seconds).c_str());
}

/// The time by class, as {class: {seconds, count}}.
nlohmann::json class_times(const plan::Prediction& p) {
  nlohmann::json time = nlohmann::json::object();
  for (const auto& [name, ct] : p.by_class) time[name] = {{"seconds", ct.seconds}, {"count", ct.count}};
  return time;
}

nlohmann::json to_json(const plan::Prediction& p, const plan::StepTrace& st, const train::JobConfig& c, const Target& t,
                       const plan::RunCost& run, std::optional<double> price) {
  nlohmann::json j = layout_keys(c);
  j["machine"] = p.machine;
  j["machine_origin"] = t.origin;
  j["flavor"] = c.model.flavor;
  j["dtype"] = std::string(name_of(st.shape.dtype));
  j["tokens_per_step"] = st.shape.tokens;
  put_summary(j, p, t);
  j["peak_flops"] = p.peak_flops;
  j["mfu_peak"] = std::string(name_of(st.shape.dtype));  // a float8 run's MFU is against the bf16 peak
  j["float8_gemms"] = p.float8_gemms;
  const nlohmann::json time = class_times(p);
  const MemoryBreakdown& b = p.memory;
  const std::size_t temporaries = b[MemoryUse::temporary] - std::min(b.saved_activations, b[MemoryUse::temporary]);
  nlohmann::json memory = {{"parameters", b[MemoryUse::parameters]},
                           {"gradients", b[MemoryUse::gradients]},
                           {"optimizer", b[MemoryUse::optimizer]},
                           {"saved_activations", b.saved_activations},
                           {"temporaries", temporaries},
                           {"workspace", b[MemoryUse::workspace]},
                           {"reserved", t.reserved_bytes}};
  j["breakdown"] = {{"time", time}, {"memory", memory}};
  j["offloaded_bytes"] = st.offloaded_bytes;  // host memory at its peak (training.enable_cpu_offload)
  j["host_seconds"] = p.host_seconds;                // the host's loops (in the classes)
  j["hidden_host_seconds"] = p.hidden_host_seconds;  // of which beside the device's work
  j["costliest"] = costliest_json(p);
  j["run"] = run_json(run, price);
  j["host_reads"] = p.host_reads;
  j["unpriced_kernels"] = p.unpriced_kernels;
  j["trace_seconds"] = st.seconds;
  j["operations"] = st.trace.events().size();
  return j;
}

void print(const plan::Prediction& p, const plan::StepTrace& st, const train::JobConfig& c, const Target& t,
           const plan::RunCost& run, std::optional<double> price) {
  const auto& a = c.model.args;
  std::printf("tessera llama-plan: %s | %lld layers, dim %lld, %lld heads (%lld kv), vocab %lld | %.2fB parameters\n",
              c.model.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
              static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
              static_cast<long long>(a.vocab_size), static_cast<double>(a.num_params()) / 1e9);
  std::printf("  %s, batch %lld x seq %lld = %lld tokens/step, activation checkpointing: %s | one rank on %s (%s)\n",
              std::string(name_of(st.shape.dtype)).c_str(),
              static_cast<long long>(st.shape.tokens / st.shape.seq_len), static_cast<long long>(st.shape.seq_len),
              static_cast<long long>(st.shape.tokens), checkpointing_text(c).c_str(), p.machine.c_str(),
              t.origin.c_str());
  std::size_t ops = 0;
  for (const auto& e : st.trace.events()) ops += !std::holds_alternative<trace::Memory>(e.op);
  if (!t.cpu)
    std::printf("  attention: %s\n", t.attention.why.c_str());
  std::printf("  traced in %.3f s: %zu operations, %lld host reads (each a device synchronisation)\n\n", st.seconds, ops,
              static_cast<long long>(p.host_reads));
  std::printf("step %s | %.0f tokens/s | MFU %.1f%% (causal %.1f%%) against %.1f TFLOP/s (%s) | peak %s of %s usable: %s\n\n",
              seconds_text(p.step_seconds).c_str(), p.tokens_per_sec, p.mfu_pct, p.mfu_causal_pct, p.peak_flops / 1e12,
              mfu_peak_text(st.shape, p.float8_gemms, t).c_str(), peak_text(p).c_str(), gib(p.usable_bytes).c_str(),
              fit_text(p, c).c_str());
  print_run(run, price, t.cpu);
  std::printf("time by class\n");
  for (const auto& [name, ct] : p.by_class)
    std::printf("  %-24s %10s  %5.1f%%  (%lld)\n", name.c_str(), seconds_text(ct.seconds).c_str(),
                p.step_seconds > 0 ? 100 * ct.seconds / p.step_seconds : 0.0, static_cast<long long>(ct.count));
  print_hidden_host(p.host_seconds, p.hidden_host_seconds);
  const MemoryBreakdown& b = p.memory;
  const std::size_t temporaries = b[MemoryUse::temporary] - std::min(b.saved_activations, b[MemoryUse::temporary]);
  std::printf("\nmemory at the peak\n");
  std::printf("  %-24s %12s\n", "parameters", gib(static_cast<double>(b[MemoryUse::parameters])).c_str());
  std::printf("  %-24s %12s\n", "gradients", gib(static_cast<double>(b[MemoryUse::gradients])).c_str());
  std::printf("  %-24s %12s  (%s moments, fp32 masters)\n", "optimizer",
              gib(static_cast<double>(b[MemoryUse::optimizer])).c_str(), c.optimizer.state_dtype.c_str());
  std::printf("  %-24s %12s\n", "saved activations", gib(static_cast<double>(b.saved_activations)).c_str());
  std::printf("  %-24s %12s\n", "temporaries", gib(static_cast<double>(temporaries)).c_str());
  std::printf("  %-24s %12s\n", "workspace", gib(static_cast<double>(b[MemoryUse::workspace])).c_str());
  if (!t.cpu)
    std::printf("  %-24s %12s  (CUDA context, library workspaces: machine file)\n", "reserved",
                gib(t.reserved_bytes).c_str());
  if (st.offloaded_bytes > 0)
    std::printf("  %-24s %12s  (host memory of this rank: shards, gradients, optimizer state)\n", "offloaded",
                gib(static_cast<double>(st.offloaded_bytes)).c_str());
  std::printf("\ncostliest operations\n");
  print_costliest(p, p.step_seconds);
  if (p.unpriced_kernels > 0)
    std::printf("\nnote: %lld launches of functors without traffic() are priced as nothing\n",
                static_cast<long long>(p.unpriced_kernels));
}

/// The world the layout spans: --gpus, else the product of the degrees (-1 counting 1).
int world_of(const train::JobConfig& c, std::int64_t gpus) {
  if (gpus > 0) return static_cast<int>(gpus);
  const auto& p = c.parallelism;
  std::int64_t w = 1;
  for (std::int64_t d : {p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree,
                         p.pipeline_parallel_degree, p.context_parallel_degree})
    w *= std::max<std::int64_t>(d, 1);
  TESSERA_CHECK(w <= (1 << 24), "parallelism: the degrees multiply to ", w, " ranks; give --gpus");
  return static_cast<int>(w);
}

/// `c` with the layout's degrees and batch resolved as the ranks will resolve them: what
/// --emit-config writes and --json reports.
train::JobConfig resolved(train::JobConfig c, const comm::MeshShape& mesh) {
  auto& p = c.parallelism;
  p.data_parallel_replicate_degree = mesh.dp_replicate;
  p.data_parallel_shard_degree = mesh.dp_shard;
  p.tensor_parallel_degree = mesh.tp;
  p.pipeline_parallel_degree = mesh.pp;
  p.context_parallel_degree = mesh.cp;
  if (c.training.global_batch_size <= 0) c.training.global_batch_size = c.training.local_batch_size * mesh.dp();
  return c;
}

/// How llama-plan counts a layout's memory: tessera's own (traced), or another runtime's.
struct MemoryModel {
  bool zero1 = false;
  std::optional<plan::ScalingRun> scaling;   // plan.runtime scaling
  std::optional<plan::TorchtitanRun> torchtitan;  // plan.runtime torchtitan (time only)
  std::vector<plan::ScalingStage> stages;    // its stages' memory, in pipeline order
};

/// Puts the runtime's memory in place of the traced one: each position's peak and fit,
/// and the layout's.
void apply_memory(plan::LayoutPrediction& l, const MemoryModel& mm) {
  if (!mm.scaling) return;
  TESSERA_CHECK(mm.stages.size() == l.positions.size(), "plan.runtime scaling: ", mm.stages.size(), " stages for ",
                l.positions.size(), " pipeline positions");
  l.peak_memory_bytes = 0;
  l.reserved_memory_bytes = 0;
  l.fits = true;
  for (std::size_t i = 0; i < l.positions.size(); ++i) {
    plan::Prediction& p = l.positions[i].compute;
    // What that runtime keeps, and what PyTorch's caching allocator reserves for it.
    p.peak_memory_bytes = static_cast<std::size_t>(mm.stages[i].peak_bytes);
    p.reserved_memory_bytes = static_cast<std::size_t>(mm.stages[i].reserved_bytes);
    p.fits = mm.stages[i].reserved_bytes <= l.usable_bytes;
    l.peak_memory_bytes = std::max(l.peak_memory_bytes, p.peak_memory_bytes);
    l.reserved_memory_bytes = std::max(l.reserved_memory_bytes, p.reserved_memory_bytes);
    l.fits = l.fits && p.fits;
  }
}

nlohmann::json layout_json(const plan::LayoutPrediction& l, const std::vector<plan::StepTrace>& traces,
                           const train::JobConfig& c, const Target& t, const MemoryModel& mm, const plan::RunCost& run,
                           std::optional<double> price) {
  nlohmann::json j = layout_keys(c);
  j["plan.zero1"] = mm.zero1;
  j["plan.runtime"] = mm.scaling ? "scaling" : mm.torchtitan ? "torchtitan" : "tessera";
  if (mm.scaling) {
    j["plan.attention"] = std::string(plan::scaling_attention_name(mm.scaling->attention));
    j["plan.rmsnorm"] = std::string(plan::scaling_rmsnorm_name(mm.scaling->fused_rmsnorm));
    j["plan.fragmentation"] = mm.scaling->fragmentation;
  }
  if (mm.torchtitan) j["plan.rmsnorm"] = mm.torchtitan->fused_rmsnorm ? "fused" : "torch";
  j["machine"] = l.positions.front().compute.machine;
  j["machine_origin"] = t.origin;
  j["gpus"] = l.gpus;
  j["mesh"] = l.mesh.str();
  j["flavor"] = c.model.flavor;
  j["dtype"] = std::string(name_of(traces.front().shape.dtype));
  j["tokens_per_step"] = traces.front().shape.tokens;
  put_summary(j, l, t);
  j["mfu_peak"] = std::string(name_of(traces.front().shape.dtype));  // a float8 run's MFU is against the bf16 peak
  j["float8_gemms"] = float8_gemms(l);
  j["exposed_comm_seconds"] = l.exposed_comm_seconds;
  j["pipeline_wait_seconds"] = l.pipeline_wait_seconds;
  j["collective_sm_seconds"] = l.collective_sm_seconds;
  j["run"] = run_json(run, price);
  nlohmann::json positions = nlohmann::json::array();
  for (std::size_t i = 0; i < l.positions.size(); ++i) {
    const plan::PositionPrediction& p = l.positions[i];
    positions.push_back({{"rank", p.rank},
                         {"end_seconds", p.time.end_seconds},
                         {"compute_seconds", p.time.compute_seconds},
                         {"exposed_comm_seconds", p.time.exposed_comm_seconds},
                         {"pipeline_wait_seconds", p.time.pipeline_wait_seconds},
                         {"comm_seconds", p.time.comm_seconds},
                         {"collective_sm_seconds", p.time.collective_sm_seconds},
                         {"host_seconds", p.time.host_seconds},
                         {"hidden_host_seconds", p.time.hidden_host_seconds},
                         {"collectives", p.time.collectives},
                         {"peak_memory_bytes", p.compute.peak_memory_bytes},
                         {"reserved_memory_bytes", p.compute.reserved_memory_bytes},
                         {"fits", p.compute.fits},
                         {"time", class_times(p.compute)},
                         {"costliest", costliest_json(p.compute)},
                         {"trace_seconds", traces[i].seconds}});
    if (mm.scaling) {
      const plan::ScalingStage& st = mm.stages[i];
      positions.back()["scaling_memory"] = {{"layers", st.layers},
                                            {"parameters", st.parameters},
                                            {"in_flight", st.in_flight},
                                            {"state_bytes", st.state_bytes},
                                            {"activation_bytes", st.activation_bytes},
                                            {"loss_bytes", st.loss_bytes},
                                            {"step_bytes", st.step_bytes},
                                            {"reserved_bytes", st.reserved_bytes}};
    }
  }
  j["positions"] = positions;
  return j;
}

void print_layout(const plan::LayoutPrediction& l, const std::vector<plan::StepTrace>& traces,
                  const train::JobConfig& c, const Target& t, const MemoryModel& mm, const plan::RunCost& run,
                  std::optional<double> price) {
  const auto& a = c.model.args;
  const plan::StepShape& shape = traces.front().shape;
  double traced = 0;
  for (const auto& st : traces) traced += st.seconds;
  std::printf("tessera llama-plan: %s | %lld layers, dim %lld, %lld heads (%lld kv), vocab %lld | %.2fB parameters\n",
              c.model.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
              static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
              static_cast<long long>(a.vocab_size), static_cast<double>(a.num_params()) / 1e9);
  std::printf("  %s, global batch %lld x seq %lld = %lld tokens/step, activation checkpointing: %s\n",
              std::string(name_of(shape.dtype)).c_str(), static_cast<long long>(shape.tokens / shape.seq_len),
              static_cast<long long>(shape.seq_len), static_cast<long long>(shape.tokens),
              checkpointing_text(c).c_str());
  std::printf("  %d GPUs of %s (%s), %g per node | mesh %s", l.gpus, l.positions.front().compute.machine.c_str(),
              t.origin.c_str(), t.network ? t.network->gpus_per_node.value : 1.0, l.mesh.str().c_str());
  if (mm.zero1) std::printf(" as ZeRO-1 over the %d data-parallel ranks", l.mesh.dp());
  if (l.mesh.pp > 1)
    std::printf(", schedule %s, microbatch %lld", c.parallelism.pipeline_parallel_schedule.c_str(),
                static_cast<long long>(c.parallelism.pipeline_parallel_microbatch_size));
  std::printf("\n");
  if (!t.cpu) std::printf("  attention: %s\n", t.attention.why.c_str());
  if (mm.scaling) {
    std::printf("  memory: as Aleph Alpha's scaling holds it (attention %s, RMSNorm %s; plan/scaling_memory.hpp), not "
                "traced; reserved by PyTorch's caching allocator at %.0f%% fragmentation\n",
                std::string(plan::scaling_attention_name(mm.scaling->attention)).c_str(),
                std::string(plan::scaling_rmsnorm_name(mm.scaling->fused_rmsnorm)).c_str(),
                100 * mm.scaling->fragmentation);
    std::printf("  time: traced without sequence parallelism, as the runtime runs it: eager kernels%s, an all-reduce "
                "per linear, bf16 gradients accumulated, all-reduced in fp32 after the backward (plan/scaling_time.hpp)\n",
                mm.scaling->fused_rmsnorm ? "" : " (its torch RMSNorm among them)");
  }
  if (mm.torchtitan)
    std::printf("  time: as torchtitan's eager FSDP2 step runs it (RMSNorm %s; plan/torchtitan_time.hpp); memory traced\n",
                mm.torchtitan->fused_rmsnorm ? "Triton" : "eager");
  std::printf("  traced %zu pipeline position%s in %.3f s\n", traces.size(), traces.size() == 1 ? "" : "s", traced);
  if (t.cpu && l.gpus > 1)
    std::printf("  note: each rank is priced on the whole CPU as measured (%s); ranks that share its cores run slower\n",
                l.positions.front().compute.machine.c_str());
  std::printf("\n");
  std::printf("step %s | %.0f tokens/s per GPU | MFU %.1f%% (causal %.1f%%, %s) | peak %s of %s usable: %s\n\n",
              seconds_text(l.step_seconds).c_str(), l.tokens_per_sec, l.mfu_pct, l.mfu_causal_pct,
              mfu_peak_text(shape, float8_gemms(l), t).c_str(), peak_text(l).c_str(), gib(l.usable_bytes).c_str(),
              fit_text(l, c).c_str());
  print_run(run, price, t.cpu);
  std::printf("position  rank      compute  exposed comm  pipeline wait  comm (all)  collectives   peak memory      reserved\n");
  for (std::size_t i = 0; i < l.positions.size(); ++i) {
    const plan::PositionPrediction& p = l.positions[i];
    // The allocator's reservation where it holds more than the live peak (what must fit).
    const bool more = p.compute.reserved_memory_bytes > p.compute.peak_memory_bytes;
    std::printf("%8zu  %4d  %11s  %12s  %13s  %10s  %11lld  %12s  %12s%s\n", i, p.rank,
                seconds_text(p.time.compute_seconds).c_str(), seconds_text(p.time.exposed_comm_seconds).c_str(),
                seconds_text(p.time.pipeline_wait_seconds).c_str(), seconds_text(p.time.comm_seconds).c_str(),
                static_cast<long long>(p.time.collectives), gib(static_cast<double>(p.compute.peak_memory_bytes)).c_str(),
                more ? gib(static_cast<double>(p.compute.reserved_memory_bytes)).c_str() : "-",
                p.compute.fits ? "" : "  does NOT fit");
  }
  // The position the step waits for, by class.
  std::size_t last = 0;
  for (std::size_t i = 1; i < l.positions.size(); ++i)
    if (l.positions[i].time.end_seconds > l.positions[last].time.end_seconds) last = i;
  const plan::PositionPrediction& p = l.positions[last];
  std::printf("\nposition %zu's compute by class (the last to finish)\n", last);
  for (const auto& [name, ct] : p.compute.by_class)
    std::printf("  %-24s %10s  %5.1f%%  (%lld)\n", name.c_str(), seconds_text(ct.seconds).c_str(),
                l.step_seconds > 0 ? 100 * ct.seconds / l.step_seconds : 0.0, static_cast<long long>(ct.count));
  if (p.time.collective_sm_seconds > 0)
    std::printf("  and %s more of GEMMs and attention on the SMs the collectives between nodes leave them "
                "(plan/cluster.hpp)\n", seconds_text(p.time.collective_sm_seconds).c_str());
  print_hidden_host(p.time.host_seconds, p.time.hidden_host_seconds);
  if (!p.compute.top.empty()) {
    std::printf("\nposition %zu's costliest operations\n", last);
    print_costliest(p.compute, l.step_seconds);
  }
}

void emit_config(const std::string& path, const train::JobConfig& c) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TESSERA_CHECK(out.good(), "--emit-config ", path, ": cannot open for writing");
  out << "# Written by llama-plan: the layout it planned, as a llama-train config.\n" << train::to_toml(c);
  out.close();
  TESSERA_CHECK(out.good(), "--emit-config ", path, ": cannot write");
}

void emit_memory_snapshot(const std::string& path, const train::JobConfig& c, bool bf16_model, std::size_t device_bytes,
                          int world) {
  const std::string pickle = llama_plan::memory_snapshot(c, bf16_model, device_bytes, world, 0);
  io::write_memory_snapshot(path, pickle, "--emit-memory-snapshot");
}

void emit_schedule(const std::string& path, const train::JobConfig& c) {
  TESSERA_CHECK(c.parallelism.pipeline_parallel_degree > 1, "--emit-schedule ", path, ": the layout has no pipeline "
                "(parallelism.pipeline_parallel_degree = ", c.parallelism.pipeline_parallel_degree, ")");
  const std::string text = parallel::format_csv(train::pipeline_schedule(c));
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  TESSERA_CHECK(out.good(), "--emit-schedule ", path, ": cannot open for writing");
  out << text;
  out.close();
  TESSERA_CHECK(out.good(), "--emit-schedule ", path, ": cannot write");
}

/// One weighting of the ends of a pipeline's even split, priced (--plan.balance_stages).
struct Balance {
  int first = 1, last = 1;  // the layers the embedding and the output count as
  std::vector<int> blocks;  // per stage
  plan::LayoutPrediction layout;
};

/// The layouts --plan.balance_stages prices: `c` with the embedding counted as 0-2 layers
/// and the output as 0-4 in the even split, each split of the blocks once (by the first
/// weighting that makes it), fastest first of those that fit, then the rest; `refused`,
/// the weightings the runtime refuses (a stage left with nothing), and `why`, the first
/// one's reason.
std::vector<Balance> balance_stages(const train::JobConfig& c, int world, const Target& target, bool bf16_model,
                                    int& refused, std::string& why) {
  const comm::MeshShape mesh = plan::check_dry_run(c, world);
  const int L = static_cast<int>(c.model.args.n_layers);
  std::vector<Balance> out;
  refused = 0;
  for (int first = 0; first <= 2; ++first)
    for (int last = 0; last <= 4; ++last) {
      train::JobConfig v = c;
      v.parallelism.pipeline_parallel_first_stage_less_layers = first;
      v.parallelism.pipeline_parallel_last_stage_less_layers = last;
      Balance b;
      b.first = first;
      b.last = last;
      try {
        const parallel::PipelineOptions o = train::pipeline_options(v);
        for (const auto& st : parallel::pipeline_stages(o.schedule, o, L, mesh.pp).stages) b.blocks.push_back(st.blocks());
        if (std::any_of(out.begin(), out.end(), [&](const Balance& x) { return x.blocks == b.blocks; }))
          continue;  // the same stages as a weighting already priced
        std::vector<plan::StepTrace> traces;
        for (int rank : plan::distinct_ranks(mesh, v))
          traces.push_back(llama_plan::trace_step(v, bf16_model, target.device_bytes, world, rank));
        b.layout = plan::predict_layout(traces, *target.pricer, target.network.value_or(plan::Network{}), 0);
      } catch (const Error& e) {  // what the runtime would refuse for this weighting
        if (refused++ == 0) why = tessera::detail::concat("first ", first, ", last ", last, ": ", e.what());
        continue;
      }
      out.push_back(std::move(b));
    }
  std::stable_sort(out.begin(), out.end(), [](const Balance& a, const Balance& b) {
    if (a.layout.fits != b.layout.fits) return a.layout.fits;
    return a.layout.step_seconds < b.layout.step_seconds;
  });
  return out;
}

/// The row among `rows` with `c`'s own split of the blocks, or nullptr.
const Balance* balance_of(const std::vector<Balance>& rows, const train::JobConfig& c) {
  const parallel::PipelineOptions o = train::pipeline_options(c);
  std::vector<int> blocks;
  for (const auto& st : parallel::pipeline_stages(o.schedule, o, static_cast<int>(c.model.args.n_layers),
                                                  static_cast<int>(c.parallelism.pipeline_parallel_degree))
                            .stages)
    blocks.push_back(st.blocks());
  for (const Balance& b : rows)
    if (b.blocks == blocks) return &b;
  return nullptr;
}

std::string blocks_text(const std::vector<int>& blocks) {
  std::string t;
  for (int b : blocks) t += (t.empty() ? "" : " ") + std::to_string(b);
  return t;
}

/// "a, b, c".
std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (const std::string& i : items) s += (s.empty() ? "" : ", ") + i;
  return s;
}

/// A searched layout's row; `float8`: with its float8 recipe ("-" without float8).
std::string layout_text(const train::JobConfig& c, bool float8) {
  const auto& p = c.parallelism;
  std::string ac = c.activation_checkpoint.mode;
  if (ac == "selective") ac += c.activation_checkpoint.selective_ac_option == "op" ? " op" : " every " + c.activation_checkpoint.selective_ac_option;
  if (c.activation_checkpoint.recompute_swiglu) ac += ", SwiGLU";
  char t[200];
  std::snprintf(t, sizeof t, "%4lld %5lld %3lld %3lld %3lld  %-21s %3lld  %-13s %-7s",
                static_cast<long long>(p.data_parallel_replicate_degree), static_cast<long long>(p.data_parallel_shard_degree),
                static_cast<long long>(p.context_parallel_degree), static_cast<long long>(p.tensor_parallel_degree),
                static_cast<long long>(p.pipeline_parallel_degree),
                p.pipeline_parallel_degree > 1 ? p.pipeline_parallel_schedule.c_str() : "-",
                static_cast<long long>(p.pipeline_parallel_degree > 1 ? p.pipeline_parallel_microbatch_size
                                                                      : c.training.local_batch_size),
                ac.c_str(),
                p.data_parallel_shard_degree * p.context_parallel_degree > 1 ? p.fsdp_reshard_after_forward.c_str() : "-");
  std::string row = t;
  if (float8) {
    const std::string recipe = plan::float8_recipe(c);
    std::snprintf(t, sizeof t, " %-18s", recipe.empty() ? "-" : recipe.c_str());
    row += t;
  }
  return row;
}

std::string layout_brief(const train::JobConfig& c) {
  const auto& p = c.parallelism;
  return tessera::detail::concat("replicate ", p.data_parallel_replicate_degree, ", shard ", p.data_parallel_shard_degree,
                                 p.context_parallel_degree > 1 ? tessera::detail::concat(", context ", p.context_parallel_degree)
                                                               : std::string(),
                                 ", tensor ", p.tensor_parallel_degree, ", pipeline ", p.pipeline_parallel_degree,
                                 p.pipeline_parallel_degree > 1 ? " " + p.pipeline_parallel_schedule : std::string(),
                                 ", microbatch ",
                                 p.pipeline_parallel_degree > 1 ? p.pipeline_parallel_microbatch_size : c.training.local_batch_size,
                                 ", checkpoint ", c.activation_checkpoint.mode,
                                 train::float8_enabled(c) ? ", float8 " + c.float8.recipe_name : std::string());
}

/// When no layout fits: the search again with each memory lever the config leaves off
/// (bf16 moments; the early step, which clips nothing; CPU offload; offload with the
/// early step), a line each on stdout: its fastest layout that fits, or its smallest
/// peak. Returns whether it printed any.
bool print_memory_levers(const train::JobConfig& given, const plan::SearchSpace& space, std::int64_t global,
                         const plan::TraceRank& trace_rank, const Target& target) {
  struct Lever {
    const char* keys;   // as the config says it
    const char* costs;  // what it costs the run
    std::function<void(train::JobConfig&)> apply;
  };
  const bool bf16_moments = given.optimizer.state_dtype == "bfloat16";
  const bool early = given.optimizer.early_step_in_backward, offload = given.training.enable_cpu_offload;
  const auto moments = [](train::JobConfig& c) { c.optimizer.state_dtype = "bfloat16"; };
  const auto early_step = [](train::JobConfig& c) {
    c.optimizer.early_step_in_backward = true;
    c.training.max_norm = 0;
  };
  const auto offloaded = [](train::JobConfig& c) { c.training.enable_cpu_offload = true; };
  std::vector<Lever> levers;
  if (!bf16_moments) levers.push_back({"optimizer.state_dtype = bfloat16", "AdamW's moments stored in bf16", moments});
  if (!early && !bf16_moments)
    levers.push_back({"optimizer.state_dtype = bfloat16, optimizer.early_step_in_backward = true, training.max_norm = 0",
                      "bf16 moments and no gradient clipping", [&](train::JobConfig& c) {
                        moments(c);
                        early_step(c);
                      }});
  if (!early && bf16_moments)
    levers.push_back({"optimizer.early_step_in_backward = true, training.max_norm = 0", "no gradient clipping", early_step});
  if (!offload)
    levers.push_back({"training.enable_cpu_offload = true", "AdamW on the host's cores, the shards over the host link",
                      offloaded});
  if (!offload && !early)
    levers.push_back({"training.enable_cpu_offload = true, optimizer.early_step_in_backward = true, training.max_norm = 0",
                      "AdamW on the host beside the backward, no gradient clipping", [&](train::JobConfig& c) {
                        offloaded(c);
                        early_step(c);
                      }});
  if (levers.empty()) return false;
  std::printf("nothing fits as configured; with the memory levers the config leaves off, each searched whole:\n");
  for (const Lever& l : levers) {
    std::string line;
    try {
      train::JobConfig c = given;
      l.apply(c);
      const plan::SearchReport r =
          plan::search_layouts(c, space, global, trace_rank, *target.pricer, target.network.value_or(plan::Network{}));
      const plan::SearchResult* best = r.layouts.empty() ? nullptr : &r.layouts.front();
      char figures[96];
      if (best && best->fits) {
        std::snprintf(figures, sizeof figures, "%.0f tokens/s per GPU, MFU %.1f%%, ", best->tokens_per_sec, best->mfu_pct);
        line = tessera::detail::concat("fits: ", figures, size_text(static_cast<double>(best->reserved_memory_bytes)),
                                       " (", layout_brief(best->config), ")");
      } else if (best) {
        line = tessera::detail::concat("does not fit: the smallest peak is ",
                                       size_text(static_cast<double>(best->reserved_memory_bytes)), " (",
                                       layout_brief(best->config), ")");
      } else {
        line = tessera::detail::concat("every layout is refused: ", r.first_refusal);
      }
    } catch (const std::exception& e) {
      line = tessera::detail::concat("not searched: ", e.what());
    }
    std::printf("  %s (%s): %s\n", l.keys, l.costs, line.c_str());
  }
  std::fflush(stdout);
  return true;
}

/// --search: every layout of `c`'s model on `world` GPUs of `target`, ranked; with
/// `float8_recipes`, each also in float8 by each recipe (--search.float8).
int search(const train::JobConfig& given, int world, const Target& target, bool bf16_model, bool json,
           const std::string& emit, const std::string& emit_csv, const std::string& emit_memory,
           std::int64_t max_microbatch,
           const std::vector<std::string>& float8_recipes, std::optional<double> price) {
  if (!float8_recipes.empty()) {
    // Refused before anything is traced: float8 casts a bf16 model's values, and is priced
    // at the profile's float8 rates.
    TESSERA_CHECK(bf16_model, "--search.float8: float8 GEMMs cast a bfloat16 model's values, and "
                  "training.mixed_precision_param is \"", given.training.mixed_precision_param, "\" (set it to \"bfloat16\")");
    target.pricer->require_float8("--search.float8's float8 layouts");
  }
  std::int64_t global = given.training.global_batch_size;
  if (global <= 0) {
    comm::MeshShape own;
    try {
      own = plan::check_dry_run(given, world);
    } catch (const std::exception& e) {
      TESSERA_CHECK(false, "--search: training.global_batch_size is -1 and the config's own degrees do not lay out ",
                    world, " GPUs (", e.what(), "); give training.global_batch_size");
    }
    global = given.training.local_batch_size * own.dp();
  }
  plan::SearchSpace space;
  space.gpus = world;
  space.gpus_per_node = target.network ? static_cast<int>(target.network->gpus_per_node.value) : 1;
  space.max_microbatch = max_microbatch;
  space.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  space.float8_recipes = float8_recipes;
  const auto t0 = std::chrono::steady_clock::now();
  const plan::TraceRank trace_rank = [&](const train::JobConfig& c, int w, int rank) {
    return llama_plan::trace_step(c, bf16_model, target.device_bytes, w, rank);
  };
  const plan::SearchReport r =
      plan::search_layouts(given, space, global, trace_rank, *target.pricer, target.network.value_or(plan::Network{}));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& a = given.model.args;
  std::size_t fitting = 0;
  for (const auto& l : r.layouts) fitting += l.fits ? 1 : 0;
  if (fitting == 0) {
    std::string smallest;
    if (!r.layouts.empty())
      smallest = tessera::detail::concat("; the smallest peak is ", size_text(static_cast<double>(r.layouts.front().reserved_memory_bytes)),
                                         " (", layout_brief(r.layouts.front().config), ")");
    else if (!r.first_refusal.empty())
      smallest = tessera::detail::concat("; every layout is refused: ", r.first_refusal);
    // What the memory levers the config leaves off would fit, searched each (text output
    // only): the error line says where to look.
    const bool levers = !json && print_memory_levers(given, space, global, trace_rank, target);
    TESSERA_CHECK(false, "--search: none of the ", r.enumerated, " layouts of ", given.model.flavor, " on ", world,
                  " GPUs of ", target.pricer->name(), " fits in ", size_text(target.pricer->usable_bytes()), " per GPU", smallest,
                  levers ? " (above: what the memory levers the config leaves off would fit)" : "");
  }
  if (!emit.empty()) emit_config(emit, r.layouts.front().config);
  if (!emit_csv.empty()) emit_schedule(emit_csv, r.layouts.front().config);
  if (!emit_memory.empty())
    emit_memory_snapshot(emit_memory, r.layouts.front().config, bf16_model, target.device_bytes, world);
  // The first layout's run, its validation traced on its own positions.
  const auto& first = r.layouts.front();
  const comm::MeshShape first_mesh = plan::check_dry_run(first.config, world);
  const ValidationPlan validation = plan_validation(first.config, first_mesh.dp(), "");
  double validation_batch = 0;
  if (validation.batches > 0) {
    std::vector<plan::StepTrace> vt;
    for (int rank : plan::distinct_ranks(first_mesh, first.config))
      vt.push_back(llama_plan::trace_validation(first.config, bf16_model, target.device_bytes, world, rank));
    validation_batch = plan::predict_layout(vt, *target.pricer, target.network.value_or(plan::Network{}), 0).step_seconds;
  }
  const plan::RunCost run = price_run(first.config, first.step_seconds, global * given.training.seq_len, world,
                                      validation, validation_batch);
  if (json) {
    nlohmann::json layouts = nlohmann::json::array();
    for (const auto& l : r.layouts) {
      nlohmann::json j = layout_keys(l.config);
      put_figures(j, l);
      j["exposed_comm_seconds"] = l.exposed_comm_seconds;
      j["pipeline_wait_seconds"] = l.pipeline_wait_seconds;
      j["collective_sm_seconds"] = l.collective_sm_seconds;
      j["extrapolated"] = l.extrapolated;
      layouts.push_back(std::move(j));
    }
    nlohmann::json out;
    out["layouts"] = std::move(layouts);
    out["run"] = run_json(run, price);  // the first layout's
    out["search"] = {{"gpus", world},
                     {"machine", target.pricer->name()},
                     {"float8_recipes", float8_recipes},
                     {"mfu_peak", bf16_model ? "bfloat16" : "float32"},
                     {"flavor", given.model.flavor},
                     {"global_batch_size", global},
                     {"enumerated", r.enumerated},
                     {"priced", r.priced},
                     {"dominated", r.dominated},
                     {"refused", r.refused},
                     {"first_refusal", r.first_refusal},
                     {"fitting", fitting},
                     {"dry_runs", r.dry_runs},
                     {"seconds", seconds},
                     {"checked", r.checked},
                     {"check_step_gap", r.check_step_gap},
                     {"check_memory_gap", r.check_memory_gap}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("tessera llama-plan --search: %s | %lld layers, dim %lld, %lld heads (%lld kv) | %.2fB parameters\n",
              given.model.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
              static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()), static_cast<double>(a.num_params()) / 1e9);
  std::printf("  %d GPUs of %s (%s), global batch %lld x seq %lld\n", world, target.pricer->name().c_str(),
              target.origin.c_str(), static_cast<long long>(global), static_cast<long long>(given.training.seq_len));
  std::printf("  %zu layouts: %zu priced (%d ranks traced in %.1f s), %zu refused by the runtime, %zu not priced (whether\n"
              "  they fit follows from a variant priced); %zu fit, and %zu more not listed (a variant doing less work fits)\n",
              r.enumerated, r.priced, r.dry_runs, seconds, r.refused, r.enumerated - r.priced - r.refused, fitting,
              r.dominated);
  if (r.refused > 0) std::printf("  first refusal: %s\n", r.first_refusal.c_str());
  const bool float8 = !float8_recipes.empty();
  if (float8)
    std::printf("  float8: each layout also with its linear layers' GEMMs in float8 by %s (float8.emulate = false); "
                "MFU against the bf16 peak, float8 layouts included\n",
                joined(float8_recipes).c_str());
  std::printf("\n rank  repl shard  cp  tp  pp  schedule               mb  checkpoint    reshard%s       step  tokens/s/GPU    MFU  peak memory\n",
              float8 ? " float8            " : "");
  const std::size_t shown = std::min<std::size_t>(fitting, 20);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto& l = r.layouts[i];
    std::printf("%5zu  %s %10s %13.0f %5.1f%% %12s%s\n", i + 1, layout_text(l.config, float8).c_str(),
                seconds_text(l.step_seconds).c_str(), l.tokens_per_sec, l.mfu_pct,
                gib(static_cast<double>(l.peak_memory_bytes)).c_str(), l.extrapolated ? "" : "  (full trace)");
  }
  if (fitting > shown) std::printf("  ... %zu more that fit (--json lists them all, and those that do not fit)\n", fitting - shown);
  std::printf("  (full trace): priced from the traces of its own depth and batch; the others extrapolated from small ones\n");
  if (r.checked)
    std::printf("\nthe first layout, predicted from its full traces: step %+.2f%%, peak memory %+.2f%% from its extrapolation\n",
                100 * r.check_step_gap, 100 * r.check_memory_gap);
  std::printf("\nthe first layout's ");
  print_run(run, price, false);
  return 0;
}

/// --search.float8's value: recipes separated by commas, each torchao's (ops/float8.hpp),
/// none twice; "all" for every one.
std::vector<std::string> float8_recipe_list(const std::string& v) {
  if (v == "all") return {std::begin(plan::kFloat8Recipes), std::end(plan::kFloat8Recipes)};
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= v.size()) {
    const std::size_t comma = std::min(v.find(',', at), v.size());
    const std::string r = v.substr(at, comma - at);
    ops::parse_float8_recipe(r, "--search.float8");
    TESSERA_CHECK(std::find(out.begin(), out.end(), r) == out.end(), "--search.float8: ", r, " is given twice");
    out.push_back(r);
    at = comma + 1;
  }
  return out;
}

/// `v`, the value of `flag`, as a whole number in [lo, hi]; else one line naming the flag.
std::int64_t whole_number(const char* flag, const std::string& v, std::int64_t lo, std::int64_t hi,
                          const std::string& expected) {
  std::size_t used = 0;
  std::int64_t n = 0;
  try {
    n = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSERA_CHECK(used == v.size() && n >= lo && n <= hi, flag, " ", v, ": expected ", expected);
  return n;
}

/// `v` as a finite number, the whole of it; nothing where it is not one.
std::optional<double> finite_number(const std::string& v) {
  std::size_t used = 0;
  double f = 0;
  try {
    f = std::stod(v, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != v.size() || !std::isfinite(f)) return std::nullopt;
  return f;
}

int run(std::vector<std::string> args) {
  std::string machine = "h100-sxm", emit, emit_csv, emit_memory;
  std::int64_t gpus = 0;
  bool json = false, zero1 = false, search_all = false;
  bool scaling = false;  // plan.runtime scaling: the memory counted as that runtime holds it
  bool torchtitan = false;  // plan.runtime torchtitan: the time as its eager FSDP2 step runs
  plan::ScalingAttention scaling_attention = plan::ScalingAttention::flash2;
  std::optional<bool> fused_rmsnorm;  // plan.rmsnorm: each runtime has its default
  bool attention_given = false;  // plan.attention: only plan.runtime scaling reads it
  std::optional<double> fragmentation;  // plan.fragmentation: only plan.runtime scaling reads it
  std::int64_t max_microbatch = 8;
  std::vector<std::string> float8_recipes;  // --search.float8: float8 as a search dimension
  std::size_t top = 12;  // plan.top: the costliest kinds of operation listed
  bool balance = false;  // plan.balance_stages: the ends' weights of a pipeline's split priced
  std::optional<double> price;  // plan.gpu_hour_price: what one GPU-hour costs
  auto value_of = [&](std::size_t i, const char* what) {
    TESSERA_CHECK(i + 1 < args.size() && !args[i + 1].empty() && args[i + 1].rfind("--", 0) != 0, args[i],
                  ": expected ", what);
    std::string v = args[i + 1];
    args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i + 2));
    return v;
  };
  for (std::size_t i = 0; i < args.size();) {
    if (args[i] == "--help" || args[i] == "-h") {
      usage();
      return 0;
    }
    if (args[i] == "--json") {
      json = true;
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (args[i] == "--search") {
      search_all = true;
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (args[i] == "--search.max_microbatch") {
      max_microbatch = whole_number("--search.max_microbatch", value_of(i, "a number of sequences"), 1, 1 << 30,
                                    "a positive number");
    } else if (args[i] == "--search.float8") {
      float8_recipes = float8_recipe_list(value_of(i, "float8 recipes (tensorwise,rowwise,rowwise_with_gw_hp or all)"));
    } else if (args[i] == "--machine") {
      machine = value_of(i, "a machine name or a profile FILE.toml");
    } else if (args[i] == "--emit-config") {
      emit = value_of(i, "the FILE.toml to write");
    } else if (args[i] == "--emit-schedule") {
      emit_csv = value_of(i, "the FILE.csv to write");
    } else if (args[i] == "--emit-memory-snapshot") {
      emit_memory = value_of(i, "the FILE.pickle to write");
    } else if (args[i].rfind("--plan.", 0) == 0) {
      // --plan.KEY VALUE or --plan.KEY=VALUE; --plan.zero1 alone is a switch.
      std::string key = args[i].substr(7), v;
      if (const auto eq = key.find('='); eq != std::string::npos) {
        v = key.substr(eq + 1);
        key.resize(eq);
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
        v = value_of(i, "a value");
      } else {
        TESSERA_CHECK(key == "zero1", "--plan.", key, ": expected a value");
        v = "true";
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (key == "zero1") {
        TESSERA_CHECK(v == "true" || v == "false", "--plan.zero1 ", v, ": expected true or false");
        zero1 = v == "true";
      } else if (key == "runtime") {
        TESSERA_CHECK(v == "tessera" || v == "scaling" || v == "torchtitan", "--plan.runtime ", v,
                      ": expected tessera, scaling or torchtitan");
        scaling = v == "scaling";
        torchtitan = v == "torchtitan";
      } else if (key == "attention") {
        scaling_attention = plan::parse_scaling_attention(v);
        attention_given = true;
      } else if (key == "rmsnorm") {
        TESSERA_CHECK(v == "torch" || v == "fused", "--plan.rmsnorm ", v, ": expected torch or fused");
        fused_rmsnorm = v == "fused";
      } else if (key == "balance_stages") {
        TESSERA_CHECK(v == "true" || v == "false", "--plan.balance_stages ", v, ": expected true or false");
        balance = v == "true";
      } else if (key == "top") {
        top = static_cast<std::size_t>(whole_number("--plan.top", v, 0, 1 << 20, "a number of kinds, 0 or more"));
      } else if (key == "gpu_hour_price") {
        price = finite_number(v);
        TESSERA_CHECK(price && *price > 0, "--plan.gpu_hour_price ", v, ": expected the price of one GPU-hour, a positive number");
      } else if (key == "fragmentation") {
        fragmentation = finite_number(v);
        TESSERA_CHECK(fragmentation && *fragmentation >= 0 && *fragmentation < 1, "--plan.fragmentation ", v,
                      ": expected a share of the reservation, from 0 up to (not including) 1");
      } else {
        TESSERA_CHECK(false, "--plan.", key, ": unknown key (known: plan.zero1, plan.runtime, plan.attention, "
                      "plan.rmsnorm, plan.fragmentation, plan.top, plan.balance_stages, plan.gpu_hour_price)");
      }
    } else if (args[i] == "--gpus") {
      gpus = whole_number("--gpus", value_of(i, "a number of GPUs"), 1, 1 << 24,
                          "a number of GPUs from 1 to " + std::to_string(1 << 24));
    } else {
      ++i;
    }
  }
  TESSERA_CHECK(scaling || !attention_given,
                "--plan.attention: describes the scaling runtime; give --plan.runtime scaling with it");
  TESSERA_CHECK(scaling || !fragmentation,
                "--plan.fragmentation: describes the scaling runtime's allocator; give --plan.runtime scaling with it");
  TESSERA_CHECK(scaling || torchtitan || !fused_rmsnorm, "--plan.rmsnorm: describes another runtime's RMSNorm; give "
                "--plan.runtime scaling or torchtitan with it");
  zero1 = zero1 || scaling;  // the runtime's data parallelism is ZeRO-1
  train::JobConfig given = train::load_config("", args);
  train::resolve_mixed_precision(given, machine != "cpu");  // what llama-train would train there
  // The other runtimes' accounts move the optimizer's region, which closes a step, and the
  // early step updates each unit inside the backward.
  TESSERA_CHECK(!(zero1 || torchtitan) || !given.optimizer.early_step_in_backward,
                "optimizer.early_step_in_backward: ", scaling ? "plan.runtime scaling" : torchtitan ? "plan.runtime torchtitan" : "plan.zero1",
                " prices another runtime's optimizer step, after the backward; price the early step as tessera runs it "
                "(without that flag)");
  // ZeRO-1 and the other runtimes' counts are of data-parallel replicas and their own
  // layouts; context-parallel ranks shard the parameters (FSDP over dp_shard x cp).
  TESSERA_CHECK(!zero1 || given.parallelism.context_parallel_degree == 1, "parallelism.context_parallel_degree ",
                given.parallelism.context_parallel_degree, ": ", scaling ? "plan.runtime scaling counts" : "plan.zero1 accounts",
                " data-parallel replicas, and context-parallel ranks shard the parameters (FSDP over dp_shard x cp)");
  if (scaling) {
    // The runtime's own stage split, so that the trace prices the layers where it placed them.
    auto& p = given.parallelism;
    TESSERA_CHECK(p.pipeline_parallel_split_points.empty(), "parallelism.pipeline_parallel_split_points: plan.runtime "
                  "scaling splits the stages as that runtime does (uniformly over embedding, layers, norm and head)");
    TESSERA_CHECK(p.pipeline_parallel_degree == 1 || p.pipeline_parallel_schedule == "1F1B",
                  "parallelism.pipeline_parallel_schedule ", p.pipeline_parallel_schedule,
                  ": plan.runtime scaling runs 1F1B");
    TESSERA_CHECK(given.activation_checkpoint.mode == "none" || given.activation_checkpoint.mode == "full",
                  "activation_checkpoint.mode ", given.activation_checkpoint.mode,
                  ": plan.runtime scaling checkpoints every layer (full) or none");
    // Its tensor parallelism keeps every row on every rank (topology.sequence_parallel is
    // off by default, and in the sheets): traced as tessera runs that layout.
    p.disable_sequence_parallel = true;
    if (p.pipeline_parallel_degree > 1)
      p.pipeline_parallel_split_points =
          plan::scaling_split_points(static_cast<int>(given.model.args.n_layers), static_cast<int>(p.pipeline_parallel_degree));
  }
  // Both other runtimes run wq, wk and wv (and w1 and w3) as separate linear layers
  // (scaling's attention_qkv_in_one: false): traced so.
  if (scaling || torchtitan) given.model.fuse_projections = false;
  if (torchtitan) {
    const auto& p = given.parallelism;
    TESSERA_CHECK(p.tensor_parallel_degree == 1, "parallelism.tensor_parallel_degree ", p.tensor_parallel_degree,
                  ": plan.runtime torchtitan counts the FSDP layouts of its published table, not its tensor parallelism");
    TESSERA_CHECK(p.pipeline_parallel_degree == 1, "parallelism.pipeline_parallel_degree ", p.pipeline_parallel_degree,
                  ": plan.runtime torchtitan counts the FSDP layouts of its published table, not its pipelines");
    TESSERA_CHECK(p.context_parallel_degree == 1, "parallelism.context_parallel_degree ", p.context_parallel_degree,
                  ": plan.runtime torchtitan counts the FSDP layouts of its published A100 table, not its context "
                  "parallelism (plan tessera's run of the layout)");
    TESSERA_CHECK(!zero1, "--plan.zero1: plan.runtime torchtitan runs FSDP, not ZeRO-1");
    TESSERA_CHECK(!search_all, "--search: plan.runtime torchtitan prices one layout of that runtime; the search ranks "
                  "tessera's");
    TESSERA_CHECK(machine != "cpu", "--machine cpu: plan.runtime torchtitan prices that runtime's CUDA step; give a GPU "
                  "--machine");
  }
  const int world = world_of(given, gpus);
  // A cluster is priced on the profile's [network], in whole nodes.
  auto check_cluster = [&](const Target& t) {
    if (world == 1 || t.cpu) return;
    TESSERA_CHECK(t.network.has_value(), "--machine ", machine, ": the profile has no [network] section, so ", world,
                  " GPUs cannot be priced (", t.origin, ")");
    const auto gpn = static_cast<int>(t.network->gpus_per_node.value);
    TESSERA_CHECK(world <= gpn || world % gpn == 0, "--gpus ", world, ": not whole nodes of ", gpn,
                  " GPUs (the machine's [network] gpus_per_node)");
  };
  if (search_all) {
    TESSERA_CHECK(!zero1, "--search: plan.zero1 is a layout tessera's runtime does not run (plan.runtime scaling is "
                  "another runtime's); the search ranks the ones it does");
    TESSERA_CHECK(machine != "cpu", "--search: plans GPU clusters; give a GPU --machine (for this machine's CPU, plan one layout)");
    const bool bf16 = given.training.mixed_precision_param == "bfloat16";
    const Target t = resolve_machine(machine, trace::Trace{}, given.training.attention, bf16 ? DType::bf16 : DType::f32,
                                     given.model.args.head_dim(), 1, given.training.document_mask,
                                     given.parallelism.context_parallel_degree > 1);
    check_cluster(t);
    TESSERA_CHECK(!balance, "--plan.balance_stages: weighs one layout's stages; not with --search");
    return search(given, world, t, bf16, json, emit, emit_csv, emit_memory, max_microbatch, float8_recipes, price);
  }
  TESSERA_CHECK(float8_recipes.empty(), "--search.float8: a dimension of --search; give --search with it (one layout "
                "in float8: model.converters = [\"float8\"], float8.recipe_name, float8.emulate = false)");
  comm::MeshShape mesh = plan::check_dry_run(given, world);
  train::JobConfig c = resolved(given, mesh);
  if (zero1) {
    // Traced as data-parallel replicas, then accounted as ZeRO-1 (plan::account_zero1).
    TESSERA_CHECK(emit.empty(), "--emit-config: plan.zero1 is a layout tessera's runtime does not run");
    TESSERA_CHECK(emit_csv.empty(), "--emit-schedule: plan.zero1 is a layout tessera's runtime does not run");
    c.parallelism.data_parallel_replicate_degree = mesh.dp();
    c.parallelism.data_parallel_shard_degree = 1;
    mesh = plan::check_dry_run(c, world);
  }
  // A GPU trains the bf16 model when the parameters are bf16 (llama-train's choice there).
  const bool cpu = machine == "cpu";
  const bool bf16_model = !cpu && c.training.mixed_precision_param == "bfloat16";
  // A bad machine file is refused before anything is traced; the CPU is measured on the trace.
  const DType dtype = bf16_model ? DType::bf16 : DType::f32;
  Target target;
  const std::int64_t hd = c.model.args.head_dim();
  if (!cpu) {
    target = resolve_machine(machine, trace::Trace{}, c.training.attention, dtype, hd, 1, c.training.document_mask,
                             c.parallelism.context_parallel_degree > 1);
    check_cluster(target);
    if (train::float8_enabled(c) && !c.float8.emulate)
      target.pricer->require_float8("model.converters = [\"float8\"] with float8.emulate = false (the GPU's float8 GEMMs)");
  }
  const std::string other_runtime = scaling ? "plan.runtime scaling" : torchtitan ? "plan.runtime torchtitan"
                                    : zero1 ? "plan.zero1" : "";
  if (balance) {
    TESSERA_CHECK(mesh.pp > 1, "--plan.balance_stages: weighs the ends of a pipeline's stages; the layout has none "
                  "(parallelism.pipeline_parallel_degree = 1)");
    TESSERA_CHECK(c.parallelism.pipeline_parallel_split_points.empty() &&
                      !c.parallelism.pipeline_parallel_layers_per_stage,
                  "--plan.balance_stages: weighs the ends of the even split; parallelism.pipeline_parallel_split_points"
                  " or pipeline_parallel_layers_per_stage place the stages themselves");
    TESSERA_CHECK(!cpu && other_runtime.empty(), "--plan.balance_stages: prices tessera's step on a GPU --machine",
                  other_runtime.empty() ? "" : ", not with ", other_runtime);
  }
  if (!emit.empty() && !balance) emit_config(emit, c);  // with balance_stages: the fastest weighting, below
  if (!emit_csv.empty()) emit_schedule(emit_csv, c);
  if (!emit_memory.empty()) {
    TESSERA_CHECK(!cpu && other_runtime.empty(), "--emit-memory-snapshot: the CUDA allocator's memory as tessera's step "
                  "uses it on a GPU --machine", other_runtime.empty() ? "" : ", not with ", other_runtime);
    emit_memory_snapshot(emit_memory, c, bf16_model, target.device_bytes, world);
  }
  // The run's validation, traced where it is priced (plan.runtime and plan.zero1 price
  // another runtime's step).
  const ValidationPlan validation = plan_validation(c, mesh.dp(), other_runtime);
  if (world == 1 && !zero1 && !torchtitan) {
    plan::StepTrace st = llama_plan::trace_step(c, bf16_model, target.device_bytes);
    std::optional<plan::StepTrace> vt;
    if (validation.batches > 0) vt = llama_plan::trace_validation(c, bf16_model, target.device_bytes);
    if (cpu) {
      trace::Trace all = st.trace;  // the CPU is measured on the step's work and the validation's
      if (vt)
        for (const auto& e : vt->trace.events()) all.add(e.op);
      target = resolve_machine(machine, all, c.training.attention, dtype, hd, 1, c.training.document_mask,
                               c.parallelism.context_parallel_degree > 1);
    }
    const plan::Prediction p = plan::predict(st, *target.pricer, top);
    const plan::RunCost run_cost = price_run(c, p.step_seconds, st.shape.tokens, 1, validation,
                                             vt ? plan::predict(*vt, *target.pricer, 0).step_seconds : 0);
    if (json)
      std::printf("%s\n", to_json(p, st, c, target, run_cost, price).dump(2).c_str());
    else
      print(p, st, c, target, run_cost, price);
    return 0;
  }
  std::vector<plan::StepTrace> traces, validation_traces;
  for (int rank : plan::distinct_ranks(mesh, c)) {
    traces.push_back(llama_plan::trace_step(c, bf16_model, target.device_bytes, world, rank));
    if (validation.batches > 0)
      validation_traces.push_back(llama_plan::trace_validation(c, bf16_model, target.device_bytes, world, rank));
  }
  std::optional<plan::ScalingRun> run;
  if (scaling) {
    run.emplace();
    run->args = c.model.args;
    run->mesh = mesh;
    run->seq_len = c.training.seq_len;
    const std::int64_t per_rank = c.training.global_batch_size / mesh.dp();  // sequences per step on one replica
    run->microbatch = mesh.pp > 1 ? c.parallelism.pipeline_parallel_microbatch_size : c.training.local_batch_size;
    TESSERA_CHECK(run->microbatch >= 1 && per_rank % run->microbatch == 0, "plan.runtime scaling: ", per_rank,
                  " sequences per data-parallel rank do not make whole microbatches of ", run->microbatch);
    run->microbatches = per_rank / run->microbatch;
    run->full_checkpoint = c.activation_checkpoint.mode == "full";
    run->attention = scaling_attention;
    run->fused_rmsnorm = fused_rmsnorm.value_or(false);
    run->fragmentation = fragmentation.value_or(plan::kTorchAllocatorFragmentation);
  }
  if (zero1)
    for (auto& st : traces) plan::account_zero1(st, /*reduce_in_bf16=*/!scaling);
  std::vector<trace::Event> spare;  // the rewrites' second buffer, from position to position
  if (run)  // the step as that runtime runs it in time (plan/scaling_time.hpp)
    for (auto& st : traces) plan::scaling_step_time(st, *run, spare);
  std::optional<plan::TorchtitanRun> titan;
  if (torchtitan) {  // plan/torchtitan_time.hpp
    titan.emplace();
    titan->args = c.model.args;
    titan->fused_rmsnorm = fused_rmsnorm.value_or(true);
    titan->sm_count = target.sm_count;
    for (auto& st : traces) plan::torchtitan_step_time(st, *titan, spare);
  }
  if (cpu) {
    trace::Trace all;  // the CPU is measured on every position's work
    for (const auto* ts : {&traces, &validation_traces})
      for (const auto& st : *ts)
        for (const auto& e : st.trace.events()) all.add(e.op);
    target = resolve_machine(machine, all, c.training.attention, dtype, hd, world, c.training.document_mask,
                             c.parallelism.context_parallel_degree > 1);
  }
  plan::LayoutPrediction l = plan::predict_layout(traces, *target.pricer, target.network.value_or(plan::Network{}), top);
  MemoryModel mm;
  mm.zero1 = zero1;
  mm.torchtitan = titan;
  if (run) {
    mm.stages = plan::scaling_memory(*run);
    mm.scaling = run;
    apply_memory(l, mm);
  }
  const plan::Network network = target.network.value_or(plan::Network{});
  const plan::RunCost run_cost =
      price_run(c, l.step_seconds, traces.front().shape.tokens, world, validation,
                validation_traces.empty() ? 0 : plan::predict_layout(validation_traces, *target.pricer, network, 0).step_seconds);
  std::vector<Balance> weighed;
  int refused = 0;
  std::string refusal;
  if (balance) {
    weighed = balance_stages(c, world, target, bf16_model, refused, refusal);
    TESSERA_CHECK(!weighed.empty(), "--plan.balance_stages: every weighting of the ends is refused (", refusal, ")");
    if (!emit.empty()) {
      train::JobConfig best = c;
      best.parallelism.pipeline_parallel_first_stage_less_layers = weighed.front().first;
      best.parallelism.pipeline_parallel_last_stage_less_layers = weighed.front().last;
      emit_config(emit, best);
    }
  }
  const Balance* mine = balance ? balance_of(weighed, c) : nullptr;
  if (json) {
    nlohmann::json j = layout_json(l, traces, c, target, mm, run_cost, price);
    if (balance) {
      nlohmann::json rows = nlohmann::json::array();
      for (const Balance& b : weighed)
        rows.push_back({{"first_stage_less_layers", b.first},
                        {"last_stage_less_layers", b.last},
                        {"blocks_per_stage", b.blocks},
                        {"step_seconds", b.layout.step_seconds},
                        {"tokens_per_sec", b.layout.tokens_per_sec},
                        {"reserved_memory_bytes", b.layout.reserved_memory_bytes},
                        {"fits", b.layout.fits}});
      j["stage_balance"] = {{"weightings", rows}, {"refused", refused}};
    }
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  print_layout(l, traces, c, target, mm, run_cost, price);
  if (balance) {
    std::printf("\nstage balance (plan.balance_stages): the embedding and the output counted as 0-2 and 0-4 layers "
                "in the even split, each split once, fastest first\n");
    std::printf(" first  last  blocks a stage          step  tokens/s/GPU     reserved\n");
    for (const Balance& b : weighed)
      std::printf("   %3d   %3d  %-18s  %10s  %12.0f  %11s%s%s\n", b.first, b.last, blocks_text(b.blocks).c_str(),
                  seconds_text(b.layout.step_seconds).c_str(), b.layout.tokens_per_sec,
                  gib(static_cast<double>(b.layout.reserved_memory_bytes)).c_str(), b.layout.fits ? "" : "  does NOT fit",
                  &b == mine ? "  (the config's split)" : "");
    if (refused > 0) std::printf("  %d weighting%s refused (%s)\n", refused, refused == 1 ? "" : "s", refusal.c_str());
    const Balance& best = weighed.front();
    if (mine && &best != mine && best.layout.fits)
      std::printf("the fastest that fits: --parallelism.pipeline_parallel_first_stage_less_layers %d "
                  "--parallelism.pipeline_parallel_last_stage_less_layers %d: %s a step (%+.1f%% against the config's)\n",
                  best.first, best.last, seconds_text(best.layout.step_seconds).c_str(),
                  100.0 * (best.layout.step_seconds / mine->layout.step_seconds - 1.0));
    else if (mine && &best == mine)
      std::printf("the config's weighting is the fastest that fits\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-plan: error: %s\n", e.what());
    return 1;
  }
}
