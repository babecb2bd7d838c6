// NcclEngine: collectives between GPUs through NCCL, one rank per device. With
// backend/cuda/, the only place that includes CUDA or NCCL headers; it is host C++
// (compiled by g++ or nvcc alike).
//
// Streams. The engine runs NCCL on its own communication stream (cudaStreamNonBlocking)
// and orders it against one compute stream, given at construction (by default the
// legacy default stream, the one the CUDA backend launches on). Each collective: an
// event recorded on the compute stream, which the comm stream waits for (the inputs
// earlier kernels write are ready), the NCCL call on the comm stream, an event recorded
// after it. The Handle's wait() makes the compute stream wait for that event
// (cudaStreamWaitEvent) and returns at once: the host never blocks. So "complete" for
// this device engine means ordered before every later piece of work on the compute
// stream -- the next kernel sees the output and may overwrite the input -- not that
// the bytes have arrived when wait() returns. A host that reads the result
// synchronises the compute stream first. Meanwhile compute runs beside the
// communication, the overlap FSDP prefetch relies on. Buffers are device memory on
// the engine's device.
//
// Ownership. Copies share the ncclComm_t, the comm stream, an event and a one-int
// device buffer (the barrier's); the last copy destroys them. split() is ncclCommSplit
// and shares the compute stream. Calls must come from one host thread at a time.
//
// Errors. Every CUDA and NCCL return code is checked; a failure throws tessera::Error
// naming the call, the rank and CUDA's or NCCL's text (with ncclGetLastError's detail).
// wait() also checks ncclCommGetAsyncError: an asynchronous failure (a peer that died,
// a broken link) aborts the communicator and throws. abort() calls ncclCommAbort, which
// stops this rank's collectives in flight, and throws the reason; the other ranks learn
// of it through their launcher (torchrun stops the job when a worker exits non-zero,
// mpirun likewise) or through NCCL's remote error at their next wait().
//
// Elements. u8 and u16 elements move as bytes; bf16 moves and reduces as ncclBfloat16;
// reductions take f32, f64, bf16, i32 and i64, as the in-process engines do.
//
// Bootstrap. Every rank needs rank 0's ncclUniqueId before ncclCommInitRank.
// nccl_from_unique_id() starts from an id shared by any means; nccl_from_torchrun()
// shares it through a TcpStore at MASTER_ADDR:MASTER_PORT and takes device LOCAL_RANK;
// nccl_from_broadcast() takes a callable that broadcasts the id's bytes from rank 0
// (MPI_Bcast under mpirun), so this header does not depend on MPI.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/comm/engine.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/tcp_store.hpp"
#include "tessera/core/error.hpp"

