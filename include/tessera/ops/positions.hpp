// Where each row of an activation sits in its sequence.
//
// Whole sequences: the rows are (batch, seq_len) row-major, row r at position r % seq_len.
//
// A context-parallel shard (parallel/context_parallel.hpp) holds two chunks of each of
// its sequences, balanced for causal attention: of a sequence cut into 2 cp chunks of c
// tokens, rank i of cp holds chunk i and chunk 2 cp - 1 - i, so every rank attends over
// the same number of (query, key) pairs. Its rows are chunk-major -- the first chunk of
// every sequence (batch x c rows), then the second -- so that each chunk is one
// (batch, c) block an attention call takes whole; every other op works row by row and
// does not mind the order.
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"

namespace tessera::ops {

/// This rank's share of each sequence under context parallelism (degree 1: all of it).
struct ContextShard {
  int rank = 0;
  int degree = 1;

  bool whole() const { return degree == 1; }
  /// The chunks a sequence is cut into (2 degree; 1 whole).
  int chunks() const { return whole() ? 1 : 2 * degree; }
  /// Which of the sequence's chunks this rank's j-th chunk (0 or 1) is.
  int chunk(int j) const { return j == 0 ? rank : 2 * degree - 1 - rank; }
  friend bool operator==(const ContextShard&, const ContextShard&) = default;
};

/// Row r's position in its sequence, for rows of `batch` sequences of which this rank
/// holds `local_len` tokens each (two chunks of local_len / 2 under context parallelism).
struct RowPositions {
  std::int64_t local_len = 1;   // rows per sequence here
  std::int64_t chunk_rows = 0;  // context-parallel: batch x chunk, the first chunk's rows; 0: whole sequences
  std::int64_t first = 0;       // context-parallel: the positions this rank's two chunks start at
  std::int64_t second = 0;

  RowPositions() = default;
  /// Whole sequences of seq_len tokens.
  RowPositions(std::int64_t seq_len) : local_len(seq_len) {}  // NOLINT: a length reads as whole sequences
  RowPositions(std::int64_t batch, std::int64_t local_len_, ContextShard cp) : local_len(local_len_) {
    if (cp.whole()) return;
    const std::int64_t c = local_len / 2;
    chunk_rows = batch * c;
    first = cp.chunk(0) * c;
    second = cp.chunk(1) * c;
  }

  TESSERA_HD std::int64_t operator()(std::int64_t r) const {
    if (chunk_rows == 0) return r % local_len;
    const std::int64_t c = local_len / 2;
    return r < chunk_rows ? first + r % c : second + (r - chunk_rows) % c;
  }
  /// One past the largest position a row can have: the length the rotary tables need.
  std::int64_t end() const {
    if (chunk_rows == 0) return local_len;
    const std::int64_t c = local_len / 2;
    return (first > second ? first : second) + c;
  }
  /// How many distinct positions rows [0, rows) take (the table rows a launch reads).
  std::int64_t distinct(std::int64_t rows) const {
    return rows < local_len ? rows : local_len;
  }
};

}  // namespace tessera::ops
