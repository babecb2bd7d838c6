// The CPU backend's "device memory": host pages, but known to be the backend's.
//
// On the CPU every tensor is host memory, so nothing tells a tensor the backend made
// (Cpu::empty, Cpu::zeros: what a GPU would hold) from a host variable or a host
// tensor (what a GPU could not hand to NCCL). This registry keeps that apart: the
// backend's allocations are recorded with the device of the rank that made them (a
// thread rank's memory counters identify its thread; one process is one device), so
// the NCCL-rules check (comm/nccl_rules.hpp) can refuse a host buffer, or a buffer of
// another rank's device, the way NCCL would fail on a GPU.
//
// One mutex and one ordered map: an allocation or a release costs a map update, small
// next to the tensors the backend allocates.
//
// A memory snapshot (profiling.enable_memory_snapshot): record_history() attaches a
// MemoryHistory (core/memory_history.hpp) to the calling thread's device, and state() is
// that device's memory now. Each tensor is its own allocation from the host's allocator,
// so each is a segment of one block: a history records a segment_alloc and an alloc for
// it, and a free_completed and a segment_free when it goes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>

#include "tessera/backend/cpu/graph.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/memory_history.hpp"

namespace tessera::cpu {

class DeviceMemory {
 public:
  static DeviceMemory& instance() {
    static DeviceMemory* registry = new DeviceMemory;  // never destroyed: tensors may outlive statics
    return *registry;
  }

  /// `bytes` bytes (64-byte aligned, at least 1), recorded as this thread's device's.
  void* allocate(std::size_t bytes) {
    const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (p == nullptr) {
      {
        std::lock_guard lock(mutex_);
        if (const auto h = histories_.find(device_of_this_thread()); h != histories_.end())
          h->second->record(AllocatorAction::oom, nullptr, bytes);
      }
      fail_out_of_memory("out of host memory allocating ", bytes, " bytes");
    }
    if (const int byte = fill_byte_.load(std::memory_order_relaxed); byte >= 0) std::memset(p, byte, rounded);
    // A capture's blocks stay the graph's while it lives (cpu/graph.hpp).
    std::shared_ptr<GraphMemory> graph = capturing() != nullptr ? capturing()->memory : nullptr;
    std::lock_guard lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(p)] = Entry{rounded, bytes, device_of_this_thread(), std::move(graph)};
    if (!histories_.empty())
      if (const auto h = histories_.find(device_of_this_thread()); h != histories_.end()) {
        h->second->record(AllocatorAction::segment_alloc, p, rounded);
        h->second->record(AllocatorAction::alloc, p, rounded);
      }
    return p;
  }

  static void release(void* p) {
    if (p == nullptr) return;
    std::shared_ptr<GraphMemory> graph;
    {
      DeviceMemory& m = instance();
      std::lock_guard lock(m.mutex_);
      const auto it = m.live_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != m.live_.end()) {
        graph = std::move(it->second.graph);
        if (!m.histories_.empty())
          if (const auto h = m.histories_.find(it->second.device); h != m.histories_.end()) {
            h->second->record(AllocatorAction::free_completed, p, it->second.bytes);
            h->second->record(AllocatorAction::segment_free, p, it->second.bytes);
          }
        m.live_.erase(it);
      }
    }
    if (graph && graph->hold(p)) return;
    std::free(p);
  }

  /// Whether [p, p + bytes) lies in one live allocation, and whose device made it.
  comm::Residence where(const void* p, std::size_t bytes) const {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mutex_);
    auto it = live_.upper_bound(at);
    if (it == live_.begin()) return comm::Residence::host;
    --it;
    if (at + bytes > it->first + it->second.bytes) return comm::Residence::host;
    return it->second.device == device_of_this_thread() ? comm::Residence::this_device
                                                        : comm::Residence::other_device;
  }

  /// Records this thread's device's allocations and releases from now on in a history
  /// of the last `max_entries` events; one already recording is kept as it is.
  void record_history(std::size_t max_entries = MemoryHistory::kDefaultEntries) {
    std::lock_guard lock(mutex_);
    auto& h = histories_[device_of_this_thread()];
    if (!h) h = std::make_unique<MemoryHistory>(max_entries);
  }
  /// This thread's device's history, or nullptr; it lives as long as the process.
  const MemoryHistory* history() const {
    std::lock_guard lock(mutex_);
    const auto it = histories_.find(device_of_this_thread());
    return it == histories_.end() ? nullptr : it->second.get();
  }
  /// Stops recording this thread's device's history and drops it (a pointer history()
  /// returned dangles after this).
  void forget_history() {
    std::lock_guard lock(mutex_);
    histories_.erase(device_of_this_thread());
  }
  /// This thread's device's memory now: each live allocation a segment of one block.
  AllocatorState state() const {
    std::lock_guard lock(mutex_);
    AllocatorState out;
    for (const auto& [at, e] : live_)
      if (e.device == device_of_this_thread())
        out.push_back({at, e.bytes, false, false, {{at, e.bytes, e.requested, true}}});
    return out;
  }

  /// Every allocation from now on filled with `byte` (0xFF: every float and double a
  /// NaN), or left as the allocator gives it (-1, the default). For tests: code that
  /// reads an empty() tensor before writing it then reads NaN, whatever the allocator
  /// reused. Process-wide; FillNewAllocations sets and restores it.
  void fill_new_allocations(int byte) { fill_byte_.store(byte, std::memory_order_relaxed); }
  int fill_byte() const { return fill_byte_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    std::size_t bytes;
    std::size_t requested;
    const void* device;
    std::shared_ptr<GraphMemory> graph;  // the capture that allocated it, if one did
  };
  /// The device a thread's allocations belong to: its rank's memory counters (thread
  /// ranks, ScopedMemoryStats), or the process (nullptr).
  static const void* device_of_this_thread() { return tessera::detail::thread_memory_stats; }

  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Entry> live_;
  std::map<const void*, std::unique_ptr<MemoryHistory>> histories_;  // by device, record_history()
  std::atomic<int> fill_byte_{-1};
};

/// Fills every CPU-backend allocation made in its scope with `byte` (default 0xFF: NaN
/// in every float), then restores the previous setting.
class FillNewAllocations {
 public:
  explicit FillNewAllocations(int byte = 0xFF) : previous_(DeviceMemory::instance().fill_byte()) {
    DeviceMemory::instance().fill_new_allocations(byte);
  }
  ~FillNewAllocations() { DeviceMemory::instance().fill_new_allocations(previous_); }
  FillNewAllocations(const FillNewAllocations&) = delete;
  FillNewAllocations& operator=(const FillNewAllocations&) = delete;

 private:
  int previous_;
};

}  // namespace tessera::cpu
