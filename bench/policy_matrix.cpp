// bench-policy-matrix: every supported composition of the parallel policies on 8 thread
// ranks of one process, each with activation checkpointing off and full (and selective
// op for a few).
//
// The block is the one llama-train builds, Parallel<LlamaBlock, Sharding<Dynamic>,
// TensorParallel<dynamic>, Pipeline<dynamic>, Checkpoint<Dynamic>>: every choice is read
// at run time from the job config ([parallelism] degrees, pipeline_parallel_schedule and
// pipeline_parallel_microbatch_size; [activation_checkpoint] mode and
// selective_ac_option), and the mesh from the degrees (comm::mesh_shape over 8 ranks).
// Layouts, as MeshShape{pp, dp_replicate, dp_shard, tp}: FSDP 8, HSDP 2x4, DDP 8, TP 8,
// TP 2 x FSDP 4, TP 4 x FSDP 2, HSDP 2x2 x TP 2; PP 8 with GPipe and 1F1B (the debug
// model's 6 blocks + embedding + output are 8 units, one per stage); PP 2 x FSDP 4 and
// PP 4 x FSDP 2 with GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, LoopedBFS,
// ZBVZeroBubble and DualPipeV (the last five with 2 stages per rank); TP 2 x PP 2 x FSDP 2
// with 1F1B and InterleavedZeroBubble.
//
// Each combination trains the debug model (dim 256, 6 layers, 16 heads, vocabulary 1024
// with the synthetic BPE tokenizer, float32; --dim and --layers make it bigger) with
// train::Trainer, the loop llama-train runs, on the same global batch (--batch sequences
// of --seq tokens): every data-parallel rank takes batch / dp sequences as one
// forward_backward per step (no gradient accumulation), which a pipeline cuts into
// microbatches of --microbatch sequences. --warmup steps, then --steps measured ones.
// Per combination it reports:
//
//   - step time: the median over the measured steps of the step's time, a step's time
//     being its slowest rank's (StepMetrics::step_seconds); tokens/s over the global batch;
//   - memory per rank (the largest over the ranks): the peak of saved activations
//     (StepMetrics::activation_bytes), the peak of tracked memory during a step
//     (StepMetrics::peak_memory_bytes; the window is reset before each step), and what the
//     rank holds once the Trainer is constructed (its parameters, gradients and AdamW
//     moments);
//   - bytes sent per rank per step, measured at the rank's Communicator
//     (StepMetrics::comm_bytes), against the analytic count
//     plan::expected_step_bytes(plan::step_layout(config, shape, pp_rank)) of the
//     rank's pipeline rank (ranks at different pipeline ranks send different bytes; the
//     table shows the range over the ranks). They must be equal on every rank at every
//     step: the benchmark prints its table, then exits with status 2 if any differs;
//   - for pipelines, the bubble:
//       simulated: parallel::simulate of the schedule the model ran (its action lists for
//         M = batch / dp / microbatch microbatches) with Costs{1, 1, 1}, that is forward 1,
//         a whole backward 2 (input 1 + weight 1): 1 - the ranks' busy time / (P x makespan);
//       measured: the share of the step a rank spent blocked receiving another stage's
//         activations or gradients, nn::Transformer::pipeline_wait_seconds() / the step's
//         time (its slowest rank's); per rank, the median of that share over the measured
//         steps. The table shows the mean of it over the 8 ranks, and the largest with
//         the pipeline rank of the rank it belongs to. A rank that finishes its pass early
//         and then waits in the loss or gradient-norm all-reduce is idle too but not
//         receiving, so the measured figure counts only part of the idle time a schedule
//         leaves.
//
// Thread ranks share this process's cores: 8 ranks on a machine of 2 cores take turns,
// each running --threads OpenMP threads (default: the hardware threads / 8, at least 1),
// so the step times show what a layout costs on one machine, not a multi-device speedup,
// and a rank blocked on another stage gives its core to a rank that can compute: the
// measured bubble is time a rank waited, not time the machine idled. Run it with
// OMP_WAIT_POLICY=PASSIVE (it warns otherwise). Each rank counts its own memory
// (comm::run_thread_ranks gives every rank thread its own MemoryStats).
//
// Output: the machine, the date and the commit (given with --commit), one progress line
// per combination, then a summary table; --markdown prints it as the Markdown rows of
// RESULTS.md instead.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/units.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/stages.hpp"
#include "tessera/plan/traffic.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer.hpp"

