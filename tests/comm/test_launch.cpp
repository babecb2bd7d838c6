// Launch detection from a fake environment: each launcher's variables, which one wins
// when several are set, and every bad value named with its variable.
#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/comm/launch.hpp"

namespace test_launch {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::comm;

namespace {
Launch detect(const std::map<std::string, std::string>& env) {
  return detect_launch([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("launch: no launcher variables is one process") {
  const Launch l = detect({{"HOME", "/root"}, {"PATH", "/usr/bin"}});
  CHECK(l.kind == LaunchKind::single);
  CHECK(l.rank == 0);
  CHECK(l.world_size == 1);
  CHECK(l.local_rank == 0);
  CHECK(l.master_addr.empty());
  CHECK(l.master_port == 0);
  CHECK(std::string(name_of(LaunchKind::single)) == "single");
  CHECK(std::string(name_of(LaunchKind::mpi)) == "mpi");
  CHECK(std::string(name_of(LaunchKind::torchrun)) == "torchrun");
}

TEST_CASE("launch: mpirun, PMI and srun variables are an MPI launch") {
  SUBCASE("Open MPI's mpirun") {
    const Launch l = detect({{"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "5"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.world_size == 8);
    CHECK(l.rank == 5);
    CHECK(l.local_rank == 1);
  }
  SUBCASE("PMI (MPICH's launcher)") {
    const Launch l = detect({{"PMI_SIZE", "4"}, {"PMI_RANK", "3"}, {"MPI_LOCALRANKID", "0"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.world_size == 4);
    CHECK(l.rank == 3);
    CHECK(l.local_rank == 0);
  }
  SUBCASE("PMIx rank with PMI_SIZE") {
    const Launch l = detect({{"PMIX_RANK", "2"}, {"PMI_SIZE", "3"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.rank == 2);
    CHECK(l.world_size == 3);
  }
  SUBCASE("PMIx rank under srun: the size and local rank from Slurm") {
    const Launch l =
        detect({{"PMIX_RANK", "6"}, {"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "2"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.rank == 6);
    CHECK(l.world_size == 16);
    CHECK(l.local_rank == 2);
  }
  SUBCASE("srun") {
    const Launch l = detect({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "3"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.rank == 7);
    CHECK(l.world_size == 16);
    CHECK(l.local_rank == 3);
  }
  SUBCASE("mpirun wins over Slurm and torchrun variables") {
    const Launch l = detect({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "1"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.rank == 1);
    CHECK(l.world_size == 2);
    CHECK(l.local_rank == 0);
  }
}

TEST_CASE("launch: torchrun-style variables") {
  const Launch l = detect({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "node0"},
                           {"MASTER_PORT", "29500"}});
  CHECK(l.kind == LaunchKind::torchrun);
  CHECK(l.rank == 3);
  CHECK(l.world_size == 4);
  CHECK(l.local_rank == 1);
  CHECK(l.master_addr == "node0");
  CHECK(l.master_port == 29500);

  // One rank needs no rendezvous address.
  const Launch one = detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  CHECK(one.kind == LaunchKind::torchrun);
  CHECK(one.world_size == 1);
  CHECK(one.master_port == 0);
}

TEST_CASE("launch: bad values name the variable and its value") {
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_SIZE", "four"}, {"OMPI_COMM_WORLD_RANK", "0"}}),
                       "launch: OMPI_COMM_WORLD_SIZE=\"four\" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "4"}}),
                       "launch: OMPI_COMM_WORLD_RANK=4 is outside [0, 4) (OMPI_COMM_WORLD_SIZE=4)");
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_RANK", "1"}}),
                       "launch: OMPI_COMM_WORLD_RANK=1 is set without OMPI_COMM_WORLD_SIZE");
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_SIZE", "2"}}),
                       "launch: OMPI_COMM_WORLD_SIZE=2 is set without OMPI_COMM_WORLD_RANK");
  CHECK_ERROR_CONTAINS(
      detect({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "-1"}}),
      "launch: OMPI_COMM_WORLD_LOCAL_RANK=-1 is outside [0, 2)");
  CHECK_ERROR_CONTAINS(detect({{"PMI_RANK", "1"}}),
                       "launch: PMI_RANK=1 is set but neither PMI_SIZE nor SLURM_NTASKS says how many ranks there are");
  CHECK_ERROR_CONTAINS(detect({{"PMIX_RANK", "x1"}, {"PMI_SIZE", "2"}}), "launch: PMIX_RANK=\"x1\" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "0"}}), "launch: SLURM_PROCID=0 is set without SLURM_NTASKS");
  CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}),
                       "launch: SLURM_NTASKS=0: a job has at least one rank");
  CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}),
                       "launch: SLURM_PROCID=3 is outside [0, 2) (SLURM_NTASKS=2)");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}}), "launch: RANK=0 is set without WORLD_SIZE");
  CHECK_ERROR_CONTAINS(detect({{"WORLD_SIZE", "2"}}), "launch: WORLD_SIZE=2 is set without RANK");
  CHECK_ERROR_CONTAINS(detect({{"RANK", ""}, {"WORLD_SIZE", "2"}}), "launch: RANK=\"\" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "1 "}, {"WORLD_SIZE", "2"}}), "launch: RANK=\"1 \" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}),
                       "launch: WORLD_SIZE=\"99999999999\" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}),
                       "launch: RANK=-1 is outside [0, 2) (WORLD_SIZE=2)");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}}),
                       "launch: LOCAL_RANK=2 is outside [0, 2)");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}),
                       "launch: WORLD_SIZE=2 needs MASTER_ADDR");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}}),
                       "launch: WORLD_SIZE=2 needs MASTER_PORT");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "70000"}}),
                       "launch: MASTER_PORT=70000 is outside 1..65535");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}}),
                       "launch: MASTER_PORT=0 is outside 1..65535");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "http"}}),
                       "launch: MASTER_PORT=\"http\" is not an integer");
}

