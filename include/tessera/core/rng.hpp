// Counter-based random numbers (Philox4x32-10).
//
// A Philox draw is a pure function of (key, counter), so any element of any tensor
// can be drawn independently, on host or device, in any order. Parameter
// initialisation keys the generator with (seed, parameter name) and counts with the
// element index: a parameter's initial value never depends on how it is later
// sharded over ranks (DESIGN principle 4).
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

/// A standard normal from four words (Box-Muller on two 53-bit uniforms).
TESSERA_HD inline double standard_normal(const std::uint32_t w[4]) {
  double u1 = uniform_open(w[0], w[1]);
  double u2 = uniform_open(w[2], w[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
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

/// The generator for the parameter `name` under `seed`.
inline Philox4x32 parameter_rng(std::uint64_t seed, std::string_view name) {
  return Philox4x32(mix64(seed ^ mix64(hash_name(name))));
}

/// Element `index` of a normal(mean, std) truncated to [lo, hi], drawn by rejection on
/// successive attempts of the same counter, so the result depends only on
/// (generator, index).
TESSERA_HD inline double truncated_normal(const Philox4x32& rng, std::uint64_t index, double mean,
                                          double std, double lo, double hi) {
  std::uint32_t w[4];
  for (std::uint32_t attempt = 0; attempt < 256; ++attempt) {
    rng.draw(index, 0, attempt, w);
    double x = mean + std * standard_normal(w);
    if (x >= lo && x <= hi) return x;
  }
  // Reached only when [lo, hi] holds almost no mass: fall back to the nearer bound.
  return mean < lo ? lo : (mean > hi ? hi : mean);
}

/// Element `index` of a normal(mean, std).
TESSERA_HD inline double normal(const Philox4x32& rng, std::uint64_t index, double mean, double std) {
  std::uint32_t w[4];
  rng.draw(index, 0, 0, w);
  return mean + std * standard_normal(w);
}

}  // namespace tessera
