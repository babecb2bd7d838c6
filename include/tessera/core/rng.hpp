// Counter-based random numbers (Philox4x32-10).
//
// A Philox draw is a pure function of (key, counter), so any element of any tensor
// can be drawn independently, on host or device, in any order. Parameter
// initialisation keys the generator with (seed, parameter name) and counts with the
// element index: a parameter's initial value never depends on how it is later
// sharded over ranks (DESIGN principle 4).
//
// Bitwise the same on every backend. A parameter is initialised by a functor
// (ops/init.hpp) that the CPU backend runs on the host and the CUDA backend on the
// device, and both must give the same bits. Philox is integer arithmetic; the normal
// transform is not, and host libm and CUDA's math library round log and cos
// differently, while nvcc contracts a * b + c into one fused multiply-add where g++ on
// x86-64 does not. So the transform uses no library transcendental: log and cos are
// written here (portable_log, portable_cos_2pi) with IEEE operations whose results are
// correctly rounded on both sides (+, -, *, / and sqrt, written through add_rn, mul_rn,
// which nvcc may not contract, and explicit fma), in a fixed order. Every product that
// feeds a sum is an explicit fma, so there is nothing left for a compiler to contract.
// They are accurate to a few ulp (tests/core), not correctly rounded: what matters is
// that they are the same function everywhere.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "tessera/core/macros.hpp"

namespace tessera {

struct Philox4x32 {
  using Counter = std::uint32_t[4];
  std::uint32_t key[2];

  TESSERA_HD explicit Philox4x32(std::uint64_t k)
      : key{static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(k >> 32)} {}

  /// Ten rounds of Philox on `ctr`; writes four independent 32-bit words to `out`.
  TESSERA_HD void operator()(const std::uint32_t ctr[4], std::uint32_t out[4]) const {
    constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
    constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
    std::uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    std::uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; ++round) {
      std::uint64_t p0 = static_cast<std::uint64_t>(kM0) * c0;
      std::uint64_t p1 = static_cast<std::uint64_t>(kM1) * c2;
      std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
      std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
      c0 = hi1 ^ c1 ^ k0;
      c1 = lo1;
      c2 = hi0 ^ c3 ^ k1;
      c3 = lo0;
      k0 += kW0;
      k1 += kW1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
  }

