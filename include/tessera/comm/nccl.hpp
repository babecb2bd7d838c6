// NcclEngine: collectives between GPUs through NCCL, one rank per device. With
// backend/cuda/, the only place that includes CUDA or NCCL headers; it is host C++
// (compiled by g++ or nvcc alike).
//
// Streams. The engine runs NCCL on its own communication stream (cudaStreamNonBlocking)
// and orders it against one compute stream, given at construction: the CUDA backend's,
// cuda::compute_stream(), in the trainers (by default the legacy default stream, which
// the backend's blocking stream is ordered with, as is every other blocking stream). Each collective: an
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
// stops this rank's collectives in flight, and throws the reason.
//
// Timeouts: no hang. Communicators are non-blocking (ncclConfig_t blocking = 0): every
// NCCL call returns at once and the engine polls ncclCommGetAsyncError until it has
// finished, up to a deadline. ncclCommInitRank and ncclCommSplit get
// NcclOptions::init_timeout; a call past it aborts the communicator (ncclCommAbort) and
// throws naming the rank and the call. Because wait() does not block the host, a
// collective that never completes (a peer died, or stopped calling collectives) would
// hang the host at its next synchronisation instead; so each engine runs a watchdog
// thread that polls the completion event of every collective in flight and the
// communicator's asynchronous error. A collective still running NcclOptions::timeout
// after it was issued, or an asynchronous error, makes the watchdog abort the
// communicator and call NcclOptions::on_failure with one message naming the rank, the
// operation and its sequence number; by default that prints the message and ends the
// process with exit status 1 (the host thread may be blocked inside CUDA and cannot be
// reached by an exception). The launcher then ends the other ranks (torchrun stops the
// job when a worker exits non-zero, mpirun likewise, srun with --kill-on-bad-exit), and
// each of them, its own collective stuck, fails the same way within the timeout anyway.
//
// Elements. u8 and u16 elements move as bytes; bf16 moves and reduces as ncclBfloat16;
// reductions take f32, f64, bf16, i32 and i64, as the in-process engines do.
//
// Bootstrap. Every rank needs rank 0's ncclUniqueId before ncclCommInitRank.
// nccl_from_unique_id() starts from an id shared by any means; nccl_from_torchrun()
// shares it through a TcpStore at MASTER_ADDR:MASTER_PORT (torchrun, or srun with those
// set), whose join checks that every rank was started for rank 0's world size, and
// trains on choose_device()'s device (comm/launch.hpp: the local rank modulo the
// visible devices); nccl_from_broadcast() takes a callable that broadcasts the id's
// bytes from rank 0 (MPI_Bcast under mpirun), so this header does not depend on MPI.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/comm/engine.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/tcp_store.hpp"
#include "tessera/core/error.hpp"

