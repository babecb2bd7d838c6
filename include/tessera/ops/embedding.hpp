// Token embedding: a row gather forward, a scatter-add backward.
//
// Forward: one index per output element (row r, column j), so neighbouring indices read
// and write neighbouring elements and a launch covers rows x dim indices: every thread
// of a GPU busy, every access coalesced.
//
// Backward: the positions are grouped by id on the host first (EmbeddingSegments: a
// stable sort, so each id's positions stay in ascending order), then one index per
// (id present in the batch, column) adds that id's positions' gradients, in ascending
// position order, to its table entry. Every table element has one owner and the same
// summation order as a sequential loop over the positions (dtable[ids[r]] += dout[r]
// for r = 0, 1, ...), so the result is deterministic, needs no atomics, and is bitwise
// the same on every backend; a launch covers (ids present) x dim indices. The host
// already holds the ids (they come from the data loader), so grouping them there costs
// a sort of one micro-batch's ids and one upload, issued without waiting for the device.
//
// A table may hold only the ids [lo, hi) of the vocabulary (split by vocabulary over
// tensor-parallel ranks): row 0 of the table is id lo; other ids give zero rows and
// no gradient.
//
// The table's gradient is in accum_t<T> (float for a bf16 table): a column sums one
// term per token, which bf16 could not hold.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// out[r, j] = table[ids[r] - lo, j], zero for an id outside [lo, hi); index r * dim + j.
template <class T>
struct EmbeddingForward {
  const std::int32_t* ids;
  const T* table;  // (hi - lo, dim)
  T* out;          // (rows, dim)
  std::int64_t dim;
  std::int64_t lo = 0, hi = INT64_MAX;
  TESSERA_HD void operator()(std::int64_t i) const {
    const std::int64_t r = i / dim, j = i - r * dim;
    const std::int64_t id = ids[r];
    out[i] = id < lo || id >= hi ? T(0) : table[(id - lo) * dim + j];
  }
  // Per element: its row's id read (neighbouring indices share it: one read per row is
  // what reaches memory, counted so), the table element read when the id is inside
  // (counted always: an upper bound), the output written. Neighbouring indices touch
  // neighbouring elements: nothing walks.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n), rows = e / static_cast<double>(dim);
    return {rows * sizeof(std::int32_t) + e * sizeof(T), e * sizeof(T), 0, 0};
  }
};

/// The positions of a batch's ids grouped by id, for EmbeddingBackward: the ids in
/// [lo, hi) present in the batch, ascending (`count` of them), then count + 1 offsets
/// into the positions, then the positions of each id in ascending order. One int32
/// array, so it crosses to the backend in one upload.
///
/// With a capacity (the batch's positions), each part is padded to it and the count
/// follows them: the layout is then the same for every batch of that size, and a launch
/// over capacity x dim indices that reads the count (EmbeddingBackward::count_at) is the
/// same launch every step, as a replayed graph needs.
struct EmbeddingSegments {
  std::vector<std::int32_t> packed;
  std::int64_t count = 0;      // distinct ids in [lo, hi)
  std::int64_t positions = 0;  // positions whose id is in [lo, hi)
  std::int64_t capacity = 0;   // each part's length when padded (0: not padded, `count`)
  std::int64_t stride() const { return capacity > 0 ? capacity : count; }
  const std::int32_t* ids(const std::int32_t* base) const { return base; }
  const std::int32_t* offsets(const std::int32_t* base) const { return base + stride(); }
  const std::int32_t* order(const std::int32_t* base) const { return base + 2 * stride() + 1; }
  /// The count, in B's memory, when padded (null otherwise).
  const std::int32_t* count_at(const std::int32_t* base) const { return capacity > 0 ? base + 3 * capacity + 1 : nullptr; }
};

