// Waits the host owes its next synchronisation.
//
// On a GPU, waiting for a collective orders the compute stream after it and returns at
// once: the host itself learns that the collective is done only when it synchronises
// (B::synchronize(), or a copy to the host). A backend whose work runs on the host (the
// CPU backend) has no stream to hand that wait to, so an engine that models the GPU's
// rule (comm/nccl_rules.hpp: a barrier's wait() does not hold the host) leaves the wait
// here, and the backend's synchronize() runs it. Per thread: each rank thread has its own.
#pragma once

#include <exception>
#include <functional>
#include <utility>
#include <vector>

namespace tessera::detail {

inline thread_local std::vector<std::function<void()>> deferred_host_waits;

/// Runs every wait left for this thread's next synchronisation, oldest first; the first
/// failure is rethrown after the rest have run.
inline void run_deferred_host_waits() {
  if (deferred_host_waits.empty()) return;
  std::vector<std::function<void()>> waits = std::exchange(deferred_host_waits, {});
  std::exception_ptr first;
  for (auto& w : waits) {
    try {
      w();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace tessera::detail
