// CachingAllocator: device memory taken from an upstream in segments and handed out
// again as blocks, so that once the first training step has reserved what a step needs,
// later steps allocate and free without calling cudaMalloc or cudaFree (both of which
// synchronise the device).
//
// It is host C++ with no CUDA headers. The CUDA backend gives it cudaMalloc and cudaFree
// as its Upstream (allocate returns nullptr when the device is out of memory and throws
// on any other error); the tests give it host memory with a budget, so its logic is
// tested without a GPU.
//
// Blocks. A request is rounded up to a multiple of 512 bytes. Requests of at most 1 MiB
// are carved from 2 MiB segments (the small pool); a larger one gets a segment of its
// size rounded up to 2 MiB (the large pool). Neither pool serves the other's requests,
// so small short-lived tensors do not fragment the segments of large ones. A request
// takes the smallest free block of its pool that fits (the lowest address among equals)
// and splits it when the rest is worth keeping: any 512 bytes in the small pool, more
// than 1 MiB in the large one; otherwise the whole block is handed out, and counted as
// allocated. A released block merges with the free blocks beside it in its segment.
//
// Expandable segments. An upstream may also give an address range and map memory into it
// page by page (Upstream::Expandable; the CUDA backend's uses CUDA's virtual memory
// management, as PyTorch's expandable_segments does). The large pool is then one segment
// over that range, backed by memory from its base up to its end: a request no free block
// fits takes the free block at the end, if there is one, and the pages it lacks are mapped
// after it. Where a new segment would hold a request beside the free blocks of the old
// ones, too small for it each, the segment grows only by what the request adds: a step
// that frees a 600 MiB buffer at the pool's end and then asks for 1.2 GiB grows by
// 600 MiB, not 1.2 GiB. empty_cache (and so running out of memory) unmaps every whole
// page no block in use covers, at the end and inside the segment alike; a block handed
// out over such holes has them mapped again first. Fragmentation then costs memory only
// until the device is full. llama-plan's replay of a step
// (meta::AllocatorReplay) measured the reservation over the live peak fall from 21% to
// 8% (Llama 2 13B under FSDP, selective checkpointing) and from 4.1% to 2.2% (405B at
// tp 4 x FSDP 32): docs/architecture.md.
//
// Alignment. Every block starts at its segment's base plus a multiple of 512 bytes, and
// upstream segments must be 256-byte aligned (cudaMalloc's are; checked here), so every
// block is 256-byte aligned: enough for the widest vector loads of the GEMM and
// elementwise kernels.
//
// Out of memory. When the upstream has no memory left, every segment with no block in
// use goes back to it (empty_cache) and the request is tried once more. If that fails
// too, allocate throws a tessera::Error naming the tensor or op it was for, the bytes it
// asked for, the bytes this allocator has handed out and holds, and the bytes the device
// has free when the upstream can tell.
//
// Release. release(p) needs only the pointer. release_to_owner(p) finds the allocator
// that owns p among all live ones: it is the plain-function deleter (void(*)(void*)) a
// tessera::Buffer adopting a block takes, whichever device the block is on. Releasing a
// pointer no allocator handed out, a pointer into the middle of a block, or a block twice
// is an error naming the pointer. The Buffer counts its bytes in memory_stats(
// Device::cuda); the allocator keeps only its own Stats, so nothing is counted twice.
//
// Streams. Blocks are reused in host order, with no events: a block the host releases
// while a kernel still reads it is handed only to work enqueued after that kernel. This
// is safe because every kernel runs on one compute stream, in order. Work on another
// stream is not ordered that way: the NCCL engine makes its comm stream wait for the
// compute stream when a collective starts, but the collective reads and writes its
// buffers until the compute stream waits for it in the handle's wait(). So the caller
// keeps a collective's tensors alive until its wait(); after that, later kernels on the
// compute stream come after the collective and may reuse its blocks.
//
// History. record_history() attaches a MemoryHistory (core/memory_history.hpp) that is
// told of every block handed out and taken back, every segment taken and given back
// (pages mapped and unmapped, for the expandable one) and every request that could not be
// served; state() is the segments and their blocks now. The two make a memory snapshot
// (io/memory_snapshot.hpp). Without a history an allocation costs one more branch.
//
// Threads. One mutex guards each allocator, upstream calls included: several virtual
// ranks (threads) share one device and its allocator.
//
// Destruction returns every segment upstream, blocks still in use included; errors from
// the upstream there are swallowed. Releasing a block after its allocator is gone is an
// error, so an allocator whose blocks may outlive it (tensors in static storage, freed
// during the process's exit) is never destroyed, as the CUDA backend's are not.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/memory_history.hpp"
#include "tessera/core/units.hpp"