  /// Four words for element `index` of stream `stream`, draw `attempt`.
  TESSERA_HD void draw(std::uint64_t index, std::uint32_t stream, std::uint32_t attempt,
                       std::uint32_t out[4]) const {
    std::uint32_t ctr[4] = {static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                            stream, attempt};
    (*this)(ctr, out);
  }
};

/// A uniform double in (0, 1) from two 32-bit words (53 bits, never 0 or 1).
TESSERA_HD inline double uniform_open(std::uint32_t a, std::uint32_t b) {
  std::uint64_t bits = (static_cast<std::uint64_t>(a) << 21) ^ (b >> 11);
  bits &= (std::uint64_t{1} << 53) - 1;
  return (static_cast<double>(bits) + 0.5) / 9007199254740992.0;
}

namespace detail {

/// a * b and a + b rounded once to nearest even, never fused with a neighbouring
/// operation (nvcc's __dmul_rn / __dadd_rn on the device; g++ on x86-64 does not
/// contract without -ffp-contract and FMA instructions, and nothing here gives it a
/// product feeding a sum).
TESSERA_HD inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
TESSERA_HD inline double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
TESSERA_HD inline double fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

}  // namespace detail

/// log(u) for a finite u > 0, the same bits on host and device. u = m 2^e with m in
/// [sqrt(1/2), sqrt(2)) by exact doublings and halvings; log(m) = 2 atanh(s),
/// s = (m - 1) / (m + 1), |s| <= 0.1716, as the odd series in s to s^23 (the next term
/// is below 1e-18 of the sum); log(u) = e ln 2 + log(m) in one fma. Within 4 ulp of the
/// exact value (tests/core).
TESSERA_HD inline double portable_log(double u) {
  using detail::add_rn, detail::mul_rn, detail::fma_rn;
  constexpr double kSqrtHalf = 0.7071067811865476, kSqrtTwo = 1.4142135623730951;
  double m = u;
  double e = 0;
  while (m < kSqrtHalf) {
    m = mul_rn(m, 2.0);
    e = add_rn(e, -1.0);
  }
  while (m >= kSqrtTwo) {
    m = mul_rn(m, 0.5);
    e = add_rn(e, 1.0);
  }
  const double s = add_rn(m, -1.0) / add_rn(m, 1.0);
  const double z = mul_rn(s, s);
  // 1 / (2k + 1) for k = 11 down to 0.
  double p = 0.043478260869565216;
  p = fma_rn(p, z, 0.047619047619047616);
  p = fma_rn(p, z, 0.05263157894736842);
  p = fma_rn(p, z, 0.058823529411764705);
  p = fma_rn(p, z, 0.06666666666666667);
  p = fma_rn(p, z, 0.07692307692307693);
  p = fma_rn(p, z, 0.09090909090909091);
  p = fma_rn(p, z, 0.1111111111111111);
  p = fma_rn(p, z, 0.14285714285714285);
  p = fma_rn(p, z, 0.2);
  p = fma_rn(p, z, 0.3333333333333333);
  p = fma_rn(p, z, 1.0);
  const double log_m = mul_rn(mul_rn(2.0, s), p);
  return fma_rn(e, 0.6931471805599453, log_m);
}

/// cos(2 pi t) for t in [0, 1], the same bits on host and device. t is folded into
/// [0, 1/8] by exact subtractions (symmetries of cos), then cos or sin of x = 2 pi b in
/// [0, pi/4] by their Taylor series to x^20 (the next term is below 1e-20). Within
/// 4 ulp of the exact value away from its zeros (tests/core).
TESSERA_HD inline double portable_cos_2pi(double t) {
  using detail::add_rn, detail::mul_rn, detail::fma_rn;
  double a = t > 0.5 ? add_rn(t, -1.0) : t;  // exact (Sterbenz): a in [-1/2, 1/2]
  a = a < 0 ? -a : a;                         // cos is even
  double sign = 1.0;
  if (a > 0.25) {  // cos(2 pi a) = -cos(2 pi (1/2 - a))
    a = add_rn(0.5, -a);
    sign = -1.0;
  }
  const bool use_sin = a > 0.125;  // cos(2 pi a) = sin(2 pi (1/4 - a))
  const double b = use_sin ? add_rn(0.25, -a) : a;
  const double x = mul_rn(b, 6.283185307179586);
  const double x2 = mul_rn(x, x);
  double r;
  if (use_sin) {  // 1 / (2k + 1)! with alternating signs, k = 10 down to 0
    double p = 1.9572941063391263e-20;
    p = fma_rn(p, x2, -8.22063524662433e-18);
    p = fma_rn(p, x2, 2.8114572543455206e-15);
    p = fma_rn(p, x2, -7.647163731819816e-13);
    p = fma_rn(p, x2, 1.6059043836821613e-10);
    p = fma_rn(p, x2, -2.505210838544172e-08);
    p = fma_rn(p, x2, 2.7557319223985893e-06);
    p = fma_rn(p, x2, -0.0001984126984126984);
    p = fma_rn(p, x2, 0.008333333333333333);
    p = fma_rn(p, x2, -0.16666666666666666);
    p = fma_rn(p, x2, 1.0);
    r = mul_rn(x, p);
  } else {  // 1 / (2k)! with alternating signs, k = 10 down to 0
    double p = 4.110317623312165e-19;
    p = fma_rn(p, x2, -1.5619206968586225e-16);
    p = fma_rn(p, x2, 4.779477332387385e-14);
    p = fma_rn(p, x2, -1.1470745597729725e-11);
    p = fma_rn(p, x2, 2.08767569878681e-09);
    p = fma_rn(p, x2, -2.755731922398589e-07);
    p = fma_rn(p, x2, 2.48015873015873e-05);
    p = fma_rn(p, x2, -0.001388888888888889);
    p = fma_rn(p, x2, 0.041666666666666664);
    p = fma_rn(p, x2, -0.5);
    r = fma_rn(p, x2, 1.0);
  }
  return mul_rn(sign, r);
}

/// A standard normal from four words (Box-Muller on two 53-bit uniforms), with the
/// portable log and cos above: the same bits on host and device.
TESSERA_HD inline double standard_normal(const std::uint32_t w[4]) {
  using detail::mul_rn;
  const double u1 = uniform_open(w[0], w[1]);
  const double u2 = uniform_open(w[2], w[3]);
  return mul_rn(std::sqrt(mul_rn(-2.0, portable_log(u1))), portable_cos_2pi(u2));
}

/// splitmix64 finaliser: spreads a 64-bit value over all bits.
TESSERA_HD inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// FNV-1a over a name, for keying a generator by parameter name.
inline std::uint64_t hash_name(std::string_view name) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

/// The Philox key of the parameter `name` under `seed`.
inline std::uint64_t parameter_key(std::uint64_t seed, std::string_view name) {
  return mix64(seed ^ mix64(hash_name(name)));
}

/// The generator for the parameter `name` under `seed`.
inline Philox4x32 parameter_rng(std::uint64_t seed, std::string_view name) {
  return Philox4x32(parameter_key(seed, name));
}

/// Element `index` of a normal(mean, std) truncated to [lo, hi], drawn by rejection on
/// successive attempts of the same counter, so the result depends only on
/// (generator, index).
TESSERA_HD inline double truncated_normal(const Philox4x32& rng, std::uint64_t index, double mean,
                                          double std, double lo, double hi) {
  std::uint32_t w[4];
  for (std::uint32_t attempt = 0; attempt < 256; ++attempt) {
    rng.draw(index, 0, attempt, w);
    const double x = detail::fma_rn(std, standard_normal(w), mean);
    if (x >= lo && x <= hi) return x;
  }
  // Reached only when [lo, hi] holds almost no mass: fall back to the nearer bound.
  return mean < lo ? lo : (mean > hi ? hi : mean);
}

/// Element `index` of a normal(mean, std).
TESSERA_HD inline double normal(const Philox4x32& rng, std::uint64_t index, double mean, double std) {
  std::uint32_t w[4];
  rng.draw(index, 0, 0, w);
  return detail::fma_rn(std, standard_normal(w), mean);
}

/// Element `index` of a uniform draw on (lo, hi): lo + (hi - lo) u, rounded once each.
TESSERA_HD inline double uniform(const Philox4x32& rng, std::uint64_t index, double lo, double hi) {
  std::uint32_t w[4];
  rng.draw(index, 0, 0, w);
  return detail::fma_rn(hi - lo, uniform_open(w[0], w[1]), lo);
}

}  // namespace tessera
