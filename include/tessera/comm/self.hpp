// SelfEngine: the communicator of one rank alone. Every collective is a copy (or
// nothing); a default-constructed comm::Communicator uses it, so single-rank code
// runs the same collective calls as many-rank code.
#pragma once

#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "tessera/comm/engine.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/error.hpp"

namespace tessera::comm {

class SelfEngine {
 public:
  /// `memory`: where the rank's buffers live (comm/memory_access.hpp).
  explicit SelfEngine(MemoryAccess memory = {}) : memory_(memory) {}

  int rank() const { return 0; }
  int size() const { return 1; }
  std::string_view engine_name() const { return "self"; }

  Handle all_gather(const void* in, void* out, std::size_t n, DataType t) { return copy(in, out, n, t); }
  Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp) { return copy(in, out, n, t); }
  Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp) { return copy(in, out, n, t); }
  Handle broadcast(void*, std::size_t, DataType, int) { return {}; }
  Handle send_recv(std::span<const PeerOp> ops) {
    TESSERA_CHECK(ops.empty(), "send_recv: a single rank has no peer to exchange with");
    return {};
  }
  Handle barrier() { return {}; }
  SelfEngine split(int, int) { return SelfEngine(memory_); }
  void abort(const std::string&) {}

 private:
  Handle copy(const void* in, void* out, std::size_t n, DataType t) const {
    if (in != out && n > 0) memory_.copy(out, in, n * size_of(t));
    return {};
  }

  MemoryAccess memory_;
};

static_assert(Engine<SelfEngine>);

}  // namespace tessera::comm
