// Sums of squares for the gradient norm, over many tensors in one launch.
//
// The elements are cut into chunks of at most kNormChunk, each within one tensor; one
// call per chunk sums its squares in double into its own slot, and the caller adds
// the slots on the host in chunk order. The chunks are fixed by the tensors alone, so
// the total does not depend on how the backend schedules the calls.
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// Elements per chunk of a sum of squares.
inline constexpr std::int64_t kNormChunk = std::int64_t{1} << 14;

/// One tensor (or piece of one) in a sum of squares: n elements from x, cut into chunks
/// of kNormChunk from the start; its chunks are numbered from `first` on.
template <class T>
struct NormPiece {
  const T* x;
  std::int64_t n;
  std::int64_t first;  // the number of its first chunk: the chunks of the pieces before it

  friend bool operator==(const NormPiece&, const NormPiece&) = default;
};

/// The chunks of a piece of n elements.
inline constexpr std::int64_t norm_chunks(std::int64_t n) { return (n + kNormChunk - 1) / kNormChunk; }

/// Call c sums the squares of chunk c into partial[c]. The table holds one entry per
/// piece (a model's few hundred tensors), not per chunk: a call finds its piece by a
/// binary search over `first`, so the table costs a few KiB of device memory and its
/// build a walk over the pieces, where a per-chunk table costs 16 bytes every 16K
/// elements (400 MiB at 405B parameters, rebuilt on the host when the pieces change).
template <class T>
struct SquaredNormChunks {
  const NormPiece<T>* pieces;  // in chunk order, each with n > 0
  std::int64_t piece_count;
  double* partial;             // one slot per chunk
  std::int64_t elements;       // the pieces' n summed (for traffic())
  TESSERA_HD void operator()(std::int64_t c) const {
    std::int64_t lo = 0, hi = piece_count - 1;  // the last piece whose first chunk is <= c
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (pieces[mid].first <= c) lo = mid;
      else hi = mid - 1;
    }
    const NormPiece<T> p = pieces[lo];
    const std::int64_t begin = (c - p.first) * kNormChunk;
    const std::int64_t n = p.n - begin < kNormChunk ? p.n - begin : kNormChunk;
    const T* x = p.x + begin;
    double s = 0;
    for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    partial[c] = s;
  }
  // The piece table once (a few KiB, cached), every element read, one slot written per
  // chunk; 2 flops an element. `elements` is the whole table's: a launch over every chunk.
  Traffic traffic(std::int64_t chunks) const {
    const double c = static_cast<double>(chunks), e = static_cast<double>(elements);
    Traffic t{static_cast<double>(piece_count) * sizeof(NormPiece<T>) + e * sizeof(T), c * sizeof(double), 2 * e, 0};
    t.walk_bytes = t.bytes();  // each index walks its own chunk alone
    return t;
  }
};

}  // namespace tessera::ops
