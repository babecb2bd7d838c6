// What a collective engine is: element types, reduction ops, point-to-point
// descriptors, the Handle of a collective in flight, and the comm::Engine concept
// that ThreadEngine, MpiEngine and NcclEngine satisfy. comm::Communicator
// (communicator.hpp) erases any engine behind one value type.
//
// Ordering contract (as MPI's and NCCL's): every rank of a communicator issues the
// same collectives in the same order; an engine completes them in issue order.
//
// Point-to-point transfers (send_recv) between two ranks are matched in issue order: a
// recv takes the oldest unmatched send from its peer (with the same tag, on the engines
// that have tags; NCCL has none, so portable code leaves every tag 0). Whether a send
// waits for its receiver depends on the engine: ThreadEngine and MpiEngine buffer small
// sends, NCCL never does. Portable code therefore assumes a send may wait until its
// receiver runs the matching recv, and issues both directions of an exchange in one
// group; comm/nccl_rules.hpp holds the CPU engines to that (and to NCCL's other rules).
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/profile.hpp"

namespace tessera::comm {

/// Collective element types. bf16 is moved as 2-byte elements and reduced in fp32 per
/// element (each partial sum rounded once to bf16), in rank order on the host engines.
enum class DataType : std::uint8_t { u8, u16, i32, i64, f32, f64, bf16 };
enum class ReduceOp : std::uint8_t { sum, max, min };

constexpr std::size_t size_of(DataType t) {
  switch (t) {
    case DataType::u8: return 1;
    case DataType::u16: return 2;
    case DataType::i32: return 4;
    case DataType::i64: return 8;
    case DataType::f32: return 4;
    case DataType::f64: return 8;
    case DataType::bf16: return 2;
  }
  return 0;
}

constexpr const char* name_of(DataType t) {
  switch (t) {
    case DataType::u8: return "u8";
    case DataType::u16: return "u16";
    case DataType::i32: return "i32";
    case DataType::i64: return "i64";
    case DataType::f32: return "f32";
    case DataType::f64: return "f64";
    case DataType::bf16: return "bf16";
  }
  return "?";
}

template <class T>
constexpr DataType data_type_of() {
  if constexpr (std::is_same_v<T, std::uint8_t> || std::is_same_v<T, std::byte> || std::is_same_v<T, char>)
    return DataType::u8;
  else if constexpr (std::is_same_v<T, std::uint16_t>)
    return DataType::u16;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return DataType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return DataType::i64;
  else if constexpr (std::is_same_v<T, float>)
    return DataType::f32;
  else if constexpr (std::is_same_v<T, double>)
    return DataType::f64;
  else if constexpr (std::is_same_v<T, bf16>)
    return DataType::bf16;
  else
    static_assert(sizeof(T) == 0, "tessera::comm: no collective element type for this T");
}

/// What one rank issues as a collective (or a barrier or a split): every rank of a
/// communicator must issue the same ones in the same order. ThreadEngine compares them in
/// memory; NcclRulesEngine over MPI exchanges them as words().
struct CollectiveCall {
  const char* kind = "";  // one of kKinds
  std::size_t count = 0;
  DataType type = DataType::u8;
  int op = -1;    // ReduceOp, or -1
  int root = -1;  // broadcast's root, or -1

  static constexpr const char* kKinds[] = {"all_gather", "reduce_scatter", "all_reduce",
                                           "broadcast",  "barrier",        "split"};
  static constexpr std::size_t kWords = 5;

  friend bool operator==(const CollectiveCall& a, const CollectiveCall& b) { return a.words() == b.words(); }

  /// The call as numbers, for ranks to compare across processes.
  std::array<std::int64_t, kWords> words() const {
    std::int64_t k = -1;
    for (std::size_t i = 0; i < std::size(kKinds); ++i)
      if (std::string_view(kKinds[i]) == kind) k = static_cast<std::int64_t>(i);
    return {k, static_cast<std::int64_t>(count), static_cast<std::int64_t>(type), op, root};
  }
  static CollectiveCall from_words(const std::int64_t* w) {
    const bool known = w[0] >= 0 && w[0] < static_cast<std::int64_t>(std::size(kKinds));
    return {known ? kKinds[w[0]] : "?", static_cast<std::size_t>(w[1]), static_cast<DataType>(w[2]),
            static_cast<int>(w[3]), static_cast<int>(w[4])};
  }

