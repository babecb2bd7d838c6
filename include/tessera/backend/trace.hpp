// A trace of what a backend was asked to do: every GEMM, attention call, kernel launch,
// zero fill, host transfer, synchronisation and fence (a point of the device's work the
// host may wait for alone), in issue order, every allocation and
// release of the memory it watches, and (in a dry run of one rank of a layout) every
// collective and send/recv the rank issues and where the compute waits for each.
//
// Traced<B> (backend/traced.hpp) records into the Trace of the Recording open on its
// thread; with the Meta backend under it (backend/meta/meta.hpp) nothing is computed,
// so a training step of any model is traced in milliseconds, with no memory. Each event
// is filed under the innermost Region open when it was issued (core/region.hpp). The
// cost model (plan/cost.hpp) prices a trace on a machine profile.
#pragma once

#include <cstdint>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/kernel_class.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/region.hpp"
#include "tessera/core/type_name.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::trace {

/// C = alpha op(A) op(B) + beta C: (m, k) x (k, n).
struct Gemm {
  std::int64_t m = 0, n = 0, k = 0;
  Trans ta = Trans::no, tb = Trans::no;
  DType operands = DType::f32;  // A and B (a float8 GEMM: A's format; B's may be the other)
  DType result = DType::f32;    // C
  bool accumulate = false;      // beta != 0: C is read as well as written
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k); }
  friend bool operator==(const Gemm&, const Gemm&) = default;
};

/// Grouped-query attention, forward or backward, over `shape` (causal or full).
struct Attention {
  AttentionShape shape;
  DType dtype = DType::f32;
  bool backward = false;
  /// Multiply-adds the computation makes, counted as two FLOPs each: q k^T and p v over
  /// the (query, key) pairs it computes (AttentionShape::pairs: those at or below the
  /// diagonal for a causal call); the backward makes two and a half times the forward's
  /// (dv, dp, dq, dk; s recomputed).
  double flops() const {
    const double forward = 4.0 * shape.pairs() * static_cast<double>(shape.head_dim);
    return backward ? 2.5 * forward : forward;
  }
  friend bool operator==(const Attention&, const Attention&) = default;
};

/// One B::for_each(n, f) of a functor: its name, what it does (ops/traffic.hpp) and the
/// kernel the CUDA backend runs it with.
struct Kernel {
  const char* functor = "";  // the functor's type, namespaces dropped ("RmsNormForward<float>")
  std::int64_t n = 0;
  ops::Traffic traffic{};
  /// What the CUDA kernel moves where it differs from the functor (ops::HasCudaTraffic):
  /// the GPU cost model prices this one, the CPU's `traffic`.
  std::optional<ops::Traffic> cuda_traffic{};
  bool priced = true;  // false: the functor has no traffic(); the cost model counts it apart
  KernelClass cuda_class = KernelClass::per_index;
  /// false: a pass the GPU runs inside the launch of the kernel before it (ops::FusesParts),
  /// so it costs no launch of its own.
  bool own_launch = true;
  /// A loop of the host backend (backend/host.hpp: an offloaded shard's optimizer step,
  /// norm or gradient sum), run by the host's cores over host memory, not launched.
  bool on_host = false;
  friend bool operator==(const Kernel& a, const Kernel& b) {
    return std::string_view(a.functor) == b.functor && a.n == b.n && a.priced == b.priced && a.cuda_class == b.cuda_class &&
           a.own_launch == b.own_launch && a.on_host == b.on_host &&
           a.traffic.bytes_read == b.traffic.bytes_read && a.traffic.bytes_written == b.traffic.bytes_written &&
           a.traffic.flops == b.traffic.flops && a.traffic.transcendentals == b.traffic.transcendentals;
  }
};

/// B::zeros: `bytes` set to zero.
struct Fill {
  std::int64_t bytes = 0;
  friend bool operator==(const Fill&, const Fill&) = default;
};

/// A host transfer. `site` is the library line that asked for it. On a GPU a copy to
/// the host waits for the device (Cuda::copy_to_host synchronises the stream); a copy
/// from the host does not (Cuda::copy_from_host stages the bytes in pinned memory and
/// issues the copy on the stream): `synchronizes` says which.
struct Transfer {
  std::int64_t bytes = 0;
  bool to_host = false;
  const char* file = "";
  std::uint32_t line = 0;
  bool synchronizes = true;
  friend bool operator==(const Transfer& a, const Transfer& b) {
    return a.bytes == b.bytes && a.to_host == b.to_host && a.line == b.line && std::string_view(a.file) == b.file &&
           a.synchronizes == b.synchronizes;
  }
};

/// B::synchronize().
struct Synchronize {
  friend bool operator==(const Synchronize&, const Synchronize&) = default;
};

/// B::fence(): a point of the device's work (all it was given before), which the host
/// may wait for alone (FenceWait) while the device goes on with what came after.
struct Fence {
  std::uint64_t id = 0;
  friend bool operator==(const Fence&, const Fence&) = default;
};

