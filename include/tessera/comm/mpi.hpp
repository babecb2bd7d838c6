// MpiEngine: collectives between processes through MPI (Open MPI), for CPU training
// across processes and nodes launched by mpirun or srun.
//
// Each collective maps to MPI's non-blocking call of the same shape (MPI_Iallgather,
// MPI_Ireduce_scatter_block, MPI_Iallreduce, MPI_Ibcast, MPI_Ibarrier; a grouped
// send/recv posts every MPI_Isend and MPI_Irecv before waiting on any, so no order of
// them can deadlock) and returns a Handle whose wait() completes its MPI requests.
// A transfer's tag t (0 .. kMaxTag) travels as MPI tag kTagBase + t, so MPI matches a
// recv to the oldest send from its peer with the same tag, and a send is an MPI_Isend:
// it never waits for its receiver until its Handle is waited on, and completes once MPI
// has matched or buffered it.
// Under NCCL's rules (mpi_world_nccl_rules) sends are MPI_Issend instead: they complete
// only once matched, as NCCL's do.
// There is no progress thread: MPI advances a collective inside MPI calls, so overlap
// is what the MPI library gives, and every call stays on the thread that issues it.
//
// The engine owns its MPI_Comm (a dup or split, never MPI_COMM_WORLD itself); copies
// share it and the last one frees it. Every communicator returns errors instead of
// aborting (MPI_ERRORS_RETURN), and every return code is checked: a failure throws
// tessera::Error naming the MPI function, the rank and MPI's own text.
//
// Failure ends the job: abort() and mpi_abort_on_error() print one line and call
// MPI_Abort, which kills every rank, so a failing rank never leaves the others
// waiting in a collective.
#pragma once

// Only MPI's C API is used; its deprecated C++ bindings do not compile cleanly under -Wextra.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/engine.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/comm/nccl_rules.hpp"
#include "tessera/core/error.hpp"

namespace tessera::comm {

namespace detail {

inline bool mpi_initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

inline bool mpi_finalized() {
  int flag = 0;
  MPI_Finalized(&flag);
  return flag != 0;
}

/// This process's rank in MPI_COMM_WORLD, or -1 outside MPI_Init..MPI_Finalize.
inline int mpi_world_rank() {
  if (!mpi_initialized() || mpi_finalized()) return -1;
  int rank = -1;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS) return -1;
  return rank;
}

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS || len <= 0)
    return tessera::detail::concat("MPI error code ", code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// Throws when `code` is not MPI_SUCCESS, naming the function and the rank.
inline void mpi_check(int code, const char* function, int rank) {
  if (code == MPI_SUCCESS) return;
  fail("rank ", rank, ": ", function, " failed: ", mpi_error_text(code));
}

inline MPI_Datatype mpi_type(DataType t) {
  switch (t) {
    case DataType::u8: return MPI_UINT8_T;
    case DataType::u16: return MPI_UINT16_T;
    case DataType::i32: return MPI_INT32_T;
    case DataType::i64: return MPI_INT64_T;
    case DataType::f32: return MPI_FLOAT;
    case DataType::f64: return MPI_DOUBLE;
    case DataType::bf16: return MPI_UINT16_T;  // moved only: check_reducible refuses bf16 reductions
  }
  fail("mpi: unknown element type ", static_cast<int>(t));
}

inline MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  fail("mpi: unknown reduction ", static_cast<int>(op));
}

/// MPI counts are ints.
inline int mpi_count(std::size_t n, const char* what, int rank) {
  TESSERA_CHECK(n <= static_cast<std::size_t>(INT_MAX), "rank ", rank, ": ", what, " of ", n,
                " elements exceeds MPI's count limit of ", INT_MAX);
  return static_cast<int>(n);
}

/// The same reductions as the thread engine (comm/reduce.hpp): not over u8 or u16.
inline void check_reducible(DataType t, const char* what, int rank) {
  TESSERA_CHECK(t != DataType::bf16, "rank ", rank, ": ", what,
                ": reduction over bf16 elements is not supported by the MPI engine (MPI has no bf16 type): "
                "train bf16 models across MPI processes with tensor_parallel_degree 1, or use NCCL");
  TESSERA_CHECK(t != DataType::u8 && t != DataType::u16, "rank ", rank, ": ", what, ": reduction over ", name_of(t),
                " elements is not supported: reduce f32, f64, i32 or i64");
}

/// The communicator an engine owns; freed when the last engine and handle using it go
/// (unless MPI is finalized by then, when there is nothing left to free).
inline std::shared_ptr<MPI_Comm> own_mpi_comm(MPI_Comm comm) {
  return std::shared_ptr<MPI_Comm>(new MPI_Comm(comm), [](MPI_Comm* c) {
    if (*c != MPI_COMM_NULL && !mpi_finalized()) MPI_Comm_free(c);
    delete c;
  });
}

