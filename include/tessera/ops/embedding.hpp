// Token embedding: a row gather forward, a scatter-add backward.
//
// The backward runs one column at a time over every token, so no two workers write
// the same element and the sum order is fixed (deterministic, no atomics).
//
// A table may hold only the ids [lo, hi) of the vocabulary (split by vocabulary over
// tensor-parallel ranks): row 0 of the table is id lo; other ids give zero rows and
// no gradient.
//
// The table's gradient is in accum_t<T> (float for a bf16 table): a column sums one
// term per token, which bf16 could not hold.
#pragma once

#include <cstdint>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

template <class T>
struct EmbeddingForward {
  const std::int32_t* ids;
  const T* table;  // (hi - lo, dim)
  T* out;          // (rows, dim)
  std::int64_t dim;
  std::int64_t lo = 0, hi = INT64_MAX;
  TESSERA_HD void operator()(std::int64_t r) const {
    const std::int64_t id = ids[r];
    T* dst = out + r * dim;
    if (id < lo || id >= hi) {
      for (std::int64_t j = 0; j < dim; ++j) dst[j] = T(0);
      return;
    }
    const T* src = table + (id - lo) * dim;
    for (std::int64_t j = 0; j < dim; ++j) dst[j] = src[j];
  }
  // Every id counted in [lo, hi), its table row read (an id outside writes zeros and reads
  // nothing: on a table split by vocabulary over d ranks, about 1 id in d is inside).
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(dim);
    Traffic t{r * sizeof(std::int32_t) + e * sizeof(T), e * sizeof(T), 0, 0};
    t.walk_bytes = t.bytes();  // each index walks its own row (or chunk) alone
    return t;
  }
};

/// dtable[ids[r], j] += dout[r, j] for every r, for column j.
template <class T>
struct EmbeddingBackwardColumn {
  const std::int32_t* ids;
  const T* dout;       // (rows, dim)
  accum_t<T>* dtable;  // (vocab, dim)
  std::int64_t rows;
  std::int64_t dim;
  std::int64_t lo = 0, hi = INT64_MAX;
  TESSERA_HD void operator()(std::int64_t j) const {
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t id = ids[r];
      if (id >= lo && id < hi) dtable[(id - lo) * dim + j] += to_accum(dout[r * dim + j]);
    }
  }
  // The ids once per launch; per (row, column) dout read and dtable read and written
  // with an addition, every id counted in [lo, hi) (others are skipped).
  Traffic traffic(std::int64_t cols) const {
    const double e = static_cast<double>(cols) * static_cast<double>(rows);
    return {static_cast<double>(rows) * sizeof(std::int32_t) + e * (sizeof(T) + sizeof(accum_t<T>)),
            e * sizeof(accum_t<T>), e, 0};
  }
};

}  // namespace tessera::ops
