// The two float8 formats of Hopper's tensor cores (and of torchao's float8 training), as
// storage types: float8_e4m3 (OCP's E4M3FN: 4 exponent bits, bias 7, 3 mantissa bits, no
// infinities, one NaN pattern a sign, largest 448) and float8_e5m2 (5 exponent bits, bias
// 15, 2 mantissa bits, IEEE-style infinities and NaNs, largest 57344).
//
// A float becomes float8 by rounding to nearest, ties to even, and saturating: a value
// past the largest finite one (an infinity too) becomes that value with its sign, as
// torchao's to_fp8_saturated (clamp, then cast) and the hardware's cvt...satfinite do;
// NaN stays NaN; a value below half the smallest subnormal becomes zero with its sign.
// The rounding is integer arithmetic on the float's bits (on Ada and Hopper, the device's
// own conversion instruction, which rounds and saturates the same way), so the host and
// the device give the same byte for every input: tests/core/test_float8.cpp checks every bf16 input and a
// large sample of floats against the ml_dtypes package (fixtures by tools/make_fixtures.py).
// A float8 value becomes a float exactly.
#pragma once

#include <cstdint>

#include "tessera/core/bits.hpp"
#include "tessera/core/macros.hpp"

namespace tessera {

namespace detail {

/// A float8 format: kExp exponent bits of bias kBias, kMan mantissa bits; kMaxCode the
/// largest finite value's code (sign clear), kNanCode the NaN the encoder writes.
template <int kExp, int kMan, int kBias, std::uint8_t kMaxCode, std::uint8_t kNanCode, bool kHasInf>
struct Float8Format {
  static constexpr int exponent_bits = kExp;
  static constexpr int mantissa_bits = kMan;
  static constexpr int bias = kBias;
  static constexpr std::uint8_t max_code = kMaxCode;
  static constexpr std::uint8_t nan_code = kNanCode;
  static constexpr bool has_inf = kHasInf;

  /// The float a code stands for (exact).
  TESSERA_HD static float decode(std::uint8_t c) {
    const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x80u) << 24;
    const int e = (c >> kMan) & ((1 << kExp) - 1);
    const std::uint32_t m = c & ((1u << kMan) - 1u);
    if (kHasInf && e == (1 << kExp) - 1) return bits_float(sign | 0x7f800000u | (m != 0 ? 0x00400000u : 0u));
    if (!kHasInf && (c & 0x7fu) == 0x7fu) return bits_float(sign | 0x7fc00000u);
    if (e == 0) {
      // A subnormal: m x 2^(1 - bias - kMan), exact in a float.
      const float unit = bits_float(static_cast<std::uint32_t>(127 + 1 - kBias - kMan) << 23);
      return bits_float(sign | float_bits(static_cast<float>(m) * unit));
    }
    return bits_float(sign | (static_cast<std::uint32_t>(e - kBias + 127) << 23) | (m << (23 - kMan)));
  }

  /// The code of `f`, rounded to nearest even and saturated (the header says how).
  TESSERA_HD static std::uint8_t encode(float f) {
    const std::uint32_t u = float_bits(f);
    const auto sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | kNanCode);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // Ada and Hopper convert in one instruction with the same rounding and saturation
    // (PTX ISA, cvt.rn.satfinite to e4m3x2 or e5m2x2: nearest even, an infinity or a
    // value past the largest finite one to that value with its sign); NaN is handled
    // above. The second operand, the pair's high byte, is a zero left unused.
    static_assert((kExp == 4 && kMan == 3 && kBias == 7) || (kExp == 5 && kMan == 2 && kBias == 15),
                  "the device converts to E4M3FN and E5M2 only");
    std::uint16_t pair;
    if constexpr (kExp == 4)
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
    else
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(f));
    return static_cast<std::uint8_t>(pair & 0xffu);
#else
    if (a >= float_bits(decode(kMaxCode))) return static_cast<std::uint8_t>(sign | kMaxCode);
    // The float as significand x 2^(e - 23), its hidden bit made explicit.
    int e = static_cast<int>(a >> 23) - 127;
    std::uint32_t significand = a & 0x7fffffu;
    if (a >= 0x00800000u)
      significand |= 0x800000u;
    else
      e = -126;  // a float subnormal: far below any float8 value, rounds to zero
    // The exponent the result is written at: its own, or the smallest normal's, where the
    // result is subnormal. Dropping `shift` bits leaves the significand in units of
    // 2^(target - kMan).
    const int min_exponent = 1 - kBias;
    const int target = e > min_exponent ? e : min_exponent;
    const int shift = 23 - kMan + (target - e);
    if (shift > 24) return sign;  // under half the smallest subnormal
    std::uint32_t q = significand >> shift;
    const std::uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
    // Round half to even, without a branch: the rounding bit is data, which a branch
    // would mispredict for half the values of a tensor.
    q += static_cast<std::uint32_t>(rest > half) | (static_cast<std::uint32_t>(rest == half) & q);
    // q < 2^kMan: a subnormal (exponent field 0); 2^kMan <= q: normal, and a carry to
    // 2^(kMan + 1) moves into the exponent field by the same sum.
    const std::uint32_t code = (static_cast<std::uint32_t>(target + kBias) << kMan) + q - (1u << kMan);
    return static_cast<std::uint8_t>(sign | code);
#endif
  }
};

}  // namespace detail

/// A float8 storage type of format F (its bits; conversions through float).
template <class F>
struct float8 {
  using format = F;
  std::uint8_t bits = 0;

  float8() = default;
  TESSERA_HD explicit float8(float f) : bits(F::encode(f)) {}
  TESSERA_HD explicit operator float() const { return F::decode(bits); }
  TESSERA_HD static float8 from_bits(std::uint8_t b) {
    float8 v;
    v.bits = b;
    return v;
  }
  /// The largest finite value.
  static constexpr float max() { return F::max_value; }
};

namespace detail {
struct E4M3 : Float8Format<4, 3, 7, 0x7e, 0x7f, false> {
  static constexpr float max_value = 448.0f;
};
struct E5M2 : Float8Format<5, 2, 15, 0x7b, 0x7e, true> {
  static constexpr float max_value = 57344.0f;
};
}  // namespace detail

/// E4M3FN: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest 448.
using float8_e4m3 = float8<detail::E4M3>;
/// E5M2: 5 exponent bits (bias 15), 2 mantissa bits, infinities and NaNs, largest 57344.
using float8_e5m2 = float8<detail::E5M2>;

/// `f` rounded to the nearest value of float8 format F (saturated), as a float.
template <class F>
TESSERA_HD inline float round_to_float8(float f) {
  return static_cast<float>(F(f));
}

}  // namespace tessera