namespace tessera::comm {

namespace detail {

/// Throws when a CUDA runtime call failed, naming the call and the rank.
inline void nccl_cuda_check(cudaError_t status, const char* call, int rank) {
  if (status != cudaSuccess)
    fail("rank ", rank, ": ", call, " failed: ", cudaGetErrorName(status), ": ", cudaGetErrorString(status));
}

/// NCCL's last error text for `comm` in parentheses, or nothing.
inline std::string nccl_detail(ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  if (last == nullptr || *last == '\0') return {};
  return tessera::detail::concat(" (", last, ")");
}

/// Throws when an NCCL call failed, naming the call and the rank.
inline void nccl_check(ncclResult_t status, const char* call, int rank, ncclComm_t comm = nullptr) {
  if (status != ncclSuccess)
    fail("rank ", rank, ": ", call, " failed: ", ncclGetErrorString(status), nccl_detail(comm));
}

/// Makes `device` current for a scope, restoring the previous one after.
class NcclDeviceScope {
 public:
  NcclDeviceScope(int device, int rank) {
    nccl_cuda_check(cudaGetDevice(&previous_), "cudaGetDevice", rank);
    if (previous_ != device) {
      nccl_cuda_check(cudaSetDevice(device), "cudaSetDevice", rank);
      restore_ = true;
    }
  }
  NcclDeviceScope(const NcclDeviceScope&) = delete;
  NcclDeviceScope& operator=(const NcclDeviceScope&) = delete;
  ~NcclDeviceScope() {
    if (restore_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

/// What every copy of one engine shares.
struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t comm_stream = nullptr;
  cudaStream_t compute_stream = nullptr;
  cudaEvent_t compute_ready = nullptr;  // recorded on the compute stream before each collective
  int* barrier_word = nullptr;          // (1,) device int the barrier all-reduces
  int device = 0, rank = 0, size = 1;
  int world_rank = 0;  // this process's rank in the communicator it was split from, for messages
  bool aborted = false;
  std::string abort_reason;

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState() {
    // Teardown cannot report: a failure here leaves nothing to recover.
    int previous = 0;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    if (comm != nullptr && !aborted) (void)ncclCommDestroy(comm);
    if (barrier_word != nullptr) (void)cudaFree(barrier_word);
    if (compute_ready != nullptr) (void)cudaEventDestroy(compute_ready);
    if (comm_stream != nullptr) (void)cudaStreamDestroy(comm_stream);
    if (switched) (void)cudaSetDevice(previous);
  }

  void cuda(cudaError_t status, const char* call) const { nccl_cuda_check(status, call, world_rank); }
  void nccl(ncclResult_t status, const char* call) const { nccl_check(status, call, world_rank, comm); }

  /// Aborts the communicator (once); later calls fail with `why`. Returns a note when
  /// ncclCommAbort itself failed.
  std::string abort_comm(const std::string& why) {
    std::string note;
    if (!aborted) {
      aborted = true;
      abort_reason = why;
      if (comm != nullptr) {
        NcclDeviceScope scope(device, world_rank);
        const ncclResult_t status = ncclCommAbort(comm);
        if (status != ncclSuccess)
          note = tessera::detail::concat(" (ncclCommAbort failed too: ", ncclGetErrorString(status), ")");
      }
    }
    return note;
  }

  [[noreturn]] void throw_aborted(std::string_view what) const {
    fail("rank ", world_rank, ": ", what, " on an aborted NCCL communicator: ", abort_reason);
  }

  /// Throws (and aborts the communicator) when NCCL reports an asynchronous error.
  void check_async(std::string_view what) {
    ncclResult_t async = ncclSuccess;
    nccl(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError");
    if (async == ncclSuccess || async == ncclInProgress) return;
    const std::string why = tessera::detail::concat(
        "rank ", world_rank, ": ", what, ": NCCL reported an asynchronous error: ", ncclGetErrorString(async),
        nccl_detail(comm));
    const std::string note = abort_comm(why);
    fail(why, note);
  }
};

/// An event on the comm stream, waited for on the compute stream.
struct NcclPending final : Handle::Impl {
  NcclPending(std::shared_ptr<NcclState> s, cudaEvent_t e, const char* w) : state(std::move(s)), done(e), what(w) {}
  NcclPending(const NcclPending&) = delete;
  NcclPending& operator=(const NcclPending&) = delete;
  ~NcclPending() override { (void)cudaEventDestroy(done); }  // deferred by CUDA until the event completes

  void wait() override {
    NcclState& s = *state;
    if (s.aborted) s.throw_aborted(what);
    NcclDeviceScope scope(s.device, s.world_rank);
    s.cuda(cudaStreamWaitEvent(s.compute_stream, done, 0), "cudaStreamWaitEvent");
    s.check_async(what);
  }

  std::shared_ptr<NcclState> state;
  cudaEvent_t done;
  const char* what;
};

struct NcclType {
  ncclDataType_t type;
  std::size_t count;
};

/// Elements moved without arithmetic: u8 and u16 travel as bytes.
inline NcclType nccl_moved(DataType t, std::size_t n) {
  switch (t) {
    case DataType::u8:
      return {ncclUint8, n};
    case DataType::u16:
      return {ncclUint8, 2 * n};
    case DataType::i32:
      return {ncclInt32, n};
    case DataType::i64:
      return {ncclInt64, n};
    case DataType::f32:
      return {ncclFloat32, n};
    case DataType::f64:
      return {ncclFloat64, n};
    case DataType::bf16:
      return {ncclBfloat16, n};
  }
  fail("NCCL: unknown element type ", static_cast<int>(t));
}

/// Elements reduced: the types every engine reduces.
inline ncclDataType_t nccl_reduced(DataType t, int rank) {
  switch (t) {
    case DataType::i32:
      return ncclInt32;
    case DataType::i64:
      return ncclInt64;
    case DataType::f32:
      return ncclFloat32;
    case DataType::f64:
      return ncclFloat64;
    case DataType::bf16:
      return ncclBfloat16;
    case DataType::u8:
    case DataType::u16:
      break;
  }
  fail("rank ", rank, ": reduction over ", name_of(t), " elements is not supported: reduce f32, f64, bf16, i32 or i64");
}

inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  return ncclSum;
}

}  // namespace detail

class NcclEngine {
 public:
  /// Adopts `comm` (an initialised communicator, destroyed with the last copy) and
  /// orders its collectives against `compute` (nullptr: the legacy default stream).
  explicit NcclEngine(ncclComm_t comm, cudaStream_t compute = nullptr) : NcclEngine(comm, compute, -1) {}

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  std::string_view engine_name() const { return "nccl"; }