/// Groups the positions of `ids` that lie in [lo, hi) by id (a stable sort: each id's
/// positions ascending); `padded`: in the fixed layout of `ids.size()` positions.
inline EmbeddingSegments embedding_segments(std::span<const std::int32_t> ids, std::int64_t lo, std::int64_t hi,
                                            bool padded = false) {
  std::vector<std::int32_t> order;
  order.reserve(ids.size());
  for (std::size_t r = 0; r < ids.size(); ++r)
    if (ids[r] >= lo && ids[r] < hi) order.push_back(static_cast<std::int32_t>(r));
  const auto by_id = [&](std::int32_t a, std::int32_t b) {
    return ids[static_cast<std::size_t>(a)] < ids[static_cast<std::size_t>(b)];
  };
  // Already in id order (one id throughout, as a dry run's batches are): nothing to sort.
  if (!std::is_sorted(order.begin(), order.end(), by_id)) std::stable_sort(order.begin(), order.end(), by_id);
  std::vector<std::int32_t> unique, offsets;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::int32_t id = ids[static_cast<std::size_t>(order[k])];
    if (k == 0 || id != unique.back()) {
      unique.push_back(id);
      offsets.push_back(static_cast<std::int32_t>(k));
    }
  }
  offsets.push_back(static_cast<std::int32_t>(order.size()));
  EmbeddingSegments s;
  s.count = static_cast<std::int64_t>(unique.size());
  s.positions = static_cast<std::int64_t>(order.size());
  if (padded) {
    s.capacity = static_cast<std::int64_t>(ids.size());
    const auto cap = ids.size();
    unique.resize(cap, 0);
    offsets.resize(cap + 1, offsets.back());
    order.resize(cap, 0);
  }
  s.packed.reserve(unique.size() + offsets.size() + order.size() + 1);
  s.packed.insert(s.packed.end(), unique.begin(), unique.end());
  s.packed.insert(s.packed.end(), offsets.begin(), offsets.end());
  s.packed.insert(s.packed.end(), order.begin(), order.end());
  if (padded) s.packed.push_back(static_cast<std::int32_t>(s.count));
  return s;
}

/// dtable[id - lo, j] += dout[r, j] over the positions r of id, ascending; index
/// s * dim + j for the s-th id of the segments (uploaded EmbeddingSegments::packed).
template <class T>
struct EmbeddingBackward {
  const std::int32_t* ids;      // (count) distinct ids in [lo, hi), ascending
  const std::int32_t* offsets;  // (count + 1) into order
  const std::int32_t* order;    // (positions) positions grouped by id, each group ascending
  const T* dout;                // (rows, dim)
  accum_t<T>* dtable;           // (hi - lo, dim)
  std::int64_t dim;
  std::int64_t lo = 0;
  std::int64_t positions = 0;  // offsets[count]: for traffic()
  /// The count in B's memory, for a launch over the padded layout's capacity: indices
  /// past count x dim do nothing. Null: every index is an id's.
  const std::int32_t* count_at = nullptr;
  TESSERA_HD void operator()(std::int64_t i) const {
    const std::int64_t s = i / dim, j = i - s * dim;
    if (count_at != nullptr && s >= *count_at) return;
    accum_t<T>* g = dtable + (ids[s] - lo) * dim + j;
    accum_t<T> acc = *g;
    for (std::int32_t k = offsets[s]; k < offsets[s + 1]; ++k) acc += to_accum(dout[order[k] * dim + j]);
    *g = acc;
  }
  // Per (id, column): the table's gradient read and written once, the id and offsets read
  // (shared by the row's indices: once per id); per (position, column) dout read and
  // added, the position read once per id's row of indices. Neighbouring indices are
  // neighbouring columns: every access coalesces, nothing walks.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n), count = e / static_cast<double>(dim);
    const double terms = static_cast<double>(positions) * static_cast<double>(dim);
    return {count * 2 * sizeof(std::int32_t) + static_cast<double>(positions) * sizeof(std::int32_t) +
                e * sizeof(accum_t<T>) + terms * sizeof(T),
            e * sizeof(accum_t<T>), terms, 0};
  }
};

}  // namespace tessera::ops
