// bench-data-parallel: every data-parallel sharding x activation-checkpoint mode of the
// debug model, trained on thread ranks of one process.
//
// Layouts: one rank (no sharding), FSDP 2, FSDP 4, HSDP 2 x 2 and DDP 4; checkpoint
// modes: none, full, selective op, selective every 2nd layer. Each combination trains
// the debug model (dim 256, 6 layers, 16 heads, vocabulary 1024, float32; the
// synthetic corpus through the synthetic BPE tokenizer) on the same global batch with
// train::Trainer, the loop llama-train runs: --warmup steps, then --steps measured
// ones. Per combination it reports, per rank (the largest over the ranks):
//
//   - the median step time (a step's time is its slowest rank's) and tokens/s over the
//     global batch;
//   - the peak of saved activations (StepMetrics::activation_bytes) and the peak of
//     tracked memory during a step (StepMetrics::peak_memory_bytes; the peak window is
//     reset before each step, after the model was built and sharded);
//   - the memory the rank holds once the Trainer is constructed, before its first step:
//     parameters, gradients and AdamW moments (this rank's shard of them), against
//     16 bytes x the parameters this rank updates;
//   - the bytes it sends per step, measured at its Communicator
//     (StepMetrics::comm_bytes), against plan::expected_step_bytes. They must be
//     equal on every rank at every step: the benchmark exits with status 2 if any
//     differs (a bug in the schedule or in the count), after printing its table.
//
// Thread ranks share this process's cores: each rank runs --threads OpenMP threads
// (default: the hardware threads divided by the ranks, at least one), so the step times
// show what the sharding costs on one machine, not a multi-device speedup. Run it with
// OMP_WAIT_POLICY=PASSIVE (it warns otherwise): spinning OpenMP threads make a rank of
// several threads wait for its descheduled ones wherever threads outnumber cores. Each
// rank counts its own memory (comm::run_thread_ranks gives every rank thread its own
// MemoryStats).
//
// Output: progress lines, then a Markdown table headed by the date, the commit (given
// with --commit, as bench-train-step takes it) and the machine; --json FILE writes the
// same figures as JSON.
#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <nlohmann/json.hpp>
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
#include "tessera/plan/traffic.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer.hpp"

#include "machine.hpp"

