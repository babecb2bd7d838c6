// The geometry of one grouped-query attention call, shared by backends.
//
// Queries and keys are the same length. A causal call lets query i see keys [0, i]
// (a whole sequence, or a context-parallel block on the diagonal); a full one lets every
// query see every key (a context-parallel block whose keys all come earlier in the
// sequence: parallel/context_parallel.hpp).
#pragma once

#include <cstdint>

namespace tessera {

struct AttentionShape {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t n_heads = 0;
  std::int64_t n_kv_heads = 0;
  std::int64_t head_dim = 0;
  bool causal = true;  // false: no mask

  std::int64_t rows() const { return batch * seq_len; }
  std::int64_t group() const { return n_heads / n_kv_heads; }
  /// The (query, key) pairs the call computes, over every sequence and query head:
  /// T (T + 1) / 2 per head causal, T^2 full.
  double pairs() const {
    const double t = static_cast<double>(seq_len);
    return static_cast<double>(batch) * static_cast<double>(n_heads) * (causal ? t * (t + 1) / 2 : t * t);
  }
  friend bool operator==(const AttentionShape&, const AttentionShape&) = default;
};

}  // namespace tessera
