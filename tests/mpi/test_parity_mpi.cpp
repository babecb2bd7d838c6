// Parity across processes: the thread-rank parity matrices (tests/parallel: tensor
// parallelism, every pipeline schedule on 2 and 4 ranks, uneven stage splits, context
// parallelism, their compositions with FSDP and HSDP, and each data-parallel sharding, the checkpoint modes
// dealt over them) run over MPI ranks, all of it in one launch of 8 processes.
//
// Each layout (a mesh shape, a schedule, a checkpoint mode) trains the parity model in
// float32 for 10 steps on its own group of processes. The layouts are packed into
// rounds that fill the 8 ranks (an 8-rank layout alone, two 4-rank layouts side by
// side, 3-, 2- and 1-rank ones together); each round the world is split into one
// communicator per layout. The one-rank references (one per model shape) are 1-rank
// layouts of the same rounds, trained once and shared by every process and by both
// test cases (the tensor and pipeline one runs first and trains the references, so
// both fill every round). After the rounds every layout's losses must match its
// reference's within 1e-5 relative at every step (gradient norms within 1e-4; a float8
// layout's bf16 model within the bf16 bars of tests/parallel/test_parity.cpp), and
// every rank of a layout must have reported the very same losses and norms. The results
// are reduced over the world, so every rank holds the same; world rank 0 checks them and
// prints one line per round (wall and CPU seconds: the cores are shared) and one per
// layout with its worst relative differences, and every rank exits with its verdict.
//
//   mpirun -np 8 test_parity_mpi     (run_mpi.sh does, with its flags)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <thread>
#include <vector>

#include "../parallel/harness.hpp"
#include "tessera/comm/mpi.hpp"

using namespace tessera;
using namespace tessera::test;

namespace {

constexpr int kWorld = 8;
constexpr int kSteps = 10;
constexpr std::int64_t kGlobalBatch = 8;

comm::Communicator& world() {
  static comm::Communicator w = comm::mpi_world();
  return w;
}

/// The world again, held to NCCL's rules (comm/nccl_rules.hpp): the layouts train on
/// communicators split from it, so what they do across ranks is what NCCL will be asked
/// to do; the harness's own bookkeeping (host values) goes over world().
comm::Communicator& rules_world() {
  static comm::Communicator w = comm::mpi_world_nccl_rules(Cpu::memory_access());
  return w;
}

/// A barrier over the world that sleeps while it waits, so ranks done with their round
/// leave the cores to the ranks still training (a blocking MPI wait polls).
void sleeping_barrier() {
  const int rank = world().rank();
  MPI_Request request = MPI_REQUEST_NULL;
  TESSERA_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &request) == MPI_SUCCESS, "rank ", rank, ": MPI_Ibarrier failed");
  for (int done = 0; !done;) {
    TESSERA_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS, "rank ", rank, ": MPI_Test failed");
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

/// Seconds of CPU this process has used (user and system): with the cores shared, the
/// cost of a round apart from what else the machine runs.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

/// One run of the matrix: a mesh, its [parallelism] and [activation_checkpoint] keys,
/// the model's keys (which its one-rank reference trains with too), and the bars it is
/// held to: the parity bars of a float32 model, or a bf16 one's (float8 takes a bf16
/// model, whose last-bit differences a bf16 rounding may flip: test_parity.cpp).
struct Layout {
  std::string name;
  comm::MeshShape shape;
  std::vector<std::string> keys;
  std::vector<std::string> model_keys;
  double loss_bar = 1e-5, norm_bar = 1e-4;
};

/// What a layout's group reports: rank 0's losses and gradient norms, whether every
/// rank had the same, and the slowest rank's seconds.
struct Outcome {
  std::vector<double> losses, grad_norms;
  bool agree = false;
  double seconds = 0;
  int first_rank = 0;  // world ranks first_rank .. first_rank + world - 1 trained it
};

/// The one-rank run per model shape (its keys), trained once per launch.
std::map<std::vector<std::string>, Outcome>& references() {
  static std::map<std::vector<std::string>, Outcome> cache;
  return cache;
}

