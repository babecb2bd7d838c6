// Rotary position embedding in the Hugging Face half-split convention, with Llama 3.1
// frequency scaling.
//
// Head dimension d is split in halves: element i pairs with i + d/2 and rotates by
// angle pos * inv_freq[i]:
//   x'[i]       = x[i] cos - x[i + d/2] sin
//   x'[i + d/2] = x[i + d/2] cos + x[i] sin
// The backward is the same rotation by -angle. Each output element is computed in
// accum_t<T> from elements, cos and sin read as stored, and rounded once.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/positions.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// Llama 3.1 RoPE frequency scaling (Hugging Face rope_type "llama3").
struct RopeScaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position = 8192;
};

/// inv_freq[i] = theta^(-2i/d) for i < d/2, rescaled as Llama 3.1 does when
/// `scaling.enabled`: long wavelengths divided by factor, short ones kept, a smooth
/// blend between.
inline std::vector<double> rope_inv_freq(std::int64_t head_dim, double theta, const RopeScaling& scaling) {
  const double pi = 3.14159265358979323846;
  std::vector<double> f(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i)
    f[i] = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  if (!scaling.enabled) return f;
  const double old_len = static_cast<double>(scaling.original_max_position);
  const double low_wavelen = old_len / scaling.low_freq_factor;
  const double high_wavelen = old_len / scaling.high_freq_factor;
  for (auto& v : f) {
    double wavelen = 2 * pi / v;
    if (wavelen > low_wavelen) {
      v = v / scaling.factor;
    } else if (wavelen >= high_wavelen) {
      double smooth = (old_len / wavelen - scaling.low_freq_factor) /
                      (scaling.high_freq_factor - scaling.low_freq_factor);
      v = (1 - smooth) * v / scaling.factor + smooth * v;
    }
  }
  return f;
}

/// Rotates every head of row r in place. Row r sits at position positions(r).
template <class T>
struct RopeRotate {
  T* x;  // (rows, n_heads * head_dim), leading dimension ld
  std::int64_t ld;
  std::int64_t n_heads;
  std::int64_t head_dim;
  RowPositions positions;
  const T* cos;  // (positions.end(), head_dim / 2)
  const T* sin;
  bool inverse;           // rotate by -angle (the backward)
  const T* src = nullptr;  // rotate src (same layout) into x; nullptr: x in place
  TESSERA_HD void operator()(std::int64_t r) const {
    const std::int64_t half = head_dim / 2;
    const std::int64_t pos = positions(r);
    const T* c = cos + pos * half;
    const T* s = sin + pos * half;
    T* row = x + r * ld;
    const T* in_row = src ? src + r * ld : row;
    for (std::int64_t h = 0; h < n_heads; ++h) {
      T* v = row + h * head_dim;
      const T* u = in_row + h * head_dim;
      for (std::int64_t i = 0; i < half; ++i) {
        const accum_t<T> si = inverse ? -to_accum(s[i]) : to_accum(s[i]);
        const accum_t<T> a = to_accum(u[i]), b = to_accum(u[i + half]);
        v[i] = from_accum<T>(a * to_accum(c[i]) - b * si);
        v[i + half] = from_accum<T>(b * to_accum(c[i]) + a * si);
      }
    }
  }
  // Every row's heads read (from src, or x in place) and written; the cos and sin rows of
  // the positions the launch touches read once; 6 flops a pair.
  Traffic traffic(std::int64_t rows) const {
    const double half = static_cast<double>(head_dim / 2), r = static_cast<double>(rows);
    const double table_rows = static_cast<double>(positions.distinct(rows));
    const double e = r * static_cast<double>(n_heads) * 2 * half;
    return {e * sizeof(T) + 2 * table_rows * half * sizeof(T), e * sizeof(T), 3 * e, 0};
  }
};

}  // namespace tessera::ops
