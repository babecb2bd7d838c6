// Token embedding: a row gather forward, a scatter-add backward.
//
// The backward runs one column at a time over every token, so no two workers write
// the same element and the sum order is fixed (deterministic, no atomics).
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"

namespace tessera::ops {

template <class T>
struct EmbeddingForward {
  const std::int32_t* ids;
  const T* table;  // (vocab, dim)
  T* out;          // (rows, dim)
  std::int64_t dim;
  TESSERA_HD void operator()(std::int64_t r) const {
    const T* src = table + static_cast<std::int64_t>(ids[r]) * dim;
    T* dst = out + r * dim;
    for (std::int64_t j = 0; j < dim; ++j) dst[j] = src[j];
  }
};

/// dtable[ids[r], j] += dout[r, j] for every r, for column j.
template <class T>
struct EmbeddingBackwardColumn {
  const std::int32_t* ids;
  const T* dout;  // (rows, dim)
  T* dtable;      // (vocab, dim)
  std::int64_t rows;
  std::int64_t dim;
  TESSERA_HD void operator()(std::int64_t j) const {
    for (std::int64_t r = 0; r < rows; ++r) dtable[static_cast<std::int64_t>(ids[r]) * dim + j] += dout[r * dim + j];
  }
};

}  // namespace tessera::ops
