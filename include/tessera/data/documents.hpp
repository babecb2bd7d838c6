// Packed documents, data side (training.document_mask): the loss target that crosses a
// document boundary does not count.
//
// Documents are packed as BOS + tokens + EOS (data/loader.hpp), so a row's target at
// position t is its input at t + 1; where that is the next document's BOS, predicting
// it would ask one document for the next one's start. With document masking the model
// keeps each document's attention and positions to itself (ops/positions.hpp), and this
// drops those targets: every target equal to the BOS id becomes Batch::ignore_index.
// A packed batch then trains exactly as its documents would one by one.
#pragma once

#include <cstdint>

#include "tessera/data/loader.hpp"

namespace tessera::data {

/// Sets every target of `b` that is `bos_id` (a document's start) to Batch::ignore_index
/// and recounts b.n_targets.
inline void mask_document_boundaries(Batch& b, std::int32_t bos_id) {
  for (std::int32_t& t : b.targets)
    if (t == bos_id) t = Batch::ignore_index;
  b.n_targets = count_targets(b);
}

}  // namespace tessera::data