namespace tessera::comm {

/// How an NcclEngine starts, how long it waits, and what ends it.
struct NcclOptions {
  /// Bounds each step of a bootstrap: the TcpStore's join and id exchange,
  /// ncclCommInitRank, and each ncclCommSplit.
  std::chrono::milliseconds init_timeout = std::chrono::seconds(300);
  /// Bounds a collective, from its issue to its completion on the device (the
  /// watchdog); zero or negative: no watchdog.
  std::chrono::milliseconds timeout = std::chrono::seconds(600);
  /// The stream the collectives are ordered against: the CUDA backend's is
  /// cuda::compute_stream() (nullptr: the legacy default stream, ordered with every
  /// blocking stream, the backend's among them, so correct but ordered against more).
  cudaStream_t compute = nullptr;
  /// Called from the watchdog thread, after it aborted the communicator, with the
  /// message that names the rank and the operation. Empty: print it to stderr and end
  /// the process with exit status 1. A callable that returns leaves the engine
  /// aborted: the program must not use it again.
  std::function<void(const std::string&)> on_failure;
  /// Ranks may share a GPU (comm.share_gpu; for testing): choose_device lets them, and
  /// each rank sets comm::shared_gpu_environment before its first NCCL call, so NCCL sees
  /// a host per rank and runs over sockets on the loopback interface.
  bool share_device = false;
};

namespace detail {

using NcclClock = std::chrono::steady_clock;

inline double nccl_seconds(std::chrono::milliseconds t) { return static_cast<double>(t.count()) / 1000.0; }

/// Polls a non-blocking communicator until the calls issued on it have finished, or
/// the deadline passes: its state (ncclSuccess or an error), ncclInProgress past the
/// deadline, or the failure of ncclCommGetAsyncError itself.
inline ncclResult_t nccl_poll(ncclComm_t comm, NcclClock::time_point deadline) {
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (NcclClock::now() >= deadline) return ncclInProgress;
    if (spins < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

/// A non-blocking communicator's configuration.
inline ncclConfig_t nccl_nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

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

/// A CUDA event, destroyed with the last of the Handle and the watchdog that hold it
/// (destruction is deferred by CUDA until the event completes).
struct NcclEvent {
  cudaEvent_t event = nullptr;
  NcclEvent() = default;
  NcclEvent(const NcclEvent&) = delete;
  NcclEvent& operator=(const NcclEvent&) = delete;
  ~NcclEvent() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
};

/// A collective in flight, as the watchdog sees it.
struct NcclInFlight {
  std::shared_ptr<NcclEvent> done;
  const char* what;
  std::uint64_t seq;
  NcclClock::time_point issued;
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
  std::chrono::milliseconds init_timeout{300'000}, timeout{600'000};
  std::function<void(const std::string&)> on_failure;
  std::uint64_t issued = 0;  // collectives issued, for messages

  std::atomic<bool> aborted{false};
  std::mutex abort_mutex;  // guards abort_reason and the abort itself (host or watchdog thread)
  std::string abort_reason;

  std::mutex watch_mutex;  // guards in_flight and stopping
  std::condition_variable watch_cv;
  std::deque<NcclInFlight> in_flight;  // oldest first: they complete in order on the comm stream
  bool stopping = false;
  std::thread watchdog;

  NcclState() = default;
  NcclState(const NcclState&) = delete;
  NcclState& operator=(const NcclState&) = delete;
  ~NcclState() {
    stop_watchdog();
    // Teardown cannot report: a failure here leaves nothing to recover.
    int previous = 0;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    if (comm != nullptr && !aborted) {
      // Unwinding from an error: the other ranks may never come, so no goodbye.
      ncclResult_t status = std::uncaught_exceptions() > 0 ? ncclInternalError : ncclCommFinalize(comm);
      if (status == ncclSuccess || status == ncclInProgress)
        status = nccl_poll(comm, NcclClock::now() + std::min(timeout_or_init(), std::chrono::milliseconds(60'000)));
      if (status == ncclSuccess)
        (void)ncclCommDestroy(comm);
      else
        (void)ncclCommAbort(comm);
    }
    in_flight.clear();
    if (barrier_word != nullptr) (void)cudaFree(barrier_word);
    if (compute_ready != nullptr) (void)cudaEventDestroy(compute_ready);
    if (comm_stream != nullptr) (void)cudaStreamDestroy(comm_stream);
    if (switched) (void)cudaSetDevice(previous);
  }

  void cuda(cudaError_t status, const char* call) const { nccl_cuda_check(status, call, world_rank); }

  /// Checks a call on this communicator; one that returned ncclInProgress (it is
  /// non-blocking) is polled until it finished. Past the timeout the communicator is
  /// aborted and the error names the call.
  void nccl(ncclResult_t status, const char* call) {
    if (status == ncclInProgress) {
      status = nccl_poll(comm, NcclClock::now() + timeout_or_init());
      if (status == ncclInProgress) {
        const std::string why = tessera::detail::concat("rank ", world_rank, ": ", call, " did not finish within ",
                                                        nccl_seconds(timeout_or_init()), " s");
        fail(why, abort_comm(why));
      }
    }
    nccl_check(status, call, world_rank, comm);
  }

  /// A call inside ncclGroupStart/End: it only records; ncclGroupEnd does the work.
  void nccl_in_group(ncclResult_t status, const char* call) const {
    if (status != ncclInProgress) nccl_check(status, call, world_rank, comm);
  }

  std::chrono::milliseconds timeout_or_init() const {
    return timeout.count() > 0 ? timeout : init_timeout;
  }

  /// Aborts the communicator (once); later calls fail with `why`. Returns a note when
  /// ncclCommAbort itself failed. Safe from the watchdog thread.
  std::string abort_comm(const std::string& why) {
    std::lock_guard<std::mutex> lock(abort_mutex);
    std::string note;
    if (!aborted) {
      abort_reason = why;
      aborted = true;
      if (comm != nullptr) {
        int previous = 0;
        const bool switched =
            cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
        const ncclResult_t status = ncclCommAbort(comm);
        if (switched) (void)cudaSetDevice(previous);
        if (status != ncclSuccess)
          note = tessera::detail::concat(" (ncclCommAbort failed too: ", ncclGetErrorString(status), ")");
      }
    }
    return note;
  }

  [[noreturn]] void throw_aborted(std::string_view what) {
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(abort_mutex);
      reason = abort_reason;
    }
    fail("rank ", world_rank, ": ", what, " on an aborted NCCL communicator: ", reason);
  }

  /// Throws (and aborts the communicator) when NCCL reports an asynchronous error.
  void check_async(std::string_view what) {
    ncclResult_t async = ncclSuccess;
    nccl_check(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError", world_rank, comm);
    if (async == ncclSuccess || async == ncclInProgress) return;
    const std::string why = tessera::detail::concat(
        "rank ", world_rank, ": ", what, ": NCCL reported an asynchronous error: ", ncclGetErrorString(async),
        nccl_detail(comm));
    const std::string note = abort_comm(why);
    fail(why, note);
  }

  // ---- the watchdog ----

  void start_watchdog() {
    if (timeout.count() <= 0) return;
    watchdog = std::thread([this] { watch(); });
  }

  void stop_watchdog() {
    if (!watchdog.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(watch_mutex);
      stopping = true;
    }
    watch_cv.notify_all();
    watchdog.join();
  }

  void watch_collective(std::shared_ptr<NcclEvent> done, const char* what) {
    std::lock_guard<std::mutex> lock(watch_mutex);
    in_flight.push_back(NcclInFlight{std::move(done), what, ++issued, NcclClock::now()});
  }

  /// Every 50 ms: retires the completed collectives, then fails on the oldest one left
  /// when it is past the timeout, on a CUDA error of its event, or on NCCL's
  /// asynchronous error.
  void watch() {
    if (cudaSetDevice(device) != cudaSuccess) return;  // the events are on this device
    std::unique_lock<std::mutex> lock(watch_mutex);
    while (!stopping && !aborted) {
      watch_cv.wait_for(lock, std::chrono::milliseconds(50));
      if (stopping || aborted) break;
      std::string why;
      while (!in_flight.empty()) {
        const NcclInFlight& f = in_flight.front();
        const cudaError_t q = cudaEventQuery(f.done->event);
        if (q == cudaSuccess) {
          in_flight.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady)
          why = tessera::detail::concat("rank ", world_rank, ": NCCL ", f.what, " (collective #", f.seq, " of ", size,
                                        " ranks) failed on the device: ", cudaGetErrorName(q), ": ",
                                        cudaGetErrorString(q));
        else if (NcclClock::now() - f.issued > timeout)
          why = tessera::detail::concat(
              "rank ", world_rank, ": NCCL ", f.what, " (collective #", f.seq, " of ", size,
              " ranks) did not complete within ", nccl_seconds(timeout),
              " s: a rank died, hangs, or stopped calling the same collectives");
        break;
      }
      if (why.empty()) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
          const std::string during =
              in_flight.empty() ? std::string("between collectives")
                                : tessera::detail::concat("during ", in_flight.front().what, " (collective #",
                                                          in_flight.front().seq, " of ", size, " ranks)");
          why = tessera::detail::concat("rank ", world_rank, ": NCCL reported an asynchronous error ", during, ": ",
                                        ncclGetErrorString(async), nccl_detail(comm));
        }
      }
      if (why.empty()) continue;
      lock.unlock();
      const std::string message = why + "; the communicator was aborted" + abort_comm(why);
      if (on_failure) {
        on_failure(message);
        return;
      }
      std::fprintf(stderr, "\ntessera: error: %s\n", message.c_str());
      std::fflush(stderr);
      std::_Exit(1);
    }
  }
};

/// An event on the comm stream, waited for on the compute stream.
struct NcclPending final : Handle::Impl {
  NcclPending(std::shared_ptr<NcclState> s, std::shared_ptr<NcclEvent> e, const char* w)
      : state(std::move(s)), done(std::move(e)), what(w) {}
  NcclPending(const NcclPending&) = delete;
  NcclPending& operator=(const NcclPending&) = delete;

  void wait() override {
    NcclState& s = *state;
    if (s.aborted) s.throw_aborted(what);
    NcclDeviceScope scope(s.device, s.world_rank);
    s.cuda(cudaStreamWaitEvent(s.compute_stream, done->event, 0), "cudaStreamWaitEvent");
    s.check_async(what);
  }

  std::shared_ptr<NcclState> state;
  std::shared_ptr<NcclEvent> done;
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
  explicit NcclEngine(ncclComm_t comm, cudaStream_t compute = nullptr)
      : NcclEngine(comm, with_compute(compute), -1) {}
  /// The same, with the timeouts and the failure action of `options` (and its stream).
  NcclEngine(ncclComm_t comm, const NcclOptions& options) : NcclEngine(comm, options, -1) {}

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  std::string_view engine_name() const { return "nccl"; }

  int device() const { return state_->device; }
  cudaStream_t compute_stream() const { return state_->compute_stream; }
  cudaStream_t comm_stream() const { return state_->comm_stream; }
  ncclComm_t nccl_comm() const { return state_->comm; }

  Handle all_gather(const void* in, void* out, std::size_t n, DataType t) {
    const auto m = detail::nccl_moved(t, n);
    require("all_gather", "input", in, n * size_of(t));
    require("all_gather", "output", out, n * size_of(t) * static_cast<std::size_t>(size()));
    return issue("all_gather", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclAllGather(in, out, m.count, m.type, c, s), "ncclAllGather");
    });
  }

  Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    const auto type = detail::nccl_reduced(t, state_->world_rank);
    require("reduce_scatter", "input", in, n * size_of(t) * static_cast<std::size_t>(size()));
    require("reduce_scatter", "output", out, n * size_of(t));
    return issue("reduce_scatter", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclReduceScatter(in, out, n, type, detail::nccl_op(op), c, s), "ncclReduceScatter");
    });
  }

  Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    const auto type = detail::nccl_reduced(t, state_->world_rank);
    require("all_reduce", "input", in, n * size_of(t));
    require("all_reduce", "output", out, n * size_of(t));
    return issue("all_reduce", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl(ncclAllReduce(in, out, n, type, detail::nccl_op(op), c, s), "ncclAllReduce");
    });
  }

  Handle broadcast(void* data, std::size_t n, DataType t, int root) {
    TESSERA_CHECK(root >= 0 && root < size(), "rank ", state_->world_rank, ": broadcast root ", root, " outside ",
                  size(), " ranks");
    const auto m = detail::nccl_moved(t, n);
    require("broadcast", "buffer", data, n * size_of(t));
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
      require("send_recv", o.kind == PeerOp::Kind::send ? "send buffer" : "recv buffer", o.data,
              o.count * size_of(o.type));
    }
    return issue("send_recv", [&](ncclComm_t c, cudaStream_t s) {
      state_->nccl_in_group(ncclGroupStart(), "ncclGroupStart");
      try {
        for (const auto& o : ops) {
          const auto m = detail::nccl_moved(o.type, o.count);
          if (o.kind == PeerOp::Kind::send)
            state_->nccl_in_group(ncclSend(o.data, m.count, m.type, o.peer, c, s), "ncclSend");
          else
            state_->nccl_in_group(ncclRecv(o.data, m.count, m.type, o.peer, c, s), "ncclRecv");
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
  /// color form a new one, ranked by key, then by rank here. The new communicator is
  /// non-blocking too, with the same options; the split is bounded by init_timeout.
  NcclEngine split(int color, int key) {
    auto& s = *state_;
    TESSERA_CHECK(color >= 0, "rank ", s.world_rank, ": split color ", color,
                  " is negative: every rank needs a color >= 0");
    if (s.aborted) s.throw_aborted("split");
    detail::NcclDeviceScope scope(s.device, s.world_rank);
    ncclConfig_t config = detail::nccl_nonblocking_config();
    ncclComm_t child = nullptr;
    ncclResult_t status = ncclCommSplit(s.comm, color, key, &child, &config);
    const auto deadline = detail::NcclClock::now() + s.init_timeout;
    // The split runs on the parent and finishes in the child: poll both.
    if (status == ncclInProgress || status == ncclSuccess) status = detail::nccl_poll(s.comm, deadline);
    if ((status == ncclInProgress || status == ncclSuccess) && child != nullptr)
      status = detail::nccl_poll(child, deadline);
    if (status != ncclSuccess) {
      const std::string why =
          status == ncclInProgress
              ? tessera::detail::concat("rank ", s.world_rank, ": ncclCommSplit(color ", color, ", key ", key,
                                        ") did not finish within ", detail::nccl_seconds(s.init_timeout),
                                        " s: a rank of the communicator did not call split")
              : tessera::detail::concat("rank ", s.world_rank, ": ncclCommSplit(color ", color, ", key ", key,
                                        ") failed: ", ncclGetErrorString(status), detail::nccl_detail(s.comm));
      if (child != nullptr) (void)ncclCommAbort(child);
      fail(why, s.abort_comm(why));
    }
    TESSERA_CHECK(child != nullptr, "rank ", s.world_rank, ": ncclCommSplit(color ", color,
                  ") returned no communicator");
    NcclOptions options;
    options.init_timeout = s.init_timeout;
    options.timeout = s.timeout;
    options.compute = s.compute_stream;
    options.on_failure = s.on_failure;
    return NcclEngine(child, options, s.world_rank);
  }

  /// ncclCommAbort (stops this rank's collectives in flight), then throws the reason.
  [[noreturn]] void abort(const std::string& reason) {
    const std::string why =
        tessera::detail::concat("rank ", state_->world_rank, ": NCCL communicator aborted: ", reason);
    const std::string note = state_->abort_comm(why);
    fail(why, note);
  }

 private:
  static NcclOptions with_compute(cudaStream_t compute) {
    NcclOptions o;
    o.compute = compute;
    return o;
  }

  NcclEngine(ncclComm_t comm, const NcclOptions& options, int world_rank)
      : state_(std::make_shared<detail::NcclState>()) {
    TESSERA_CHECK(comm != nullptr, "NcclEngine: no NCCL communicator (ncclComm_t is null)");
    auto& s = *state_;
    s.comm = comm;  // owned from here: destroyed if the rest fails
    s.compute_stream = options.compute;
    s.init_timeout = options.init_timeout;
    s.timeout = options.timeout;
    s.on_failure = options.on_failure;
    s.nccl(ncclCommUserRank(comm, &s.rank), "ncclCommUserRank");
    s.world_rank = world_rank >= 0 ? world_rank : s.rank;
    s.nccl(ncclCommCount(comm, &s.size), "ncclCommCount");
    s.nccl(ncclCommCuDevice(comm, &s.device), "ncclCommCuDevice");
    detail::NcclDeviceScope scope(s.device, s.world_rank);
    s.cuda(cudaStreamCreateWithFlags(&s.comm_stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    s.cuda(cudaEventCreateWithFlags(&s.compute_ready, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s.cuda(cudaMalloc(reinterpret_cast<void**>(&s.barrier_word), sizeof(int)), "cudaMalloc");
    s.cuda(cudaMemsetAsync(s.barrier_word, 0, sizeof(int), s.comm_stream), "cudaMemsetAsync");
    s.start_watchdog();
  }

  /// Refuses a buffer that is not memory of this engine's device: a host variable (what a
  /// host engine would have moved) or another device's memory fails here, naming the
  /// operation, instead of inside NCCL or as garbage.
  void require(const char* what, const char* role, const void* p, std::size_t bytes) const {
    if (bytes == 0) return;
    cudaPointerAttributes a{};
    const cudaError_t status = cudaPointerGetAttributes(&a, p);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the refusal below says what went wrong
      a.type = cudaMemoryTypeUnregistered;
    }
    const bool device = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
    TESSERA_CHECK(device, "rank ", state_->world_rank, ": ", what, ": the ", role, " (", p, ", ", bytes,
                  " bytes) is host memory, which NCCL cannot move: stage host values through a device buffer "
                  "(parallel/host_values.hpp)");
    TESSERA_CHECK(a.type == cudaMemoryTypeManaged || a.device == state_->device, "rank ", state_->world_rank, ": ",
                  what, ": the ", role, " (", p, ") is memory of CUDA device ", a.device, ", but this rank's NCCL "
                  "communicator runs on device ", state_->device);
  }

  /// comm stream waits for compute, `call` enqueues the NCCL work, an event marks its end.
  template <class Call>
  Handle issue(const char* what, Call&& call) {
    auto& s = *state_;
    if (s.aborted) s.throw_aborted(what);
    detail::NcclDeviceScope scope(s.device, s.world_rank);
    auto done = std::make_shared<detail::NcclEvent>();
    s.cuda(cudaEventCreateWithFlags(&done->event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    s.cuda(cudaEventRecord(s.compute_ready, s.compute_stream), "cudaEventRecord");
    s.cuda(cudaStreamWaitEvent(s.comm_stream, s.compute_ready, 0), "cudaStreamWaitEvent");
    call(s.comm, s.comm_stream);
    s.cuda(cudaEventRecord(done->event, s.comm_stream), "cudaEventRecord");
    s.watch_collective(done, what);
    return Handle(std::make_unique<detail::NcclPending>(state_, std::move(done), what));
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
/// becomes this thread's current device. Every rank calls it with the same id. The
/// communicator is non-blocking: its initialisation is polled until
/// options.init_timeout, then aborted.
inline NcclEngine nccl_from_unique_id(const ncclUniqueId& id, int rank, int world_size, int device,
                                      const NcclOptions& options = {}) {
  TESSERA_CHECK(world_size >= 1, "NCCL: a world of ", world_size, " ranks");
  TESSERA_CHECK(rank >= 0 && rank < world_size, "NCCL: rank ", rank, " is outside [0, ", world_size, ")");
  TESSERA_CHECK(options.init_timeout.count() > 0, "rank ", rank, ": NCCL init timeout of ",
                options.init_timeout.count(), " ms: it must be positive");
  int devices = 0;
  detail::nccl_cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount", rank);
  TESSERA_CHECK(device >= 0 && device < devices, "rank ", rank, ": CUDA device ", device,
                " does not exist: this process sees ", devices,
                " device(s) (is LOCAL_RANK or CUDA_VISIBLE_DEVICES right?)");
  detail::nccl_cuda_check(cudaSetDevice(device), "cudaSetDevice", rank);
  ncclConfig_t config = detail::nccl_nonblocking_config();
  ncclComm_t comm = nullptr;
  ncclResult_t status = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  if ((status == ncclSuccess || status == ncclInProgress) && comm != nullptr)
    status = detail::nccl_poll(comm, detail::NcclClock::now() + options.init_timeout);
  if (status != ncclSuccess) {
    const std::string last = comm != nullptr ? detail::nccl_detail(comm) : detail::nccl_detail(nullptr);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (status == ncclInProgress)
      fail("rank ", rank, ": ncclCommInitRank (", world_size, " ranks, CUDA device ", device,
           ") did not finish within ", detail::nccl_seconds(options.init_timeout),
           " s: a rank that never joined, ranks given different ids, or a network NCCL cannot reach "
           "(NCCL_SOCKET_IFNAME); the communicator was aborted");
    fail("rank ", rank, ": ncclCommInitRank (", world_size, " ranks, CUDA device ", device,
         ") failed: ", ncclGetErrorString(status), last);
  }
  TESSERA_CHECK(comm != nullptr, "rank ", rank, ": ncclCommInitRankConfig returned no communicator");
  return NcclEngine(comm, options);
}

/// The world of a launch whose ranks meet at MASTER_ADDR:MASTER_PORT (torchrun; srun
/// with those set; the port after it where torchrun's agent holds that one, see
/// Launch::store_port): rank 0 makes the id and shares it through a TcpStore, whose join
/// checks that every rank was started for the same world size (a mismatch fails every
/// rank that reached the store, naming the rank and both sizes). The device is
/// choose_device()'s: the local rank modulo the visible devices. options.init_timeout
/// bounds the join, the exchange and ncclCommInitRank, each.
inline NcclEngine nccl_from_torchrun(const Launch& launch, const NcclOptions& options = {}) {
  TESSERA_CHECK(launch.world_size == 1 || launch.has_master(), "launch: ", describe_rank(launch), " of ",
                launch.world_size, " (", name_of(launch.launcher),
                "): the NCCL id is exchanged at MASTER_ADDR:MASTER_PORT, which are not both set "
                "(set them to rank 0's host and a free port; under mpirun the id goes by MPI broadcast instead)");
  int visible = 0;
  const cudaError_t counted = cudaGetDeviceCount(&visible);
  if (counted != cudaSuccess) {
    (void)cudaGetLastError();
    visible = 0;
  }
  const int device = choose_device(launch, visible, options.share_device);
  if (options.share_device) set_shared_gpu_environment(launch.rank);
  std::vector<std::uint8_t> bytes(sizeof(ncclUniqueId));
  {
    TcpStore store(launch.master_addr, launch.store_port(), launch.rank, launch.world_size, options.init_timeout);
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
  return nccl_from_unique_id(id, launch.rank, launch.world_size, device, options);
}

/// The same, for the launch this process's environment describes.
inline NcclEngine nccl_from_torchrun(const NcclOptions& options = {}) {
  return nccl_from_torchrun(detect_launch(), options);
}

/// The world of a launch with its own broadcast (mpirun): `broadcast_from_rank0` is
/// called on every rank with the id's bytes (filled on rank 0) and must leave rank 0's
/// bytes on every rank, e.g. under MPI
///   [](std::span<std::uint8_t> b) { MPI_Bcast(b.data(), int(b.size()), MPI_BYTE, 0, MPI_COMM_WORLD); }
/// The caller picks the device (choose_device) and has checked the world size (MPI's).
template <class Broadcast>
requires std::invocable<Broadcast&, std::span<std::uint8_t>> NcclEngine nccl_from_broadcast(
    int rank, int world_size, int device, Broadcast&& broadcast_from_rank0, const NcclOptions& options = {}) {
  if (options.share_device) set_shared_gpu_environment(rank);
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
  return nccl_from_unique_id(id, rank, world_size, device, options);
}

}  // namespace tessera::comm
