// A job in which rank 2 fails, for run_mpi.sh: the whole job must end promptly with
// the failing rank's reason instead of leaving the other ranks waiting for it.
//   fail_rank throw   rank 2 throws after one collective; main's catch block ends the job
//   fail_rank abort   rank 2 calls Communicator::abort after one collective
//   fail_rank early   throws before MPI is initialised (run without mpirun): exit status 1
#include <cstdio>
#include <exception>
#include <span>
#include <string>
#include <vector>

#include "tessera/comm/mpi.hpp"
#include "tessera/core/error.hpp"

int main(int argc, char** argv) {
  using namespace tessera;
  const std::string mode = argc > 1 ? argv[1] : "throw";
  try {
    if (mode == "early") fail("bad configuration before MPI started");
    comm::Communicator world = comm::mpi_world();
    std::vector<float> x(8, 1.0f);
    world.all_reduce(std::span<float>(x));
    if (world.rank() == 2) {
      if (mode == "abort") world.abort("rank 2 gave up: loss is NaN");
      fail("bad batch on this rank");
    }
    // The other ranks wait here for rank 2, which never comes.
    for (int step = 0; step < 3; ++step) world.all_reduce(std::span<float>(x));
    std::printf("rank %d finished, but rank 2 failed: the job should have ended\n", world.rank());
    return 0;
  } catch (const std::exception& e) {
    comm::mpi_abort_on_error(e, "fail_rank");
  }
}