/// The rank in MPI_COMM_WORLD of `rank` in `comm` (for messages; -1 if unknown).
inline int mpi_world_rank_of(MPI_Comm comm, int rank) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int out = -1;
  if (MPI_Comm_group(comm, &group) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS)
    MPI_Group_translate_ranks(group, 1, &rank, world, &out);
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  return out;
}

/// Each recv's length is checked against what arrived: a send shorter than its recv
/// would otherwise leave the end of the buffer silently stale (a longer one is
/// MPI_ERR_TRUNCATE). Only the receiving rank sees the mismatch.
struct MpiRecvCheck {
  std::size_t request;  // index into the requests
  int peer;
  std::size_t bytes;
};

/// A collective or group of transfers in flight.
class MpiRequests final : public Handle::Impl {
 public:
  MpiRequests(std::shared_ptr<MPI_Comm> comm, int rank, const char* what)
      : comm_(std::move(comm)), rank_(rank), what_(what) {}

  std::vector<MPI_Request> requests;
  std::vector<MpiRecvCheck> recvs;

  /// MPI_Wait on each request in turn rather than one MPI_Waitall: Open MPI 4.1's
  /// MPI_Waitall can hang when a request completes in error (a truncated recv) in a
  /// process initialised with MPI_THREAD_SERIALIZED. Every request is completed even
  /// after one fails, so no buffer is released while MPI still uses it.
  void wait() override {
    std::vector<MPI_Status> statuses(requests.size());
    std::string error;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      const int rc = MPI_Wait(&requests[i], &statuses[i]);
      if (rc != MPI_SUCCESS && error.empty())
        error = tessera::detail::concat("rank ", rank_, ": MPI_Wait (", what_, ") failed: ", mpi_error_text(rc));
    }
    if (!error.empty()) fail(error);
    for (const auto& r : recvs) {
      int got = 0;
      mpi_check(MPI_Get_count(&statuses[r.request], MPI_BYTE, &got), "MPI_Get_count", rank_);
      TESSERA_CHECK(static_cast<std::size_t>(got) == r.bytes, "rank ", rank_, ": recv of ", r.bytes,
                    " bytes from rank ", mpi_world_rank_of(*comm_, r.peer), " met a send of ", got, " bytes");
    }
  }

 private:
  std::shared_ptr<MPI_Comm> comm_;  // kept alive while the requests are pending
  int rank_;
  const char* what_;
};

inline void finalize_mpi_at_exit() {
  if (mpi_initialized() && !mpi_finalized()) MPI_Finalize();
}

/// Initialises MPI once per process (MPI_THREAD_SERIALIZED: calls may come from any
/// thread, one at a time) and finalizes it at exit. If the program initialised MPI
/// itself, it keeps that and finalizes it itself.
inline void init_mpi_once() {
  static const bool done = [] {
    TESSERA_CHECK(!mpi_finalized(), "mpi: MPI is already finalized; it cannot be initialised again");
    if (mpi_initialized()) return true;
    int provided = MPI_THREAD_SINGLE;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) fail("MPI_Init_thread failed: ", mpi_error_text(rc));
    std::atexit(finalize_mpi_at_exit);
    // Errors not tied to one of the engine's communicators are returned, not fatal.
    mpi_check(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", mpi_world_rank());
    TESSERA_CHECK(provided >= MPI_THREAD_SERIALIZED, "rank ", mpi_world_rank(),
                  ": MPI_Init_thread provided thread level ", provided, ", below the MPI_THREAD_SERIALIZED (",
                  MPI_THREAD_SERIALIZED, ") tessera asks for");
    return true;
  }();
  (void)done;
}

}  // namespace detail

