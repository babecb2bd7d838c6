// The geometry of one grouped-query attention call, shared by backends.
//
// Queries and keys are the same length. A causal call lets query i see keys [0, i]
// (a whole sequence, or a context-parallel block on the diagonal); a full one lets every
// query see every key (a context-parallel block whose keys all come earlier in the
// sequence: parallel/context_parallel.hpp).
//
// Decoding with a KV cache (`past` > 0, layer/kv_cache.hpp) the queries are the last
// seq_len tokens of sequences whose keys and values are all there: k and v hold past +
// seq_len rows a sequence, and causal query i sees keys [0, past + i]. Only a backend
// that says so takes it (attends_past_keys, backend/backend.hpp); never with documents.
//
// Packed documents (`documents`, per row of the call; ops/positions.hpp): row i, as a
// query, sees the keys from documents[i].begin on, and as a key is seen by the queries
// before documents[i].end, both indices of the call's rows; the causal or full bound
// applies as well. Over whole sequences these are each row's document: query i sees
// [begin, i], key j is seen by [j, end). A context-parallel ring block (queries and keys
// from different chunks of the sequence) carries its own bounds (ops::BlockDocuments),
// causal on the diagonal and full below it; a row may then see no key of the block
// (begin past the last key: its output is zero and its log-sum-exp -inf) or be seen by
// no query (end 0). The whole-sequence causal bound stays the cost's upper bound
// (pairs()).
//
// A whole-sequence call over packed documents also carries its document table
// (`document_table`, `document_slots` entries a sequence: ops/ragged_documents.hpp), the
// same documents as cuDNN's variable-length attention takes them; a ring block, whose
// bounds are not whole documents, carries none, and only the project's kernels run it.
#pragma once

#include <cstdint>

#include "tessera/ops/positions.hpp"

namespace tessera {

struct AttentionShape {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t n_heads = 0;
  std::int64_t n_kv_heads = 0;
  std::int64_t head_dim = 0;
  bool causal = true;  // false: no mask
  const ops::DocumentSpan* documents = nullptr;  // (batch * seq_len) in the backend's memory; nullptr: one
                                                 // document a sequence
  const ops::DocumentSpan* document_table = nullptr;  // (batch * document_slots), with documents on a whole-
  std::int64_t document_slots = 0;                    // sequence call: each sequence's documents in order
  std::int64_t past = 0;  // keys a sequence before its first query (a KV cache's); 0: none

  std::int64_t rows() const { return batch * seq_len; }
  /// Key (and value) rows a sequence: past + seq_len.
  std::int64_t key_len() const { return past + seq_len; }
  std::int64_t group() const { return n_heads / n_kv_heads; }
  /// The (query, key) pairs the call computes, over every sequence and query head:
  /// T (T + 1) / 2 per head causal, T^2 full, and T x past more after a KV cache's keys
  /// (with documents, the causal bound: what they skip depends on the data).
  double pairs() const {
    const double t = static_cast<double>(seq_len), p = static_cast<double>(past);
    return static_cast<double>(batch) * static_cast<double>(n_heads) * (causal ? t * (t + 1) / 2 + t * p : t * (t + p));
  }
  friend bool operator==(const AttentionShape&, const AttentionShape&) = default;
};

}  // namespace tessera
