// How this process was launched: alone, as one rank of an MPI job, or as one rank of
// a torchrun-style job, read from the environment the launcher sets.
//
// Checked in this order, the first that is present wins:
//   mpirun (Open MPI)     OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK
//   other MPIs (PMI)      PMIX_RANK or PMI_RANK, with PMI_SIZE (else SLURM_NTASKS);
//                         the local rank from MPI_LOCALRANKID (else SLURM_LOCALID)
//   srun                  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//   torchrun              RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//   none of these         one process, rank 0 of 1
// A value that is not an integer or is out of range is an error naming the variable
// and its value: a job that starts with a wrong rank layout would compute garbage or
// hang, so it stops before any collective.
//
// No MPI header here: detection is plain environment parsing, and the caller picks
// the engine (comm/mpi.hpp for an MPI launch).
#pragma once

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <system_error>

#include "tessera/core/error.hpp"

namespace tessera::comm {

enum class LaunchKind { single, mpi, torchrun };

struct Launch {
  LaunchKind kind = LaunchKind::single;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;     // rank among the processes on this node
  std::string master_addr;  // torchrun only: where rank 0 listens
  int master_port = 0;      // torchrun only
};

inline const char* name_of(LaunchKind k) {
  switch (k) {
    case LaunchKind::single: return "single";
    case LaunchKind::mpi: return "mpi";
    case LaunchKind::torchrun: return "torchrun";
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
}

inline Launch mpi_launch(const LaunchEnv& env, const char* rank_var, const char* size_var, const char* local_var) {
  Launch l;
  l.kind = LaunchKind::mpi;
  l.world_size = env.integer(size_var);
  l.rank = env.integer(rank_var);
  if (local_var) l.local_rank = env.integer(local_var);
  check_ranks(l, rank_var, size_var, local_var);
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
    return detail::mpi_launch(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              env.has("OMPI_COMM_WORLD_LOCAL_RANK") ? "OMPI_COMM_WORLD_LOCAL_RANK" : nullptr);
  }

  // Other MPIs through PMI or PMIx (MPICH's and Intel MPI's launchers, srun --mpi=pmi2/pmix).
  const char* pmi_rank = env.has("PMIX_RANK") ? "PMIX_RANK" : env.has("PMI_RANK") ? "PMI_RANK" : nullptr;
  if (pmi_rank) {
    const char* size_var = env.has("PMI_SIZE") ? "PMI_SIZE" : env.has("SLURM_NTASKS") ? "SLURM_NTASKS" : nullptr;
    TESSERA_CHECK(size_var != nullptr, "launch: ", pmi_rank, "=", env.get(pmi_rank),
                  " is set but neither PMI_SIZE nor SLURM_NTASKS says how many ranks there are");
    const char* local_var =
        env.has("MPI_LOCALRANKID") ? "MPI_LOCALRANKID" : env.has("SLURM_LOCALID") ? "SLURM_LOCALID" : nullptr;
    return detail::mpi_launch(env, pmi_rank, size_var, local_var);
  }

  // srun.
  if (env.has("SLURM_PROCID")) {
    TESSERA_CHECK(env.has("SLURM_NTASKS"), "launch: SLURM_PROCID=", env.get("SLURM_PROCID"),
                  " is set without SLURM_NTASKS");
    return detail::mpi_launch(env, "SLURM_PROCID", "SLURM_NTASKS",
                              env.has("SLURM_LOCALID") ? "SLURM_LOCALID" : nullptr);
  }

  // torchrun-style variables.
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    TESSERA_CHECK(env.has("WORLD_SIZE"), "launch: RANK=", env.get("RANK"), " is set without WORLD_SIZE");
    TESSERA_CHECK(env.has("RANK"), "launch: WORLD_SIZE=", env.get("WORLD_SIZE"), " is set without RANK");
    Launch l;
    l.kind = LaunchKind::torchrun;
    l.world_size = env.integer("WORLD_SIZE");
    l.rank = env.integer("RANK");
    if (env.has("LOCAL_RANK")) l.local_rank = env.integer("LOCAL_RANK");
    detail::check_ranks(l, "RANK", "WORLD_SIZE", env.has("LOCAL_RANK") ? "LOCAL_RANK" : nullptr);
    if (const char* addr = env.get("MASTER_ADDR")) l.master_addr = addr;
    if (env.has("MASTER_PORT")) {
      l.master_port = env.integer("MASTER_PORT");
      TESSERA_CHECK(l.master_port >= 1 && l.master_port <= 65535, "launch: MASTER_PORT=", l.master_port,
                    " is outside 1..65535");
    }
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