class MpiEngine {
 public:
  /// An engine over a duplicate of `comm` (the caller keeps `comm`). MPI must be
  /// initialised; mpi_world() does that.
  explicit MpiEngine(MPI_Comm comm) {
    TESSERA_CHECK(detail::mpi_initialized() && !detail::mpi_finalized(),
                  "MpiEngine: MPI is not initialised (or already finalized); call mpi_world()");
    MPI_Comm dup = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup", detail::mpi_world_rank());
    adopt(dup);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string_view engine_name() const { return "mpi"; }
  /// The communicator, for code that calls MPI directly. The engine keeps owning it.
  MPI_Comm native() const { return *comm_; }

  Handle all_gather(const void* in, void* out, std::size_t n, DataType t) {
    const int count = detail::mpi_count(n, "all_gather", world_rank_);
    const MPI_Datatype type = detail::mpi_type(t);
    auto req = start("all_gather", 1);
    detail::mpi_check(MPI_Iallgather(in, count, type, out, count, type, *comm_, req->requests.data()), "MPI_Iallgather",
                      world_rank_);
    return Handle(std::move(req));
  }

  Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    detail::check_reducible(t, "reduce_scatter", world_rank_);
    const int count = detail::mpi_count(n, "reduce_scatter", world_rank_);
    auto req = start("reduce_scatter", 1);
    detail::mpi_check(MPI_Ireduce_scatter_block(in, out, count, detail::mpi_type(t), detail::mpi_op(op), *comm_,
                                                req->requests.data()),
                      "MPI_Ireduce_scatter_block", world_rank_);
    return Handle(std::move(req));
  }

  Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    detail::check_reducible(t, "all_reduce", world_rank_);
    const int count = detail::mpi_count(n, "all_reduce", world_rank_);
    auto req = start("all_reduce", 1);
    detail::mpi_check(MPI_Iallreduce(in == out ? MPI_IN_PLACE : in, out, count, detail::mpi_type(t),
                                     detail::mpi_op(op), *comm_, req->requests.data()),
                      "MPI_Iallreduce", world_rank_);
    return Handle(std::move(req));
  }

  Handle broadcast(void* data, std::size_t n, DataType t, int root) {
    const int count = detail::mpi_count(n, "broadcast", world_rank_);
    auto req = start("broadcast", 1);
    detail::mpi_check(MPI_Ibcast(data, count, detail::mpi_type(t), root, *comm_, req->requests.data()), "MPI_Ibcast",
                      world_rank_);
    return Handle(std::move(req));
  }

  Handle send_recv(std::span<const PeerOp> ops) {
    // Checked before anything is posted, so a bad op leaves no transfer half-started.
    for (const auto& o : ops) {
      detail::mpi_count(o.count, o.kind == PeerOp::Kind::send ? "send" : "recv", world_rank_);
      TESSERA_CHECK(o.peer >= 0 && o.peer < size_ && o.peer != rank_, "rank ", world_rank_, ": send_recv: rank ",
                    rank_, " cannot exchange with peer ", o.peer, " of ", size_);
      detail::check_tag(o, world_rank_);
    }
    auto req = start("send_recv", ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const PeerOp& o = ops[i];
      const int count = static_cast<int>(o.count), tag = kTagBase + o.tag;
      if (o.kind == PeerOp::Kind::send) {
        if (synchronous_sends_)
          detail::mpi_check(
              MPI_Issend(o.data, count, detail::mpi_type(o.type), o.peer, tag, *comm_, &req->requests[i]),
              "MPI_Issend", world_rank_);
        else
          detail::mpi_check(
              MPI_Isend(o.data, count, detail::mpi_type(o.type), o.peer, tag, *comm_, &req->requests[i]),
              "MPI_Isend", world_rank_);
      } else {
        detail::mpi_check(MPI_Irecv(o.data, count, detail::mpi_type(o.type), o.peer, tag, *comm_, &req->requests[i]),
                          "MPI_Irecv", world_rank_);
        req->recvs.push_back({i, o.peer, o.count * size_of(o.type)});
      }
    }
    return Handle(std::move(req));
  }

  Handle barrier() {
    auto req = start("barrier", 1);
    detail::mpi_check(MPI_Ibarrier(*comm_, req->requests.data()), "MPI_Ibarrier", world_rank_);
    return Handle(std::move(req));
  }

  /// MPI_Comm_split takes colors >= 0 only; any int is accepted here, as the thread
  /// engine does, by first agreeing on a dense numbering of the colors in use.
  MpiEngine split(int color, int key) {
    std::vector<int> colors(static_cast<std::size_t>(size_));
    detail::mpi_check(MPI_Allgather(&color, 1, MPI_INT, colors.data(), 1, MPI_INT, *comm_), "MPI_Allgather (split)",
                      world_rank_);
    std::sort(colors.begin(), colors.end());
    colors.erase(std::unique(colors.begin(), colors.end()), colors.end());
    const int dense = static_cast<int>(std::lower_bound(colors.begin(), colors.end(), color) - colors.begin());
    MPI_Comm child = MPI_COMM_NULL;
    detail::mpi_check(MPI_Comm_split(*comm_, dense, key, &child), "MPI_Comm_split", world_rank_);
    MpiEngine engine(child, Adopt{});
    engine.synchronous_sends_ = synchronous_sends_;
    return engine;
  }

  /// Sends complete only once their receiver has posted the matching recv (MPI_Issend),
  /// as NCCL's do: the NCCL-rules check (comm/nccl_rules.hpp) turns this on. Splits inherit it.
  void set_synchronous_sends(bool on) { synchronous_sends_ = on; }

  /// Ends the whole job: every rank of MPI_COMM_WORLD, not only this communicator's.
  [[noreturn]] void abort(const std::string& reason) {
    std::fprintf(stderr, "tessera: %s\n", reason.c_str());
    std::fflush(stderr);
    if (detail::mpi_initialized() && !detail::mpi_finalized()) MPI_Abort(MPI_COMM_WORLD, 1);
    std::abort();
  }

 private:
  /// MPI tag of a transfer with tag 0: tags kTagBase .. 32767 (the least MPI_TAG_UB the
  /// standard allows) are send_recv's, the ones below stay free for code using native().
  /// Collectives never clash with them: MPI matches collectives apart from point-to-point.
  static constexpr int kTagBase = 32767 - kMaxTag;
  static_assert(kTagBase > 0);
  struct Adopt {};

  MpiEngine(MPI_Comm comm, Adopt) { adopt(comm); }

  void adopt(MPI_Comm comm) {
    comm_ = detail::own_mpi_comm(comm);
    world_rank_ = detail::mpi_world_rank();
    detail::mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", world_rank_);
    detail::mpi_check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank", world_rank_);
    detail::mpi_check(MPI_Comm_size(comm, &size_), "MPI_Comm_size", world_rank_);
  }

  std::unique_ptr<detail::MpiRequests> start(const char* what, std::size_t n) {
    auto req = std::make_unique<detail::MpiRequests>(comm_, world_rank_, what);
    req->requests.assign(n, MPI_REQUEST_NULL);
    return req;
  }

  std::shared_ptr<MPI_Comm> comm_;
  int rank_ = 0;
  int size_ = 1;
  int world_rank_ = 0;  // errors name the rank in MPI_COMM_WORLD, as mpirun numbers them
  bool synchronous_sends_ = false;
};