  int device() const { return state_->device; }
  cudaStream_t compute_stream() const { return state_->compute_stream; }
  cudaStream_t comm_stream() const { return state_->comm_stream; }
  ncclComm_t nccl_comm() const { return state_->comm; }

  Handle all_gather(const void* in, void* out, std::size_t n, DataType t) {
    const auto m = detail::nccl_moved(t, n);
    return issue("all_gather", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclAllGather(in, out, m.count, m.type, c, s), "ncclAllGather");
    });
  }

  Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    const auto type = detail::nccl_reduced(t, state_->world_rank);
    return issue("reduce_scatter", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclReduceScatter(in, out, n, type, detail::nccl_op(op), c, s), "ncclReduceScatter");
    });
  }

  Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    const auto type = detail::nccl_reduced(t, state_->world_rank);
    return issue("all_reduce", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclAllReduce(in, out, n, type, detail::nccl_op(op), c, s), "ncclAllReduce");
    });
  }

  Handle broadcast(void* data, std::size_t n, DataType t, int root) {
    TESSERA_CHECK(root >= 0 && root < size(), "rank ", state_->world_rank, ": broadcast root ", root, " outside ",
                  size(), " ranks");
    const auto m = detail::nccl_moved(t, n);
    return issue("broadcast", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclBroadcast(data, data, m.count, m.type, root, c, s), "ncclBroadcast");
    });
  }

  /// One NCCL group: every send and receive progresses together, so no order deadlocks.
  /// NCCL has no tags: it pairs the sends and recvs between two ranks in the order they
  /// are issued, so a transfer with a tag other than 0 is refused rather than reordered.
  Handle send_recv(std::span<const PeerOp> ops) {
    for (const auto& o : ops) {
      TESSERA_CHECK(o.peer >= 0 && o.peer < size(), "rank ", state_->world_rank, ": send_recv peer ", o.peer,
                    " outside ", size(), " ranks");
      TESSERA_CHECK(o.tag == 0, "rank ", state_->world_rank, ": send_recv: the ",
                    o.kind == PeerOp::Kind::send ? "send to" : "recv from", " peer ", o.peer, " has tag ", o.tag,
                    ", but NCCL matches point-to-point transfers in issue order; tags are not supported");
    }
    return issue("send_recv", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclGroupStart(), "ncclGroupStart");
      try {
        for (const auto& o : ops) {
          const auto m = detail::nccl_moved(o.type, o.count);
          if (o.kind == PeerOp::Kind::send)
            state_->nccl(ncclSend(o.data, m.count, m.type, o.peer, c, s), "ncclSend");
          else
            state_->nccl(ncclRecv(o.data, m.count, m.type, o.peer, c, s), "ncclRecv");
        }
      } catch (...) {
        (void)ncclGroupEnd();  // close the group before the error leaves it
        throw;
      }
      state_->nccl(ncclGroupEnd(), "ncclGroupEnd");
    });
  }

  /// An all-reduce of one int: complete (on the compute stream) once every rank has
  /// reached it. The host does not block; synchronise the compute stream for that.
  Handle barrier() {
    return issue("barrier", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclAllReduce(state_->barrier_word, state_->barrier_word, 1, ncclInt32, ncclSum, c, s),
                   "ncclAllReduce");
    });
  }

  /// ncclCommSplit: every rank of this communicator calls it; the ranks with the same
  /// color form a new one, ranked by key, then by rank here.
  NcclEngine split(int color, int key) {
    TESSERA_CHECK(color >= 0, "rank ", state_->world_rank, ": split color ", color,
                  " is negative: every rank needs a color >= 0");
    if (state_->aborted) state_->throw_aborted("split");
    detail::NcclDeviceScope scope(state_->device, state_->world_rank);
    ncclComm_t child = nullptr;
    state_->nccl(ncclCommSplit(state_->comm, color, key, &child, nullptr), "ncclCommSplit");
    TESSERA_CHECK(child != nullptr, "rank ", state_->world_rank, ": ncclCommSplit(color ", color,
                  ") returned no communicator");
    return NcclEngine(child, state_->compute_stream, state_->world_rank);
  }

  /// ncclCommAbort (stops this rank's collectives in flight), then throws the reason.
  [[noreturn]] void abort(const std::string& reason) {
    const std::string why =
        tessera::detail::concat("rank ", state_->world_rank, ": NCCL communicator aborted: ", reason);
    const std::string note = state_->abort_comm(why);
    fail(why, note);
  }

 private:
  NcclEngine(ncclComm_t comm, cudaStream_t compute, int world_rank) : state_(std::make_shared<detail::NcclState>()) {
    TESSERA_CHECK(comm != nullptr, "NcclEngine: no NCCL communicator (ncclComm_t is null)");
    auto& s = *state_;
    s.comm = comm;  // owned from here: destroyed if the rest fails
    s.compute_stream = compute;
    s.nccl(ncclCommUserRank(comm, &s.rank), "ncclCommUserRank");
    s.world_rank = world_rank >= 0 ? world_rank : s.rank;
    s.nccl(ncclCommCount(comm, &s.size), "ncclCommCount");
    s.nccl(ncclCommCuDevice(comm, &s.device), "ncclCommCuDevice");
    detail::NcclDeviceScope scope(s.device, s.world_rank);
    s.cuda(cudaStreamCreateWithFlags(&s.comm_stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    s.cuda(cudaEventCreateWithFlags(&s.compute_ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s.cuda(cudaMalloc(reinterpret_cast<void**>(&s.barrier_word), sizeof(int)), "cudaMalloc");
    s.cuda(cudaMemsetAsync(s.barrier_word, 0, sizeof(int), s.comm_stream), "cudaMemsetAsync");
  }

  /// comm stream waits for compute, `call` enqueues the NCCL work, an event marks its end.
  template <class Call>
  Handle issue(const char* what, Call&& call) {
    auto& s = *state_;
    if (s.aborted) s.throw_aborted(what);
    detail::NcclDeviceScope scope(s.device, s.world_rank);
    cudaEvent_t done = nullptr;
    s.cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    auto pending = std::make_unique<detail::NcclPending>(state_, done, what);  // owns the event from here
    s.cuda(cudaEventRecord(s.compute_ready, s.compute_stream), "cudaEventRecord");
    s.cuda(cudaStreamWaitEvent(s.comm_stream, s.compute_ready, 0), "cudaStreamWaitEvent");
    call(s.comm, s.comm_stream);
    s.cuda(cudaEventRecord(done, s.comm_stream), "cudaEventRecord");
    return Handle(std::move(pending));
  }

  std::shared_ptr<detail::NcclState> state_;
};

static_assert(Engine<NcclEngine>);

/// A fresh id for a new communicator (call on one rank, share with all).
inline ncclUniqueId nccl_unique_id(int rank = 0) {
  ncclUniqueId id;
  detail::nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId", rank);
  return id;
}

/// Rank `rank` of `world_size` joins the communicator of `id` on `device`, which
/// becomes this thread's current device. Every rank calls it with the same id.
inline NcclEngine nccl_from_unique_id(const ncclUniqueId& id, int rank, int world_size, int device,
                                      cudaStream_t compute = nullptr) {
  TESSERA_CHECK(world_size >= 1, "NCCL: a world of ", world_size, " ranks");
  TESSERA_CHECK(rank >= 0 && rank < world_size, "NCCL: rank ", rank, " is outside [0, ", world_size, ")");
  int devices = 0;
  detail::nccl_cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount", rank);
  TESSERA_CHECK(device >= 0 && device < devices, "rank ", rank, ": CUDA device ", device,
                " does not exist: this process sees ", devices,
                " device(s) (is LOCAL_RANK or CUDA_VISIBLE_DEVICES right?)");
  detail::nccl_cuda_check(cudaSetDevice(device), "cudaSetDevice", rank);
  ncclComm_t comm = nullptr;
  detail::nccl_check(ncclCommInitRank(&comm, world_size, id, rank), "ncclCommInitRank", rank);
  return NcclEngine(comm, compute);
}

/// The world of a torchrun-style launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
/// MASTER_PORT): rank 0 makes the id and shares it through a TcpStore; device LOCAL_RANK.
/// `timeout` bounds the wait for every rank to arrive.
inline NcclEngine nccl_from_torchrun(const Launch& launch, std::chrono::milliseconds timeout = std::chrono::minutes(5),
                                     cudaStream_t compute = nullptr) {
  TESSERA_CHECK(launch.kind != LaunchKind::mpi, "rank ", launch.rank,
                ": nccl_from_torchrun on an MPI launch: share the NCCL id with nccl_from_broadcast and MPI_Bcast");
  std::vector<std::uint8_t> bytes(sizeof(ncclUniqueId));
  {
    TcpStore store(launch.master_addr, launch.master_port, launch.rank, launch.world_size, timeout);
    if (launch.rank == 0) {
      const ncclUniqueId id = nccl_unique_id(0);
      std::memcpy(bytes.data(), &id, sizeof id);
    }
    bytes = store.broadcast(bytes, 0);
  }
  TESSERA_CHECK(bytes.size() == sizeof(ncclUniqueId), "rank ", launch.rank, ": the NCCL id from rank 0 has ",
                bytes.size(), " bytes, not ", sizeof(ncclUniqueId));
  ncclUniqueId id;
  std::memcpy(&id, bytes.data(), sizeof id);
  return nccl_from_unique_id(id, launch.rank, launch.world_size, launch.local_rank, compute);
}

/// The same, for the launch this process's environment describes.
inline NcclEngine nccl_from_torchrun(std::chrono::milliseconds timeout = std::chrono::minutes(5),
                                     cudaStream_t compute = nullptr) {
  return nccl_from_torchrun(detect_launch(), timeout, compute);
}

/// The world of a launch with its own broadcast (mpirun): `broadcast_from_rank0` is
/// called on every rank with the id's bytes (filled on rank 0) and must leave rank 0's
/// bytes on every rank, e.g. under MPI
///   [](std::span<std::uint8_t> b) { MPI_Bcast(b.data(), int(b.size()), MPI_BYTE, 0, MPI_COMM_WORLD); }
template <class Broadcast>
requires std::invocable<Broadcast&, std::span<std::uint8_t>> NcclEngine nccl_from_broadcast(
    int rank, int world_size, int device, Broadcast&& broadcast_from_rank0, cudaStream_t compute = nullptr) {
  std::vector<std::uint8_t> bytes(sizeof(ncclUniqueId), 0);
  if (rank == 0) {
    const ncclUniqueId id = nccl_unique_id(0);
    std::memcpy(bytes.data(), &id, sizeof id);
  }
  broadcast_from_rank0(std::span<std::uint8_t>(bytes));
  bool empty = true;
  for (auto b : bytes) empty = empty && b == 0;
  TESSERA_CHECK(!empty, "rank ", rank,
                ": the NCCL id is still all zeros after the broadcast: the callable must copy "
                "rank 0's bytes to every rank");
  ncclUniqueId id;
  std::memcpy(&id, bytes.data(), sizeof id);
  return nccl_from_unique_id(id, rank, world_size, device, compute);
}

}  // namespace tessera::comm