/// The host waits until the device has reached Fence `id`.
struct FenceWait {
  std::uint64_t id = 0;
  friend bool operator==(const FenceWait&, const FenceWait&) = default;
};

/// The communicator a collective runs on: its size, this rank's place in it, and the
/// distance in world ranks between neighbouring members (a mesh dimension's stride:
/// tensor-parallel peers 1, dp_shard peers the tensor-parallel degree, ...), from which
/// the cluster model knows which links it crosses.
struct CommGroup {
  int size = 1;
  int rank = 0;
  int stride = 1;
  friend bool operator==(const CommGroup&, const CommGroup&) = default;
};

/// One transfer of a grouped send/recv: `peer` numbered in the group.
struct PeerBytes {
  int peer = 0;
  std::int64_t bytes = 0;
  bool send = false;
  friend bool operator==(const PeerBytes&, const PeerBytes&) = default;
};

/// A collective or a grouped send/recv, issued on a communicator (the dry run's engine
/// records them: plan/phantom.hpp). It runs beside the compute stream, as NCCL runs on
/// its own stream; the compute that needs its result waits for it at its CommWait.
struct Collective {
  /// all_gather, reduce_scatter, all_reduce, broadcast, barrier (CollectiveCall's
  /// kinds), or send_recv.
  const char* kind = "";
  /// The whole buffer: all_gather's output, reduce_scatter's input, all_reduce's and
  /// broadcast's data (group.size x the per-rank count for the first two).
  std::int64_t bytes = 0;
  int root = -1;  // broadcast
  CommGroup group;
  std::vector<PeerBytes> peers;  // send_recv
  std::uint64_t id = 0;          // its CommWait's

  /// Bytes this rank sends, as comm::Traffic counts them (communicator.hpp).
  std::int64_t sent_bytes() const {
    const std::int64_t p = group.size;
    const std::string_view k = kind;
    if (k == "all_gather" || k == "reduce_scatter") return bytes / p * (p - 1);
    if (k == "all_reduce") return 2 * bytes * (p - 1) / p;
    if (k == "broadcast") return group.rank == root ? bytes * (p - 1) : 0;
    std::int64_t sent = 0;
    for (const auto& x : peers) sent += x.send ? x.bytes : 0;
    return sent;
  }
  friend bool operator==(const Collective& a, const Collective& b) {
    return std::string_view(a.kind) == b.kind && a.bytes == b.bytes && a.root == b.root && a.group == b.group &&
           a.peers == b.peers && a.id == b.id;
  }
};

/// The compute stream waits for collective `id` (Handle::wait; on NCCL an event wait,
/// the host does not block).
struct CommWait {
  std::uint64_t id = 0;
  friend bool operator==(const CommWait&, const CommWait&) = default;
};

/// An allocation (delta > 0) or release (delta < 0) of `device` memory; `live`: bytes held after it.
struct Memory {
  Device device = Device::cpu;
  std::int64_t delta = 0;
  MemoryUse use = MemoryUse::temporary;
  std::size_t live = 0;
  friend bool operator==(const Memory&, const Memory&) = default;
};

using Op = std::variant<Gemm, Attention, Kernel, Fill, Transfer, Synchronize, Fence, FenceWait, Memory, Collective,
                        CommWait>;

/// "nn", "nt", "tn" or "tt": a GEMM's transposes.
inline std::string trans_name(Trans a, Trans b) {
  return std::string(a == Trans::no ? "n" : "t") + (b == Trans::no ? "n" : "t");
}
/// How llama-plan names an operation ("gemm 8192x2048x2048 bfloat16->bfloat16 (nt)",
/// "RmsNormForward<bf16> (row)"): the kinds it sums and lists, and the names a device
/// profile gives the kernels a GEMM or attention call launched (Launching).
inline std::string describe(const Op& op) {
  return std::visit(
      [](const auto& o) -> std::string {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, Gemm>)
          return tessera::detail::concat("gemm ", o.m, "x", o.n, "x", o.k, " ", name_of(o.operands), "->",
                                         name_of(o.result), " (", trans_name(o.ta, o.tb), o.accumulate ? ", +=" : "",
                                         ")");
        else if constexpr (std::is_same_v<O, Attention>)
          return tessera::detail::concat("attention ", o.backward ? "backward" : "forward", " b", o.shape.batch, " t",
                                         o.shape.seq_len, " h", o.shape.n_heads, "/", o.shape.n_kv_heads, " d",
                                         o.shape.head_dim, " ", name_of(o.dtype));
        else if constexpr (std::is_same_v<O, Kernel>)
          return tessera::detail::concat(o.functor, " (", name_of(o.cuda_class), ")");
        else if constexpr (std::is_same_v<O, Fill>)
          return "zero fill";
        else if constexpr (std::is_same_v<O, Transfer>)
          return tessera::detail::concat(o.to_host ? "copy to host" : "copy from host", " (", o.file, ":", o.line, ")");
        else if constexpr (std::is_same_v<O, Synchronize>)
          return "synchronize";
        else if constexpr (std::is_same_v<O, Fence>)
          return "fence";
        else if constexpr (std::is_same_v<O, FenceWait>)
          return "wait for a fence";
        else if constexpr (std::is_same_v<O, Collective>)
          return tessera::detail::concat(o.kind, " of ", o.bytes, " bytes over ", o.group.size, " ranks");
        else if constexpr (std::is_same_v<O, CommWait>)
          return "wait for a collective";
        else
          return "memory";
      },
      op);
}