static_assert(Engine<MpiEngine>);

/// The communicator of every process of the MPI job (a dup of MPI_COMM_WORLD).
/// Initialises MPI on first use and finalizes it at exit, unless the program
/// initialised MPI itself.
inline Communicator mpi_world() {
  detail::init_mpi_once();
  return Communicator(MpiEngine(MPI_COMM_WORLD));
}

/// The MPI world held to NCCL's rules (comm/nccl_rules.hpp): synchronous sends, one group
/// of transfers at a time, and every buffer checked against `memory` (the backend's
/// memory_access(), which tells its device memory from host memory).
inline Communicator mpi_world_nccl_rules(const MemoryAccess& memory) {
  detail::init_mpi_once();
  MpiEngine engine(MPI_COMM_WORLD);
  engine.set_synchronous_sends(true);
  return Communicator(NcclRulesEngine(std::move(engine), memory, NcclRulesOptions{.serialize_groups = true, .check_same_calls = true}));
}

/// mpi_world(), checked against the launch the environment describes: a binary
/// started without its launcher (say straight from an sbatch script, which sets
/// SLURM_NTASKS) would otherwise run as a world of one believing it is one of many.
/// `nccl_rules`: the world of mpi_world_nccl_rules(*nccl_rules) instead.
inline Communicator mpi_world(const Launch& launch, const MemoryAccess* nccl_rules = nullptr) {
  Communicator world = nccl_rules ? mpi_world_nccl_rules(*nccl_rules) : mpi_world();
  TESSERA_CHECK(world.size() == launch.world_size && world.rank() == launch.rank, "rank ", world.rank(),
                ": the environment describes rank ", launch.rank, " of ", launch.world_size, " (", name_of(launch.kind),
                " launch), but MPI started rank ", world.rank(), " of ", world.size(),
                ": start the ranks with mpirun or srun");
  return world;
}

/// For a binary's catch block: prints "<program>: rank R: <what>" and ends the whole
/// MPI job with exit status 1, so no other rank waits for this one. Outside MPI (not
/// initialised, or already finalized) it prints "<program>: <what>" and exits 1.
[[noreturn]] inline void mpi_abort_on_error(const std::exception& e, std::string_view program = "tessera") {
  const int rank = detail::mpi_world_rank();
  std::string what = e.what();
  const std::string prefix = tessera::detail::concat("rank ", rank, ": ");
  if (rank >= 0 && what.rfind(prefix, 0) != 0) what = prefix + what;  // MPI errors name the rank already
  std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(program.size()), program.data(), what.c_str());
  std::fflush(stderr);
  if (rank >= 0) MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

}  // namespace tessera::comm
