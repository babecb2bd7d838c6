// Packed documents for the attention tests: the spans of a batch whose documents start at
// given rows, and a context-parallel ring block's bounds over them (ops::BlockDocuments),
// computed on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "tessera/ops/positions.hpp"

namespace tessera::testing {

/// The document spans of `batch` sequences of `seq_len` ids where a document starts at
/// each of `starts` (rows of the batch, b * seq_len + position) and at each sequence's
/// first token.
inline std::vector<ops::DocumentSpan> spans_starting_at(std::int64_t batch, std::int64_t seq_len,
                                                        std::initializer_list<std::int64_t> starts) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * seq_len), 3);
  for (std::int64_t start : starts) ids[static_cast<std::size_t>(start)] = 1;
  return ops::document_spans(ids, batch, seq_len, 1);
}

/// The bounds of the ring block whose queries are chunk `q_chunk` and keys chunk
/// `k_chunk` (chunks of c positions) of sequences whose whole spans are `spans`, one per
/// row of the block (batch x c).
inline std::vector<ops::DocumentSpan> ring_block_bounds(const std::vector<ops::DocumentSpan>& spans,
                                                        std::int64_t batch, std::int64_t seq_len, std::int64_t c,
                                                        std::int64_t q_chunk, std::int64_t k_chunk) {
  std::vector<ops::DocumentSpan> queries;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < c; ++i)
      queries.push_back(spans[static_cast<std::size_t>(b * seq_len + q_chunk * c + i)]);
  std::vector<ops::DocumentSpan> out(queries.size());
  const ops::BlockDocuments bounds{queries.data(), out.data(), c, q_chunk * c, k_chunk * c};
  for (std::int64_t r = 0; r < batch * c; ++r) bounds(r);
  return out;
}

}  // namespace tessera::testing
