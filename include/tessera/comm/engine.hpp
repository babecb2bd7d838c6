// What a collective engine is: element types, reduction ops, point-to-point
// descriptors, the Handle of a collective in flight, and the comm::Engine concept
// that ThreadEngine, MpiEngine and NcclEngine satisfy. comm::Communicator
// (communicator.hpp) erases any engine behind one value type.
//
// Ordering contract (as MPI's and NCCL's): every rank of a communicator issues the
// same collectives in the same order; an engine completes them in issue order.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace tessera::comm {

enum class DataType : std::uint8_t { u8, u16, i32, i64, f32, f64 };
enum class ReduceOp : std::uint8_t { sum, max, min };

constexpr std::size_t size_of(DataType t) {
  switch (t) {
    case DataType::u8: return 1;
    case DataType::u16: return 2;
    case DataType::i32: return 4;
    case DataType::i64: return 8;
    case DataType::f32: return 4;
    case DataType::f64: return 8;
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
  else
    static_assert(sizeof(T) == 0, "tessera::comm: no collective element type for this T");
}

/// One point-to-point transfer in a grouped send/recv.
struct PeerOp {
  enum class Kind : std::uint8_t { send, recv } kind;
  int peer;
  void* data;  // const for a send
  std::size_t count;
  DataType type;
};

/// A collective in flight. wait() returns once this rank's part is complete (its
/// output written, its input free to reuse) and throws if the collective failed.
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