std::string describe(const std::vector<std::string>& model_keys) {
  std::string s = "one rank";
  for (std::size_t i = 0; i + 1 < model_keys.size(); i += 2)
    s += ", " + model_keys[i].substr(2) + " " + model_keys[i + 1];  // "--model.n_layers", "5": model.n_layers 5
  return s;
}

/// The jobs in rounds of at most kWorld ranks: largest layouts first, each round filled
/// in that order (first fit), so two 4-rank layouts run side by side, and 3-, 2- and
/// 1-rank ones fill what is left.
std::vector<std::vector<std::size_t>> pack_rounds(const std::vector<Layout>& jobs) {
  std::vector<std::size_t> order(jobs.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return jobs[a].shape.world() > jobs[b].shape.world(); });
  for (const Layout& l : jobs)
    TESSERA_CHECK(l.shape.world() >= 1 && l.shape.world() <= kWorld, "layout ", l.name, " needs ", l.shape.world(),
                  " ranks, the world has ", kWorld);
  std::vector<std::vector<std::size_t>> rounds;
  std::vector<bool> placed(jobs.size(), false);
  for (std::size_t left = jobs.size(); left > 0;) {
    std::vector<std::size_t>& round = rounds.emplace_back();
    int free = kWorld;
    for (std::size_t j : order) {
      if (placed[j] || jobs[j].shape.world() > free) continue;
      round.push_back(j);
      placed[j] = true;
      free -= jobs[j].shape.world();
      --left;
    }
  }
  return rounds;
}

/// Trains every job, round by round, each on its own communicator (a round's layouts
/// take consecutive world ranks; ranks left over idle), and returns each job's outcome,
/// the same on every rank.
std::vector<Outcome> run_rounds(const std::vector<Layout>& jobs) {
  comm::Communicator& w = world();
  const std::vector<std::vector<std::size_t>> rounds = pack_rounds(jobs);
  // Per job: the losses, the gradient norms, the slowest rank's seconds, whether any
  // rank disagreed, the first world rank; written by the group's rank 0, summed over the world.
  constexpr std::size_t kRow = 2 * kSteps + 3;
  std::vector<double> table(jobs.size() * kRow, 0.0);
  for (std::size_t r = 0; r < rounds.size(); ++r) {
    const std::vector<std::size_t>& round = rounds[r];
    sleeping_barrier();
    const auto round_start = std::chrono::steady_clock::now();
    const double cpu_start = cpu_seconds();
    int color = -1, first = 0;  // color: this rank's job, -1 if idle
    for (int at = 0; std::size_t j : round) {
      const int n = jobs[j].shape.world();
      if (w.rank() >= at && w.rank() < at + n) {
        color = static_cast<int>(j);
        first = at;
      }
      at += n;
    }
    try {
      comm::Communicator group = w.split(color, w.rank());
      comm::Communicator trained = rules_world().split(color, w.rank());
      if (color >= 0) {
        const std::size_t job = static_cast<std::size_t>(color);
        const Layout& l = jobs[job];
        TESSERA_CHECK(group.size() == l.shape.world(), "layout ", l.name, ": group of ", group.size(),
                      " ranks, expected ", l.shape.world());
        const auto start = std::chrono::steady_clock::now();
        const RunResult run = train_layout(
            trained, l.shape, debug_job(kGlobalBatch / l.shape.dp(), kGlobalBatch, kSteps, with(l.keys, l.model_keys)));
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        TESSERA_CHECK(run.losses.size() == static_cast<std::size_t>(kSteps) &&
                          run.grad_norms.size() == static_cast<std::size_t>(kSteps),
                      "layout ", l.name, ": ", run.losses.size(), " losses for ", kSteps, " steps");
        // Every rank of the group must report the very same losses and norms (both are
        // reduced over it): rank 0 compares every rank's with its own.
        std::vector<double> mine = run.losses;
        mine.insert(mine.end(), run.grad_norms.begin(), run.grad_norms.end());
        std::vector<double> all(mine.size() * static_cast<std::size_t>(group.size()));
        group.all_gather(std::span<const double>(mine), std::span<double>(all));
        double disagree = 0;
        for (std::size_t i = 0; i < all.size(); ++i)
          if (!(all[i] == mine[i % mine.size()])) disagree = 1;  // a NaN never agrees
        group.all_reduce(std::span<double>(&seconds, 1), comm::ReduceOp::max);
        if (group.rank() == 0) {
          double* row = table.data() + job * kRow;
          std::copy(mine.begin(), mine.end(), row);
          row[2 * kSteps] = seconds;
          row[2 * kSteps + 1] = disagree;
          row[2 * kSteps + 2] = first;
        }
      }
    } catch (const std::exception& e) {
      // A rank that fails here would leave its group waiting in a collective: end the job.
      comm::mpi_abort_on_error(e, "test_parity_mpi");
    }
    sleeping_barrier();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start).count();
    const double cpu = w.all_reduce_value(cpu_seconds() - cpu_start);
    if (w.rank() == 0) {
      std::string names;
      for (int at = 0; std::size_t j : round) {
        const int n = jobs[j].shape.world();
        if (!names.empty()) names += "; ";
        names += jobs[j].name;
        names += n > 1 ? " (ranks " + std::to_string(at) + "-" + std::to_string(at + n - 1) + ")"
                       : " (rank " + std::to_string(at) + ")";
        at += n;
      }
      std::printf("parity over MPI: round %zu of %zu, %.1f s (%.1f s of CPU): %s\n", r + 1, rounds.size(), seconds, cpu,
                  names.c_str());
      std::fflush(stdout);
    }
  }
  w.all_reduce(std::span<double>(table));
  std::vector<Outcome> out(jobs.size());
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const double* row = table.data() + j * kRow;
    out[j].losses.assign(row, row + kSteps);
    out[j].grad_norms.assign(row + kSteps, row + 2 * kSteps);
    out[j].seconds = row[2 * kSteps];
    out[j].agree = row[2 * kSteps + 1] == 0;
    out[j].first_rank = static_cast<int>(row[2 * kSteps + 2]);
  }
  return out;
}