namespace tessera {

class CachingAllocator;

namespace detail {

/// Every live CachingAllocator, so that a block can be released from its pointer alone.
struct AllocatorRegistry {
  std::mutex mutex;
  std::vector<CachingAllocator*> live;
};

/// Never destroyed: a Buffer in static storage may release its block during the
/// process's exit, after a function-local registry would have gone.
inline AllocatorRegistry& allocator_registry() {
  static auto* registry = new AllocatorRegistry;
  return *registry;
}

}  // namespace detail

class CachingAllocator {
 public:
  /// Where segments come from and go back to.
  struct Upstream {
    /// `bytes` of device memory, 256-byte aligned; nullptr when the device has no more.
    std::function<void*(std::size_t bytes)> allocate;
    /// Gives back a segment `allocate` returned, with its size.
    std::function<void(void* p, std::size_t bytes)> release;
    /// Bytes free on the device, for out-of-memory messages; may be left empty.
    std::function<std::size_t()> device_free_bytes;
    /// The device in messages ("cuda:1"); may be left empty.
    std::string device;

    /// Expandable segments: the large pool as one segment that grows at its end.
    struct Expandable {
      /// The address range reserved for the segment: the most it can grow to.
      std::size_t range_bytes = 0;
      /// map and unmap take multiples of this at multiples of it from the range's base.
      std::size_t page_bytes = std::size_t{2} << 20;
      /// An address range of `bytes`, 256-byte aligned, with no memory behind it; nullptr
      /// when there is none.
      std::function<void*(std::size_t bytes)> reserve;
      /// Memory behind [at, at + bytes) of the range; false when the device has no more.
      std::function<bool(void* at, std::size_t bytes)> map;
      /// Gives back the memory behind [at, at + bytes), mapped before.
      std::function<void(void* at, std::size_t bytes)> unmap;
      /// Gives back the range itself (nothing mapped in it any more).
      std::function<void(void* base, std::size_t bytes)> free_range;
    };
    /// Set: the large pool grows one segment (Expandable); unset: a segment per request.
    std::optional<Expandable> expandable;
  };

  /// Byte counts are sizes of blocks (requests rounded up), unless said otherwise.
  struct Stats {
    std::size_t allocated_bytes = 0;       // blocks in use
    std::size_t requested_bytes = 0;       // bytes asked for by the blocks in use
    std::size_t reserved_bytes = 0;        // segments held from the upstream
    std::size_t peak_allocated = 0;        // most allocated_bytes since the last reset_peak()
    std::size_t peak_reserved = 0;         // most reserved_bytes since the last reset_peak()
    std::size_t allocations = 0;           // allocate calls served, ever
    std::size_t upstream_allocations = 0;  // segments taken from the upstream (or growths mapped), ever
    std::size_t upstream_releases = 0;     // segments given back to the upstream (or ends unmapped), ever
    std::size_t cache_hits = 0;            // allocations served by a free block, no new segment
  };

  static constexpr std::size_t kBlockRound = 512;             // block sizes and offsets
  static constexpr std::size_t kSegmentAlign = 256;           // required of upstream segments
  static constexpr std::size_t kSmallLimit = std::size_t{1} << 20;    // largest small request
  static constexpr std::size_t kSmallSegment = std::size_t{2} << 20;  // small-pool segment
  static constexpr std::size_t kLargeRound = std::size_t{2} << 20;    // large-pool segment sizes