TEST_CASE("launch: the three GPU launchers' local sizes and rendezvous") {
  SUBCASE("torchrun") {
    const Launch l = detect({{"RANK", "9"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "8"},
                             {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
    CHECK(l.launcher == Launcher::torchrun);
    CHECK(l.local_rank == 1);
    CHECK(l.local_world_size == 8);
    CHECK(l.local_size_var == "LOCAL_WORLD_SIZE");
    CHECK(l.has_master());
    CHECK(describe_rank(l) == "rank 9 (local rank 1 of 8 on this node)");
    CHECK_FALSE(l.agent_store);
    CHECK(l.store_port() == 29500);
  }
  SUBCASE("torchrun whose agent serves its own store on MASTER_PORT: the ranks meet on the next port") {
    const Launch l = detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"},
                             {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
    CHECK(l.agent_store);
    CHECK(l.store_port() == 29501);
    CHECK_FALSE(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"},
                        {"TORCHELASTIC_USE_AGENT_STORE", "False"}})
                    .agent_store);
    CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "65535"},
                                 {"TORCHELASTIC_USE_AGENT_STORE", "True"}}),
                         "launch: MASTER_PORT=65535 is held by torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True)");
  }
  SUBCASE("mpirun") {
    const Launch l = detect({{"OMPI_COMM_WORLD_SIZE", "16"}, {"OMPI_COMM_WORLD_RANK", "12"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.launcher == Launcher::mpirun);
    CHECK(l.local_rank == 4);
    CHECK(l.local_world_size == 8);
    CHECK_FALSE(l.has_master());  // the id goes by MPI broadcast
  }
  SUBCASE("srun with --ntasks-per-node and a rendezvous address") {
    const Launch l = detect({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "5"},
                             {"SLURM_NTASKS_PER_NODE", "8"}, {"SLURM_TASKS_PER_NODE", "8(x2)"},
                             {"MASTER_ADDR", "gpu-a01"}, {"MASTER_PORT", "29400"}});
    CHECK(l.kind == LaunchKind::mpi);
    CHECK(l.launcher == Launcher::srun);
    CHECK(l.local_world_size == 8);
    CHECK(l.local_size_var == "SLURM_NTASKS_PER_NODE");
    CHECK(l.master_addr == "gpu-a01");
    CHECK(l.master_port == 29400);
    CHECK(l.has_master());
  }
  SUBCASE("srun: SLURM_TASKS_PER_NODE, this node's entry") {
    const std::map<std::string, std::string> base = {
        {"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "11"}, {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "4(x2),3"}};
    CHECK(detect(base).local_world_size == 4);  // no SLURM_NODEID: the first entry
    auto on = [&](const char* node) {
      auto env = base;
      env["SLURM_NODEID"] = node;
      return detect(env).local_world_size;
    };
    CHECK(on("0") == 4);
    CHECK(on("1") == 4);
    CHECK(on("2") == 3);
    CHECK(on("7") == 4);  // past the list: the first
    CHECK(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "2"}}).local_world_size == 2);
    CHECK(detect(base).local_size_var == "SLURM_TASKS_PER_NODE");
  }
  SUBCASE("srun without a per-node count: unknown") {
    const Launch l = detect({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"}});
    CHECK(l.local_world_size == 0);
    CHECK_FALSE(l.has_master());
    CHECK(describe_rank(l) == "rank 3 (local rank 3)");
  }
  SUBCASE("PMI under srun takes Slurm's per-node count") {
    const Launch l = detect({{"PMIX_RANK", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                             {"SLURM_TASKS_PER_NODE", "2"}});
    CHECK(l.launcher == Launcher::pmi);
    CHECK(l.local_world_size == 2);
  }
  CHECK(std::string(name_of(Launcher::srun)) == "srun");
  CHECK(std::string(name_of(Launcher::mpirun)) == "mpirun");
}

TEST_CASE("launch: bad local sizes name the variable and its value") {
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_WORLD_SIZE", "0"}}),
                       "launch: LOCAL_WORLD_SIZE=0: a node runs at least one rank");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_WORLD_SIZE", "eight"}}),
                       "launch: LOCAL_WORLD_SIZE=\"eight\" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "a"},
                               {"MASTER_PORT", "1"}}),
                       "launch: LOCAL_WORLD_SIZE=4 is outside 1..2 (WORLD_SIZE=2)");
  CHECK_ERROR_CONTAINS(detect({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                               {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}),
                       "launch: LOCAL_RANK=2 is outside [0, 2) (LOCAL_WORLD_SIZE=2)");
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "-1"}}),
                       "launch: OMPI_COMM_WORLD_LOCAL_SIZE=-1: a node runs at least one rank");
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}}),
                       "launch: OMPI_COMM_WORLD_LOCAL_RANK=1 is outside [0, 1) (OMPI_COMM_WORLD_LOCAL_SIZE=1)");
  CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_NTASKS_PER_NODE", "16"}}),
                       "launch: SLURM_NTASKS_PER_NODE=16 is outside 1..8 (SLURM_NTASKS=8)");
  for (const char* bad : {"", "x", "4(2)", "4(x2", "4(x0)", "4,", "4;3", "4(x2)3"})
    CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_TASKS_PER_NODE", bad}}),
                         "launch: SLURM_TASKS_PER_NODE=\"" + std::string(bad) +
                             "\" is not a list of task counts (as in \"4(x2),3\")");
  CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_TASKS_PER_NODE", "4(x2)"},
                               {"SLURM_NODEID", "one"}}),
                       "launch: SLURM_NODEID=\"one\" is not an integer");
  CHECK_ERROR_CONTAINS(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"MASTER_PORT", "99999"}}),
                       "launch: MASTER_PORT=99999 is outside 1..65535");
  CHECK_ERROR_CONTAINS(detect({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"MASTER_PORT", "p"}}),
                       "launch: MASTER_PORT=\"p\" is not an integer");
}

