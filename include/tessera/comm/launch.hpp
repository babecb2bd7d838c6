// How this process was launched: alone, as one rank of an MPI job, or as one rank of
// a torchrun-style job, read from the environment the launcher sets.
//
// Checked in this order, the first that is present wins:
//   mpirun (Open MPI)     OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK,
//                         OMPI_COMM_WORLD_LOCAL_SIZE
//   other MPIs (PMI)      PMIX_RANK or PMI_RANK, with PMI_SIZE (else SLURM_NTASKS);
//                         the local rank from MPI_LOCALRANKID (else SLURM_LOCALID), the
//                         local size from MPI_LOCALNRANKS (else Slurm's, as for srun)
//   srun                  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the local size from
//                         SLURM_NTASKS_PER_NODE, else this node's entry (SLURM_NODEID,
//                         else the first) of SLURM_TASKS_PER_NODE ("4(x2),3")
//   torchrun              RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
//   none of these         one process, rank 0 of 1
// MASTER_ADDR and MASTER_PORT (where rank 0 listens for a TCP rendezvous) are read for
// every launcher when set; torchrun needs them for more than one rank. Where torchrun's
// agent serves its own store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True, as
// recent torchrun sets it), rank 0 listens on the next port instead (store_port()).
// A value that is not an integer or is out of range is an error naming the variable
// and its value: a job that starts with a wrong rank layout would compute garbage or
// hang, so it stops before any collective.
//
// choose_device() maps a launch to the CUDA device its rank trains on: the local rank
// modulo the devices this process sees, refusing a node with more ranks than GPUs,
// unless the ranks are told to share them (comm.share_gpu, for testing: then each rank
// sets shared_gpu_environment() before NCCL starts).
//
// No MPI header here: detection is plain environment parsing, and the caller picks
// the engine (comm/mpi.hpp for an MPI launch).
#pragma once

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera::comm {

enum class LaunchKind { single, mpi, torchrun };

/// The program that started the job, for messages and for choosing how ranks meet.
enum class Launcher { none, mpirun, pmi, srun, torchrun };

struct Launch {
  LaunchKind kind = LaunchKind::single;
  Launcher launcher = Launcher::none;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // rank among the processes on this node
  int local_world_size = 0;  // processes on this node; 0: the launcher does not say
  std::string local_size_var;  // the variable local_world_size came from, for messages
  std::string master_addr;   // MASTER_ADDR: where rank 0 listens ("" when unset)
  int master_port = 0;       // MASTER_PORT (0 when unset)
  /// TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent already serves its own store
  /// on MASTER_PORT, so the ranks' TcpStore takes the next port (store_port()).
  bool agent_store = false;

  /// MASTER_ADDR and MASTER_PORT are both set: the ranks can meet in a TcpStore.
  bool has_master() const { return !master_addr.empty() && master_port != 0; }
  /// The port rank 0's TcpStore listens on: MASTER_PORT, or MASTER_PORT + 1 where
  /// torchrun's agent holds MASTER_PORT.
  int store_port() const { return agent_store ? master_port + 1 : master_port; }
};

inline const char* name_of(LaunchKind k) {
  switch (k) {
    case LaunchKind::single: return "single";
    case LaunchKind::mpi: return "mpi";
    case LaunchKind::torchrun: return "torchrun";
  }
  return "?";
}

inline const char* name_of(Launcher l) {
  switch (l) {
    case Launcher::none: return "none";
    case Launcher::mpirun: return "mpirun";
    case Launcher::pmi: return "PMI";
    case Launcher::srun: return "srun";
    case Launcher::torchrun: return "torchrun";
  }
  return "?";
}

namespace detail {

/// The environment, read through a function so tests can give a fake one.
class LaunchEnv {
 public:
  explicit LaunchEnv(const std::function<const char*(const char*)>& getenv_fn) : getenv_(getenv_fn) {}

  const char* get(const char* name) const { return getenv_(name); }
  bool has(const char* name) const { return get(name) != nullptr; }

  /// The integer in `name`; the whole value must be one.
  int integer(const char* name) const {
    const char* v = get(name);
    TESSERA_CHECK(v != nullptr, "launch: ", name, " is not set");
    const char* end = v + std::strlen(v);
    int out = 0;
    const auto [p, ec] = std::from_chars(v, end, out);
    TESSERA_CHECK(*v != '\0' && ec == std::errc() && p == end, "launch: ", name, "=\"", v, "\" is not an integer");
    return out;
  }

 private:
  const std::function<const char*(const char*)>& getenv_;
};

/// world_size >= 1, rank and local_rank in [0, world_size).
inline void check_ranks(const Launch& l, const char* rank_var, const char* size_var, const char* local_var) {
  TESSERA_CHECK(l.world_size >= 1, "launch: ", size_var, "=", l.world_size, ": a job has at least one rank");
  TESSERA_CHECK(l.rank >= 0 && l.rank < l.world_size, "launch: ", rank_var, "=", l.rank, " is outside [0, ",
                l.world_size, ") (", size_var, "=", l.world_size, ")");
  if (local_var)
    TESSERA_CHECK(l.local_rank >= 0 && l.local_rank < l.world_size, "launch: ", local_var, "=", l.local_rank,
                  " is outside [0, ", l.world_size, ") (", size_var, "=", l.world_size, ")");
  if (l.local_world_size != 0) {
    const char* v = l.local_size_var.c_str();
    TESSERA_CHECK(l.local_world_size >= 1 && l.local_world_size <= l.world_size, "launch: ", v, "=",
                  l.local_world_size, " is outside 1..", l.world_size, " (", size_var, "=", l.world_size, ")");
    if (local_var)
      TESSERA_CHECK(l.local_rank < l.local_world_size, "launch: ", local_var, "=", l.local_rank, " is outside [0, ",
                    l.local_world_size, ") (", v, "=", l.local_world_size, ")");
  }
}

/// This node's count in Slurm's SLURM_TASKS_PER_NODE, a list of counts with repeats
/// ("4(x2),3": nodes 0 and 1 run 4 tasks, node 2 runs 3): entry SLURM_NODEID when that
/// is set and in the list, else the first.
inline int slurm_task_count(const LaunchEnv& env, const char* name) {
  const char* v = env.get(name);
  const auto bad = [&] {
    fail("launch: ", name, "=\"", v, "\" is not a list of task counts (as in \"4(x2),3\")");
  };
  const auto number = [&](const char*& at) {
    const char* end = at;
    while (*end >= '0' && *end <= '9') ++end;
    int out = 0;
    const auto [p, ec] = std::from_chars(at, end, out);
    if (end == at || ec != std::errc() || p != end) bad();
    at = end;
    return out;
  };
  const int node = env.has("SLURM_NODEID") ? env.integer("SLURM_NODEID") : 0;
  int first = 0, mine = 0;
  long long index = 0;  // the node the next entry starts at
  for (const char* at = v;;) {
    const int count = number(at);
    long long repeat = 1;
    if (*at == '(') {
      if (at[1] != 'x') bad();
      at += 2;
      repeat = number(at);
      if (*at++ != ')' || repeat < 1) bad();
    }
    if (index == 0) first = count;
    if (node >= index && node < index + repeat) mine = count;
    index += repeat;
    if (*at == '\0') break;
    if (*at++ != ',') bad();
  }
  return mine != 0 ? mine : first;
}

/// The processes on this node as the launcher states it, or 0 with no variable.
inline void read_local_size(Launch& l, const LaunchEnv& env, std::initializer_list<const char*> vars) {
  for (const char* var : vars) {
    if (!env.has(var)) continue;
    l.local_size_var = var;
    l.local_world_size = std::strcmp(var, "SLURM_TASKS_PER_NODE") == 0 ? slurm_task_count(env, var)
                                                                         : env.integer(var);
    TESSERA_CHECK(l.local_world_size >= 1, "launch: ", var, "=", l.local_world_size,
                  ": a node runs at least one rank");
    return;
  }
}

/// MASTER_ADDR and MASTER_PORT, when set.
inline void read_master(Launch& l, const LaunchEnv& env) {
  if (const char* addr = env.get("MASTER_ADDR")) l.master_addr = addr;
  if (env.has("MASTER_PORT")) {
    l.master_port = env.integer("MASTER_PORT");
    TESSERA_CHECK(l.master_port >= 1 && l.master_port <= 65535, "launch: MASTER_PORT=", l.master_port,
                  " is outside 1..65535");
  }
  const char* agent = env.get("TORCHELASTIC_USE_AGENT_STORE");
  l.agent_store = agent != nullptr && std::strcmp(agent, "True") == 0;
  TESSERA_CHECK(!l.agent_store || l.master_port < 65535, "launch: MASTER_PORT=", l.master_port,
                " is held by torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True) and the port after it, where the "
                "ranks would meet, is outside 1..65535");
}

inline Launch mpi_launch(const LaunchEnv& env, Launcher launcher, const char* rank_var, const char* size_var,
                         const char* local_var, std::initializer_list<const char*> local_size_vars) {
  Launch l;
  l.kind = LaunchKind::mpi;
  l.launcher = launcher;
  l.world_size = env.integer(size_var);
  l.rank = env.integer(rank_var);
  if (local_var) l.local_rank = env.integer(local_var);
  read_local_size(l, env, local_size_vars);
  check_ranks(l, rank_var, size_var, local_var);
  read_master(l, env);
  return l;
}

}  // namespace detail

/// The launch described by the environment that `getenv_fn` reads (nullptr: unset).
inline Launch detect_launch(const std::function<const char*(const char*)>& getenv_fn) {
  const detail::LaunchEnv env(getenv_fn);

  // mpirun (Open MPI).
  if (env.has("OMPI_COMM_WORLD_SIZE") || env.has("OMPI_COMM_WORLD_RANK")) {
    TESSERA_CHECK(env.has("OMPI_COMM_WORLD_SIZE"), "launch: OMPI_COMM_WORLD_RANK=", env.get("OMPI_COMM_WORLD_RANK"),
                  " is set without OMPI_COMM_WORLD_SIZE");
    TESSERA_CHECK(env.has("OMPI_COMM_WORLD_RANK"), "launch: OMPI_COMM_WORLD_SIZE=", env.get("OMPI_COMM_WORLD_SIZE"),
                  " is set without OMPI_COMM_WORLD_RANK");
    return detail::mpi_launch(env, Launcher::mpirun, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              env.has("OMPI_COMM_WORLD_LOCAL_RANK") ? "OMPI_COMM_WORLD_LOCAL_RANK" : nullptr,
                              {"OMPI_COMM_WORLD_LOCAL_SIZE"});
  }

  // Other MPIs through PMI or PMIx (MPICH's and Intel MPI's launchers, srun --mpi=pmi2/pmix).
  const char* pmi_rank = env.has("PMIX_RANK") ? "PMIX_RANK" : env.has("PMI_RANK") ? "PMI_RANK" : nullptr;
  if (pmi_rank) {
    const char* size_var = env.has("PMI_SIZE") ? "PMI_SIZE" : env.has("SLURM_NTASKS") ? "SLURM_NTASKS" : nullptr;
    TESSERA_CHECK(size_var != nullptr, "launch: ", pmi_rank, "=", env.get(pmi_rank),
                  " is set but neither PMI_SIZE nor SLURM_NTASKS says how many ranks there are");
    const char* local_var =
        env.has("MPI_LOCALRANKID") ? "MPI_LOCALRANKID" : env.has("SLURM_LOCALID") ? "SLURM_LOCALID" : nullptr;
    return detail::mpi_launch(env, Launcher::pmi, pmi_rank, size_var, local_var,
                              {"MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  }

  // srun.
  if (env.has("SLURM_PROCID")) {
    TESSERA_CHECK(env.has("SLURM_NTASKS"), "launch: SLURM_PROCID=", env.get("SLURM_PROCID"),
                  " is set without SLURM_NTASKS");
    return detail::mpi_launch(env, Launcher::srun, "SLURM_PROCID", "SLURM_NTASKS",
                              env.has("SLURM_LOCALID") ? "SLURM_LOCALID" : nullptr,
                              {"SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"});
  }

  // torchrun-style variables.
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    TESSERA_CHECK(env.has("WORLD_SIZE"), "launch: RANK=", env.get("RANK"), " is set without WORLD_SIZE");
    TESSERA_CHECK(env.has("RANK"), "launch: WORLD_SIZE=", env.get("WORLD_SIZE"), " is set without RANK");
    Launch l;
    l.kind = LaunchKind::torchrun;
    l.launcher = Launcher::torchrun;
    l.world_size = env.integer("WORLD_SIZE");
    l.rank = env.integer("RANK");
    if (env.has("LOCAL_RANK")) l.local_rank = env.integer("LOCAL_RANK");
    detail::read_local_size(l, env, {"LOCAL_WORLD_SIZE"});
    detail::check_ranks(l, "RANK", "WORLD_SIZE", env.has("LOCAL_RANK") ? "LOCAL_RANK" : nullptr);
    detail::read_master(l, env);
    if (l.world_size > 1) {
      TESSERA_CHECK(!l.master_addr.empty(), "launch: WORLD_SIZE=", l.world_size,
                    " needs MASTER_ADDR (the host of rank 0), which is not set");
      TESSERA_CHECK(l.master_port != 0, "launch: WORLD_SIZE=", l.world_size,
                    " needs MASTER_PORT (the port rank 0 listens on), which is not set");
    }
    return l;
  }

  return Launch{};
}

/// The launch described by this process's environment.
inline Launch detect_launch() {
  return detect_launch([](const char* name) -> const char* { return std::getenv(name); });
}

/// The launch's rank and where it runs, for messages: "rank 5 (local rank 1 of 4 on this node)".
inline std::string describe_rank(const Launch& l) {
  std::string out = tessera::detail::concat("rank ", l.rank, " (local rank ", l.local_rank);
  if (l.local_world_size > 0) out += tessera::detail::concat(" of ", l.local_world_size, " on this node");
  return out + ")";
}

/// The CUDA device this rank trains on, of the `visible` devices this process sees
/// (cudaGetDeviceCount, after CUDA_VISIBLE_DEVICES): the local rank modulo `visible`.
/// NCCL runs one rank per GPU, so:
///  - one visible device is device 0 whatever the local rank: a launcher that gives
///    each task its own GPU (CUDA_VISIBLE_DEVICES per task, srun --gpus-per-task=1)
///    shows each process exactly one. If several ranks really see the same one,
///    ncclCommInitRank refuses them ("Duplicate GPU detected").
///  - several visible devices are the node's GPUs, shared by its ranks: a node whose
///    launcher states more ranks than that, or a local rank past the last device, is
///    refused naming the rank, since two of its ranks would take one GPU.
///
/// With `share` (comm.share_gpu) ranks may outnumber the devices: local rank r takes
/// device r modulo `visible`, and NCCL is told each rank is a host of its own
/// (shared_gpu_environment).
inline int choose_device(const Launch& l, int visible, bool share = false) {
  TESSERA_CHECK(visible >= 1, "launch: ", describe_rank(l), ": no CUDA device is visible to this process",
                " (is CUDA_VISIBLE_DEVICES empty, or the driver missing?)");
  if (visible == 1) return 0;
  if (share) return l.local_rank % visible;
  TESSERA_CHECK(l.local_world_size <= visible, "launch: ", describe_rank(l), ": ", l.local_size_var, "=",
                l.local_world_size, " ranks on this node but this process sees ", visible,
                " CUDA devices: two ranks would share GPU ", l.local_rank % visible,
                ", and NCCL runs one rank per GPU; start at most ", visible,
                " ranks per node (or give each rank its own GPU through CUDA_VISIBLE_DEVICES; to test several "
                "ranks on one GPU, comm.share_gpu = true)");
  TESSERA_CHECK(l.local_rank < visible, "launch: ", describe_rank(l), ": local rank ", l.local_rank,
                " but this process sees ", visible, " CUDA devices (0..", visible - 1, "): it would share GPU ",
                l.local_rank % visible, " with local rank ", l.local_rank % visible,
                ", and NCCL runs one rank per GPU; start at most ", visible, " ranks per node");
  return l.local_rank % visible;
}

/// The variables a rank that shares its GPU with other ranks sets before NCCL starts,
/// those the user has not set (`get` reads the environment): NCCL refuses two ranks on
/// one GPU only when they are on one host (its duplicate-GPU check compares bus ids and
/// host hashes, and the host hash comes from NCCL_HOSTID when it is set), so each rank
/// names a host of its own; NCCL then moves data between the ranks over its socket
/// transport, on the loopback interface (every rank is on this machine), with
/// InfiniBand off. For testing the multi-process path on one GPU: slow, but every NCCL
/// call runs for real.
inline std::vector<std::pair<std::string, std::string>> shared_gpu_environment(
    int rank, const std::function<const char*(const char*)>& get = [](const char* name) { return std::getenv(name); }) {
  const std::pair<std::string, std::string> wanted[] = {
      {"NCCL_HOSTID", "tessera-shared-gpu-rank-" + std::to_string(rank)},
      {"NCCL_SOCKET_IFNAME", "lo"},
      {"NCCL_IB_DISABLE", "1"},
  };
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [name, value] : wanted) {
    const char* given = get(name.c_str());
    if (given == nullptr || *given == '\0') out.emplace_back(name, value);
  }
  return out;
}

/// Sets shared_gpu_environment(rank) in this process (before its first NCCL call: NCCL
/// reads its variables once).
inline void set_shared_gpu_environment(int rank) {
  for (const auto& [name, value] : shared_gpu_environment(rank))
    TESSERA_CHECK(::setenv(name.c_str(), value.c_str(), 0) == 0, "launch: rank ", rank, ": cannot set ", name);
}

/// The CPU engines (thread ranks, MPI) start their processes with MPI; torchrun-style
/// variables serve the NCCL engine, which comes with the CUDA backend. A torchrun-style
/// launch of more than one rank is refused here, pointing to mpirun.
inline void check_cpu_launch(const Launch& l) {
  TESSERA_CHECK(l.kind != LaunchKind::torchrun || l.world_size == 1, "launch: a torchrun-style launch of ",
                l.world_size, " ranks (RANK=", l.rank, ", WORLD_SIZE=", l.world_size,
                ") needs the NCCL engine, which comes with the CUDA backend; on the CPU start the ranks with "
                "`mpirun -np ",
                l.world_size, "` (or srun) instead");
}

}  // namespace tessera::comm
