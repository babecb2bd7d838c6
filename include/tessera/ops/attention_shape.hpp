// The geometry of one causal grouped-query attention call, shared by backends.
#pragma once

#include <cstdint>

namespace tessera {

struct AttentionShape {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t n_heads = 0;
  std::int64_t n_kv_heads = 0;
  std::int64_t head_dim = 0;

  std::int64_t rows() const { return batch * seq_len; }
  std::int64_t group() const { return n_heads / n_kv_heads; }
};

}  // namespace tessera
