// Sums of squares for the gradient norm, over many tensors in one launch, and the clip
// scale computed from them where they are, with no value read by the host.
//
// The elements are cut into chunks of at most kNormChunk, each within one tensor; one
// call per chunk sums its squares in double into its own slot, and LaneSum then adds the
// slots in the lane order below, on the device. The chunks are fixed by the tensors
// alone, so the total does not depend on how the backend schedules the calls.
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
#include "tessera/ops/math.hpp"
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

/// The sum of n doubles in the lane order of a chunk (lane l adds x[l], x[l + kNormLanes],
/// ... in turn, then the lanes by halves), written to *out, or added to it with
/// `accumulate`. One call, index 0: on CUDA one block of kNormLanes threads, with
/// coalesced loads (backend/cuda/norm_kernels.cuh), the CPU's sum bit for bit. It adds
/// the gradient norm's chunk sums and the loss head's row losses on the device, so a
/// step's scalars stay there until the step ends (train/step_scalars.hpp).
struct LaneSum {
  const double* x;
  std::int64_t n;
  double* out;
  bool accumulate;
  TESSERA_HD void operator()(std::int64_t) const {
    double lane[kNormLanes] = {};
    std::int64_t i = 0;
    for (; i + kNormLanes <= n; i += kNormLanes)
      for (int l = 0; l < kNormLanes; ++l) lane[l] += x[i + l];
    for (int l = 0; i + l < n; ++l) lane[l] += x[i + l];
    for (int h = kNormLanes / 2; h >= 1; h /= 2)
      for (int l = 0; l < h; ++l) lane[l] += lane[l + h];
    *out = accumulate ? *out + lane[0] : lane[0];
  }
  Traffic traffic(std::int64_t) const {
    const double e = static_cast<double>(n);
    return Traffic{(e + (accumulate ? 1 : 0)) * sizeof(double), sizeof(double), e, 0};
  }
};

/// Whether x is a finite number (neither infinite nor NaN), on either backend.
TESSERA_HD inline bool finite(double x) { return x - x == 0.0; }

/// The clipping coefficient for a gradient norm: min(1, max_norm / (norm + 1e-6))
/// (torch.nn.utils.clip_grad_norm_'s), 1 when max_norm <= 0 (no clipping).
TESSERA_HD inline double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

/// The gradient scale AdamW reads (AdamWMultiStep::grad_scale) from the squared gradient
/// norm the device holds: clip_coefficient(sqrt(*squared_norm), max_norm), rounded to A.
/// NaN where the norm or the loss sum (when given) is not finite: AdamW then changes
/// nothing, and the trainer, reading both at the step's end, stops with the values.
template <class A>
struct ClipScale {
  const double* squared_norm;
  const double* loss_sum;  // or null
  double max_norm;
  A* scale;
  TESSERA_HD void operator()(std::int64_t) const {
    const double norm = sqrt_(*squared_norm);
    if (!finite(norm)) *scale = static_cast<A>(norm - norm);  // x - x: NaN for x infinite or NaN
    else if (loss_sum != nullptr && !finite(*loss_sum)) *scale = static_cast<A>(*loss_sum - *loss_sum);
    else *scale = static_cast<A>(clip_coefficient(norm, max_norm));
  }
  Traffic traffic(std::int64_t) const {
    return Traffic{(loss_sum != nullptr ? 2.0 : 1.0) * sizeof(double), sizeof(A), 4, 1};
  }
};

}  // namespace tessera::ops
