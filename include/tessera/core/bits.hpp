// A float's bits and back, on the host and the device alike (a union: constexpr-free, but
// what nvcc and g++ both compile to a register move).
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"

namespace tessera::detail {

TESSERA_HD inline std::uint32_t float_bits(float f) {
  union {
    float f;
    std::uint32_t u;
  } v{f};
  return v.u;
}

TESSERA_HD inline float bits_float(std::uint32_t u) {
  union {
    std::uint32_t u;
    float f;
  } v{u};
  return v.f;
}

}  // namespace tessera::detail
