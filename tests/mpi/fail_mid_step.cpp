// A rank that fails in the middle of a training step, for run_mpi.sh: the parity model
// trained with FSDP over every rank of the MPI world, its blocks a user's own layer
// type that throws on world rank 1 in the backward of step 2 — while the other ranks
// are inside that step's collectives. main's catch block must end the whole job
// promptly, naming rank 1 and the error, instead of leaving the others waiting.
//   mpirun -np 4 fail_mid_step
#include <omp.h>

#include <cstdio>
#include <exception>

#include "../parallel/harness.hpp"
#include "../support/failing_block.hpp"
#include "tessera/comm/mpi.hpp"

using namespace tessera;

int main() {
  try {
    comm::Communicator world = comm::mpi_world();
    omp_set_num_threads(1);
    using Block = Parallel<test::FailingBlock<float, Cpu>, Sharding<FSDP>>;
    using Model = nn::Transformer<float, Cpu, Block>;
    const comm::MeshShape shape{1, 1, world.size(), 1};
    const test::RunResult r = test::train_layout<Model>(world, shape, test::debug_job(2, 2 * world.size(), 3));
    std::printf("rank %d trained %zu steps, but rank 1 failed in step 2: the job should have ended\n", world.rank(),
                r.losses.size());
    return 0;
  } catch (const std::exception& e) {
    comm::mpi_abort_on_error(e, "fail_mid_step");
  }
}
