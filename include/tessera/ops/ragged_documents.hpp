// Packed documents in cuDNN's variable-length ("ragged") attention layout.
//
// tessera's own kernels mask packed documents apart row by row (AttentionShape::documents,
// ops/positions.hpp). cuDNN's fused attention instead takes each document as one entry of
// a batch of variable-length sequences: an entry's rows are a contiguous run of the
// tensors, found by a "ragged offset" per entry (in elements), and its length is given
// with the padding mask; the causal mask then applies inside each entry. Over whole
// sequences that is exactly document masking, so cuDNN runs it at the cost of the
// documents' own triangles.
//
// The entries: a batch of B sequences, each given `slots` entries (a power of two at
// least the most documents any of its sequences holds, so that one cuDNN graph serves
// every batch up to that count): sequence b's k-th document is entry b * slots + k, and
// the entries past its last document are empty spans at the sequence's end. The table
// (DocumentTable) is made on the host with the rows' spans and staged beside them; the
// backend turns it into each call's offsets and lengths on the device (RaggedOffsets), as
// many offset arrays as the call has tensors with different leading dimensions.
//
// cuDNN's ragged log-sum-exp is token-major, (rows, heads); the backends' is (batch,
// heads, seq_len). StatsLayout moves it between the two.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/positions.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// Each sequence's documents in order, `slots` entries a sequence: spans in positions of
/// the sequence, then {seq_len, seq_len} for each entry past its last document.
struct DocumentTable {
  std::int64_t slots = 0;
  std::vector<DocumentSpan> spans;  // (batch x slots)
};

/// The smallest power of two at least n (1 for n <= 1).
inline std::int64_t document_slots_for(std::int64_t n) {
  std::int64_t slots = 1;
  while (slots < n) slots *= 2;
  return slots;
}

/// The document table of `batch` sequences of `seq_len` rows whose rows' documents are
/// `rows` (document_spans), with at least `min_slots` entries a sequence (a table staged
/// again at a fixed size keeps its slots; 0: as few as fit). Rows whose spans do not
/// tile their sequence in order are refused.
inline DocumentTable document_table(std::span<const DocumentSpan> rows, std::int64_t batch, std::int64_t seq_len,
                                    std::int64_t min_slots = 0) {
  TESSERA_CHECK(batch >= 0 && seq_len > 0 && static_cast<std::int64_t>(rows.size()) == batch * seq_len,
                "document_table: ", rows.size(), " row spans for a batch of ", batch, " x ", seq_len);
  std::vector<std::vector<DocumentSpan>> documents(static_cast<std::size_t>(batch));
  std::int64_t most = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const DocumentSpan* row = rows.data() + b * seq_len;
    for (std::int64_t start = 0; start < seq_len;) {
      const DocumentSpan d = row[start];
      TESSERA_CHECK(d.begin == start && d.end > d.begin && d.end <= seq_len, "document_table: sequence ", b,
                    ", row ", start, ": span [", d.begin, ", ", d.end, ") does not start a document there");
      documents[static_cast<std::size_t>(b)].push_back(d);
      start = d.end;
    }
    most = std::max<std::int64_t>(most, static_cast<std::int64_t>(documents[static_cast<std::size_t>(b)].size()));
  }
  DocumentTable t;
  t.slots = document_slots_for(std::max(most, min_slots));
  const auto end = static_cast<std::int32_t>(seq_len);
  t.spans.assign(static_cast<std::size_t>(batch * t.slots), DocumentSpan{end, end});
  for (std::int64_t b = 0; b < batch; ++b)
    std::copy(documents[static_cast<std::size_t>(b)].begin(), documents[static_cast<std::size_t>(b)].end(),
              t.spans.begin() + b * t.slots);
  return t;
}

/// The rows' spans and their document table as the one int32 array the model stages
/// beside the ids (two a span: begin, end): the rows' spans, then the table's, which so
/// starts at span rows.size().
inline std::vector<std::int32_t> staged_documents(std::span<const DocumentSpan> rows, const DocumentTable& table) {
  std::vector<std::int32_t> flat;
  flat.reserve(2 * (rows.size() + table.spans.size()));
  for (std::span<const DocumentSpan> part : {rows, std::span<const DocumentSpan>(table.spans)})
    for (const DocumentSpan& d : part) {
      flat.push_back(d.begin);
      flat.push_back(d.end);
    }
  return flat;
}

/// The tensors of a ragged attention call, in the order of RaggedOffsets::offsets.
enum RaggedTensor : int { kRaggedQ, kRaggedK, kRaggedV, kRaggedO, kRaggedDO, kRaggedDQ, kRaggedDK, kRaggedDV,
                          kRaggedStats, kRaggedTensors };

/// One call's ragged description, from its document table (`table`, entries x 1 spans;
/// entries = batch x slots): entry e is lengths[e] rows from row (e / slots) seq_len +
/// table[e].begin, and tensor t's offset of it, in elements, is that row times scale[t]
/// (the tensor's leading dimension; the heads for the token-major statistics). Index
/// `entries` closes every tensor at the rows' end. Called for e in [0, entries].
struct RaggedOffsets {
  const DocumentSpan* table;
  std::int64_t entries = 0, slots = 1, seq_len = 0;
  std::int64_t scale[kRaggedTensors] = {};
  std::int64_t* offsets = nullptr;  // (kRaggedTensors x (entries + 1))
  std::int32_t* lengths = nullptr;  // (entries)
  TESSERA_HD void operator()(std::int64_t e) const {
    std::int64_t row = (entries / slots) * seq_len;
    if (e < entries) {
      const DocumentSpan d = table[e];
      row = (e / slots) * seq_len + d.begin;
      lengths[e] = d.end - d.begin;
    }
    for (int t = 0; t < kRaggedTensors; ++t) offsets[t * (entries + 1) + e] = row * scale[t];
  }
  // A span read, a length and an offset a tensor written; a multiply each.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n), tensors = static_cast<double>(static_cast<int>(kRaggedTensors));
    return {e * sizeof(DocumentSpan), e * (sizeof(std::int32_t) + tensors * sizeof(std::int64_t)), e * tensors, 0};
  }
};

/// The log-sum-exp moved between the backends' (batch, heads, seq_len) layout and the
/// token-major (batch x seq_len, heads) one of cuDNN's ragged calls: i indexes the
/// token-major layout; to_tokens copies the backends' layout into it, else back.
struct StatsLayout {
  const float* from;
  float* to;
  std::int64_t seq_len = 0, heads = 0;
  bool to_tokens = true;
  TESSERA_HD void operator()(std::int64_t i) const {
    const std::int64_t r = i / heads, h = i % heads;
    const std::int64_t bht = ((r / seq_len) * heads + h) * seq_len + r % seq_len;
    if (to_tokens)
      to[i] = from[bht];
    else
      to[bht] = from[i];
  }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(float), e * sizeof(float), 0, 0};
  }
};

}  // namespace tessera::ops
