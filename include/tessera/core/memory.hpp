// Memory accounting per device: bytes held now, the peak since the last reset, and what
// the bytes hold.
//
// Every Buffer allocation reports here (to the stats current when it was made), so the
// trainer's peak_memory_bytes and the benchmarks' memory figures are measured, not
// estimated. Each allocation is filed under a MemoryUse, taken from the MemoryUseScope
// open on its thread when it was made (parameters, their gradients, optimizer state,
// backend workspace; anything else is a temporary), and the stats keep how many bytes of
// each use were live at the peak: the breakdown of the peak. Saved activations are
// temporaries a layer keeps for its backward; the ActivationMeter (layer/layer.hpp)
// reports them here as it sees them saved and dropped, so the breakdown can tell them
// from the rest.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace tessera {

/// Where a tensor's memory lives: the host, a CUDA device, nowhere (the dry run's Meta
/// backend, backend/meta/meta.hpp: shapes without storage), or the host memory a device
/// backend keeps beside its own (`host`: FSDP's CPU offload, backend/host.hpp; pinned on
/// a GPU). The CPU backend's memory is `cpu`, as is a plain host tensor's: counting
/// `host` apart is what shows, on any backend, what offloading takes off the device.
enum class Device : std::uint8_t { cpu, cuda, meta, host };
inline constexpr int kDeviceKinds = 4;

constexpr const char* name_of(Device d) {
  switch (d) {
    case Device::cpu: return "cpu";
    case Device::cuda: return "cuda";
    case Device::meta: return "meta";
    case Device::host: return "host";
  }
  return "?";
}

/// What an allocation holds.
enum class MemoryUse : std::uint8_t {
  temporary,   // activations, saved or not, and every other tensor of a step
  parameters,  // parameter values (whole, tensor-parallel pieces or data-parallel shards)
  gradients,   // parameter gradients and gradient buckets
  optimizer,   // optimizer moments and fp32 master weights
  workspace,   // a backend's own scratch (GEMM and attention workspaces, partial sums)
};
inline constexpr int kMemoryUses = 5;

constexpr const char* name_of(MemoryUse u) {
  switch (u) {
    case MemoryUse::temporary: return "temporary";
    case MemoryUse::parameters: return "parameters";
    case MemoryUse::gradients: return "gradients";
    case MemoryUse::optimizer: return "optimizer";
    case MemoryUse::workspace: return "workspace";
  }
  return "?";
}

/// Bytes by use, and of the temporaries those a layer saved for its backward.
struct MemoryBreakdown {
  std::array<std::size_t, kMemoryUses> by_use{};
  std::size_t saved_activations = 0;  // part of by_use[temporary]

  std::size_t total() const {
    std::size_t n = 0;
    for (std::size_t b : by_use) n += b;
    return n;
  }
  std::size_t operator[](MemoryUse u) const { return by_use[static_cast<std::size_t>(u)]; }
};

/// Told of every allocation and release a MemoryStats counts (the dry run's trace).
class MemoryObserver {
 public:
  virtual ~MemoryObserver() = default;
  /// `bytes` allocated (delta > 0) or released (delta < 0); `live` bytes held after it.
  virtual void on_memory(Device device, std::int64_t delta, MemoryUse use, std::size_t live) = 0;
};

class MemoryStats {
 public:
  void on_alloc(std::size_t bytes, MemoryUse use = MemoryUse::temporary) { change(static_cast<std::int64_t>(bytes), use); }
  void on_free(std::size_t bytes, MemoryUse use = MemoryUse::temporary) { change(-static_cast<std::int64_t>(bytes), use); }

  /// `bytes` of temporaries are now kept for a backward (delta > 0), or no longer (< 0).
  void on_saved(std::int64_t delta) {
    std::lock_guard lock(mu_);
    now_.saved_activations = static_cast<std::size_t>(static_cast<std::int64_t>(now_.saved_activations) + delta);
  }

  std::size_t current() const {
    std::lock_guard lock(mu_);
    return current_;
  }
  std::size_t peak() const {
    std::lock_guard lock(mu_);
    return peak_;
  }
  /// What the bytes held now hold.
  MemoryBreakdown now() const {
    std::lock_guard lock(mu_);
    return now_;
  }
  /// What the bytes held at the peak held.
  MemoryBreakdown at_peak() const {
    std::lock_guard lock(mu_);
    return at_peak_;
  }
  /// Starts a new peak window at the bytes held now.
  void reset_peak() {
    std::lock_guard lock(mu_);
    peak_ = current_;
    at_peak_ = now_;
  }

  /// Reports every change to `o` (nullptr: to no one), as changes of `device`'s memory,
  /// until observe() is called again; returns the observer it replaces.
  MemoryObserver* observe(MemoryObserver* o, Device device) {
    std::lock_guard lock(mu_);
    MemoryObserver* previous = observer_;
    observer_ = o;
    device_ = device;
    return previous;
  }

 private:
  void change(std::int64_t delta, MemoryUse use) {
    std::lock_guard lock(mu_);
    current_ = static_cast<std::size_t>(static_cast<std::int64_t>(current_) + delta);
    auto& b = now_.by_use[static_cast<std::size_t>(use)];
    b = static_cast<std::size_t>(static_cast<std::int64_t>(b) + delta);
    if (current_ > peak_) {
      peak_ = current_;
      at_peak_ = now_;
    }
    if (observer_) observer_->on_memory(device_, delta, use, current_);
  }

  mutable std::mutex mu_;
  std::size_t current_ = 0, peak_ = 0;
  MemoryBreakdown now_{}, at_peak_{};
  MemoryObserver* observer_ = nullptr;
  Device device_ = Device::cpu;
};

namespace detail {
inline thread_local MemoryStats* thread_memory_stats = nullptr;  // one per Device, or none
inline thread_local MemoryUse thread_memory_use = MemoryUse::temporary;
}  // namespace detail

/// The counters for one device kind: the process's, or those of the rank this thread
/// runs (thread ranks each count their own; see ScopedMemoryStats).
inline MemoryStats& memory_stats(Device d) {
  static MemoryStats stats[kDeviceKinds];
  MemoryStats* own = detail::thread_memory_stats;
  return own ? own[static_cast<int>(d)] : stats[static_cast<int>(d)];
}

/// Makes this thread count its allocations in `stats` (kDeviceKinds of them, one per
/// Device) until the scope ends: how several ranks in one process each measure their
/// own memory.
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

/// Files the allocations this thread makes until the scope ends under `use`.
class MemoryUseScope {
 public:
  explicit MemoryUseScope(MemoryUse use) : previous_(detail::thread_memory_use) { detail::thread_memory_use = use; }
  ~MemoryUseScope() { detail::thread_memory_use = previous_; }
  MemoryUseScope(const MemoryUseScope&) = delete;
  MemoryUseScope& operator=(const MemoryUseScope&) = delete;

 private:
  MemoryUse previous_;
};

/// The use an allocation made now on this thread is filed under.
inline MemoryUse current_memory_use() { return detail::thread_memory_use; }

}  // namespace tessera
