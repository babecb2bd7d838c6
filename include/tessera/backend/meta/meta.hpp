// Meta: a backend with shapes and no storage, that computes nothing.
//
// The dry run. A model, a trainer and an optimizer written against the Backend concept
// run on Meta unchanged: tensors have shapes, element types and distinct addresses, but
// no memory behind them, and every GEMM, attention call and kernel launch returns at
// once. Under Traced<Meta> (DryRun below) every call is recorded (backend/traced.hpp), so
// a training step of Llama 3 405B is traced in well under a second on any machine, and
// its memory counted exactly: Meta's allocations are counted in memory_stats(Device::meta)
// like any backend's, under the MemoryUse open when they were made.
//
// - Addresses. Each allocation takes the next 256-byte-aligned range of an address space
//   above 2^48, which no x86-64 or AArch64 process can map: a host access to Meta memory,
//   which would be a bug in the model (the Backend concept forbids it), faults at once.
//   Ranges are never reused, so two live tensors never share an address. While a
//   meta::AllocatorReplay is open (a dry run opens one), tensors are blocks of tessera's
//   caching allocator over such ranges instead: reused as the GPU's allocator reuses
//   them, two live ones still never sharing an address.
// - Host reads. copy_to_host fills the destination with zero bytes: a loss or a gradient
//   norm read back is 0, a well-defined placeholder. A trace names every place that reads
//   (trace::Transfer): each is a device synchronisation on a GPU. The one exception: a few
//   bytes the host uploaded come back as they went (meta::HostValues), so a host value a
//   layout's dry run stages for a reduction over ranks (a token count the trainer then
//   checks: parallel/host_values.hpp) reads back as this rank's own.
// - Checks. gemm checks its operands as every backend does (check_gemm), so a shape error
//   in a model shows in its dry run.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/traced.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/buffer.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/attention_shape.hpp"

namespace tessera {

namespace meta {
/// Host values of at most kMaxBytes uploaded to a Meta buffer, by its address, until it
/// is released: what copy_to_host gives back from that address.
class HostValues {
 public:
  static constexpr std::size_t kMaxBytes = 64;

  static void put(const void* at, const void* src, std::size_t bytes) {
    if (bytes > kMaxBytes) return;
    std::lock_guard lock(state().mutex);
    auto& v = state().values[at];
    v.assign(static_cast<const std::byte*>(src), static_cast<const std::byte*>(src) + bytes);
    state().count.store(state().values.size(), std::memory_order_release);
  }
  /// Copies the value uploaded at `at` into dst if it has `bytes`; else zero bytes.
  static void get(const void* at, void* dst, std::size_t bytes) {
    std::lock_guard lock(state().mutex);
    const auto it = state().values.find(at);
    if (it != state().values.end() && it->second.size() == bytes) std::memcpy(dst, it->second.data(), bytes);
    else std::memset(dst, 0, bytes);
  }
  /// The value uploaded at `from`, if it has `bytes`, now also at `to` (a copy between
  /// two Meta buffers); else `to` holds none.
  static void copy(const void* from, const void* to, std::size_t bytes) {
    if (state().count.load(std::memory_order_acquire) == 0) return;
    std::lock_guard lock(state().mutex);
    const auto it = state().values.find(from);
    if (it != state().values.end() && it->second.size() == bytes) {
      state().values[to] = it->second;  // a map's insertion leaves `it` valid
    } else {
      state().values.erase(to);
    }
    state().count.store(state().values.size(), std::memory_order_release);
  }

  /// Every Meta buffer's release calls this: with no value held anywhere (nearly always:
  /// a staged value lives for one reduction), it returns without taking the lock that
  /// the threads of a search would otherwise queue on. The count is stored under the
  /// lock after each change, and a buffer is released after its upload, so the count
  /// read here includes a value held at `at`.
  static void forget(const void* at) {
    if (state().count.load(std::memory_order_acquire) == 0) return;
    std::lock_guard lock(state().mutex);
    state().values.erase(at);
    state().count.store(state().values.size(), std::memory_order_release);
  }