/// Trains `layouts` and the references they need (those not trained yet), then checks
/// every layout against its reference: losses within 1e-5 relative at every step,
/// gradient norms (which clipping uses) within 1e-4. World rank 0 prints one line per layout.
void check_matrix(const std::vector<Layout>& layouts) {
  comm::Communicator& w = world();
  REQUIRE(w.size() == kWorld);  // the same on every rank: all fail or none
  const auto start = std::chrono::steady_clock::now();
  const double cpu_start = cpu_seconds();
  std::vector<Layout> jobs = layouts;
  std::vector<std::vector<std::string>> wanted;
  for (const Layout& l : layouts)
    if (!references().count(l.model_keys) && std::find(wanted.begin(), wanted.end(), l.model_keys) == wanted.end()) {
      wanted.push_back(l.model_keys);
      jobs.push_back({describe(l.model_keys), comm::MeshShape{}, {}, l.model_keys});
    }
  const std::vector<Outcome> outcomes = run_rounds(jobs);
  std::size_t width = 0;
  for (const Layout& l : jobs) width = std::max(width, l.name.size());
  for (std::size_t j = layouts.size(); j < jobs.size(); ++j) {
    references()[jobs[j].model_keys] = outcomes[j];
    if (w.rank() == 0)
      std::printf("parity over MPI: reference %-*s | rank %d | %5.1f s\n", static_cast<int>(width),
                  jobs[j].name.c_str(), outcomes[j].first_rank, outcomes[j].seconds);
  }
  for (std::size_t j = 0; j < layouts.size(); ++j) {
    const Layout& l = layouts[j];
    const Outcome& o = outcomes[j];
    const Outcome& ref = references().at(l.model_keys);
    // Infinite for a NaN or a missing step: a NaN never passes.
    const double loss_gap = max_relative_difference(o.losses, ref.losses);
    const double norm_gap = max_relative_difference(o.grad_norms, ref.grad_norms);
    const bool pass = o.agree && loss_gap <= l.loss_bar && norm_gap <= l.norm_bar;
    const int n = l.shape.world();
    const std::string ranks = std::to_string(o.first_rank) + "-" + std::to_string(o.first_rank + n - 1);
    // Every rank holds the same outcomes: world rank 0 reports them, and main() gives
    // every rank its verdict.
    if (w.rank() != 0) continue;
    std::printf("parity over MPI: %-*s | ranks %-3s | worst relative difference %.3g (gradient norm %.3g) over %d "
                "steps | %5.1f s%s%s\n",
                static_cast<int>(width), l.name.c_str(), ranks.c_str(), loss_gap, norm_gap, kSteps, o.seconds,
                o.agree ? "" : "  RANKS DISAGREE", pass ? "" : "  FAIL");
    INFO("layout ", l.name, " ", l.shape.str(), " on world ranks ", ranks);
    CHECK(o.agree);
    CHECK(loss_gap <= l.loss_bar);
    CHECK(norm_gap <= l.norm_bar);
  }
  const double cpu = w.all_reduce_value(cpu_seconds() - cpu_start);
  if (w.rank() == 0)
    std::printf("parity over MPI: %zu layouts and %zu references took %.1f s (%.1f s of CPU over the %d ranks)\n",
                layouts.size(), jobs.size() - layouts.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), cpu, kWorld);
  std::fflush(stdout);
}

