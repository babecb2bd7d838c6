// Element types: fp32, fp64 (for gradient checks), bf16 storage, and the two float8
// storage formats (core/float8.hpp: operands of float8 GEMMs, never a model's type).
//
// bf16 is a storage type: arithmetic happens in fp32 after conversion, and the
// conversion back rounds to nearest even, as the hardware does. NaN stays NaN.
//
// accum_t<T> is the type arithmetic, statistics and gradients use for storage type T:
// float for bf16, T itself for float and double. Code written for any T reads elements
// with to_accum (exact), computes in accum_t<T> and writes results with from_accum<T>
// (one rounding to nearest even for bf16); for float and double both are the identity,
// so such code compiles to what it would be written directly in T.
#pragma once

#include <bit>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "tessera/core/bits.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/macros.hpp"

namespace tessera {

struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  TESSERA_HD explicit bf16(float f) : bits(round_bits(f)) {}
  TESSERA_HD explicit operator float() const { return from_bits_to_float(bits); }

  TESSERA_HD static bf16 from_bits(std::uint16_t b) {
    bf16 v;
    v.bits = b;
    return v;
  }

  TESSERA_HD static std::uint16_t round_bits(float f) {
    std::uint32_t u = detail::float_bits(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    }
    std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>((u + rounding) >> 16);
  }

  TESSERA_HD static float from_bits_to_float(std::uint16_t b) {
    return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
  }
};

/// Rounds an fp32 value to the nearest bf16-representable value.
TESSERA_HD inline float round_to_bf16(float f) { return static_cast<float>(bf16(f)); }

enum class DType : std::uint8_t { f32, f64, bf16, f8e4m3, f8e5m2 };

constexpr std::size_t size_of(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f8e4m3: return 1;
    case DType::f8e5m2: return 1;
  }
  return 0;
}

/// PyTorch's names (torch.float8_e4m3fn, torch.float8_e5m2).
constexpr std::string_view name_of(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f8e4m3: return "float8_e4m3fn";
    case DType::f8e5m2: return "float8_e5m2";
  }
  return "?";
}

/// Parses the names configs use ("float32", "bfloat16", "float64"); `what` names
/// the key in the error.
inline DType parse_dtype(std::string_view s, std::string_view what) {
  if (s == "float32" || s == "fp32") return DType::f32;
  if (s == "bfloat16" || s == "bf16") return DType::bf16;
  if (s == "float64" || s == "fp64") return DType::f64;
  fail(what, ": unknown dtype '", s, "' (expected float32, bfloat16 or float64)");
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, bf16>) return DType::bf16;
  else if constexpr (std::is_same_v<T, float8_e4m3>) return DType::f8e4m3;
  else if constexpr (std::is_same_v<T, float8_e5m2>) return DType::f8e5m2;
  else static_assert(sizeof(T) == 0, "tessera: dtype_of<T>: T must be float, double, bf16 or a float8 type");
}

namespace detail {
template <class T>
struct Accum {
  using type = T;
};
template <>
struct Accum<bf16> {
  using type = float;
};
}  // namespace detail

/// The type arithmetic, statistics and gradients use for storage type T: float for
/// bf16, T otherwise.
template <class T>
using accum_t = typename detail::Accum<T>::type;

/// An element in its arithmetic type: exact (every bf16 value is a float); the
/// identity for float and double.
template <class T>
TESSERA_HD inline accum_t<T> to_accum(T v) {
  if constexpr (std::is_same_v<T, bf16>) return static_cast<float>(v);
  else return v;
}

/// A result stored as T: rounded to nearest even for bf16; the identity for float and
/// double. T is given explicitly: from_accum<T>(x).
template <class T>
TESSERA_HD inline T from_accum(accum_t<T> v) {
  if constexpr (std::is_same_v<T, bf16>) return bf16(v);
  else return v;
}

/// Converts between element types through fp32 (or fp64 when both sides are fp64).
template <class To, class From>
TESSERA_HD To convert(From v) {
  if constexpr (std::is_same_v<To, From>) return v;
  else if constexpr (std::is_same_v<To, bf16>) return bf16(static_cast<float>(v));
  else if constexpr (std::is_same_v<From, bf16>) return static_cast<To>(static_cast<float>(v));
  else return static_cast<To>(v);
}

}  // namespace tessera
