// Which elements each thread of two CUDA kernels holds: plain C++ (host and device), so
// that the CPU tests can check, for every shape a launcher accepts, that the threads
// cover each element exactly once and never hold more than their registers do.
//
//   OneReadLayout     the one-read cross-entropy (cross_entropy_kernels.cuh): a row of
//                     `vocab` logits over a cluster of `blocks` blocks of `threads`
//                     threads, each block a contiguous slice of the row's vectors of V
//                     logits, each thread its vectors k = 0, 1, ... at a stride of the
//                     block's threads
//   FusedNormLayout   RMSNorm's fused backward (rmsnorm_kernels.cuh): a row of n
//                     elements, n a whole number of vectors of V, over one block, thread
//                     t holding vectors t, t + threads, ...
//   TransposeTileLayout  the transposing float8 cast (float8_kernels.cuh): a square
//                     tile of x over one block, read as runs along x's rows, written as
//                     4-byte words along out's rows (x's columns)
#pragma once

#include <cstdint>
#include <optional>

#include "tessera/core/macros.hpp"

namespace tessera::cuda::detail {

struct OneReadLayout {
  int vocab = 0;    // logits in the row
  int width = 0;    // V: logits per 16-byte vector
  int blocks = 0;   // in the cluster
  int threads = 0;  // per block

  TESSERA_HD int vectors() const { return (vocab + width - 1) / width; }
  TESSERA_HD int per_block() const { return (vectors() + blocks - 1) / blocks; }
  /// The column after block `rank`'s last logit.
  TESSERA_HD int end(int rank) const {
    const int e = (rank + 1) * per_block() * width;
    return e < vocab ? e : vocab;
  }
  /// Columns between a thread's vectors k and k + 1.
  TESSERA_HD int stride() const { return threads * width; }
  /// The first column of vector k of thread `tid` of block `rank`.
  TESSERA_HD int column(int rank, int tid, int k) const { return (rank * per_block() + tid) * width + k * stride(); }
  /// Whether logit w of that vector is in the block's slice (and the row).
  TESSERA_HD bool present(int rank, int tid, int k, int w) const { return column(rank, tid, k) + w < end(rank); }
  /// Whether the whole vector is.
  TESSERA_HD bool whole(int rank, int tid, int k) const { return column(rank, tid, k) + width <= end(rank); }
};

/// The logits a thread of the one-read kernel holds for a row of `vocab` (8, 16 or 32,
/// the fewest that cover it with `blocks` blocks of `threads`), or none past 32.
inline std::optional<int> one_read_logits_per_thread(std::int64_t vocab, int blocks, int threads) {
  const std::int64_t capacity = std::int64_t{blocks} * threads;
  for (const int e : {8, 16, 32})
    if (vocab <= capacity * e) return e;
  return std::nullopt;
}

struct FusedNormLayout {
  std::int64_t vectors = 0;  // per row
  int threads = 0;           // per block
  int per_thread = 0;        // K: the most vectors a thread holds

  /// The vector index of a thread's k-th vector, and whether it is in the row.
  TESSERA_HD std::int64_t vector(int tid, int k) const { return tid + std::int64_t{k} * threads; }
  TESSERA_HD bool mine(int tid, int k) const { return vector(tid, k) < vectors; }
};

/// The fused RMSNorm backward's block for rows of `vectors` vectors: K = 1 up to
/// `max_threads` vectors, 2 up to twice that (one thread per vector, or per two, in
/// whole warps); none past it (the launcher then takes the two kernels). Not 4: under
/// the kernel's 64 registers a thread spills heavily at 4 (at 2, 92 bytes in bf16, for
/// rows of 16384 only).
inline std::optional<FusedNormLayout> fused_norm_layout(std::int64_t vectors, int max_threads) {
  if (vectors <= 0 || vectors > 2 * std::int64_t{max_threads}) return std::nullopt;
  const int k = vectors <= max_threads ? 1 : 2;
  const std::int64_t per = (vectors + k - 1) / k;
  const auto threads = static_cast<int>((per + 31) / 32 * 32);
  return FusedNormLayout{vectors, threads < max_threads ? threads : max_threads, k};
}

/// A tile of `tile` x `tile` elements of x over `threads` threads, in two phases. Read:
/// run k of thread t is `run` neighbouring elements of one of x's rows (a warp's runs
/// side by side along the row). Write: word k of thread t is 4 neighbouring bytes of one
/// of out's rows, x's rows [write_row, +4) of x's column write_column (a warp's words
/// side by side along out's row). tile is a multiple of run and of 4, and tile^2 of
/// run x threads and of 4 x threads.
struct TransposeTileLayout {
  static constexpr int kWord = 4;  // bytes of a write
  int tile = 0, threads = 0, run = 0;

  TESSERA_HD int reads() const { return tile * tile / run / threads; }  // runs a thread reads
  TESSERA_HD int read_row(int t, int k) const { return (k * threads + t) / (tile / run); }
  TESSERA_HD int read_column(int t, int k) const { return (k * threads + t) % (tile / run) * run; }
  TESSERA_HD int writes() const { return tile * tile / kWord / threads; }  // words a thread writes
  TESSERA_HD int write_column(int t, int k) const { return (k * threads + t) / (tile / kWord); }
  TESSERA_HD int write_row(int t, int k) const { return (k * threads + t) % (tile / kWord) * kWord; }
};

}  // namespace tessera::cuda::detail
