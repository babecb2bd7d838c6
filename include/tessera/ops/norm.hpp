// Sums of squares for the gradient norm, over many tensors in one launch.
//
// The elements are cut into chunks of at most kNormChunk, each within one tensor; one
// call per chunk sums its squares in double into its own slot, and the caller adds
// the slots on the host in chunk order. The chunks are fixed by the tensors alone, so
// the total does not depend on how the backend schedules the calls.
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"

namespace tessera::ops {

/// Elements per chunk of a sum of squares.
inline constexpr std::int64_t kNormChunk = std::int64_t{1} << 14;

/// One chunk: n (<= kNormChunk) consecutive elements.
template <class T>
struct NormChunk {
  const T* x;
  std::int64_t n;

  friend bool operator==(const NormChunk&, const NormChunk&) = default;
};

template <class T>
struct SquaredNormChunks {
  const NormChunk<T>* chunks;
  double* partial;  // one slot per chunk
  TESSERA_HD void operator()(std::int64_t c) const {
    const NormChunk<T> k = chunks[c];
    double s = 0;
    for (std::int64_t i = 0; i < k.n; ++i) s += static_cast<double>(k.x[i]) * static_cast<double>(k.x[i]);
    partial[c] = s;
  }
};

}  // namespace tessera::ops