TEST_CASE("launch: the device of a rank is its local rank modulo the visible devices, one rank per GPU") {
  const auto torchrun = [](int rank, int local, int local_size) {
    return detect({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", std::to_string(local)},
                   {"LOCAL_WORLD_SIZE", std::to_string(local_size)}, {"MASTER_ADDR", "node0"},
                   {"MASTER_PORT", "29500"}});
  };
  // A node of 8 GPUs, 8 ranks: local rank i on GPU i.
  for (int i = 0; i < 8; ++i) CHECK(choose_device(torchrun(8 + i, i, 8), 8) == i);
  // Fewer ranks than GPUs: the first ones.
  CHECK(choose_device(torchrun(3, 3, 4), 8) == 3);
  // Each task sees its own one GPU (CUDA_VISIBLE_DEVICES per task, srun --gpus-per-task=1).
  for (int i = 0; i < 8; ++i) CHECK(choose_device(torchrun(i, i, 8), 1) == 0);
  const Launch srun = detect({{"SLURM_PROCID", "13"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "5"},
                              {"SLURM_NTASKS_PER_NODE", "8"}});
  CHECK(choose_device(srun, 1) == 0);
  CHECK(choose_device(srun, 8) == 5);
  // The local size unknown: the local rank decides.
  const Launch unknown = detect({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "2"}});
  CHECK(choose_device(unknown, 4) == 2);
  CHECK(choose_device(Launch{}, 2) == 0);

  // More ranks on the node than GPUs: refused, naming the rank.
  CHECK_ERROR_CONTAINS(choose_device(torchrun(9, 1, 16), 8),
                       "launch: rank 9 (local rank 1 of 16 on this node): LOCAL_WORLD_SIZE=16 ranks on this node but "
                       "this process sees 8 CUDA devices: two ranks would share GPU 1, and NCCL runs one rank per GPU");
  CHECK_ERROR_CONTAINS(choose_device(torchrun(9, 1, 16), 8), "start at most 8 ranks per node");
  CHECK_ERROR_CONTAINS(choose_device(srun, 4), "launch: rank 13 (local rank 5 of 8 on this node): "
                                               "SLURM_NTASKS_PER_NODE=8 ranks on this node but this process sees 4");
  CHECK_ERROR_CONTAINS(choose_device(unknown, 2),
                       "launch: rank 2 (local rank 2): local rank 2 but this process sees 2 CUDA devices (0..1): it "
                       "would share GPU 0 with local rank 0");
  CHECK_ERROR_CONTAINS(choose_device(srun, 0),
                       "launch: rank 13 (local rank 5 of 8 on this node): no CUDA device is visible to this process");
}