 private:
  struct State {
    std::mutex mutex;
    std::map<const void*, std::vector<std::byte>> values;
    std::atomic<std::size_t> count{0};  // values.size(), read without the lock
  };
  static State& state() {
    static State s;
    return s;
  }
};

/// Distinct, never-dereferenceable addresses for Meta's tensors.
class AddressSpace {
 public:
  static constexpr std::uintptr_t kBase = std::uintptr_t{1} << 48;
  static constexpr std::uintptr_t kAlign = 256;
  static constexpr std::uintptr_t kSpan = std::numeric_limits<std::uintptr_t>::max() - kBase;

  static void* allocate(std::size_t bytes) {
    TESSERA_CHECK(bytes <= kSpan, "Meta: cannot give ", bytes, " bytes of address space");
    const std::uintptr_t size = (std::max<std::size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
    const std::uintptr_t at = next().fetch_add(size);
    TESSERA_CHECK(at >= kBase && at - kBase <= kSpan - size, "Meta: the address space is used up (",
                  kSpan, " bytes above ", kBase, " handed out): this process has traced too much");
    return reinterpret_cast<void*>(at);
  }
  static void release(void* p) { HostValues::forget(p); }

 private:
  static std::atomic<std::uintptr_t>& next() {
    static std::atomic<std::uintptr_t> n{kBase};
    return n;
  }
};
/// Meta's allocations through tessera's caching allocator, the CUDA backend's
/// (backend/caching_allocator.hpp), while one is open on this thread. Its segments are
/// ranges of Meta's address space, so nothing is stored; what it reserves is what the
/// GPU's allocator would, given the same allocations and releases in the same order,
/// which is what a dry run makes (plan/dry_run.hpp): its rounding, its two pools, its
/// splitting and the free blocks too small for the next request. Per thread, as
/// DeviceMemory is; a buffer goes back to the replay it came from, if that is still open.
class AllocatorReplay {
 public:
  /// The address range of an expandable segment: 1 PiB, more than any step on one device
  /// holds (Llama 3.1 405B unsharded on one device: about 7 TiB).
  static constexpr std::size_t kExpandableRange = std::size_t{1} << 50;

  /// `expandable`: the large pool as one expandable segment (training.expandable_segments),
  /// as the CUDA backend's allocator then runs it.
  explicit AllocatorReplay(bool expandable = true)
      : allocator_(upstream(expandable)), previous_(std::exchange(current(), this)) {}
  ~AllocatorReplay() {
    current() = previous_;
    // Its range serves the next replay unless one of its blocks outlives it.
    recycle_range_ = allocator_.stats().allocated_bytes == 0;
  }
  AllocatorReplay(const AllocatorReplay&) = delete;
  AllocatorReplay& operator=(const AllocatorReplay&) = delete;

  void* allocate(std::size_t bytes) {
    void* p = allocator_.allocate(bytes);
    if (log_ != nullptr) log_->push_back({bytes, reinterpret_cast<std::uintptr_t>(p)});
    return p;
  }
  CachingAllocator::Stats stats() const { return allocator_.stats(); }
  /// The allocator's history from now on, and its segments now: a memory snapshot of the
  /// step the dry run replays (plan::dry_run_memory_snapshot).
  void record_history(std::size_t max_entries = MemoryHistory::kDefaultEntries) {
    allocator_.record_history(max_entries);
  }
  const MemoryHistory* history() const { return allocator_.history(); }
  AllocatorState state() const { return allocator_.state(); }

  /// A block allocate() handed out: the bytes asked for and where it went.
  struct Block {
    std::size_t bytes;
    std::uintptr_t address;
    friend bool operator==(const Block&, const Block&) = default;
  };
  /// From now on appends each block allocate() hands out to `log`, in order (nullptr:
  /// stops). Two steps that log the same blocks could both be replays of one CUDA graph
  /// captured over either: its kernels keep the addresses they were captured with.
  void log_blocks(std::vector<Block>* log) { log_ = log; }

  /// The replay open on this thread, or nullptr.
  static AllocatorReplay*& current() {
    static thread_local AllocatorReplay* r = nullptr;
    return r;
  }
  /// The deleter of the Meta buffers a replay allocated.
  static void release(void* p) {
    HostValues::forget(p);
    for (AllocatorReplay* r = current(); r != nullptr; r = r->previous_)
      if (r->allocator_.try_release(p)) return;
  }