#include "machine.hpp"

namespace {

using namespace tessera;
using namespace tessera::bench;
using clock_type = std::chrono::steady_clock;

/// The block llama-train builds: every policy read from the Plan.
using Block = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<Dynamic>, TensorParallel<dynamic>, Pipeline<dynamic>,
                       Checkpoint<Dynamic>>;
using Model = nn::Transformer<float, Cpu, Block>;

constexpr int kRanks = 8;

struct Layout {
  std::string key;       // what --layouts matches
  std::string name;      // as the table shows it
  comm::MeshShape shape;  // {pp, dp_replicate, dp_shard, tp}
  std::string schedule;  // pipeline_parallel_schedule; empty without a pipeline
  bool selective_op = false;  // the default matrix runs selective op checkpointing on it too
};

const std::vector<Layout>& all_layouts() {
  static const std::vector<Layout> layouts = [] {
    std::vector<Layout> l = {
        {"fsdp8", "FSDP 8", {1, 1, 8, 1}, "", true},
        {"hsdp2x4", "HSDP 2x4", {1, 2, 4, 1}, "", false},
        {"ddp8", "DDP 8", {1, 8, 1, 1}, "", false},
        {"tp8", "TP 8", {1, 1, 1, 8}, "", false},
        {"tp2-fsdp4", "TP 2 x FSDP 4", {1, 1, 4, 2}, "", true},
        {"tp4-fsdp2", "TP 4 x FSDP 2", {1, 1, 2, 4}, "", false},
        {"hsdp2x2-tp2", "HSDP 2x2 x TP 2", {1, 2, 2, 2}, "", false},
        {"pp8-gpipe", "PP 8", {8, 1, 1, 1}, "GPipe", false},
        {"pp8-1f1b", "PP 8", {8, 1, 1, 1}, "1F1B", true},
    };
    const std::pair<const char*, const char*> schedules[] = {
        {"gpipe", "GPipe"},
        {"1f1b", "1F1B"},
        {"i1f1b", "Interleaved1F1B"},
        {"izb", "InterleavedZeroBubble"},
        {"bfs", "LoopedBFS"},
        {"zbv", "ZBVZeroBubble"},
        {"dpv", "DualPipeV"}};
    for (const auto& [key, schedule] : schedules)
      l.push_back({std::string("pp2-fsdp4-") + key, "PP 2 x FSDP 4", {2, 1, 4, 1}, schedule, false});
    for (const auto& [key, schedule] : schedules)
      l.push_back({std::string("pp4-fsdp2-") + key, "PP 4 x FSDP 2", {4, 1, 2, 1}, schedule,
                   std::string_view(key) == "1f1b"});
    l.push_back({"tp2-pp2-fsdp2-1f1b", "TP 2 x PP 2 x FSDP 2", {2, 1, 2, 2}, "1F1B", true});
    l.push_back({"tp2-pp2-fsdp2-izb", "TP 2 x PP 2 x FSDP 2", {2, 1, 2, 2}, "InterleavedZeroBubble", false});
    return l;
  }();
  return layouts;
}

struct AcMode {
  std::string key;           // as --ac names it
  std::string mode, option;  // [activation_checkpoint] mode and selective_ac_option
};

const std::vector<AcMode>& all_ac_modes() {
  static const std::vector<AcMode> modes = {{"none", "none", "2"}, {"full", "full", "2"}, {"op", "selective", "op"}};
  return modes;
}

struct Options {
  std::int64_t batch = 16;  // global: sequences per step over all data-parallel ranks
  std::int64_t seq = 64;
  std::int64_t microbatch = 1;  // pipeline_parallel_microbatch_size
  std::int64_t warmup = 2;
  std::int64_t steps = 5;
  std::int64_t dim = 0, layers = 0;  // 0: the debug model's
  int threads = 0;                   // OpenMP threads per rank; 0: hardware threads / ranks
  std::vector<Layout> layouts = all_layouts();
  std::vector<AcMode> ac_modes;  // empty: none and full, and selective op where the layout asks for it
  bool markdown = false;
  std::string commit = "-";
};

constexpr const char* usage =
    "usage: bench-policy-matrix [--batch N] [--seq N] [--microbatch N] [--warmup N] [--steps N] [--threads N]\n"
    "                           [--dim N] [--layers N] [--layouts SUBSTRING[,SUBSTRING...]] [--ac none,full,op]\n"
    "                           [--markdown] [--commit HASH]\n"
    "  every parallel policy composition of the debug model (vocabulary 1024, fp32) on 8 thread ranks;\n"
    "  defaults: --batch 16 (global) --seq 64 --microbatch 1 --warmup 2 --steps 5, every layout,\n"
    "  checkpointing none and full (and selective op on a few layouts), --threads = hardware threads / 8\n"
    "  (at least 1); --layouts runs the layouts whose key contains one of the substrings\n";

std::string layout_keys() {
  std::string keys;
  for (const Layout& l : all_layouts()) keys += (keys.empty() ? "" : ", ") + l.key;
  return keys;
}

std::vector<Layout> filter_layouts(std::string_view flag, std::string_view text) {
  const std::vector<std::string_view> words = split_commas(text);
  for (std::string_view w : words) TESSERA_CHECK(!w.empty(), flag, ": empty substring in '", text, "'");
  std::vector<Layout> out;
  for (const Layout& l : all_layouts())
    if (std::any_of(words.begin(), words.end(), [&](std::string_view w) { return l.key.find(w) != std::string::npos; }))
      out.push_back(l);
  TESSERA_CHECK(!out.empty(), flag, ": no layout key contains '", text, "' (keys: ", layout_keys(), ")");
  return out;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--batch") o.batch = parse_count(flag, f.value(), 1);
    else if (flag == "--seq") o.seq = parse_count(flag, f.value(), 1);
    else if (flag == "--microbatch") o.microbatch = parse_count(flag, f.value(), 1);
    else if (flag == "--warmup") o.warmup = parse_count(flag, f.value(), 0);
    else if (flag == "--steps") o.steps = parse_count(flag, f.value(), 1);
    else if (flag == "--threads") o.threads = static_cast<int>(parse_count(flag, f.value(), 1));
    else if (flag == "--dim") o.dim = parse_count(flag, f.value(), 1);
    else if (flag == "--layers") o.layers = parse_count(flag, f.value(), 1);
    else if (flag == "--layouts") o.layouts = filter_layouts(flag, f.value());
    else if (flag == "--ac")
      o.ac_modes = parse_keyed(flag, f.value(), all_ac_modes(), [](const AcMode& m) -> const std::string& { return m.key; });
    else if (flag == "--markdown") o.markdown = true;
    else if (flag == "--commit") o.commit = std::string(f.value());
    else if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else {
      f.unknown();
    }
  }
  return o;
}

