// A rank that fails in the middle of a training step, on thread ranks: the parity model
// trained with FSDP over 4 ranks whose blocks (a user's own layer type) throw on rank 1
// in the backward of step 2, while the other ranks are inside that step's collectives.
// run_thread_ranks must end every rank and rethrow rank 1's error promptly — not wait
// out the collectives' timeout — and leave no thread of the run behind.
// tests/mpi/fail_mid_step.cpp is the same scenario across MPI processes.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <string>

#include "../support/failing_block.hpp"
#include "../support/errors.hpp"
#include "harness.hpp"
#include "tessera/comm/thread.hpp"

namespace test_failure {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

/// The threads of this process, from /proc/self/status (-1 where there is none).
int process_threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

}  // namespace

TEST_CASE("failure: a rank that throws in the middle of a step ends every thread rank, naming it") {
  using Block = Parallel<FailingBlock<float, Cpu>, Sharding<FSDP>>;
  using Model = nn::Transformer<float, Cpu, Block>;
  constexpr int kRanks = 4;
  const comm::MeshShape shape{1, 1, kRanks, 1};
  const train::JobConfig job = debug_job(1, kRanks, 3);  // one sequence per rank per step
  (void)debug_tokens();  // the corpus is made once per process, outside the timed run

  const int threads_before = process_threads();
  // A collective left waiting would fail after this long; the run must end well before.
  comm::ThreadOptions options;
  options.timeout = std::chrono::seconds(60);
  int steps_done[kRanks] = {};
  const auto start = std::chrono::steady_clock::now();
  const std::string error = tessera::testing::error_of([&] {
    comm::run_thread_ranks(
        kRanks,
        [&](comm::Communicator& world) {
          steps_done[world.rank()] = static_cast<int>(train_layout<Model>(world, shape, job).losses.size());
        },
        options);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO("error: ", error);
  INFO("seconds: ", seconds);
  CHECK(error.rfind("rank 1: injected failure in the backward of layers.3 at step 2", 0) == 0);
  CHECK(seconds < 30);
  for (int r = 0; r < kRanks; ++r) CHECK(steps_done[r] == 0);  // no rank finished the run
  // run_thread_ranks joined its rank threads; the ranks' collective workers ended with them.
  if (threads_before > 0) CHECK(process_threads() == threads_before);
}

}  // namespace test_failure