 private:
  /// Meta's address space as the allocator's upstream. An expandable segment maps nothing
  /// behind its pages, as nothing is stored; its range, taken from the address space once,
  /// goes to the next replay when this one closes with no block outliving it, so that a
  /// search tracing a hundred thousand steps does not use up the space a petabyte at a time.
  CachingAllocator::Upstream upstream(bool expandable) {
    CachingAllocator::Upstream u{[](std::size_t bytes) { return AddressSpace::allocate(bytes); },
                                 [](void*, std::size_t) {}, {}, "meta", std::nullopt};
    if (expandable)
      u.expandable = CachingAllocator::Upstream::Expandable{
          kExpandableRange, CachingAllocator::kLargeRound, [](std::size_t) { return take_range(); },
          [](void*, std::size_t) { return true; }, [](void*, std::size_t) {},
          [this](void* base, std::size_t) {
            if (recycle_range_) give_back_range(base);
          }};
    return u;
  }

  /// Expandable ranges free for another replay.
  struct FreeRanges {
    std::mutex mutex;
    std::vector<void*> ranges;
  };
  static FreeRanges& free_ranges() {
    static auto* r = new FreeRanges;  // immortal, as the address space is
    return *r;
  }
  static void* take_range() {
    FreeRanges& f = free_ranges();
    {
      std::lock_guard lock(f.mutex);
      if (!f.ranges.empty()) {
        void* p = f.ranges.back();
        f.ranges.pop_back();
        return p;
      }
    }
    return AddressSpace::allocate(kExpandableRange);
  }
  static void give_back_range(void* base) {
    FreeRanges& f = free_ranges();
    std::lock_guard lock(f.mutex);
    f.ranges.push_back(base);
  }

  bool recycle_range_ = false;  // read while allocator_ is destroyed: declared before it
  CachingAllocator allocator_;
  std::vector<Block>* log_ = nullptr;
  AllocatorReplay* previous_;
};

/// The capacity Meta reports while one is open on this thread: the device the dry run
/// stands for. Per thread, as the dry run's other state is: a search traces layouts on
/// several threads at once, and one dry run's end must not change another's device.
class DeviceMemory {
 public:
  explicit DeviceMemory(std::size_t bytes) : previous_(std::exchange(current(), bytes)) {}
  ~DeviceMemory() { current() = previous_; }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  static std::size_t& current() {
    static thread_local std::size_t bytes = 0;
    return bytes;
  }

 private:
  std::size_t previous_;
};
}  // namespace meta

namespace meta {
struct HostSide;
}

struct Meta {
  static constexpr Device device = Device::meta;
  /// Its host backend (backend/host.hpp): host memory as Meta's own, nothing stored.
  using Host = meta::HostSide;

  template <class T>
  static Tensor<T> empty(Shape shape) {
    const auto n = static_cast<std::size_t>(shape.numel());
    if (meta::AllocatorReplay* r = meta::AllocatorReplay::current(); r != nullptr && n > 0)
      return Tensor<T>(shape, Buffer<T>(static_cast<T*>(r->allocate(n * sizeof(T))), n, Device::meta,
                                        &meta::AllocatorReplay::release));
    T* p = n == 0 ? nullptr : static_cast<T*>(meta::AddressSpace::allocate(n * sizeof(T)));
    return Tensor<T>(shape, Buffer<T>(p, n, Device::meta, &meta::AddressSpace::release));
  }
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    return empty<T>(shape);
  }

  template <class F>
  static void for_each(std::int64_t, const F&) {}

  static void synchronize() {}

  /// The capacity of the device the dry run stands for (meta::DeviceMemory), or 0.
  static std::size_t device_memory_bytes() { return meta::DeviceMemory::current(); }