/// The checkpoint modes `layout` runs.
std::vector<AcMode> ac_modes_for(const Options& o, const Layout& layout) {
  if (!o.ac_modes.empty()) return o.ac_modes;
  std::vector<AcMode> modes = {all_ac_modes()[0], all_ac_modes()[1]};
  if (layout.selective_op) modes.push_back(all_ac_modes()[2]);
  return modes;
}

// ---------------------------------------------------------------------------------------
// One combination.

/// The job a combination runs: the debug model with the vocabulary of the synthetic BPE
/// tokenizer, float32, the layout's degrees and schedule, one pass of batch / dp
/// sequences per data-parallel rank and step.
train::JobConfig job(const Options& o, const Layout& l, const AcMode& ac) {
  std::vector<std::string> keys = {
      "--training.local_batch_size", std::to_string(o.batch / l.shape.dp()),
      "--training.global_batch_size", std::to_string(o.batch),
      "--training.seq_len", std::to_string(o.seq),
      "--training.steps", std::to_string(o.warmup + o.steps),
      "--activation_checkpoint.mode", ac.mode,
      "--activation_checkpoint.selective_ac_option", ac.option,
      "--parallelism.data_parallel_replicate_degree", std::to_string(l.shape.dp_replicate),
      "--parallelism.data_parallel_shard_degree", std::to_string(l.shape.dp_shard),
      "--parallelism.tensor_parallel_degree", std::to_string(l.shape.tp),
      "--parallelism.pipeline_parallel_degree", std::to_string(l.shape.pp),
      "--parallelism.pipeline_parallel_microbatch_size", std::to_string(o.microbatch),
  };
  if (!l.schedule.empty()) keys.insert(keys.end(), {"--parallelism.pipeline_parallel_schedule", l.schedule});
  if (o.dim > 0) keys.insert(keys.end(), {"--model.dim", std::to_string(o.dim)});
  if (o.layers > 0) keys.insert(keys.end(), {"--model.n_layers", std::to_string(o.layers)});
  return train::parse_config(kDebugModelJob, "bench-policy-matrix", keys);
}

