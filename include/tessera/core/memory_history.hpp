// A device allocator's history and state: what a memory snapshot holds
// (profiling.enable_memory_snapshot; io/memory_snapshot.hpp writes it in PyTorch's
// format, which pytorch.org/memory_viz draws).
//
// MemoryHistory is told by an allocator (the CUDA backend's and the dry run's
// CachingAllocator, the CPU backend's DeviceMemory) of everything it does while one is
// attached: each block handed out and taken back, each segment taken from its upstream
// or given back (or pages of an expandable one mapped and unmapped), and each request it
// could not serve. Each event keeps its time and, for a block handed out, its context:
// what the memory holds (the MemoryUse open on the asking thread, core/memory.hpp), the
// request's name where the caller gave one, and the spans open on that thread
// (core/profile.hpp: the step, the micro-batch, the layer and its forward or backward,
// the collective, the pipeline action), which a snapshot shows as the allocation's stack.
// Contexts are interned: a step asks for the same few hundred again and again. The spans
// name the step ("step 812"), so each step brings its own: once the table has grown to
// twice what the kept events and the live blocks refer to, the others are dropped and
// the ids renumbered, so that a long run's table stays the size of its ring. view() is
// the consistent picture a snapshot writes (events, their contexts, the live blocks').
//
// It keeps the last `max_entries` events (a ring, as PyTorch's _record_memory_history
// does; 100,000 as torchtitan records) and, apart from the ring, the context of every
// block still in use, so a snapshot names the blocks that were handed out before the
// ring's oldest event.
//
// AllocatorState is the allocator's picture now: its segments in address order, each
// covered exactly by its blocks, in use or free.
//
// Thread-safe: thread ranks sharing a device share its allocator and its history.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/core/memory.hpp"
#include "tessera/core/profile.hpp"

namespace tessera {

/// What an allocator did (PyTorch's names for them).
enum class AllocatorAction : std::uint8_t {
  alloc,           // a block handed out
  free_completed,  // a block taken back (blocks are reused in stream order: at once)
  segment_alloc,   // a segment taken from the upstream (cudaMalloc)
  segment_free,    // a segment given back (cudaFree)
  segment_map,     // pages mapped into an expandable segment
  segment_unmap,   // pages of an expandable segment unmapped
  oom,             // a request the allocator could not serve, its cache emptied
};

constexpr const char* name_of(AllocatorAction a) {
  switch (a) {
    case AllocatorAction::alloc: return "alloc";
    case AllocatorAction::free_completed: return "free_completed";
    case AllocatorAction::segment_alloc: return "segment_alloc";
    case AllocatorAction::segment_free: return "segment_free";
    case AllocatorAction::segment_map: return "segment_map";
    case AllocatorAction::segment_unmap: return "segment_unmap";
    case AllocatorAction::oom: return "oom";
  }
  return "?";
}

/// Where a block was asked for.
struct AllocationContext {
  struct Span {
    std::string category;  // "step", "layer", "comm", ...
    std::string name;      // "layers.3 backward"
    friend bool operator==(const Span&, const Span&) = default;
  };
  MemoryUse use = MemoryUse::temporary;
  std::string what;         // the request's name, where the caller gave one
  std::vector<Span> spans;  // open on the asking thread, the outermost first
  friend bool operator==(const AllocationContext&, const AllocationContext&) = default;
};

struct AllocatorEvent {
  AllocatorAction action = AllocatorAction::alloc;
  std::uintptr_t address = 0;  // the block's or the segment's (pages') start; 0 for oom
  std::size_t bytes = 0;       // the block's or the segment's (pages') size; the request for oom
  std::size_t device_free = 0;  // oom: what the device had free, where the upstream could tell
  std::int64_t time_us = 0;     // steady clock, as the profile's spans
  std::uint32_t context = 0;    // MemoryHistory::context(); alloc, and oom (the request's)
};

class MemoryHistory {
 public:
  static constexpr std::size_t kDefaultEntries = 100000;

  explicit MemoryHistory(std::size_t max_entries = kDefaultEntries)
      : max_entries_(max_entries == 0 ? 1 : max_entries) {
    contexts_.push_back({});  // 0: no context (segment events)
  }

  /// Records `action` on [address, address + bytes); alloc and oom take their context
  /// from this thread (its MemoryUse and open spans) and `what`.
  void record(AllocatorAction action, const void* address, std::size_t bytes, std::string_view what = {},
              std::size_t device_free = 0) {
    const auto at = reinterpret_cast<std::uintptr_t>(address);
    AllocationContext c;
    const bool asked = action == AllocatorAction::alloc || action == AllocatorAction::oom;
    if (asked) c = context_here(what);
    const std::int64_t now = profile::now_ns() / 1000;
    std::lock_guard lock(mutex_);
    AllocatorEvent e{action, at, bytes, device_free, now, 0};
    if (asked) e.context = intern(std::move(c));
    if (action == AllocatorAction::alloc) live_[at] = e.context;
    if (action == AllocatorAction::free_completed) live_.erase(at);
    if (ring_.size() < max_entries_) {
      ring_.push_back(e);
    } else {
      ring_[next_] = e;
      next_ = (next_ + 1) % max_entries_;
      overflowed_ = true;
    }
  }