  /// "all_reduce of 4 f32 (sum)", "broadcast of 8 bf16 from root 0", "barrier".
  std::string str() const {
    std::string s = kind;
    if (s != "barrier" && s != "split") s += tessera::detail::concat(" of ", count, " ", name_of(type));
    if (op >= 0) s += op == 0 ? " (sum)" : op == 1 ? " (max)" : " (min)";
    if (root >= 0) s += tessera::detail::concat(" from root ", root);
    return s;
  }
};

/// The largest tag a point-to-point transfer may carry (tags are 0 .. kMaxTag). MPI
/// guarantees tags up to 32767; MpiEngine sends tag t as MPI tag 32767 - kMaxTag + t,
/// which leaves MPI tags below that free for code calling MPI on the engine's communicator.
inline constexpr int kMaxTag = 16383;

/// One point-to-point transfer in a grouped send/recv.
///
/// Matching: a recv from `peer` with tag t takes the oldest send from `peer` to this rank
/// with tag t that no recv has taken yet. Transfers between two ranks with the same tag
/// are therefore received in the order they were issued; transfers with different tags
/// may be received in any order. The recv's count * size_of(type) must equal the send's:
/// a mismatch fails the job, naming both ranks and both sizes.
///
/// Completion: a send_recv Handle completes when each transfer in it has, a recv when its
/// data has arrived, a send when its buffer may be reused. On NcclEngine (and on the CPU
/// engines under NCCL's rules, comm/nccl_rules.hpp) a send completes only when its
/// receiver runs the matching recv, and a rank's next operation on the communicator
/// starts only after the group before it completed. ThreadEngine otherwise copies a send's
/// data and completes it as soon as the rank's worker reaches it; MpiEngine's send (an
/// MPI_Isend) completes once MPI has matched or buffered it. The send's buffer must stay
/// untouched until its Handle is waited on. Put the transfers a peer waits for in the same
/// send_recv as the recvs this rank waits for: within one group no order can deadlock.
struct PeerOp {
  enum class Kind : std::uint8_t { send, recv } kind;
  int peer;    // the other rank, numbered in this communicator
  void* data;  // const for a send
  std::size_t count;
  DataType type;
  int tag = 0;  // 0 .. kMaxTag; NcclEngine takes 0 only (NCCL matches in issue order)
};

namespace detail {

/// Throws unless `o.tag` is in 0 .. kMaxTag; `rank` is how the message names this rank.
inline void check_tag(const PeerOp& o, int rank) {
  TESSERA_CHECK(o.tag >= 0 && o.tag <= kMaxTag, "rank ", rank, ": send_recv: the ",
                o.kind == PeerOp::Kind::send ? "send to" : "recv from", " peer ", o.peer, " has tag ", o.tag,
                ", outside 0..", kMaxTag);
}

}  // namespace detail

/// A collective in flight. wait() returns once this rank's part is complete for the
/// backend's later work (its output visible to the next kernel, its input free to reuse)
/// and throws if the collective failed. On the host engines that is also when the host
/// may read it; on NcclEngine wait() orders the compute stream and returns at once, so the
/// host reads a result only through a copy to the host (which synchronises) after wait().
/// A barrier's wait() likewise holds the host only after B::synchronize().
class Handle {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
  };

  Handle() = default;
  explicit Handle(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Handle(Handle&&) noexcept = default;
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      drain();
      impl_ = std::move(o.impl_);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  /// A handle dropped unwaited still completes: buffers are not freed under a collective.
  ~Handle() { drain(); }

  void wait() {
    if (!impl_) return;
    auto impl = std::move(impl_);
    impl->wait();
  }
  bool pending() const { return impl_ != nullptr; }

  /// This handle with its wait() a span "wait <what>" of the waiting thread's profile
  /// (core/profile.hpp), while a profile records on this thread; else itself.
  Handle timed(const char* what, std::uint64_t bytes, int ranks) && {
    if (!impl_ || !profile::recording()) return std::move(*this);
    struct Timed : Impl {
      std::unique_ptr<Impl> inner;
      const char* what;
      std::uint64_t bytes;
      int ranks;
      Timed(std::unique_ptr<Impl> i, const char* w, std::uint64_t b, int r)
          : inner(std::move(i)), what(w), bytes(b), ranks(r) {}
      void wait() override {
        const profile::Span span("comm", [&] { return std::string("wait ") + what; }, bytes, ranks);
        inner->wait();
      }
    };
    return Handle(std::make_unique<Timed>(std::move(impl_), what, bytes, ranks));
  }

  /// This handle with `done` called once its wait() returns (at once for an empty one).
  template <class F>
  Handle then(F done) && {
    if (!impl_) {
      done();
      return std::move(*this);
    }
    struct Then : Impl {
      std::unique_ptr<Impl> inner;
      F done;
      Then(std::unique_ptr<Impl> i, F d) : inner(std::move(i)), done(std::move(d)) {}
      void wait() override {
        inner->wait();
        done();
      }
    };
    return Handle(std::make_unique<Then>(std::move(impl_), std::move(done)));
  }

 private:
  void drain() noexcept {
    if (!impl_) return;
    try {
      wait();
    } catch (...) {
      // The error reaches the rank through the collective it waits on next.
    }
  }
  std::unique_ptr<Impl> impl_;
};

/// What an engine provides. Counts are elements of `type`; all_gather and
/// reduce_scatter take `count` elements per rank (out and in hold size() * count);
/// all_reduce may run in place (in == out).
template <class E>
concept Engine = std::move_constructible<E> &&
                 requires(E& e, const E& ce, const void* in, void* out, std::size_t count, DataType type,
                          ReduceOp op, int root, std::span<const PeerOp> peers, int color, int key,
                          const std::string& reason) {
                   { ce.rank() } -> std::convertible_to<int>;
                   { ce.size() } -> std::convertible_to<int>;
                   { ce.engine_name() } -> std::convertible_to<std::string_view>;
                   { e.all_gather(in, out, count, type) } -> std::same_as<Handle>;
                   { e.reduce_scatter(in, out, count, type, op) } -> std::same_as<Handle>;
                   { e.all_reduce(in, out, count, type, op) } -> std::same_as<Handle>;
                   { e.broadcast(out, count, type, root) } -> std::same_as<Handle>;
                   { e.send_recv(peers) } -> std::same_as<Handle>;
                   { e.barrier() } -> std::same_as<Handle>;
                   { e.split(color, key) } -> std::same_as<E>;
                   { e.abort(reason) } -> std::same_as<void>;
                 };

}  // namespace tessera::comm