namespace {

using namespace tessera::bench;

using namespace tessera;
using clock_type = std::chrono::steady_clock;

/// The block llama-train builds: sharding and checkpointing read from the Plan.
using Block = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<Dynamic>, TensorParallel<dynamic>, Pipeline<dynamic>,
                       Checkpoint<Dynamic>>;
using Model = nn::Transformer<float, Cpu, Block>;

struct Layout {
  std::string key;   // as --layouts names it
  std::string name;  // as the table shows it
  comm::MeshShape shape;
};

const std::vector<Layout>& all_layouts() {
  static const std::vector<Layout> layouts = {
      {"one", "one rank", comm::MeshShape{1, 1, 1, 1}}, {"fsdp2", "FSDP 2", comm::MeshShape{1, 1, 2, 1}},
      {"fsdp4", "FSDP 4", comm::MeshShape{1, 1, 4, 1}}, {"hsdp2x2", "HSDP 2x2", comm::MeshShape{1, 2, 2, 1}},
      {"ddp4", "DDP 4", comm::MeshShape{1, 4, 1, 1}},
  };
  return layouts;
}

struct AcMode {
  std::string key;  // as --ac names it
  std::string mode, option;  // [activation_checkpoint] mode and selective_ac_option
};

const std::vector<AcMode>& all_ac_modes() {
  static const std::vector<AcMode> modes = {
      {"none", "none", "2"}, {"full", "full", "2"}, {"op", "selective", "op"}, {"layer2", "selective", "2"}};
  return modes;
}

struct Options {
  std::int64_t batch = 8;  // global: sequences per step over all data-parallel ranks
  std::int64_t seq = 128;
  std::int64_t warmup = 2;
  std::int64_t steps = 5;
  int threads = 0;  // OpenMP threads per rank; 0: hardware threads / ranks
  std::vector<Layout> layouts = all_layouts();
  std::vector<AcMode> ac_modes = all_ac_modes();
  std::string json_path;
  std::string commit = "-";
};

constexpr const char* usage =
    "usage: bench-data-parallel [--batch N] [--seq N] [--warmup N] [--steps N] [--threads N]\n"
    "                           [--layouts one,fsdp2,fsdp4,hsdp2x2,ddp4] [--ac none,full,op,layer2]\n"
    "                           [--json FILE] [--commit HASH]\n"
    "  every sharding x activation-checkpoint mode of the debug model (vocabulary 1024, fp32) on thread ranks;\n"
    "  defaults: --batch 8 (global) --seq 128 --warmup 2 --steps 5, every layout and mode,\n"
    "  --threads = hardware threads / ranks (at least 1)\n";

Options parse_options(int argc, char** argv) {
  Options o;
  const auto key = [](const auto& item) -> const std::string& { return item.key; };
  for (Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--batch") o.batch = parse_count(flag, f.value(), 1);
    else if (flag == "--seq") o.seq = parse_count(flag, f.value(), 1);
    else if (flag == "--warmup") o.warmup = parse_count(flag, f.value(), 0);
    else if (flag == "--steps") o.steps = parse_count(flag, f.value(), 1);
    else if (flag == "--threads") o.threads = static_cast<int>(parse_count(flag, f.value(), 1));
    else if (flag == "--layouts") o.layouts = parse_keyed(flag, f.value(), all_layouts(), key);
    else if (flag == "--ac") o.ac_modes = parse_keyed(flag, f.value(), all_ac_modes(), key);
    else if (flag == "--json") o.json_path = std::string(f.value());
    else if (flag == "--commit") o.commit = std::string(f.value());
    else if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else {
      f.unknown();
    }
  }
  for (const auto& l : o.layouts)
    TESSERA_CHECK(o.batch % l.shape.dp() == 0, "--batch ", o.batch, ": the global batch must split evenly over the ",
                  l.shape.dp(), " data-parallel ranks of ", l.name);
  return o;
}

// ---------------------------------------------------------------------------------------
// One combination.

/// The job every combination runs: the debug model with the vocabulary of the
/// synthetic BPE tokenizer, float32, one micro-batch of batch / dp sequences per rank.
train::JobConfig job(const Options& o, std::int64_t dp, const AcMode& ac) {
  const std::vector<std::string> keys = {
      "--training.local_batch_size", std::to_string(o.batch / dp),
      "--training.global_batch_size", std::to_string(o.batch),
      "--training.seq_len", std::to_string(o.seq),
      "--training.steps", std::to_string(o.warmup + o.steps),
      "--activation_checkpoint.mode", ac.mode,
      "--activation_checkpoint.selective_ac_option", ac.option,
  };
  return train::parse_config(kDebugModelJob, "bench-data-parallel", keys);
}

/// What one rank measured.
struct RankFigures {
  std::vector<double> step_seconds;   // every step, warm-up included
  std::vector<std::uint64_t> sent;    // bytes sent, every step
  std::vector<double> losses;
  std::size_t activation_bytes = 0;   // peak over the measured steps
  std::size_t peak_memory_bytes = 0;  // peak over the measured steps
  std::size_t held_bytes = 0;         // after the Trainer is constructed, before the first step
  std::int64_t local_params = 0;      // parameters this rank updates
  std::int64_t micro_batches = 0;
};

struct Result {
  Layout layout;
  std::string ac_name;
  int threads = 1;
  double step_seconds = 0;  // median over the measured steps of the slowest rank's time
  double tokens_per_sec = 0;
  std::size_t activation_bytes = 0, peak_memory_bytes = 0, held_bytes = 0;  // largest over ranks
  std::int64_t local_params = 0;                                             // largest over ranks
  std::uint64_t sent_measured = 0;  // largest over ranks and steps
  std::uint64_t sent_analytic = 0;
  bool traffic_exact = true;  // every rank, every step
  std::string traffic_mismatch;
  double final_loss = 0;
  double other_share = 0;  // share of the machine's cores other processes used during the combination
};

Result run_combination(const Options& o, const Layout& layout, const AcMode& ac,
                       const std::vector<std::uint32_t>& tokens) {
  const comm::MeshShape shape = layout.shape;
  const int world_size = shape.world();
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const int threads = o.threads > 0 ? o.threads : std::max(1, int(hw) / world_size);
  const train::JobConfig c = job(o, shape.dp(), ac);
  std::vector<RankFigures> ranks(static_cast<std::size_t>(world_size));

  const double cpu0 = cpu_seconds(), busy0 = machine_busy_seconds();
  const auto t0 = clock_type::now();
  comm::run_thread_ranks(world_size, [&](comm::Communicator& world) {
    omp_set_num_threads(threads);
    RankFigures& f = ranks[static_cast<std::size_t>(world.rank())];
    comm::DeviceMesh mesh(world, shape);
    const parallel::Plan plan = train::make_plan(c, &mesh);
    Model model(c.model.args, plan);
    model.init_weights(static_cast<std::uint64_t>(c.training.seed));
    data::DataLoader loader(tokens, c.training.seq_len, c.training.local_batch_size, mesh.dp_rank(),
                            mesh.dp_degree());
    train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
    MemoryStats& stats = memory_stats(Device::cpu);  // this rank's own counters
    f.held_bytes = stats.current();
    model.for_each_local_parameter([&](nn::Parameter<float>& p) { f.local_params += p.numel(); });
    f.micro_batches = trainer.accumulation_steps();
    for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
      stats.reset_peak();
      const train::StepMetrics m = trainer.step();
      f.step_seconds.push_back(m.step_seconds);
      f.sent.push_back(m.comm_bytes);
      f.losses.push_back(m.loss);
      if (s >= o.warmup) {
        f.activation_bytes = std::max(f.activation_bytes, m.activation_bytes);
        f.peak_memory_bytes = std::max(f.peak_memory_bytes, m.peak_memory_bytes);
      }
    }
  });
  const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
  const double other = std::max(0.0, machine_busy_seconds() - busy0 - (cpu_seconds() - cpu0));