  /// Everything a snapshot writes, taken at one moment: the events kept (oldest first),
  /// the contexts their ids and the live blocks' ids name, and the ring's settings.
  struct View {
    std::vector<AllocatorEvent> events;
    std::vector<AllocationContext> contexts;  // by id; 0 is no context
    std::unordered_map<std::uintptr_t, std::uint32_t> live;  // block address -> its alloc's context
    bool overflowed = false;
    std::size_t max_entries = 0;
  };
  View view() const {
    std::lock_guard lock(mutex_);
    return {events_locked(), contexts_, live_, overflowed_, max_entries_};
  }

  /// The events kept, oldest first. Their context ids hold until the table is next
  /// compacted (an allocation may do it): view() takes both at once.
  std::vector<AllocatorEvent> events() const {
    std::lock_guard lock(mutex_);
    return events_locked();
  }
  /// Whether events older than the kept ones were dropped.
  bool overflowed() const {
    std::lock_guard lock(mutex_);
    return overflowed_;
  }
  std::size_t max_entries() const { return max_entries_; }

  /// The context an event's `context` names (0: none).
  AllocationContext context(std::uint32_t id) const {
    std::lock_guard lock(mutex_);
    return id < contexts_.size() ? contexts_[id] : AllocationContext{};
  }
  /// The context of the block in use at `address` (0 when its alloc was not recorded).
  std::uint32_t live_context(std::uintptr_t address) const {
    std::lock_guard lock(mutex_);
    const auto it = live_.find(address);
    return it == live_.end() ? 0 : it->second;
  }

 private:
  static AllocationContext context_here(std::string_view what) {
    AllocationContext c;
    c.use = current_memory_use();
    c.what = std::string(what);
    if (const profile::Recorder* r = profile::recorder())
      for (const profile::Event* e : r->open_spans()) c.spans.push_back({e->category, e->name});
    return c;
  }

  std::vector<AllocatorEvent> events_locked() const {
    std::vector<AllocatorEvent> out(ring_.begin() + static_cast<std::ptrdiff_t>(next_), ring_.end());
    out.insert(out.end(), ring_.begin(), ring_.begin() + static_cast<std::ptrdiff_t>(next_));
    return out;
  }

  static std::string key_of(const AllocationContext& c) {
    std::string key(1, static_cast<char>(c.use));
    key += c.what;
    for (const auto& s : c.spans) {
      key += '\0';
      key += s.category;
      key += '\x01';
      key += s.name;
    }
    return key;
  }

  std::uint32_t intern(AllocationContext c) {
    if (contexts_.size() >= compact_at_) compact();
    const auto [it, added] = ids_.try_emplace(key_of(c), static_cast<std::uint32_t>(contexts_.size()));
    if (added) contexts_.push_back(std::move(c));
    return it->second;
  }

  /// Keeps the contexts the ring's events and the live blocks refer to, renumbered.
  void compact() {
    constexpr std::uint32_t kDropped = ~std::uint32_t{0};
    std::vector<std::uint32_t> remap(contexts_.size(), kDropped);
    std::vector<AllocationContext> kept(1);
    remap[0] = 0;
    auto keep = [&](std::uint32_t& id) {
      if (remap[id] == kDropped) {
        remap[id] = static_cast<std::uint32_t>(kept.size());
        kept.push_back(std::move(contexts_[id]));
      }
      id = remap[id];
    };
    for (AllocatorEvent& e : ring_) keep(e.context);
    for (auto& [address, id] : live_) keep(id);
    contexts_ = std::move(kept);
    ids_.clear();
    for (std::uint32_t i = 1; i < contexts_.size(); ++i) ids_.emplace(key_of(contexts_[i]), i);
    compact_at_ = std::max(kMinCompaction, 2 * contexts_.size());
  }

  static constexpr std::size_t kMinCompaction = 1024;

  mutable std::mutex mutex_;
  std::size_t max_entries_;
  std::vector<AllocatorEvent> ring_;
  std::size_t next_ = 0;  // the oldest event once the ring is full
  bool overflowed_ = false;
  std::vector<AllocationContext> contexts_;
  std::size_t compact_at_ = kMinCompaction;  // the table's size that triggers compact()
  std::unordered_map<std::string, std::uint32_t> ids_;
  std::unordered_map<std::uintptr_t, std::uint32_t> live_;  // block address -> its alloc's context
};

/// A block of a segment, in use or free.
struct BlockState {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  std::size_t requested = 0;  // bytes asked for, while in use
  bool in_use = false;
  friend bool operator==(const BlockState&, const BlockState&) = default;
};

/// Memory an allocator holds from its upstream, and the blocks that cover it.
struct SegmentState {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  bool small = false;       // the small pool's (requests up to 1 MiB)
  bool expandable = false;  // mapped pages of the expandable segment
  std::vector<BlockState> blocks;  // in address order, covering [address, address + bytes)
  friend bool operator==(const SegmentState&, const SegmentState&) = default;
};

/// An allocator's segments, in address order.
using AllocatorState = std::vector<SegmentState>;

}  // namespace tessera
