// Scalar helpers shared by the ops: exp, log, sqrt and sigmoid for float and double,
// on host and device. They take the arithmetic type accum_t<T> (core/dtype.hpp), never
// bf16: a functor over bf16 storage converts with to_accum first.
//
// exp_nonpositive for float is written out (Cody-Waite range reduction and a degree-6
// polynomial, within 1 ulp of the exact value on [-87.3, 0], results below 2^-126
// flushed to 2^-126, NaN kept) so loops over it vectorise: a call into libm stops the
// compiler from vectorising the softmax and cross-entropy rows, the bulk of the CPU
// attention's time. Its arguments are never positive there (x - max). double keeps
// std::exp (the gradient checks run in double), and so does exp_ for other uses.
//
// mul_rn and add_rn are a product and a sum rounded once each, never fused: nvcc
// contracts a * b + c into one fma by default and g++ (ISO C++ on x86-64) does not, so
// arithmetic whose bits must agree between the backends (the optimizer's, whose
// rounding to bf16 would otherwise differ now and then) is written with them.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"

namespace tessera::ops {

namespace detail {

/// Whether storage type T is its own arithmetic type (float, double). A functor may
/// then keep intermediates in its output row, as it does for speed; for bf16 it keeps
/// them in accum_t<T> and rounds each output once.
template <class T>
inline constexpr bool accum_is_storage = std::is_same_v<T, accum_t<T>>;

}  // namespace detail

/// e^x for float x <= 0 in straight-line arithmetic (vectorisable).
TESSERA_HD inline float exp_poly(float x) {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  // All ones when x is NaN: the result is then x itself, chosen with bit masks (a
  // select between float values would stop the vectoriser).
  const std::uint32_t nan_mask = 0u - static_cast<std::uint32_t>((bits & 0x7fffffffu) > 0x7f800000u);
  // Clamp below at -87.33654 (e^x = 2^-126) on the bit pattern: negative floats order
  // like their bits as unsigned integers, and an integer min vectorises where a float
  // comparison (which may trap) does not.
  const float xc = std::bit_cast<float>(std::min(bits, std::uint32_t{0xc2aeac4fu}));
  // xc = k ln2 + r, |r| <= ln2 / 2, ln2 split in a short high part and a low correction;
  // adding and removing 1.5 * 2^23 rounds to the nearest integer without a branch.
  const float t = xc * 1.44269504f;
  const float kf = (t + 12582912.0f) - 12582912.0f;
  const float r = (xc - kf * 0.693359375f) + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^k built in the exponent field (k in [-126, 0]).
  const auto k = static_cast<std::int32_t>(kf);
  const float e = p * std::bit_cast<float>(static_cast<std::uint32_t>(k + 127) << 23);
  return std::bit_cast<float>((bits & nan_mask) | (std::bit_cast<std::uint32_t>(e) & ~nan_mask));
}

/// e^x for x <= 0.
template <class T>
TESSERA_HD inline T exp_nonpositive(T x) {
  if constexpr (sizeof(T) == 4) return exp_poly(x);
  else return std::exp(x);
}

template <class T>
TESSERA_HD inline T exp_(T x) {
  return std::exp(x);
}
template <class T>
TESSERA_HD inline T log_(T x) {
  return std::log(x);
}
template <class T>
TESSERA_HD inline T sqrt_(T x) {
  return std::sqrt(x);
}

/// a * b, rounded to T once and never fused with a neighbouring add.
template <class T>
TESSERA_HD inline T mul_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __fmul_rn(a, b);
  else return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

/// a + b, rounded to T once and never fused with a neighbouring product.
template <class T>
TESSERA_HD inline T add_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __fadd_rn(a, b);
  else return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

template <class T>
TESSERA_HD inline T sigmoid(T x) {
  return T(1) / (T(1) + exp_(-x));
}

/// The larger of m and |v|; a NaN wins (a float8 scale taken from it is NaN, as
/// torch.max's amax): the step of an amax (ops/float8.hpp).
TESSERA_HD inline float max_abs(float m, float v) {
  const float a = std::fabs(v);
  return a > m || a != a ? a : m;
}

/// The larger of two non-negative values or NaNs, a NaN winning (either order gives a
/// NaN or the same number): amaxes combined.
TESSERA_HD inline float max_nan(float m, float v) { return v > m || v != v ? v : m; }

}  // namespace tessera::ops