  explicit CachingAllocator(Upstream upstream) : upstream_(std::move(upstream)) {
    TESSERA_CHECK(upstream_.allocate && upstream_.release,
                  "CachingAllocator", device_suffix(), ": the upstream needs both allocate and release");
    if (const auto& x = upstream_.expandable) {
      TESSERA_CHECK(x->reserve && x->map && x->unmap && x->free_range, "CachingAllocator", device_suffix(),
                    ": an expandable upstream needs reserve, map, unmap and free_range");
      TESSERA_CHECK(x->page_bytes > 0 && x->page_bytes % kBlockRound == 0 && x->range_bytes >= x->page_bytes,
                    "CachingAllocator", device_suffix(), ": expandable pages of ", x->page_bytes,
                    " bytes (a multiple of ", kBlockRound, " is needed) in a range of ", x->range_bytes, " bytes");
    }
    auto& registry = detail::allocator_registry();
    std::lock_guard lock(registry.mutex);
    registry.live.push_back(this);
  }

  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  ~CachingAllocator() {
    {
      auto& registry = detail::allocator_registry();
      std::lock_guard lock(registry.mutex);
      std::erase(registry.live, this);
    }
    for (auto& [base, segment] : segments_) {
      for (Block* b = segment.first; b != nullptr;) {
        Block* next = b->next;
        delete b;
        b = next;
      }
      try {
        if (base == grow_base_) unmap_pages(0, grow_end_, /*keep_holes=*/false);
        else upstream_.release(base, segment.size);
      } catch (...) {  // nothing sensible to do with a failure while tearing down
      }
    }
    if (grow_base_ != nullptr) {
      try {
        upstream_.expandable->free_range(grow_base_, upstream_.expandable->range_bytes);
      } catch (...) {
      }
    }
  }

  /// A block of at least `bytes` bytes, 256-byte aligned; nullptr for 0 bytes. `what`
  /// (the tensor or op) names the request in the out-of-memory error.
  void* allocate(std::size_t bytes, std::string_view what = {}) {
    if (bytes == 0) return nullptr;
    std::lock_guard lock(mutex_);
    if (bytes > kMaxRequest)
      fail("cannot allocate ", bytes, " bytes", for_what(what), device_suffix(),
           ": larger than any device memory");
    const std::size_t size = round_up(bytes, kBlockRound);
    const bool small = size <= kSmallLimit;
    FreeSet& pool = small ? small_free_ : large_free_;
    Block* b = nullptr;
    for (int attempt = 0;; ++attempt) {
      bool hit = false;
      if (auto it = pool.lower_bound(std::pair{size, static_cast<char*>(nullptr)}); it != pool.end()) {
        b = *it;
        pool.erase(it);
        hit = true;
      } else if (!small && upstream_.expandable) {
        b = grow(size, bytes, what);
      } else {
        b = new_segment(small ? kSmallSegment : round_up(size, kLargeRound), small, bytes, what);
      }
      // A block of the expandable segment may hold pages unmapped by empty_cache: those
      // under the part handed out are mapped again first.
      const std::size_t used = splits(b->size - size, small) ? size : b->size;
      if (b->segment != grow_base_ || map_holes(b->ptr, b->ptr + used)) {
        if (hit) ++stats_.cache_hits;
        break;
      }
      pool.insert(b);
      if (attempt == 1) out_of_memory(bytes, what);
      empty_cache_locked();
    }
    const std::size_t rest = b->size - size;
    if (splits(rest, small)) {
      auto* tail = new Block{b->ptr + size, rest, b->segment, b->small};
      tail->prev = b;
      tail->next = b->next;
      if (b->next != nullptr) b->next->prev = tail;
      b->next = tail;
      if (b == grow_last_) grow_last_ = tail;
      b->size = size;
      pool.insert(tail);
    }
    b->allocated = true;
    b->requested = bytes;
    live_.emplace(b->ptr, b);
    stats_.allocated_bytes += b->size;
    stats_.requested_bytes += bytes;
    stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated_bytes);
    ++stats_.allocations;
    if (history_) history_->record(AllocatorAction::alloc, b->ptr, b->size, what);
    return b->ptr;
  }

  /// Gives back a block this allocator handed out; nullptr does nothing.
  void release(void* p) {
    if (p == nullptr) return;
    std::lock_guard lock(mutex_);
    if (!release_locked(p))
      fail("release of device pointer ", static_cast<const void*>(p), device_suffix(),
           ": not allocated by this caching allocator");
  }

  /// Releases `p` to whichever live allocator handed it out: a deleter for Buffers that
  /// adopt blocks. nullptr does nothing.
  static void release_to_owner(void* p) {
    if (p == nullptr) return;
    auto& registry = detail::allocator_registry();
    std::lock_guard lock(registry.mutex);
    for (CachingAllocator* a : registry.live) {
      std::lock_guard own(a->mutex_);
      if (a->release_locked(p)) return;
    }
    fail("release of device pointer ", static_cast<const void*>(p),
         ": not allocated by any caching allocator");
  }