/// While one is open on this thread, the backend is launching the work of `op` (a GEMM,
/// an attention call): a device profile (backend/cuda/kernel_profile.hpp) names the
/// kernels launched meanwhile by describe(op), so that each is set beside the price of
/// the same operation. The CUDA backend opens one around each cuBLASLt and attention
/// call; opening one costs a thread-local pointer swap.
class Launching {
 public:
  explicit Launching(const Op& op) : op_(op), outer_(innermost()) { innermost() = &op_; }
  ~Launching() { innermost() = outer_; }
  Launching(const Launching&) = delete;
  Launching& operator=(const Launching&) = delete;
  /// The operation being launched on this thread, or nullptr.
  static const Op* current() { return innermost(); }

 private:
  static const Op*& innermost() {
    static thread_local const Op* op = nullptr;
    return op;
  }
  Op op_;
  const Op* outer_;
};

struct Event {
  Op op;
  const char* region = "";  // the innermost Region open when it was issued ("" outside any)
};

class Trace {
 public:
  void add(Op op) { events_.push_back(Event{std::move(op), Region::current_name()}); }
  const std::vector<Event>& events() const { return events_; }
  /// For a planner that edits a trace's events in place (plan/layout.hpp: account_zero1).
  std::vector<Event>& mutable_events() { return events_; }

  /// Replaces the events with those `f(events, out)` appends to `out`, moving from
  /// `events` what it keeps. `out` is `spare`, emptied; on return `spare` holds the
  /// replaced events' buffer, emptied. A planner rewrites traces of millions of events
  /// several times over, and a fresh vector for each rewrite costs it more in page faults
  /// (the kernel zeroing the new buffer's pages) than the rewrite itself: one spare passed
  /// along a chain of rewrites, and from trace to trace, allocates those pages once.
  template <class F>
  void rewrite(std::vector<Event>& spare, F&& f) {
    spare.clear();
    spare.reserve(events_.size());  // a rewrite that adds events grows it as it goes
    std::forward<F>(f)(events_, spare);
    events_.swap(spare);
    spare.clear();
  }
  void clear() { events_.clear(); }
  /// Room for `n` events before the first reallocation.
  void reserve(std::size_t n) { events_.reserve(n); }

  /// The events of one kind, in order.
  template <class K>
  std::vector<K> all() const {
    std::vector<K> out;
    for (const auto& e : events_)
      if (const K* k = std::get_if<K>(&e.op)) out.push_back(*k);
    return out;
  }

 private:
  std::vector<Event> events_;
};

namespace detail {
inline thread_local Trace* current_trace = nullptr;
}  // namespace detail

/// The name a trace gives functor F (computed once per type).
template <class F>
const char* functor_name() {
  static const std::string name = tessera::type_name<F>();
  return name.c_str();
}

/// The trace this thread's Traced backends record into, or nullptr.
inline Trace* current() { return detail::current_trace; }

/// Records into `trace`, on this thread, every call made through a Traced backend and
/// every allocation and release of the `watched` devices' memory (this thread's
/// counters), until the scope ends.
class Recording : private MemoryObserver {
 public:
  explicit Recording(Trace& trace, std::initializer_list<Device> watched = {Device::meta})
      : trace_(trace), previous_trace_(detail::current_trace) {
    detail::current_trace = &trace_;
    for (Device d : watched) watched_.push_back({d, memory_stats(d).observe(this, d)});
  }
  ~Recording() {
    for (auto it = watched_.rbegin(); it != watched_.rend(); ++it) memory_stats(it->device).observe(it->previous, it->device);
    detail::current_trace = previous_trace_;
  }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;

 private:
  void on_memory(Device device, std::int64_t delta, MemoryUse use, std::size_t live) override {
    trace_.add(Memory{device, delta, use, live});
  }

  struct Watched {
    Device device;
    MemoryObserver* previous;
  };
  Trace& trace_;
  Trace* previous_trace_;
  std::vector<Watched> watched_;
};

/// Adds `op` to this thread's trace, if one is recording.
inline void record(Op op) {
  if (Trace* t = current()) t->add(std::move(op));
}

}  // namespace tessera::trace
