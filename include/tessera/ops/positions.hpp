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
//
// Packed documents (document masking, training.document_mask): a row's sequence may hold
// several documents, each a contiguous run of its tokens. Each row then carries its
// document's span (DocumentSpan, positions in its sequence), its position restarts at 0
// where its document starts, and attention keeps each query to the keys of its own
// document (ops/attention_shape.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// This rank's share of each sequence under context parallelism (degree 1: all of it).
struct ContextShard {
  int rank = 0;
  int degree = 1;
  /// The head-tail balance (torchtitan's "headtail" load balancer): rank i holds chunks
  /// i and 2 degree - 1 - i. false ("none"): chunks 2i and 2i + 1, the sequence's
  /// degree-th part in order, the later ranks attending over more keys.
  bool head_tail = true;

  bool whole() const { return degree == 1; }
  /// The chunks a sequence is cut into (2 degree; 1 whole).
  int chunks() const { return whole() ? 1 : 2 * degree; }
  /// Which of the sequence's chunks this rank's j-th chunk (0 or 1) is.
  int chunk(int j) const {
    if (!head_tail) return 2 * rank + j;
    return j == 0 ? rank : 2 * degree - 1 - rank;
  }
  friend bool operator==(const ContextShard&, const ContextShard&) = default;
};

/// The document a row belongs to: positions [begin, end) of its sequence (in the whole
/// sequence's positions under context parallelism).
struct DocumentSpan {
  std::int32_t begin = 0;
  std::int32_t end = 0;
  friend bool operator==(const DocumentSpan&, const DocumentSpan&) = default;
};

/// Each row's document in `batch` sequences of `seq_len` input ids (row-major): a
/// document starts at the sequence's first token and at every token equal to
/// `start_id` (a BOS), and runs to the next start or the sequence's end.
inline std::vector<DocumentSpan> document_spans(std::span<const std::int32_t> ids, std::int64_t batch,
                                                std::int64_t seq_len, std::int32_t start_id) {
  TESSERA_CHECK(batch >= 0 && seq_len > 0 && static_cast<std::int64_t>(ids.size()) == batch * seq_len,
                "document_spans: ", ids.size(), " ids for a batch of ", batch, " x ", seq_len);
  TESSERA_CHECK(seq_len <= INT32_MAX, "document_spans: seq_len ", seq_len, " does not fit in int32");
  std::vector<DocumentSpan> spans(ids.size());
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t row0 = b * seq_len;
    std::int64_t begin = 0;
    for (std::int64_t t = 1; t <= seq_len; ++t) {
      if (t < seq_len && ids[static_cast<std::size_t>(row0 + t)] != start_id) continue;
      for (std::int64_t i = begin; i < t; ++i)
        spans[static_cast<std::size_t>(row0 + i)] = {static_cast<std::int32_t>(begin), static_cast<std::int32_t>(t)};
      begin = t;
    }
  }
  return spans;
}

/// One context-parallel ring block's document bounds (parallel/context_parallel.hpp), as
/// the backends' attention reads AttentionShape::documents: the queries are a chunk of c
/// rows a sequence starting at position `query_start` of it, the keys a chunk starting at
/// `key_start` (at or before it), and `queries` holds each query row's document in whole
/// sequence positions. Row r of the block gets, as a query, the first key it sees
/// (`begin`: its document's first position less key_start, clamped to [0, c]; c: none)
/// and, as a key, one past the last query that sees it (`end`: the queries whose document
/// begins at or before the key, a prefix of the chunk since documents begin in row order;
/// 0: none). Keys before the queries are then seen exactly by the queries of their own
/// document, and a block on the diagonal (key_start == query_start) gives each row its
/// document's bounds within the chunk, which the causal bound completes.
struct BlockDocuments {
  const DocumentSpan* queries;  // (batch x c), the query chunk's rows
  DocumentSpan* out;            // (batch x c)
  std::int64_t c;
  std::int64_t query_start, key_start;
  TESSERA_HD void operator()(std::int64_t r) const {
    const std::int64_t b = r / c, j = r % c;
    const DocumentSpan* row = queries + b * c;
    const std::int64_t begin = row[j].begin - key_start;
    // The first query of the chunk whose document begins after key j.
    const std::int64_t key = key_start + j;
    std::int64_t lo = 0, hi = c;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (row[mid].begin <= key)
        lo = mid + 1;
      else
        hi = mid;
    }
    out[r] = {static_cast<std::int32_t>(begin < 0 ? 0 : (begin > c ? c : begin)), static_cast<std::int32_t>(lo)};
  }
  // Its own query's span and the spans the search reads, one span written; a comparison
  // and an index update a search step.
  Traffic traffic(std::int64_t n) const {
    const double steps = std::ceil(std::log2(static_cast<double>(c) + 1)), e = static_cast<double>(n);
    return {e * (1 + steps) * sizeof(DocumentSpan), e * sizeof(DocumentSpan), 2 * e * steps, 0};
  }
};

/// Row r's position in its sequence, for rows of `batch` sequences of which this rank
/// holds `local_len` tokens each (two chunks of local_len / 2 under context parallelism).
/// Rows that continue a sequence whose first `past` tokens are already in a KV cache
/// (decoding: whole sequences, no documents) start at position past.
struct RowPositions {
  std::int64_t local_len = 1;   // rows per sequence here
  std::int64_t chunk_rows = 0;  // context-parallel: batch x chunk, the first chunk's rows; 0: whole sequences
  std::int64_t first = 0;       // context-parallel: the positions this rank's two chunks start at
  std::int64_t second = 0;
  const DocumentSpan* documents = nullptr;  // per row (the backend's memory): positions count from its
                                            // document's begin; nullptr: from the sequence's start
  std::int64_t past = 0;                    // whole sequences: the position of each sequence's first row

  RowPositions() = default;
  /// Whole sequences of seq_len tokens.
  RowPositions(std::int64_t seq_len) : local_len(seq_len) {}  // NOLINT: a length reads as whole sequences
  RowPositions(std::int64_t batch, std::int64_t local_len_, ContextShard cp, const DocumentSpan* docs = nullptr)
      : local_len(local_len_), documents(docs) {
    if (cp.whole()) return;
    const std::int64_t c = local_len / 2;
    chunk_rows = batch * c;
    first = cp.chunk(0) * c;
    second = cp.chunk(1) * c;
  }

  TESSERA_HD std::int64_t operator()(std::int64_t r) const {
    const std::int64_t start = documents ? documents[r].begin : 0;
    if (chunk_rows == 0) return past + r % local_len - start;
    const std::int64_t c = local_len / 2;
    return (r < chunk_rows ? first + r % c : second + (r - chunk_rows) % c) - start;
  }
  /// One past the largest position a row can have (with documents, a bound): the length
  /// the rotary tables need.
  std::int64_t end() const {
    if (chunk_rows == 0) return past + local_len;
    const std::int64_t c = local_len / 2;
    return (first > second ? first : second) + c;
  }
  /// How many distinct positions rows [0, rows) take (the table rows a launch reads; with
  /// documents, a bound).
  std::int64_t distinct(std::int64_t rows) const {
    return rows < local_len ? rows : local_len;
  }
};

}  // namespace tessera::ops