  /// Releases `p` when it lies in one of this allocator's segments; false when it does
  /// not (another allocator's). Inside a segment, a pointer that is not a block in use
  /// is an error, as for release().
  bool try_release(void* p) {
    if (p == nullptr) return false;
    std::lock_guard lock(mutex_);
    return release_locked(p);
  }

  /// Whether `p` is the start of a block in use from this allocator.
  bool owns(const void* p) const {
    std::lock_guard lock(mutex_);
    return live_.contains(static_cast<const char*>(p));
  }

  /// Gives every segment with no block in use back to the upstream.
  void empty_cache() {
    std::lock_guard lock(mutex_);
    empty_cache_locked();
  }

  Stats stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  /// Records what this allocator does from now on in a history of the last `max_entries`
  /// events (core/memory_history.hpp); a history already recording is kept as it is.
  void record_history(std::size_t max_entries = MemoryHistory::kDefaultEntries) {
    std::lock_guard lock(mutex_);
    if (!history_) history_ = std::make_unique<MemoryHistory>(max_entries);
  }
  /// The history record_history() attached, or nullptr; it lives as long as the allocator.
  const MemoryHistory* history() const {
    std::lock_guard lock(mutex_);
    return history_.get();
  }

  /// The segments held now, in address order, each with the blocks that cover it. The
  /// expandable segment is given as its runs of mapped pages: the free blocks over the
  /// pages empty_cache unmapped are left out (they hold no memory).
  AllocatorState state() const {
    std::lock_guard lock(mutex_);
    AllocatorState out;
    auto blocks_in = [](const Block* first, const char* from, const char* to) {
      std::vector<BlockState> v;
      for (const Block* b = first; b != nullptr; b = b->next) {
        const char* lo = std::max<const char*>(b->ptr, from);
        const char* hi = std::min<const char*>(b->ptr + b->size, to);
        if (lo < hi)
          v.push_back({reinterpret_cast<std::uintptr_t>(lo), static_cast<std::size_t>(hi - lo),
                       b->allocated ? b->requested : 0, b->allocated});
      }
      return v;
    };
    for (const auto& entry : segments_) {
      char* const base = entry.first;  // named, not bound: lambdas capture them (Clang with OpenMP cannot bind)
      const Segment& segment = entry.second;
      if (base != grow_base_) {
        out.push_back({reinterpret_cast<std::uintptr_t>(base), segment.size, segment.first->small, false,
                       blocks_in(segment.first, base, base + segment.size)});
        continue;
      }
      const std::size_t page = upstream_.expandable->page_bytes;
      std::size_t start = 0;
      auto run = [&](std::size_t from, std::size_t to) {
        if (from < to)
          out.push_back({reinterpret_cast<std::uintptr_t>(base + from), to - from, false, true,
                         blocks_in(segment.first, base + from, base + to)});
      };
      for (std::size_t hole : holes_) {
        run(start, hole);
        start = hole + page;
      }
      run(start, grow_end_);
    }
    return out;
  }

  /// Starts new peak windows at the bytes allocated and reserved now.
  void reset_peak() {
    std::lock_guard lock(mutex_);
    stats_.peak_allocated = stats_.allocated_bytes;
    stats_.peak_reserved = stats_.reserved_bytes;
  }

 private:
  // Larger requests would overflow the rounding; no device holds that much anyway.
  static constexpr std::size_t kMaxRequest = std::numeric_limits<std::size_t>::max() / 2;

  /// A run of bytes in a segment, in use or free. The blocks of a segment form a list in
  /// address order that covers it exactly.
  struct Block {
    char* ptr;
    std::size_t size;
    char* segment;  // its segment's base
    bool small;     // which pool
    bool allocated = false;
    std::size_t requested = 0;  // bytes asked for, while allocated
    Block* prev = nullptr;
    Block* next = nullptr;
  };

  struct Segment {
    std::size_t size;
    Block* first;
  };