  Result r;
  r.layout = layout;
  const parallel::Plan plan = train::make_plan(c, nullptr);
  r.ac_name = plan.checkpoint.str();
  r.threads = threads;
  r.other_share = other / (wall * double(hw));
  r.sent_analytic = plan::expected_step_bytes(plan::step_layout(c, shape));
  std::vector<double> step_times;
  for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
    double slowest = 0;
    for (std::size_t k = 0; k < ranks.size(); ++k) {
      const RankFigures& f = ranks[k];
      slowest = std::max(slowest, f.step_seconds[static_cast<std::size_t>(s)]);
      const std::uint64_t sent = f.sent[static_cast<std::size_t>(s)];
      r.sent_measured = std::max(r.sent_measured, sent);
      if (sent != r.sent_analytic && r.traffic_exact) {
        r.traffic_exact = false;
        r.traffic_mismatch = detail::concat(layout.name, ", checkpoint ", r.ac_name, ": rank ", k, " sent ", sent,
                                            " bytes in step ", s + 1, ", the analytic count is ", r.sent_analytic);
      }
    }
    if (s >= o.warmup) step_times.push_back(slowest);
  }
  for (const RankFigures& f : ranks) {
    r.activation_bytes = std::max(r.activation_bytes, f.activation_bytes);
    r.peak_memory_bytes = std::max(r.peak_memory_bytes, f.peak_memory_bytes);
    r.held_bytes = std::max(r.held_bytes, f.held_bytes);
    r.local_params = std::max(r.local_params, f.local_params);
  }
  r.step_seconds = median(step_times);
  r.tokens_per_sec = double(o.batch * o.seq) / r.step_seconds;
  r.final_loss = ranks.front().losses.back();
  return r;
}