/// The mesh the job's [parallelism] degrees describe on the 8 ranks.
comm::MeshShape mesh_of(const train::JobConfig& c) {
  return train::mesh_shape(c, kRanks);
}

/// Fails before any rank starts if the batch does not fit `layout`: a batch the
/// data-parallel ranks cannot split, or a pipeline its schedule cannot run.
void check_layout(const Options& o, const Layout& layout) {
  const comm::MeshShape& s = layout.shape;
  TESSERA_CHECK(o.batch % s.dp() == 0, layout.key, ": --batch ", o.batch, " does not split evenly over the ", s.dp(),
                " data-parallel ranks");
  if (s.pp == 1) return;
  const std::int64_t local = o.batch / s.dp();
  TESSERA_CHECK(local % o.microbatch == 0, layout.key, ": --microbatch ", o.microbatch,
                " does not divide a data-parallel rank's ", local, " sequences (--batch ", o.batch, " / ", s.dp(), ")");
  const train::JobConfig c = job(o, layout, all_ac_modes().front());
  const parallel::ScheduleKind kind = parallel::parse_schedule_kind(layout.schedule);
  try {
    parallel::check_schedule_shape(kind, s.pp, parallel::default_stages_per_rank(kind), static_cast<int>(local / o.microbatch));
    parallel::split_stages(static_cast<int>(c.model.args.n_layers), s.pp * parallel::default_stages_per_rank(kind));
  } catch (const std::exception& e) {
    fail(layout.key, " (--batch ", o.batch, ", --microbatch ", o.microbatch, "): ", e.what());
  }
}

/// What one rank measured.
struct RankFigures {
  int pp_rank = 0;
  std::vector<double> step_seconds;  // every step, warm-up included
  std::vector<double> wait_seconds;  // pipeline_wait_seconds after each step
  std::vector<std::uint64_t> sent;   // bytes sent, every step
  std::vector<double> losses;
  std::size_t activation_bytes = 0;   // peak over the measured steps
  std::size_t peak_memory_bytes = 0;  // peak over the measured steps
  std::size_t held_bytes = 0;         // after the Trainer is constructed, before the first step
};

