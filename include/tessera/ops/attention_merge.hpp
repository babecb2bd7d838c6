// Attention over a sequence whose keys arrive in blocks (context parallelism's ring,
// parallel/context_parallel.hpp): each block's output and log-sum-exp merged into a
// running pair, and each block's gradients summed into running ones.
//
// A block of keys K_b gives, per query row and head, o_b = softmax(q K_b^T) V_b and
// lse_b = log sum_j exp(q . k_j) over its keys. Two blocks' results combine exactly:
//   lse = log(exp(lse_a) + exp(lse_b)),  o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)
// (computed from m = max(lse_a, lse_b), so no exponential overflows). A block in which a
// row sees no key (packed documents: lse_b = -inf, o_b = 0) leaves the row as it was. The running pair is
// kept in accum_t<T> and rounded to T once at the end.
//
// Layouts: o is (rows, heads * head_dim) with leading dimension ld; rows are (batch,
// chunk) row-major; lse is (batch, heads, chunk), as the backends' attention writes it.
#pragma once

#include <cstdint>
#include <limits>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// Merges block (o_block, lse_block) into the running (o, lse) for row r's heads; `first`:
/// the running pair takes the block's values.
template <class T>
struct MergeAttention {
  using A = accum_t<T>;
  A* o;  // (rows, heads * head_dim), ld
  A* lse;  // (batch, heads, chunk)
  const T* o_block;  // (rows, heads * head_dim), ld_block
  const A* lse_block;
  std::int64_t ld, ld_block, heads, head_dim, chunk;
  bool first;
  TESSERA_HD void operator()(std::int64_t r) const {
    constexpr A kInfinity = std::numeric_limits<A>::infinity();
    const std::int64_t b = r / chunk, t = r % chunk;
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t s = (b * heads + h) * chunk + t;
      A* out = o + r * ld + h * head_dim;
      const T* in = o_block + r * ld_block + h * head_dim;
      if (first) {
        for (std::int64_t d = 0; d < head_dim; ++d) out[d] = to_accum(in[d]);
        lse[s] = lse_block[s];
        continue;
      }
      const A la = lse[s], lb = lse_block[s], m = la > lb ? la : lb;
      if (!(lb > -kInfinity)) continue;  // the block saw none of the row's keys
      if (!(la > -kInfinity)) {          // nor had any block before it: the block's values
        for (std::int64_t d = 0; d < head_dim; ++d) out[d] = to_accum(in[d]);
        lse[s] = lb;
        continue;
      }
      const A wa = exp_nonpositive(la - m), wb = exp_nonpositive(lb - m), sum = wa + wb;
      const A ca = wa / sum, cb = wb / sum;
      for (std::int64_t d = 0; d < head_dim; ++d) out[d] = out[d] * ca + to_accum(in[d]) * cb;
      lse[s] = m + log_(sum);
    }
  }
  // Both outputs and both lse read, the running ones written; per element two
  // multiplications and an addition, per (row, head) three exp/log and a few flops. Each
  // index walks its row's heads alone.
  Traffic traffic(std::int64_t rows) const {
    const double e = static_cast<double>(rows) * static_cast<double>(heads * head_dim);
    const double stats = static_cast<double>(rows) * static_cast<double>(heads);
    Traffic t{e * (sizeof(A) + sizeof(T)) + 2 * stats * sizeof(A), e * sizeof(A) + stats * sizeof(A),
              3 * e + 6 * stats, 3 * stats};
    t.walk_bytes = t.bytes();
    return t;
  }
};

/// acc[i] += x[i] in accum_t<T> (acc[i] = x[i] when `first`): a block's gradient summed
/// into the running one.
template <class T>
struct AccumulateInto {
  const T* x;
  accum_t<T>* acc;
  bool first;
  TESSERA_HD void operator()(std::int64_t i) const { acc[i] = first ? to_accum(x[i]) : acc[i] + to_accum(x[i]); }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(T) + (first ? 0.0 : e * sizeof(accum_t<T>)), e * sizeof(accum_t<T>), first ? 0.0 : e, 0};
  }
};

}  // namespace tessera::ops