std::string traffic_ratio(const Result& r) {
  if (r.sent_analytic == 0) return r.sent_measured == 0 ? "n/a (0 = 0)" : "MISMATCH";
  char s[48];
  std::snprintf(s, sizeof s, "%.6f", double(r.sent_measured) / double(r.sent_analytic));
  return r.traffic_exact ? std::string(s) : std::string(s) + " MISMATCH";
}

std::string bytes_exact(std::uint64_t b) {
  if (b == 0) return "0";
  return std::to_string(b) + " (" + mebibytes(double(b)) + ")";
}

int run(const Options& o) {
  // Opened first, so a path that cannot be written fails before the runs, not after.
  std::ofstream json_out;
  if (!o.json_path.empty()) {
    json_out.open(o.json_path);
    TESSERA_CHECK(json_out.good(), o.json_path, ": cannot open for writing");
  }
  const std::string date = utc_date();
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::string cpu = cpuinfo_field("model name") + " (family " + cpuinfo_field("cpu family") + " model " +
                          cpuinfo_field("model") + ")";
  const std::string blas_core = openblas_get_corename();
  const int blas_parallel = openblas_get_parallel();
  const char* policy_env = std::getenv("OMP_WAIT_POLICY");
  const std::string wait_policy = policy_env ? policy_env : "unset";
  const std::string machine = cpu + ", " + std::to_string(hw) + " hardware threads, OpenBLAS " + blas_core + " kernels";

  // Every rank reads the same stream and takes its slice of each global batch.
  const train::JobConfig c0 = job(o, 1, all_ac_modes().front());
  const std::vector<std::uint32_t> tokens = [&] {
    auto tok = data::make_tokenizer(c0.model.tokenizer);
    return train::load_training_tokens(c0, *tok).ids;
  }();
  const nn::ModelArgs& args = c0.model.args;

  std::printf("bench-data-parallel: debugmodel (dim %lld, %lld layers, %lld heads, vocabulary %lld, %lld parameters), "
              "float32\n",
              (long long)args.dim, (long long)args.n_layers, (long long)args.n_heads, (long long)args.vocab_size,
              (long long)args.num_params());
  std::printf("global batch %lld x seq %lld = %lld tokens/step; %lld warm-up + %lld measured steps; "
              "fsdp_reshard_after_forward = %s\n",
              (long long)o.batch, (long long)o.seq, (long long)(o.batch * o.seq), (long long)o.warmup,
              (long long)o.steps, c0.parallelism.fsdp_reshard_after_forward.c_str());
  std::printf("machine: %s; OpenBLAS threading %s; OMP_WAIT_POLICY %s\n", machine.c_str(),
              blas_parallel == 0 ? "sequential" : blas_parallel == 1 ? "pthreads" : "OpenMP", wait_policy.c_str());
  if (wait_policy != "PASSIVE" && wait_policy != "passive")
    std::printf("warning: OMP_WAIT_POLICY is not PASSIVE: OpenMP threads spin between parallel loops, and where the "
                "ranks (or other processes) outnumber the cores a rank of several threads waits for its descheduled "
                "threads; run with OMP_WAIT_POLICY=PASSIVE\n");
  std::printf("date: %s; commit: %s\n\n", date.c_str(), o.commit.c_str());
  std::fflush(stdout);

  std::vector<Result> results;
  for (const Layout& layout : o.layouts)
    for (const AcMode& ac : o.ac_modes) {
      Result r = run_combination(o, layout, ac, tokens);
      std::printf("%-9s %-32s %7.3f s/step %7.0f tokens/s  activations %s  peak %s  held %s  sent %llu / analytic "
                  "%llu  loss %.4f  other processes %.0f%%\n",
                  layout.name.c_str(), r.ac_name.c_str(), r.step_seconds, r.tokens_per_sec,
                  mebibytes(double(r.activation_bytes)).c_str(), mebibytes(double(r.peak_memory_bytes)).c_str(),
                  mebibytes(double(r.held_bytes)).c_str(), (unsigned long long)r.sent_measured,
                  (unsigned long long)r.sent_analytic, r.final_loss, 100 * r.other_share);
      std::fflush(stdout);
      results.push_back(std::move(r));
    }

  std::printf("\n%s; commit %s; %s; OMP_WAIT_POLICY %s; debugmodel vocabulary 1024 fp32, global batch %lld x seq "
              "%lld, median of %lld steps after %lld warm-up\n\n",
              date.c_str(), o.commit.c_str(), machine.c_str(), wait_policy.c_str(), (long long)o.batch,
              (long long)o.seq, (long long)o.steps, (long long)o.warmup);
  std::printf("| layout | ranks x threads | activation checkpoint | step time | tokens/s | activations / rank | "
              "peak memory / rank | params + grads + AdamW / rank | of 16 B x local params | sent / rank / step "
              "(bytes) | analytic (bytes) | measured / analytic | loss | other processes |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Result& r : results) {
    const double state_analytic = 16.0 * double(r.local_params);
    std::printf("| %s | %d x %d | %s | %.3f s | %.0f | %s | %s | %s | %.3fx | %s | %s | %s | %.4f | %.0f%% |\n",
                r.layout.name.c_str(), r.layout.shape.world(), r.threads, r.ac_name.c_str(), r.step_seconds,
                r.tokens_per_sec, mebibytes(double(r.activation_bytes)).c_str(),
                mebibytes(double(r.peak_memory_bytes)).c_str(),
                mebibytes(double(r.held_bytes)).c_str(), double(r.held_bytes) / state_analytic,
                bytes_exact(r.sent_measured).c_str(), bytes_exact(r.sent_analytic).c_str(), traffic_ratio(r).c_str(),
                r.final_loss, 100 * r.other_share);
  }

  double busiest = 0;
  for (const Result& r : results) busiest = std::max(busiest, r.other_share);
  if (busiest > 0.1)
    std::printf("\nnote: other processes used up to %.0f%% of the machine's cores during a combination: they competed "
                "with the ranks, and the step times understate this machine (memory and traffic are unaffected)\n",
                100 * busiest);

  if (!o.json_path.empty()) {
    nlohmann::json rows = nlohmann::json::array();
    for (const Result& r : results)
      rows.push_back({{"layout", r.layout.name},
                      {"dp_replicate", r.layout.shape.dp_replicate},
                      {"dp_shard", r.layout.shape.dp_shard},
                      {"ranks", r.layout.shape.world()},
                      {"threads_per_rank", r.threads},
                      {"activation_checkpoint", r.ac_name},
                      {"step_seconds", r.step_seconds},
                      {"tokens_per_sec", r.tokens_per_sec},
                      {"activation_bytes_per_rank", r.activation_bytes},
                      {"peak_memory_bytes_per_rank", r.peak_memory_bytes},
                      {"held_before_first_step_bytes_per_rank", r.held_bytes},
                      {"local_params_per_rank", r.local_params},
                      {"sent_bytes_per_rank_per_step", r.sent_measured},
                      {"analytic_sent_bytes_per_rank_per_step", r.sent_analytic},
                      {"traffic_exact", r.traffic_exact},
                      {"final_loss", r.final_loss},
                      {"other_processes_share", r.other_share}});
    const nlohmann::json doc = {{"date", date},
                                {"commit", o.commit},
                                {"machine", machine},
                                {"omp_wait_policy", wait_policy},
                                {"model", "debugmodel, vocabulary 1024, float32"},
                                {"global_batch", o.batch},
                                {"seq_len", o.seq},
                                {"warmup_steps", o.warmup},
                                {"measured_steps", o.steps},
                                {"results", rows}};
    json_out << doc.dump(2) << '\n';
    json_out.flush();
    TESSERA_CHECK(json_out.good(), o.json_path, ": write failed");
  }

  int status = 0;
  for (const Result& r : results)
    if (!r.traffic_exact) {
      std::fprintf(stderr, "bench-data-parallel: %s: the measured traffic differs from plan::expected_step_bytes\n",
                   r.traffic_mismatch.c_str());
      status = 2;
    }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-data-parallel: %s\n", e.what());
    return 1;
  }
}