struct Result {
  Layout layout;
  std::string ac_name;
  int threads = 1;
  int microbatches = 0, stages_per_rank = 0;  // pipelines only
  double step_seconds = 0;                    // median over the measured steps of the slowest rank's time
  double tokens_per_sec = 0;
  std::size_t activation_bytes = 0, peak_memory_bytes = 0, held_bytes = 0;  // largest over ranks
  std::uint64_t sent_min = 0, sent_max = 0;          // measured, over ranks and steps
  std::uint64_t analytic_min = 0, analytic_max = 0;  // over pipeline ranks
  int mismatches = 0;                                // (rank, step) pairs whose bytes differ
  std::string first_mismatch;
  double bubble_simulated = 0;
  double bubble_mean = 0, bubble_max = 0;  // measured: per rank the median over steps; their mean, their largest
  int bubble_max_pp_rank = 0;              // the pipeline rank of the rank with the largest
  double final_loss = 0;
  double other_share = 0;  // share of the machine's cores other processes used during the combination
};

Result run_combination(const Options& o, const Layout& layout, const AcMode& ac,
                       const std::vector<std::uint32_t>& tokens) {
  const train::JobConfig c = job(o, layout, ac);
  const comm::MeshShape shape = mesh_of(c);
  TESSERA_CHECK(shape.str() == layout.shape.str(), layout.key, ": the config's degrees make the mesh ", shape.str(),
                ", the layout names ", layout.shape.str());
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const int threads = o.threads > 0 ? o.threads : std::max(1, int(hw) / kRanks);
  std::vector<RankFigures> ranks(kRanks);
  parallel::Simulation simulation;
  int microbatches = 0, virtual_stages = 0;

  const double cpu0 = cpu_seconds(), busy0 = machine_busy_seconds();
  const auto t0 = clock_type::now();
  comm::run_thread_ranks(kRanks, [&](comm::Communicator& world) {
    omp_set_num_threads(threads);
    RankFigures& f = ranks[static_cast<std::size_t>(world.rank())];
    comm::DeviceMesh mesh(world, shape);
    f.pp_rank = mesh.pp_rank();
    const parallel::Plan plan = train::make_plan(c, &mesh);
    Model model(c.model.args, plan);
    model.init_weights(static_cast<std::uint64_t>(c.training.seed));
    data::DataLoader loader(tokens, c.training.seq_len, c.training.local_batch_size, mesh.dp_rank(),
                            mesh.dp_degree());
    train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
    TESSERA_CHECK(trainer.accumulation_steps() == 1, layout.key, ": expected one pass per step, the trainer runs ",
                  trainer.accumulation_steps());
    MemoryStats& stats = memory_stats(Device::cpu);  // this rank's own counters
    f.held_bytes = stats.current();
    for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
      stats.reset_peak();
      const train::StepMetrics m = trainer.step();
      f.step_seconds.push_back(m.step_seconds);
      f.wait_seconds.push_back(model.pipeline_degree() > 1 ? model.pipeline_wait_seconds() : 0.0);
      f.sent.push_back(m.comm_bytes);
      f.losses.push_back(m.loss);
      if (s >= o.warmup) {
        f.activation_bytes = std::max(f.activation_bytes, m.activation_bytes);
        f.peak_memory_bytes = std::max(f.peak_memory_bytes, m.peak_memory_bytes);
      }
    }
    if (world.rank() == 0 && model.pipeline_degree() > 1) {
      microbatches = static_cast<int>(c.training.local_batch_size / c.parallelism.pipeline_parallel_microbatch_size);
      const parallel::Schedule& schedule = model.schedule(microbatches);
      virtual_stages = schedule.stages_per_rank;
      simulation = parallel::simulate(schedule, parallel::Costs{1, 1, 1});
    }
  });
  const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
  const double other = std::max(0.0, machine_busy_seconds() - busy0 - (cpu_seconds() - cpu0));

  Result r;
  r.layout = layout;
  r.ac_name = train::make_plan(c, nullptr).checkpoint.str();
  r.threads = threads;
  r.other_share = other / (wall * double(hw));
  r.microbatches = microbatches;
  r.stages_per_rank = virtual_stages;
  r.bubble_simulated = simulation.bubble;

  std::vector<std::uint64_t> analytic(static_cast<std::size_t>(shape.pp));
  for (int p = 0; p < shape.pp; ++p)
    analytic[static_cast<std::size_t>(p)] = plan::expected_step_bytes(plan::step_layout(c, shape, p));
  r.analytic_min = *std::min_element(analytic.begin(), analytic.end());
  r.analytic_max = *std::max_element(analytic.begin(), analytic.end());
  r.sent_min = ranks.front().sent.front();

  std::vector<double> step_times;
  for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
    const auto si = static_cast<std::size_t>(s);
    double slowest = 0;
    for (std::size_t k = 0; k < ranks.size(); ++k) {
      const RankFigures& f = ranks[k];
      slowest = std::max(slowest, f.step_seconds[si]);
      const std::uint64_t sent = f.sent[si], expected = analytic[static_cast<std::size_t>(f.pp_rank)];
      r.sent_min = std::min(r.sent_min, sent);
      r.sent_max = std::max(r.sent_max, sent);
      if (sent != expected && r.mismatches++ == 0)
        r.first_mismatch = detail::concat(layout.name, layout.schedule.empty() ? "" : " " + layout.schedule,
                                          ", checkpoint ", r.ac_name, ": rank ", k, " (pipeline rank ", f.pp_rank,
                                          ") sent ", sent, " bytes in step ", s + 1, ", the analytic count is ",
                                          expected, " (", sent > expected ? "+" : "-",
                                          sent > expected ? sent - expected : expected - sent, ")");
    }
    if (s < o.warmup) continue;
    step_times.push_back(slowest);
  }
  for (const RankFigures& f : ranks) {
    std::vector<double> shares;  // of each measured step's time
    for (std::size_t i = 0; i < step_times.size(); ++i)
      shares.push_back(f.wait_seconds[static_cast<std::size_t>(o.warmup) + i] / step_times[i]);
    const double share = median(shares);
    r.bubble_mean += share / double(ranks.size());
    if (share > r.bubble_max) {
      r.bubble_max = share;
      r.bubble_max_pp_rank = f.pp_rank;
    }
  }
  for (const RankFigures& f : ranks) {
    r.activation_bytes = std::max(r.activation_bytes, f.activation_bytes);
    r.peak_memory_bytes = std::max(r.peak_memory_bytes, f.peak_memory_bytes);
    r.held_bytes = std::max(r.held_bytes, f.held_bytes);
  }
  r.step_seconds = median(step_times);
  r.tokens_per_sec = double(o.batch * o.seq) / r.step_seconds;
  r.final_loss = ranks.front().losses.back();
  return r;
}

