// Host memory beside a backend's, and the host's cores that work on it: what FSDP's CPU
// offload (training.enable_cpu_offload, parallel/sharding.hpp) keeps its flat shards in.
//
// Each backend names its host backend, B::Host: a backend whose tensors live in the
// host's memory (Device::host, counted apart from the device's) and whose for_each runs
// the same ops/ functors on the host's cores, so an offloaded shard's optimizer step,
// gradient norm and initialisation are the very arithmetic the device would do:
//
//   Cpu, GuardedCpu   cpu::HostSide the CPU backend's loops, plain host pages
//   Cuda              cuda::PinnedHost   the same loops, page-locked memory the GPU's
//                                   copy engines read and write asynchronously
//   Meta              meta::HostSide nothing stored, nothing run (a dry run's host side)
//   Traced<X>         Traced<X::Host>   every host loop recorded as host work
//
// Values cross between B's memory and its host backend's only through
// copy_from_host_memory and copy_to_host_memory below: in B's stream order and without
// a synchronisation where B can (B::copy_from_pinned, B::copy_to_pinned: a GPU's
// asynchronous copies), so the host reads what it received only after B::synchronize(),
// and changes what it sent only after the same.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "tessera/backend/backend.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera {

/// The host backend of backend B (see the header comment).
template <class B>
using host_backend_t = typename B::Host;

/// Whether backend B names a host backend (a backend of a test's own may not; Traced<B>
/// names one where B does).
template <class B>
concept HasHostBackend = requires { typename B::Host; } && !std::is_void_v<typename B::Host>;

/// Whether backend X runs its work on the host's cores over host memory (a backend's
/// Host): what a trace records as host work.
template <class X>
inline constexpr bool is_host_backend = requires { requires X::runs_on_host; };

/// Whether a tensor lives in the host memory beside a device backend (an offloaded shard).
template <class T>
bool on_host(const Tensor<T>& t) {
  return t.device() == Device::host;
}

/// Calls f.template operator()<X>() with X = B's host backend where `host`, else B:
/// the one place code that works on either picks the loops that can reach the memory.
template <Backend B, class F>
decltype(auto) with_backend(bool host, F&& f) {
  if constexpr (HasHostBackend<B>) {
    if (host) return std::forward<F>(f).template operator()<host_backend_t<B>>();
  } else {
    TESSERA_CHECK(!host, "host memory handed to a backend that names no host backend (B::Host)");
  }
  return std::forward<F>(f).template operator()<B>();
}

/// n elements of host memory B's host backend allocated, copied into B's memory, in B's
/// stream order: `src` must keep its values until B::synchronize().
template <Backend B, class T>
void copy_from_host_memory(const T* src, T* dst, std::int64_t n) {
  if constexpr (requires { B::copy_from_pinned(src, dst, n); })
    B::copy_from_pinned(src, dst, n);
  else
    B::copy_from_host(src, dst, n);
}

/// n elements of B's memory copied into host memory B's host backend allocated, in B's
/// stream order: `dst` holds them after B::synchronize().
template <Backend B, class T>
void copy_to_host_memory(const T* src, T* dst, std::int64_t n) {
  if constexpr (requires { B::copy_to_pinned(src, dst, n); })
    B::copy_to_pinned(src, dst, n);
  else
    B::copy_to_host(src, dst, n);
}

}  // namespace tessera
