// MemoryAccess: how an in-process engine (SelfEngine, ThreadEngine) reaches the
// buffers it is given.
//
// Those engines move bytes themselves instead of handing them to a library, so they
// must know what memory they are moving. By default it is the host's: memcpy, the
// host reduction, malloc'd scratch. A backend whose memory the host cannot touch
// (CUDA: several virtual ranks on one GPU) gives its own, and the engines call only
// these four functions on rank buffers:
//   copy(dst, src, bytes)      between any two buffers, the backend's or the host's
//   reduce(dst, src, n, t, op) dst[i] = op(dst[i], src[i]); dst is the backend's memory,
//                              src the backend's or the host's (a host value reduced
//                              across ranks, such as a loss sum)
//   allocate(bytes), release(p) scratch in the backend's memory
//   where(p, bytes)            whether [p, p + bytes) is memory of this rank's device,
//                              of another rank's device, or the host's; nullptr where
//                              the backend cannot tell (a plain host-memory engine).
//                              Only the NCCL-rules check (comm/nccl_rules.hpp) asks.
// Plain function pointers keep the engines free of any backend header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "tessera/comm/engine.hpp"
#include "tessera/comm/reduce.hpp"

namespace tessera::comm {

namespace detail {
inline void host_copy(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
}
inline void* host_allocate(std::size_t bytes) {
  void* p = std::malloc(bytes > 0 ? bytes : 1);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
inline void host_release(void* p) { std::free(p); }
}  // namespace detail

/// Where a buffer handed to an engine lives (MemoryAccess::where).
enum class Residence : std::uint8_t {
  host,          ///< the host's memory: NCCL cannot move it
  this_device,   ///< memory of the device of the rank that calls
  other_device,  ///< memory of another rank's device (NCCL: one rank per device)
};

struct MemoryAccess {
  void (*copy)(void* dst, const void* src, std::size_t bytes) = &detail::host_copy;
  void (*reduce)(void* dst, const void* src, std::size_t n, DataType t, ReduceOp op) = &reduce_into;
  void* (*allocate)(std::size_t bytes) = &detail::host_allocate;
  void (*release)(void* p) = &detail::host_release;
  Residence (*where)(const void* p, std::size_t bytes) = nullptr;
};

/// Scratch bytes in an engine's memory, released when the scope ends.
class Scratch {
 public:
  Scratch(const MemoryAccess& m, std::size_t bytes) : m_(m), p_(bytes > 0 ? m.allocate(bytes) : nullptr) {}
  ~Scratch() {
    if (p_ != nullptr) m_.release(p_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  char* data() const { return static_cast<char*>(p_); }

 private:
  const MemoryAccess& m_;
  void* p_;
};

}  // namespace tessera::comm