const std::vector<std::string>& ac(int mode) { return kAcModes[mode].keys; }

std::vector<std::string> schedule(const char* name, int microbatch_size = 1) {
  return {"--parallelism.pipeline_parallel_schedule", name, "--parallelism.pipeline_parallel_microbatch_size",
          std::to_string(microbatch_size)};
}

/// A bf16 model with emulated float8 GEMMs by `recipe`.
std::vector<std::string> float8_keys(const char* recipe) {
  return {"--training.mixed_precision_param", "bfloat16", "--model.converters", "float8", "--float8.emulate", "true",
          "--float8.recipe_name", recipe};
}
/// Tensorwise, the weights gathered in float8, micro-batches of 4 sequences (one rank's
/// reference runs two, as a rank of a data-parallel degree of 2 runs one; both test
/// cases' layouts share it).
std::vector<std::string> float8_gathered() {
  return with(float8_keys("tensorwise"),
              {"--float8.enable_fsdp_float8_all_gather", "true", "--training.local_batch_size", "4"});
}

constexpr const char* kSchedules[] = {"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"};

}  // namespace

TEST_CASE("parity over MPI: tensor, pipeline and context parallelism, every schedule, and their compositions") {
  std::vector<Layout> matrix = {
      {"TP 2", {1, 1, 1, 2}, {}, {}},
      {"TP 4, checkpoint full", {1, 1, 1, 4}, ac(1), {}},
      {"TP 4 > kv heads 2, checkpoint selective op", {1, 1, 1, 4}, ac(2), {"--model.n_kv_heads", "2"}},
  };
  for (const char* s : kSchedules)
    matrix.push_back({std::string("PP 2, ") + s + ", 8 microbatches", {2, 1, 1, 1}, schedule(s), {}});
  for (const char* s : kSchedules)
    matrix.push_back({std::string("PP 4, ") + s + ", 4 microbatches", {4, 1, 1, 1}, schedule(s, 2), {}});
  // 5 blocks + embedding + output = 7 layers over 4 stages (2, 2, 2, 1); 8 over 3 (3, 3, 2).
  matrix.push_back({"PP 4, 1F1B, 5 layers", {4, 1, 1, 1}, schedule("1F1B", 2), {"--model.n_layers", "5"}});
  matrix.push_back({"PP 3, GPipe", {3, 1, 1, 1}, schedule("GPipe"), {}});
  matrix.push_back({"FSDP 2 x TP 2, checkpoint selective op", {1, 1, 2, 2}, ac(2), {}});
  matrix.push_back({"FSDP 2 x PP 2, 1F1B, checkpoint full", {2, 1, 2, 1}, with(schedule("1F1B"), ac(1)), {}});
  matrix.push_back({"TP 2 x PP 2, Interleaved1F1B, checkpoint selective op",
                    {2, 1, 1, 2},
                    with(schedule("Interleaved1F1B"), ac(2)),
                    {}});
  matrix.push_back({"FSDP 2 x TP 2 x PP 2, InterleavedZeroBubble, checkpoint every 2nd layer",
                    {2, 1, 2, 2},
                    with(schedule("InterleavedZeroBubble"), ac(3)),
                    {}});
  matrix.push_back({"HSDP 2x2 x TP 2, checkpoint full", {1, 2, 2, 2}, ac(1), {}});
  // Context parallelism: the ring's sends and receives over MPI.
  matrix.push_back({"CP 4, checkpoint selective op", {1, 1, 1, 1, 4}, ac(2), {}});
  matrix.push_back({"CP 2 x TP 2 x FSDP 2, checkpoint full", {1, 1, 2, 2, 2}, ac(1), {}});
  // Float8 GEMMs (emulated) under TP, each piece cast by the whole tensor's scales, and
  // under FSDP x TP with the weights gathered in float8; the reference runs the
  // data-parallel ranks' micro-batches (a cast's amax is its micro-batch's).
  matrix.push_back({"TP 2, float8 rowwise", {1, 1, 1, 2}, {}, float8_keys("rowwise"), 1e-3, 5e-3});
  matrix.push_back({"FSDP 2 x TP 2, float8 tensorwise gathered in float8, checkpoint full", {1, 1, 2, 2}, ac(1),
                    float8_gathered(), 1e-3, 5e-3});
  check_matrix(matrix);
}