TEST_CASE("launch: ranks told to share GPUs (comm.share_gpu) take local rank modulo the devices, each its own host") {
  const auto torchrun = [](int rank, int local, int local_size) {
    return detect({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", std::to_string(local)},
                   {"LOCAL_WORLD_SIZE", std::to_string(local_size)}, {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", "29500"}});
  };
  // Four processes on one GPU, or on two: what the default refuses, sharing allows.
  for (int i = 0; i < 4; ++i) {
    CHECK(choose_device(torchrun(i, i, 4), 1, true) == 0);
    CHECK(choose_device(torchrun(i, i, 4), 2, true) == i % 2);
  }
  CHECK_ERROR_CONTAINS(choose_device(torchrun(3, 3, 4), 2), "two ranks would share GPU 1");
  CHECK_ERROR_CONTAINS(choose_device(torchrun(3, 3, 4), 2), "to test several ranks on one GPU, comm.share_gpu = true");
  CHECK_ERROR_CONTAINS(choose_device(torchrun(3, 3, 4), 0, true), "no CUDA device is visible to this process");

  // Each rank names a host of its own for NCCL, and NCCL's socket transport on loopback.
  using Env = std::vector<std::pair<std::string, std::string>>;
  const auto nothing_set = [](const char*) -> const char* { return nullptr; };
  CHECK(shared_gpu_environment(0, nothing_set) == Env{{"NCCL_HOSTID", "tessera-shared-gpu-rank-0"},
                                                      {"NCCL_SOCKET_IFNAME", "lo"},
                                                      {"NCCL_IB_DISABLE", "1"}});
  CHECK(shared_gpu_environment(3, nothing_set).front().second == "tessera-shared-gpu-rank-3");
  // What the user set is kept; an empty value counts as unset.
  const auto user_set = [](const char* name) -> const char* {
    const std::string n = name;
    return n == "NCCL_HOSTID" ? "mine" : n == "NCCL_SOCKET_IFNAME" ? "" : nullptr;
  };
  CHECK(shared_gpu_environment(1, user_set) == Env{{"NCCL_SOCKET_IFNAME", "lo"}, {"NCCL_IB_DISABLE", "1"}});
  // In this process: set where unset, kept where set.
  for (const char* n : {"NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"}) ::unsetenv(n);
  ::setenv("NCCL_SOCKET_IFNAME", "eth7", 1);
  set_shared_gpu_environment(7);
  CHECK(std::string(std::getenv("NCCL_HOSTID")) == "tessera-shared-gpu-rank-7");
  CHECK(std::string(std::getenv("NCCL_SOCKET_IFNAME")) == "eth7");
  CHECK(std::string(std::getenv("NCCL_IB_DISABLE")) == "1");
  for (const char* n : {"NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"}) ::unsetenv(n);
}

TEST_CASE("launch: the CPU engines refuse a torchrun-style launch of several ranks, pointing to mpirun") {
  check_cpu_launch(Launch{});
  check_cpu_launch(detect({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_RANK", "0"}}));
  check_cpu_launch(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
  const Launch four = detect({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}});
  CHECK_ERROR_CONTAINS(check_cpu_launch(four), "a torchrun-style launch of 4 ranks (RANK=1, WORLD_SIZE=4)");
  CHECK_ERROR_CONTAINS(check_cpu_launch(four), "`mpirun -np 4`");
}

TEST_CASE("launch: detect_launch() reads this process's environment") {
  const char* names[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"};
  std::map<std::string, std::string> saved;
  for (const char* n : names)
    if (const char* v = std::getenv(n)) saved[n] = v;
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29512", 1);
  const Launch l = detect_launch();
  for (const char* n : names) {
    const auto it = saved.find(n);
    if (it == saved.end())
      ::unsetenv(n);
    else
      ::setenv(n, it->second.c_str(), 1);
  }
  if (l.kind == LaunchKind::mpi) return;  // this test itself runs under an MPI launcher, whose variables win
  CHECK(l.kind == LaunchKind::torchrun);
  CHECK(l.rank == 1);
  CHECK(l.world_size == 2);
  CHECK(l.local_rank == 1);
  CHECK(l.master_addr == "127.0.0.1");
  CHECK(l.master_port == 29512);
}

}  // namespace test_launch
