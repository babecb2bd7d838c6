// Grouped-query attention, causal or full, written out in double the plain way: every
// score, every probability and every gradient term one at a time, with D_i taken as
// sum_j p_ij dp_ij (not dO . O, as the backends take it). The reference the CPU backend
// and the flash functors are held to (tests/ops).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "tessera/ops/attention_shape.hpp"

namespace tessera::testing {

/// o, dq (B*T, H*hd), dk, dv (B*T, KV*hd), dense row-major; lse (B, H, T).
struct NaiveAttention {
  std::vector<double> o, lse, dq, dk, dv;
};

/// Attention over dense row-major q, d_o (B*T, H*hd) and k, v (B*T, KV*hd): causal
/// (query i sees keys 0..i) when s.causal, else every query sees every key; with
/// s.documents (host memory here), query i sees only keys from its document's begin. Head h
/// reads kv head h / (H / KV); scale 1/sqrt(hd).
inline NaiveAttention naive_attention(const AttentionShape& s, const std::vector<double>& q,
                                      const std::vector<double>& k, const std::vector<double>& v,
                                      const std::vector<double>& d_o) {
  const std::int64_t t = s.seq_len, hd = s.head_dim, qc = s.n_heads * hd, kc = s.n_kv_heads * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  auto at = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  NaiveAttention r;
  r.o.assign(at(s.rows() * qc), 0.0);
  r.dq.assign(at(s.rows() * qc), 0.0);
  r.dk.assign(at(s.rows() * kc), 0.0);
  r.dv.assign(at(s.rows() * kc), 0.0);
  r.lse.assign(at(s.batch * s.n_heads * t), 0.0);
  std::vector<double> p(at(t)), dp(at(t));
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t h = 0; h < s.n_heads; ++h) {
      const std::int64_t kvh = h / s.group();
      auto qrow = [&](std::int64_t i) { return q.data() + (b * t + i) * qc + h * hd; };
      auto dorow = [&](std::int64_t i) { return d_o.data() + (b * t + i) * qc + h * hd; };
      auto krow = [&](std::int64_t j) { return k.data() + (b * t + j) * kc + kvh * hd; };
      auto vrow = [&](std::int64_t j) { return v.data() + (b * t + j) * kc + kvh * hd; };
      for (std::int64_t i = 0; i < t; ++i) {
        const std::int64_t keys = s.causal ? i + 1 : t;  // keys 0..keys-1 are seen
        const std::int64_t j0 = s.documents ? s.documents[b * t + i].begin : 0;  // from its document's first
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = j0; j < keys; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += qrow(i)[d] * krow(j)[d];
          p[at(j)] = scale * dot;
          m = std::max(m, p[at(j)]);
        }
        double sum = 0;
        for (std::int64_t j = j0; j < keys; ++j) sum += std::exp(p[at(j)] - m);
        const double lse = m + std::log(sum);
        r.lse[at((b * s.n_heads + h) * t + i)] = lse;
        for (std::int64_t j = j0; j < keys; ++j) p[at(j)] = std::exp(p[at(j)] - lse);
        double* o = r.o.data() + (b * t + i) * qc + h * hd;
        for (std::int64_t j = j0; j < keys; ++j)
          for (std::int64_t d = 0; d < hd; ++d) o[d] += p[at(j)] * vrow(j)[d];
        // Backward: dp_ij = dO_i . v_j, D_i = sum_j p_ij dp_ij, ds_ij = p_ij (dp_ij - D_i).
        double delta = 0;
        for (std::int64_t j = j0; j < keys; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < hd; ++d) dot += dorow(i)[d] * vrow(j)[d];
          dp[at(j)] = dot;
          delta += p[at(j)] * dot;
        }
        double* dq = r.dq.data() + (b * t + i) * qc + h * hd;
        for (std::int64_t j = j0; j < keys; ++j) {
          const double ds = p[at(j)] * (dp[at(j)] - delta);
          double* dk = r.dk.data() + (b * t + j) * kc + kvh * hd;
          double* dv = r.dv.data() + (b * t + j) * kc + kvh * hd;
          for (std::int64_t d = 0; d < hd; ++d) {
            dq[d] += scale * ds * krow(j)[d];
            dk[d] += scale * ds * qrow(i)[d];
            dv[d] += p[at(j)] * dorow(i)[d];
          }
        }
      }
    }
  return r;
}

}  // namespace tessera::testing
