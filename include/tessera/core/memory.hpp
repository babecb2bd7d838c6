// Memory accounting per device: bytes held now and the peak since the last reset.
//
// Every Buffer allocation reports here, so the trainer's peak_memory_bytes and the
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

/// The process-wide counters for one device kind.
inline MemoryStats& memory_stats(Device d) {
  static MemoryStats stats[2];
  return stats[static_cast<int>(d)];
}

}  // namespace tessera
