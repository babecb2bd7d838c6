// Sums of squares for the gradient norm, over many tensors in one launch.
//
// The elements are cut into chunks of at most kNormChunk, each within one tensor; one
// call per chunk sums its squares in double into its own slot, and the caller adds
// the slots on the host in chunk order. The chunks are fixed by the tensors alone, so
// the total does not depend on how the backend schedules the calls.
//
// Within a chunk the order of the additions is fixed too, and chosen for a GPU block:
// kNormLanes lanes, lane l summing elements l, l + kNormLanes, l + 2 kNormLanes, ... in
// turn, then the lanes added by halves (lane l += lane l + h for h = kNormLanes / 2, ...,
// 1). On the CPU a call runs that order itself (a contiguous loop into 256 running sums);
// on CUDA a block of kNormLanes threads runs it, each thread one lane, with coalesced
// loads and the halving in shared memory (backend/cuda/norm_kernels.cuh). A float or bf16
// element squared is exact in double, so the two give the same sum bit for bit.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// Elements per chunk of a sum of squares.
inline constexpr std::int64_t kNormChunk = std::int64_t{1} << 14;

/// Running sums within a chunk: lane l takes its elements l, l + kNormLanes, ...
inline constexpr int kNormLanes = 256;
static_assert(kNormChunk % kNormLanes == 0 && (kNormLanes & (kNormLanes - 1)) == 0);

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
  /// v squared in double: exact for float and bf16 (a 24-bit significand squared).
  static TESSERA_HD double square(T v) {
    const double d = static_cast<double>(to_accum(v));
    return d * d;
  }
  /// Chunk c's elements: n (at most kNormChunk) from x.
  struct Chunk {
    const T* x;
    std::int64_t n;
  };
  TESSERA_HD Chunk chunk(std::int64_t c) const {
    std::int64_t lo = 0, hi = piece_count - 1;  // the last piece whose first chunk is <= c
    while (lo < hi) {
      const std::int64_t mid = (lo + hi + 1) / 2;
      if (pieces[mid].first <= c) lo = mid;
      else hi = mid - 1;
    }
    const NormPiece<T> p = pieces[lo];
    const std::int64_t begin = (c - p.first) * kNormChunk;
    return {p.x + begin, p.n - begin < kNormChunk ? p.n - begin : kNormChunk};
  }
  TESSERA_HD void operator()(std::int64_t c) const {
    const auto [x, n] = chunk(c);
    double lane[kNormLanes] = {};
    std::int64_t i = 0;
    for (; i + kNormLanes <= n; i += kNormLanes)
      for (int l = 0; l < kNormLanes; ++l) lane[l] += square(x[i + l]);
    for (int l = 0; i + l < n; ++l) lane[l] += square(x[i + l]);
    for (int h = kNormLanes / 2; h >= 1; h /= 2)
      for (int l = 0; l < h; ++l) lane[l] += lane[l + h];
    partial[c] = lane[0];
  }
  // The piece table once (a few KiB, cached), every element read, one slot written per
  // chunk; 2 flops an element. `elements` is the whole table's: a launch over every chunk.
  // On CUDA a block reads a chunk with coalesced loads, so the bytes stream.
  Traffic traffic(std::int64_t chunks) const {
    const double c = static_cast<double>(chunks), e = static_cast<double>(elements);
    return Traffic{static_cast<double>(piece_count) * sizeof(NormPiece<T>) + e * sizeof(T), c * sizeof(double), 2 * e, 0};
  }
};

}  // namespace tessera::ops
