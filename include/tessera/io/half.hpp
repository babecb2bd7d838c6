// IEEE half precision (binary16, safetensors' F16) as raw bits: it has no type in core/.
// Conversions from double to a 16-bit format (f16, bf16) round once, directly (through
// round-to-odd), not twice via float.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "tessera/core/dtype.hpp"

namespace tessera::io {

/// Exact: every half value is a float. Keeps the sign of zero, infinities and NaN payloads.
inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/// Rounds to the nearest half, ties to even; beyond 65504 (from 65520 up) gives infinity,
/// below the smallest subnormal gives signed zero; NaN stays a (quiet) NaN.
inline std::uint16_t float_to_f16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {
    if (magnitude == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520
  if (magnitude < 0x38800000u) {
    // Below 2^-14: a half subnormal m * 2^-24 (or zero); m may round up to 0x400, the
    // smallest normal, which the same bit pattern already encodes.
    const std::uint32_t exponent = magnitude >> 23;
    if (exponent < 102) return sign;  // below 2^-25: rounds to zero
    const std::uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14 .. 24
    std::uint32_t m = significand >> shift;
    const std::uint32_t rest = significand & ((1u << shift) - 1u);
    const std::uint32_t half_way = 1u << (shift - 1u);
    if (rest > half_way || (rest == half_way && (m & 1u))) ++m;
    return static_cast<std::uint16_t>(sign | m);
  }
  std::uint32_t h = (magnitude - 0x38000000u) >> 13;  // rebias exponent 127 -> 15
  const std::uint32_t rest = magnitude & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

namespace detail {

/// double -> float rounding to odd: exact values stay; an inexact one becomes whichever
/// float neighbour has an odd last bit. Rounding that result to any format with at
/// least two fewer significand bits (bf16, f16) gives the correctly rounded value.
inline float round_to_odd_float(double d) {
  if (std::isnan(d)) return static_cast<float>(d);
  float f = static_cast<float>(d);
  if (static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) {
    f = std::nextafter(f, 0.0f);  // the neighbour towards zero
  }
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
}

}  // namespace detail

/// Rounds a double to the nearest half, ties to even, in one rounding.
inline std::uint16_t double_to_f16(double d) {
  return float_to_f16(detail::round_to_odd_float(d));
}

/// Rounds a double to the nearest bf16, ties to even, in one rounding.
inline bf16 double_to_bf16(double d) { return bf16(detail::round_to_odd_float(d)); }

}  // namespace tessera::io