  /// Free blocks by (size, address): lower_bound is the best fit.
  struct BySizeThenAddress {
    using is_transparent = void;
    static std::pair<std::size_t, const char*> key(const Block* b) { return {b->size, b->ptr}; }
    static std::pair<std::size_t, const char*> key(std::pair<std::size_t, char*> k) { return k; }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      return key(a) < key(b);
    }
  };
  using FreeSet = std::set<Block*, BySizeThenAddress>;

  static std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

  /// Whether a block with `rest` bytes beyond a request is split: any 512 bytes in the
  /// small pool, more than 1 MiB in the large one.
  static bool splits(std::size_t rest, bool small) { return small ? rest >= kBlockRound : rest > kSmallLimit; }

  static std::string for_what(std::string_view what) {
    return what.empty() ? std::string() : " for " + std::string(what);
  }

  std::string device_suffix() const { return upstream_.device.empty() ? std::string() : " on " + upstream_.device; }

  /// A new segment of `size` bytes as one free block (not in any free set).
  Block* new_segment(std::size_t size, bool small, std::size_t bytes, std::string_view what) {
    void* p = upstream_.allocate(size);
    if (p == nullptr) {
      empty_cache_locked();
      p = upstream_.allocate(size);
    }
    if (p == nullptr) out_of_memory(bytes, what);
    if (reinterpret_cast<std::uintptr_t>(p) % kSegmentAlign != 0) {
      upstream_.release(p, size);
      fail("the upstream of the caching allocator", device_suffix(), " returned a segment at ",
           static_cast<const void*>(p), " that is not ", kSegmentAlign, "-byte aligned");
    }
    auto* base = static_cast<char*>(p);
    if (history_) history_->record(AllocatorAction::segment_alloc, base, size);
    auto* b = new Block{base, size, base, small};
    segments_.emplace(base, Segment{size, b});
    stats_.reserved_bytes += size;
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved_bytes);
    ++stats_.upstream_allocations;
    return b;
  }

  [[noreturn]] void out_of_memory(std::size_t bytes, std::string_view what) const {
    std::string free_text;
    std::size_t free_bytes = 0;
    if (upstream_.device_free_bytes) {
      try {
        free_bytes = upstream_.device_free_bytes();
        free_text = ", " + binary_bytes(static_cast<double>(free_bytes)) + " free on the device";
      } catch (const std::exception&) {  // the figure is a courtesy: the error is out of memory
      }
    }
    if (history_) history_->record(AllocatorAction::oom, nullptr, bytes, what, free_bytes);
    fail_out_of_memory("out of device memory", device_suffix(), " allocating ", bytes, " bytes (",
         binary_bytes(static_cast<double>(bytes)), ")", for_what(what), ": ",
         binary_bytes(static_cast<double>(stats_.allocated_bytes)), " allocated by tessera, ",
         binary_bytes(static_cast<double>(stats_.reserved_bytes)), " reserved", free_text);
  }

  /// Releases `p` when it lies in one of this allocator's segments (false when it does
  /// not); throws when it lies there but is not the start of a block in use.
  bool release_locked(void* p) {
    auto* c = static_cast<char*>(p);
    auto it = live_.find(c);
    if (it == live_.end()) {
      diagnose_release(c);
      return false;
    }
    Block* b = it->second;
    live_.erase(it);
    if (history_) history_->record(AllocatorAction::free_completed, b->ptr, b->size);
    stats_.allocated_bytes -= b->size;
    stats_.requested_bytes -= b->requested;
    b->allocated = false;
    b->requested = 0;
    FreeSet& pool = b->small ? small_free_ : large_free_;
    if (Block* prev = b->prev; prev != nullptr && !prev->allocated) {
      pool.erase(prev);
      prev->size += b->size;
      if (b == grow_last_) grow_last_ = prev;
      unlink(b);
      b = prev;
    }
    if (Block* next = b->next; next != nullptr && !next->allocated) {
      pool.erase(next);
      b->size += next->size;
      if (next == grow_last_) grow_last_ = b;
      unlink(next);
    }
    pool.insert(b);
    return true;
  }

  /// Removes `b` (merged into its predecessor) from its segment's list and deletes it.
  static void unlink(Block* b) {
    b->prev->next = b->next;
    if (b->next != nullptr) b->next->prev = b->prev;
    delete b;
  }

  /// Throws when `p`, not a block in use, lies in one of this allocator's segments.
  void diagnose_release(const char* p) const {
    auto it = segments_.upper_bound(const_cast<char*>(p));
    if (it == segments_.begin()) return;
    --it;
    if (p >= it->first + it->second.size) return;
    const Block* b = it->second.first;
    while (p >= b->ptr + b->size) b = b->next;
    if (!b->allocated)
      fail("release of device pointer ", static_cast<const void*>(p), device_suffix(),
           ": already released (it lies in a free block of the caching allocator)");
    fail("release of device pointer ", static_cast<const void*>(p), device_suffix(),
         ": not the start of a block (it lies ", p - b->ptr, " bytes into a block of ", b->size, " bytes at ",
         static_cast<const void*>(b->ptr), ")");
  }

  void empty_cache_locked() {
    shrink_locked();
    if (grow_base_ != nullptr)
      for (Block* b : large_free_)
        if (b->segment == grow_base_) {
          const Upstream::Expandable& x = *upstream_.expandable;
          const auto from = static_cast<std::size_t>(b->ptr - grow_base_);
          // Whole pages inside the free block only: a page it shares with a block in use stays.
          const std::size_t first = round_up(from, x.page_bytes);
          const std::size_t last = (from + b->size) / x.page_bytes * x.page_bytes;
          if (first < last) unmap_pages(first, last);
        }
    for (FreeSet* pool : {&small_free_, &large_free_}) {
      for (auto it = pool->begin(); it != pool->end();) {
        Block* b = *it;
        if (b->prev != nullptr || b->next != nullptr || b->segment == grow_base_) {
          ++it;
          continue;
        }
        it = pool->erase(it);
        segments_.erase(b->ptr);
        stats_.reserved_bytes -= b->size;
        ++stats_.upstream_releases;
        void* base = b->ptr;
        const std::size_t size = b->size;
        delete b;
        if (history_) history_->record(AllocatorAction::segment_free, base, size);
        upstream_.release(base, size);
      }
    }
  }

  /// The expandable segment's free block at its end, and the pages it lacks for `size`
  /// bytes mapped after it (nothing free at the end: a new block of those pages).
  /// Reserves the range on first use. Out of memory: the cache emptied, then one retry.
  Block* grow(std::size_t size, std::size_t bytes, std::string_view what) {
    const Upstream::Expandable& x = *upstream_.expandable;
    if (grow_base_ == nullptr) {
      void* base = x.reserve(x.range_bytes);
      if (base == nullptr)
        fail("the upstream of the caching allocator", device_suffix(), " could not reserve an address range of ",
             x.range_bytes, " bytes (", binary_bytes(static_cast<double>(x.range_bytes)),
             ") for the expandable segment");
      if (reinterpret_cast<std::uintptr_t>(base) % kSegmentAlign != 0) {
        x.free_range(base, x.range_bytes);
        fail("the upstream of the caching allocator", device_suffix(), " reserved a range at ",
             static_cast<const void*>(base), " that is not ", kSegmentAlign, "-byte aligned");
      }
      grow_base_ = static_cast<char*>(base);
    }
    for (int attempt = 0;; ++attempt) {
      Block* last = grow_last_ != nullptr && !grow_last_->allocated ? grow_last_ : nullptr;
      const std::size_t need = round_up(size - (last != nullptr ? last->size : 0), x.page_bytes);
      if (need <= x.range_bytes - grow_end_ && x.map(grow_base_ + grow_end_, need)) {
        if (history_) history_->record(AllocatorAction::segment_map, grow_base_ + grow_end_, need);
        Block* b = last;
        if (b != nullptr) {
          large_free_.erase(b);
          b->size += need;
        } else {
          b = new Block{grow_base_ + grow_end_, need, grow_base_, false};
          b->prev = grow_last_;
          if (grow_last_ != nullptr) grow_last_->next = b;
          else segments_.emplace(grow_base_, Segment{0, b});
          grow_last_ = b;
        }
        grow_end_ += need;
        segments_.at(grow_base_).size = grow_end_;
        stats_.reserved_bytes += need;
        stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved_bytes);
        ++stats_.upstream_allocations;
        return b;
      }
      if (attempt == 1) out_of_memory(bytes, what);
      empty_cache_locked();
    }
  }

  /// Unmaps the mapped pages of [from, to) of the expandable segment (offsets from its
  /// base, multiples of the page), a run of them a call; they become holes, unless
  /// `keep_holes` is false (the whole segment going: a set entry a page would cost the
  /// dry runs of a search more than the rest of their replay).
  void unmap_pages(std::size_t from, std::size_t to, bool keep_holes = true) {
    const Upstream::Expandable& x = *upstream_.expandable;
    std::size_t at = from;
    while (at < to) {
      auto hole = holes_.lower_bound(at);
      const std::size_t end = hole == holes_.end() ? to : std::min(to, *hole);
      if (at < end) {
        x.unmap(grow_base_ + at, end - at);
        if (history_) history_->record(AllocatorAction::segment_unmap, grow_base_ + at, end - at);
        if (keep_holes)
          for (std::size_t page = at; page < end; page += x.page_bytes) holes_.insert(hole, page);
        stats_.reserved_bytes -= end - at;
        ++stats_.upstream_releases;
      }
      at = end;
      while (at < to && holes_.contains(at)) at += x.page_bytes;
    }
  }

  /// Maps the pages of the expandable segment under [from, to) that are holes, a run of
  /// them a call; false, with none of them mapped, when the device has no memory for them.
  bool map_holes(const char* from, const char* to) {
    if (holes_.empty()) return true;
    const Upstream::Expandable& x = *upstream_.expandable;
    const auto lo = static_cast<std::size_t>(from - grow_base_) / x.page_bytes * x.page_bytes;
    const auto hi = static_cast<std::size_t>(to - grow_base_);
    std::vector<std::pair<std::size_t, std::size_t>> runs;  // [start, end) of the holes mapped so far
    for (auto it = holes_.lower_bound(lo); it != holes_.end() && *it < hi;) {
      const std::size_t start = *it;
      std::size_t end = start + x.page_bytes;
      for (++it; it != holes_.end() && *it == end && end < hi; ++it) end += x.page_bytes;
      if (!x.map(grow_base_ + start, end - start)) {
        for (auto [s, e] : runs) x.unmap(grow_base_ + s, e - s);
        return false;
      }
      runs.emplace_back(start, end);
    }
    for (auto [start, end] : runs) {
      if (history_) history_->record(AllocatorAction::segment_map, grow_base_ + start, end - start);
      holes_.erase(holes_.lower_bound(start), holes_.lower_bound(end));
      stats_.reserved_bytes += end - start;
      ++stats_.upstream_allocations;
    }
    stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved_bytes);
    return true;
  }

  /// Unmaps the whole pages of the expandable segment's free block at its end.
  void shrink_locked() {
    if (grow_last_ == nullptr || grow_last_->allocated) return;
    const Upstream::Expandable& x = *upstream_.expandable;
    Block* last = grow_last_;
    const auto offset = static_cast<std::size_t>(last->ptr - grow_base_);
    const std::size_t keep = round_up(offset, x.page_bytes);  // the pages the blocks before it still use
    if (keep >= grow_end_) return;
    unmap_pages(keep, grow_end_, /*keep_holes=*/false);  // the segment ends at keep: no holes past it
    holes_.erase(holes_.lower_bound(keep), holes_.end());
    large_free_.erase(last);
    if (keep > offset) {  // the part of a page the block before it shares stays free
      last->size = keep - offset;
      large_free_.insert(last);
    } else {
      grow_last_ = last->prev;
      if (grow_last_ != nullptr) grow_last_->next = nullptr;
      delete last;
    }
    grow_end_ = keep;
    if (grow_end_ == 0) segments_.erase(grow_base_);
    else segments_.at(grow_base_).size = grow_end_;
  }

  Upstream upstream_;
  mutable std::mutex mutex_;
  std::map<char*, Segment> segments_;  // by base address
  std::unordered_map<const char*, Block*> live_;  // blocks in use, by address
  FreeSet small_free_;
  FreeSet large_free_;
  Stats stats_;
  // The expandable segment (Upstream::expandable): its range, the bytes its blocks cover
  // from its base, its last block (nullptr when none), and the pages among those that
  // empty_cache unmapped under free blocks.
  char* grow_base_ = nullptr;
  std::size_t grow_end_ = 0;
  Block* grow_last_ = nullptr;
  std::set<std::size_t> holes_;  // pages (offsets from the base) below grow_end_ not mapped
  std::unique_ptr<MemoryHistory> history_;  // record_history()
};

}  // namespace tessera
