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
    if (p == nullptr) fail_out_of_memory("out of host memory allocating ", bytes, " bytes");
    if (const int byte = fill_byte_.load(std::memory_order_relaxed); byte >= 0) std::memset(p, byte, rounded);
    // A capture's blocks stay the graph's while it lives (cpu/graph.hpp).
    std::shared_ptr<GraphMemory> graph = capturing() != nullptr ? capturing()->memory : nullptr;
    std::lock_guard lock(mutex_);
    live_[reinterpret_cast<std::uintptr_t>(p)] = Entry{rounded, device_of_this_thread(), std::move(graph)};
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

  /// Every allocation from now on filled with `byte` (0xFF: every float and double a
  /// NaN), or left as the allocator gives it (-1, the default). For tests: code that
  /// reads an empty() tensor before writing it then reads NaN, whatever the allocator
  /// reused. Process-wide; FillNewAllocations sets and restores it.
  void fill_new_allocations(int byte) { fill_byte_.store(byte, std::memory_order_relaxed); }
  int fill_byte() const { return fill_byte_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    std::size_t bytes;
    const void* device;
    std::shared_ptr<GraphMemory> graph;  // the capture that allocated it, if one did
  };
  /// The device a thread's allocations belong to: its rank's memory counters (thread
  /// ranks, ScopedMemoryStats), or the process (nullptr).
  static const void* device_of_this_thread() { return tessera::detail::thread_memory_stats; }

  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Entry> live_;
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