// Each sharding once, the checkpoint modes dealt over them so each runs at least once:
// the checkpoint policies do not touch the engine, and the thread-rank tests run every
// sharding with every mode (tests/parallel/test_parity.cpp).
TEST_CASE("parity over MPI: data parallelism (FSDP 8, 4, 2, HSDP 2x2, DDP 4, the early step, LoRA, float8), the checkpoint modes dealt over them") {
  const std::tuple<const char*, comm::MeshShape, int> layouts[] = {
      {"FSDP 8", {1, 1, 8, 1}, 0},   {"FSDP 4", {1, 1, 4, 1}, 1}, {"FSDP 2", {1, 1, 2, 1}, 2},
      {"HSDP 2x2", {1, 2, 2, 1}, 3}, {"DDP 4", {1, 4, 1, 1}, 1},
  };
  std::vector<Layout> matrix;
  for (const auto& [name, shape, mode] : layouts)
    matrix.push_back({std::string(name) + ", checkpoint " + kAcModes[mode].name, shape, ac(mode), {}});
  // The early step updates each unit as its reduce-scatter completes, without clipping:
  // against one rank's step without either.
  matrix.push_back({"FSDP 2, early step, checkpoint selective op", {1, 1, 2, 1},
                    with(ac(2), {"--optimizer.early_step_in_backward", "true"}), {"--training.max_norm", "0"}});
  // LoRA: the frozen weights gathered from shards of their own, the adapters' gradients
  // reduce-scattered and summed over the tensor-parallel ranks; against one rank's LoRA.
  matrix.push_back({"FSDP 2 x TP 2, LoRA, checkpoint none", {1, 1, 2, 2}, ac(0),
                    {"--model.converters", "lora", "--lora.rank", "4", "--optimizer.lr", "1e-2"}});
  // FSDP's float8 all-gather: each weight's scale agreed over the shards, the float8
  // bytes gathered; against one rank's float8 run of the same micro-batches.
  matrix.push_back({"FSDP 2, float8 tensorwise gathered in float8, checkpoint selective op", {1, 1, 2, 1}, ac(2),
                    float8_gathered(), 1e-3, 5e-3});
  check_matrix(matrix);
}

int main(int argc, char** argv) {
  // Eight processes share the cores: one OpenMP thread each.
  omp_set_num_threads(1);
  int failed = 0;
  try {
    comm::Communicator& w = world();  // initialises MPI; it is finalized at exit
    rules_world();
    doctest::Context context(argc, argv);
    if (w.rank() != 0) context.setOption("minimal", true);  // every rank reports its failures, rank 0 the summary
    failed = context.run() != 0 ? 1 : 0;
    if (!context.shouldExit()) failed = w.all_reduce_value<std::int32_t>(failed, comm::ReduceOp::max);
  } catch (const std::exception& e) {
    comm::mpi_abort_on_error(e, "test_parity_mpi");
  }
  return failed;
}
