// Parity across processes: the thread-rank parity matrix (tests/parallel/test_parity.cpp)
// run over MPI ranks, all of it in one launch of 8 processes. The world is split into
// groups, each training one layout on its own communicator while the others train
// theirs: FSDP 8 (the whole world), FSDP 4 and HSDP 2 x 2 and DDP 4 (two groups of 4),
// FSDP 2 (four groups of 2). A layout's checkpoint modes are dealt out over its groups
// (group g takes modes g, g + groups, ...), so every layout meets every mode and the
// launch does no run twice. Every group's losses must match one rank's (computed by
// each process itself) within 1e-5 relative at every step, and agree bitwise between
// the ranks of the group. The verdict is reduced over the world, so every rank reports
// the same; world rank 0 prints one line per layout and mode.
//
//   mpirun -np 8 test_parity_mpi     (run_mpi.sh does, with its flags)
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "../parallel/harness.hpp"
#include "tessera/comm/mpi.hpp"

using namespace tessera;
using namespace tessera::test;

namespace {

constexpr int kWorld = 8;
constexpr int kSteps = 10;
constexpr std::int64_t kGlobalBatch = 8;

constexpr int kModes = static_cast<int>(std::size(kAcModes));

comm::Communicator& world() {
  static comm::Communicator w = comm::mpi_world();
  return w;
}

/// One rank, no checkpointing: the reference every group is held to.
const std::vector<double>& reference_losses() {
  static const std::vector<double> losses =
      train_layout(comm::Communicator(), comm::MeshShape{}, debug_job(kGlobalBatch, kGlobalBatch, kSteps)).losses;
  return losses;
}

/// Trains `shape` in groups of shape.world() consecutive world ranks, each group its
/// share of the checkpoint modes, and checks every group against the reference.
void check_layout(const char* name, comm::MeshShape shape) {
  comm::Communicator& w = world();
  REQUIRE(w.size() == kWorld);  // the same on every rank: all fail or none
  const int group_size = shape.world();
  const int groups = kWorld / group_size;
  const int group = w.rank() / group_size;
  static bool reference_timed = false;
  const auto ref_start = std::chrono::steady_clock::now();
  const std::vector<double>& reference = reference_losses();
  w.barrier();  // every process has its reference: the time below is the layout's
  const auto start = std::chrono::steady_clock::now();
  if (w.rank() == 0 && !reference_timed)
    std::printf("parity over MPI: the reference (one rank, computed by each process) took %.1f s\n",
                std::chrono::duration<double>(start - ref_start).count());
  reference_timed = true;

  // Per mode: the worst relative difference this rank saw (-1: its group did not run the mode).
  std::vector<double> worst(kModes, -1.0);
  std::vector<std::int32_t> failures(kModes, 0);  // this rank's failed checks, per mode
  try {
    comm::Communicator group_comm = w.split(group, w.rank());
    TESSERA_CHECK(group_comm.size() == group_size, "layout ", name, ": group ", group, " has ", group_comm.size(),
                  " ranks, expected ", group_size);
    for (int m = group; m < kModes; m += groups) {
      const AcMode& ac = kAcModes[m];
      const std::vector<double> losses =
          train_layout(group_comm, shape, debug_job(kGlobalBatch / shape.dp(), kGlobalBatch, kSteps, ac.keys)).losses;
      // Every rank of the group must report the very same losses (they are reduced over it).
      std::vector<double> all(losses.size() * static_cast<std::size_t>(group_size));
      group_comm.all_gather(std::span<const double>(losses), std::span<double>(all));
      bool agree = losses.size() == static_cast<std::size_t>(kSteps);
      for (std::size_t i = 0; i < all.size(); ++i) agree = agree && all[i] == losses[i % losses.size()];
      // max_relative_difference passes over a NaN step; a loss must be finite to count.
      bool finite = true;
      for (double l : losses) finite = finite && std::isfinite(l);
      const double diff = finite ? max_relative_difference(losses, reference) : INFINITY;
      worst[static_cast<std::size_t>(m)] = diff;
      if (!agree || !(diff <= 1e-5)) failures[static_cast<std::size_t>(m)] = 1;
      INFO("layout ", std::string(name), ", group ", group, ", checkpoint mode ", std::string(ac.name), ", world rank ",
           w.rank());
      CHECK(agree);
      CHECK(diff <= 1e-5);
    }
  } catch (const std::exception& e) {
    // A rank that fails here would leave its group waiting in a collective: end the job.
    comm::mpi_abort_on_error(e, "test_parity_mpi");
  }

  w.all_reduce(std::span<double>(worst), comm::ReduceOp::max);
  w.all_reduce(std::span<std::int32_t>(failures));
  std::int32_t world_failures = 0;  // ranks that failed a check, over every mode
  for (std::int32_t f : failures) world_failures += f;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (w.rank() == 0)
    for (int m = 0; m < kModes; ++m)
      std::printf("parity over MPI: %-8s %d group%s of %d | checkpoint %-25s | worst relative difference %.3g over %d "
                  "steps%s\n",
                  name, groups, groups == 1 ? " " : "s", group_size, kAcModes[m].name, worst[static_cast<std::size_t>(m)],
                  kSteps, failures[static_cast<std::size_t>(m)] == 0 ? "" : "  FAIL");
  if (w.rank() == 0) std::printf("parity over MPI: %s took %.1f s\n", name, seconds);
  std::fflush(stdout);
  INFO("layout ", std::string(name), ": ", world_failures, " failed checks over the world's ranks");
  CHECK(world_failures == 0);
}

}  // namespace

TEST_CASE("parity over MPI: FSDP over the whole world of 8") { check_layout("FSDP 8", {1, 1, 8, 1}); }
TEST_CASE("parity over MPI: FSDP 4, two groups") { check_layout("FSDP 4", {1, 1, 4, 1}); }
TEST_CASE("parity over MPI: FSDP 2, four groups") { check_layout("FSDP 2", {1, 1, 2, 1}); }
TEST_CASE("parity over MPI: HSDP 2 x 2, two groups") { check_layout("HSDP 2x2", {1, 2, 2, 1}); }
TEST_CASE("parity over MPI: DDP 4, two groups") { check_layout("DDP 4", {1, 4, 1, 1}); }

int main(int argc, char** argv) {
  // Eight processes share the cores: one OpenMP thread each.
  omp_set_num_threads(1);
  int failed = 0;
  try {
    comm::Communicator& w = world();  // initialises MPI; it is finalized at exit
    doctest::Context context(argc, argv);
    if (w.rank() != 0) context.setOption("minimal", true);  // every rank reports its failures, rank 0 the summary
    failed = context.run() != 0 ? 1 : 0;
    if (!context.shouldExit()) failed = w.all_reduce_value<std::int32_t>(failed, comm::ReduceOp::max);
  } catch (const std::exception& e) {
    comm::mpi_abort_on_error(e, "test_parity_mpi");
  }
  return failed;
}
