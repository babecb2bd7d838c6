// Memory accounting per device: bytes held now and the peak since the last reset.
//
// Every Buffer allocation reports here (to the stats current when it was made), so the trainer's peak_memory_bytes and the
// benchmarks' memory figures are measured, not estimated.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace tessera {

enum class Device : std::uint8_t { cpu, cuda };

constexpr const char* name_of(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

class MemoryStats {
 public:
  void on_alloc(std::size_t bytes) {
    auto now = current_.fetch_add(bytes) + bytes;
    auto peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void on_free(std::size_t bytes) { current_.fetch_sub(bytes); }
  std::size_t current() const { return current_.load(); }
  std::size_t peak() const { return peak_.load(); }
  /// Starts a new peak window at the bytes held now.
  void reset_peak() { peak_.store(current_.load()); }

 private:
  std::atomic<std::size_t> current_{0};
  std::atomic<std::size_t> peak_{0};
};

namespace detail {
inline thread_local MemoryStats* thread_memory_stats = nullptr;  // [cpu, cuda], or none
}

/// The counters for one device kind: the process's, or those of the rank this thread
/// runs (thread ranks each count their own; see ScopedMemoryStats).
inline MemoryStats& memory_stats(Device d) {
  static MemoryStats stats[2];
  MemoryStats* own = detail::thread_memory_stats;
  return own ? own[static_cast<int>(d)] : stats[static_cast<int>(d)];
}

/// Makes this thread count its allocations in `stats` ([cpu, cuda]) until the scope
/// ends: how several ranks in one process each measure their own memory.
class ScopedMemoryStats {
 public:
  explicit ScopedMemoryStats(MemoryStats* stats) : previous_(detail::thread_memory_stats) {
    detail::thread_memory_stats = stats;
  }
  ~ScopedMemoryStats() { detail::thread_memory_stats = previous_; }
  ScopedMemoryStats(const ScopedMemoryStats&) = delete;
  ScopedMemoryStats& operator=(const ScopedMemoryStats&) = delete;

 private:
  MemoryStats* previous_;
};

}  // namespace tessera