// ---------------------------------------------------------------------------------------
// Output.

std::string percent(double share) {
  char s[16];
  std::snprintf(s, sizeof s, "%.1f%%", 100 * share);
  return s;
}

/// "a" or "a – b" when the range is not one value.
std::string range(std::uint64_t lo, std::uint64_t hi) {
  return lo == hi ? std::to_string(lo) : std::to_string(lo) + " – " + std::to_string(hi);
}

std::string schedule_cell(const Result& r) {
  if (r.layout.schedule.empty()) return "-";
  return detail::concat(r.layout.schedule, " (", r.stages_per_rank, r.stages_per_rank == 1 ? " stage" : " stages",
                        "/rank, ", r.microbatches, " mb)");
}

/// "13.6% / 22.1% (pp 1)": the measured bubble, mean over the ranks / the largest.
std::string measured_bubble(const Result& r) {
  return percent(r.bubble_mean) + " / " + percent(r.bubble_max) + " (pp " + std::to_string(r.bubble_max_pp_rank) + ")";
}

std::string traffic_cell(const Result& r) {
  return r.mismatches == 0 ? "exact" : detail::concat("MISMATCH (", r.mismatches, " rank-steps)");
}

int run(const Options& o) {
  for (const Layout& l : o.layouts) check_layout(o, l);
  const std::string date = utc_date();
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::string cpu = cpuinfo_field("model name") + " (family " + cpuinfo_field("cpu family") + " model " +
                          cpuinfo_field("model") + ")";
  const std::string machine = cpu + ", " + std::to_string(hw) + " hardware threads, OpenBLAS " +
                              openblas_get_corename() + " kernels";
  const int blas_parallel = openblas_get_parallel();
  const char* policy_env = std::getenv("OMP_WAIT_POLICY");
  const std::string wait_policy = policy_env ? policy_env : "unset";
  const int threads = o.threads > 0 ? o.threads : std::max(1, int(hw) / kRanks);

  const train::JobConfig c0 = job(o, all_layouts().front(), all_ac_modes().front());
  const std::vector<std::uint32_t> tokens = [&] {
    auto tok = data::make_tokenizer(c0.model.tokenizer);
    return train::load_training_tokens(c0, *tok).ids;
  }();
  const nn::ModelArgs& args = c0.model.args;
  std::size_t combinations = 0;
  for (const Layout& l : o.layouts) combinations += ac_modes_for(o, l).size();

  std::printf("bench-policy-matrix: debugmodel (dim %lld, %lld layers, %lld heads, vocabulary %lld, %lld parameters), "
              "float32\n",
              (long long)args.dim, (long long)args.n_layers, (long long)args.n_heads, (long long)args.vocab_size,
              (long long)args.num_params());
  std::printf("global batch %lld x seq %lld = %lld tokens/step, one pass per data-parallel rank, pipeline microbatches "
              "of %lld sequences; %lld warm-up + %lld measured steps; %zu combinations\n",
              (long long)o.batch, (long long)o.seq, (long long)(o.batch * o.seq), (long long)o.microbatch,
              (long long)o.warmup, (long long)o.steps, combinations);
  std::printf("machine: %s; OpenBLAS threading %s; OMP_WAIT_POLICY %s\n", machine.c_str(),
              blas_parallel == 0 ? "sequential" : blas_parallel == 1 ? "pthreads" : "OpenMP", wait_policy.c_str());
  std::printf("%d thread ranks x %d OpenMP threads share this machine's %u hardware threads: step times show what a "
              "layout costs on one machine, not a multi-device speedup\n",
              kRanks, threads, hw);
  if (wait_policy != "PASSIVE" && wait_policy != "passive")
    std::printf("warning: OMP_WAIT_POLICY is not PASSIVE: OpenMP threads spin between parallel loops, and where the "
                "ranks (or other processes) outnumber the cores a rank of several threads waits for its descheduled "
                "threads; run with OMP_WAIT_POLICY=PASSIVE\n");
  std::printf("date: %s; commit: %s\n\n", date.c_str(), o.commit.c_str());
  std::fflush(stdout);

  std::vector<Result> results;
  for (const Layout& layout : o.layouts)
    for (const AcMode& ac : ac_modes_for(o, layout)) {
      Result r = run_combination(o, layout, ac, tokens);
      std::printf("%-20s %-22s %-15s %7.3f s/step %6.0f tokens/s  peak %s  held %s  sent %s / analytic %s %s",
                  layout.name.c_str(), layout.schedule.empty() ? "-" : layout.schedule.c_str(), r.ac_name.c_str(),
                  r.step_seconds, r.tokens_per_sec, mebibytes(double(r.peak_memory_bytes)).c_str(),
                  mebibytes(double(r.held_bytes)).c_str(), range(r.sent_min, r.sent_max).c_str(),
                  range(r.analytic_min, r.analytic_max).c_str(), traffic_cell(r).c_str());
      if (!layout.schedule.empty())
        std::printf("  bubble simulated %s measured %s", percent(r.bubble_simulated).c_str(),
                    measured_bubble(r).c_str());
      std::printf("  loss %.4f  other processes %.0f%%\n", r.final_loss, 100 * r.other_share);
      std::fflush(stdout);
      results.push_back(std::move(r));
    }

  std::printf("\n%s; commit %s; %s; OMP_WAIT_POLICY %s; %d thread ranks x %d OpenMP threads; debugmodel vocabulary "
              "1024 fp32, global batch %lld x seq %lld, pipeline microbatch %lld, median of %lld steps after %lld "
              "warm-up\n\n",
              date.c_str(), o.commit.c_str(), machine.c_str(), wait_policy.c_str(), kRanks, threads,
              (long long)o.batch, (long long)o.seq, (long long)o.microbatch, (long long)o.steps, (long long)o.warmup);
  if (o.markdown) {
    std::printf("| layout | mesh [pp, dp_replicate, dp_shard, tp] | schedule | activation checkpoint | step time | "
                "tokens/s | activations / rank | peak memory / rank | params + grads + AdamW / rank | sent / rank / "
                "step (bytes, measured) | analytic (bytes, per pp rank) | traffic | bubble simulated | bubble "
                "measured (mean / largest rank) | loss | other processes |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Result& r : results) {
      const bool pp = !r.layout.schedule.empty();
      std::printf("| %s | %d, %d, %d, %d | %s | %s | %.3f s | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %.4f | "
                  "%.0f%% |\n",
                  r.layout.name.c_str(), r.layout.shape.pp, r.layout.shape.dp_replicate, r.layout.shape.dp_shard,
                  r.layout.shape.tp, schedule_cell(r).c_str(), r.ac_name.c_str(), r.step_seconds, r.tokens_per_sec,
                  mebibytes(double(r.activation_bytes)).c_str(), mebibytes(double(r.peak_memory_bytes)).c_str(),
                  mebibytes(double(r.held_bytes)).c_str(), range(r.sent_min, r.sent_max).c_str(),
                  range(r.analytic_min, r.analytic_max).c_str(), traffic_cell(r).c_str(),
                  pp ? percent(r.bubble_simulated).c_str() : "-",
                  pp ? measured_bubble(r).c_str() : "-", r.final_loss,
                  100 * r.other_share);
    }
  } else {
    std::printf("%-20s %-48s %-15s %9s %8s %11s %11s %11s %-8s %9s %25s\n", "layout", "schedule", "checkpoint",
                "step", "tokens/s", "activations", "peak", "held", "traffic", "bubble", "measured mean / largest");
    for (const Result& r : results) {
      const bool pp = !r.layout.schedule.empty();
      std::printf("%-20s %-48s %-15s %7.3f s %8.0f %11s %11s %11s %-8s %9s %25s\n", r.layout.name.c_str(),
                  schedule_cell(r).c_str(), r.ac_name.c_str(), r.step_seconds, r.tokens_per_sec,
                  mebibytes(double(r.activation_bytes)).c_str(), mebibytes(double(r.peak_memory_bytes)).c_str(),
                  mebibytes(double(r.held_bytes)).c_str(), r.mismatches == 0 ? "exact" : "MISMATCH",
                  pp ? percent(r.bubble_simulated).c_str() : "-",
                  pp ? measured_bubble(r).c_str() : "-");
    }
  }

  double busiest = 0;
  for (const Result& r : results) busiest = std::max(busiest, r.other_share);
  if (busiest > 0.1)
    std::printf("\nnote: other processes used up to %.0f%% of the machine's cores during a combination: they competed "
                "with the ranks, and the step times understate this machine (memory and traffic are unaffected)\n",
                100 * busiest);

  int status = 0;
  for (const Result& r : results)
    if (r.mismatches > 0) {
      std::fprintf(stderr,
                   "bench-policy-matrix: %s; %d rank-steps in all: the measured traffic differs from "
                   "plan::expected_step_bytes\n",
                   r.first_mismatch.c_str(), r.mismatches);
      status = 2;
    }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-policy-matrix: %s\n", e.what());
    return 1;
  }
}