  /// The host gets zero bytes, the placeholder for any value read back, except a small
  /// value the host uploaded to the same address (meta::HostValues).
  template <class T>
  static void copy_to_host(const T* src, T* dst, std::int64_t n) {
    if (n > 0) meta::HostValues::get(src, dst, static_cast<std::size_t>(n) * sizeof(T));
  }
  template <class T>
  static void copy_from_host(const T* src, T* dst, std::int64_t n) {
    if (n > 0) meta::HostValues::put(dst, src, static_cast<std::size_t>(n) * sizeof(T));
  }
  /// Copies between Meta's memory and its host backend's (backend/host.hpp), whose
  /// tensors have no storage either: a small value uploaded to the source goes with it.
  template <class T>
  static void copy_from_pinned(const T* src, T* dst, std::int64_t n) {
    copy_stored(src, dst, n);
  }
  template <class T>
  static void copy_to_pinned(const T* src, T* dst, std::int64_t n) {
    copy_stored(src, dst, n);
  }

  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T>, TensorView<const T> a, TensorView<const T> b, accum_t<T>,
                   TensorView<C> c) {
    check_gemm(ta, tb, a, b, c);
  }
  template <class T, class C>
  static void gemm(Trans ta, Trans tb, accum_t<T>, TensorView<const T> a, TensorView<const T> b, accum_t<T>,
                   TensorView<const C> c, TensorView<C> d) {
    check_gemm_out_of_place(ta, tb, a, b, c, d);
  }

  /// A float8 GEMM, as the GPU the dry run stands for runs it (cuBLASLt's float8 matmul):
  /// checked, recorded by Traced<Meta> as a float8 GEMM.
  template <class C>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float, TensorView<C> c, bool) {
    check_float8_gemm(a, b, c);
  }
  /// The same, C read apart from D (cuBLASLt's out-of-place matmul).
  template <class C>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float, TensorView<const C> c,
                          TensorView<C> d, bool) {
    check_float8_gemm(a, b, d);
    check_float8_gemm_input(c, d);
  }

  template <class T>
  static void attention_forward(const AttentionShape&, TensorView<const T>, TensorView<const T>, TensorView<const T>,
                                TensorView<T>, accum_t<T>*) {}
  template <class T>
  static void attention_backward(const AttentionShape&, TensorView<const T>, TensorView<const T>, TensorView<const T>,
                                 TensorView<const T>, const accum_t<T>*, TensorView<const T>, TensorView<T>,
                                 TensorView<T>, TensorView<T>) {}

  /// How in-process engines move Meta buffers: they do not; scratch is Meta's.
  static comm::MemoryAccess memory_access() {
    comm::MemoryAccess m;
    m.copy = [](void*, const void*, std::size_t) {};
    m.reduce = [](void*, const void*, std::size_t, comm::DataType, comm::ReduceOp) {};
    m.allocate = [](std::size_t bytes) { return meta::AddressSpace::allocate(bytes); };
    m.release = [](void* p) { meta::AddressSpace::release(p); };
    return m;
  }

 private:
  template <class T>
  static void copy_stored(const T* src, T* dst, std::int64_t n) {
    if (n > 0) meta::HostValues::copy(src, dst, static_cast<std::size_t>(n) * sizeof(T));
  }
};

namespace meta {
/// The dry run's host backend (backend/host.hpp): the host memory beside the device the
/// dry run stands for, which a dry run does not store either. Its tensors are Meta
/// addresses counted as Device::host, so the device's peak leaves them out; its loops
/// run nothing, and Traced<meta::HostSide> records them as host work (priced at the host's
/// memory rate). Its `device` stays Meta's: its values are read only through copies.
struct HostSide : Meta {
  static constexpr bool runs_on_host = true;
  using Host = meta::HostSide;

  template <class T>
  static Tensor<T> empty(Shape shape) {
    const auto n = static_cast<std::size_t>(shape.numel());
    T* p = n == 0 ? nullptr : static_cast<T*>(AddressSpace::allocate(n * sizeof(T)));
    return Tensor<T>(shape, Buffer<T>(p, n, Device::host, &AddressSpace::release));
  }
  template <class T>
  static Tensor<T> zeros(Shape shape) {
    return empty<T>(shape);
  }
};
}  // namespace meta

static_assert(Backend<Meta>, "tessera: Meta must satisfy the Backend concept");

static_assert(HasFloat8Gemm<Meta>, "tessera: Meta must take float8 GEMMs, as the GPUs it stands for do");

static_assert(Backend<meta::HostSide>, "tessera: meta::HostSide must satisfy the Backend concept");

/// The dry-run backend: Meta, every call recorded.
using DryRun = Traced<Meta>;
static_assert(Backend<DryRun>, "tessera: Traced<Meta> must satisfy the Backend concept");
static_assert(HasFloat8Gemm<DryRun>, "tessera: Traced<Meta> must record float8 GEMMs");

}  // namespace tessera
