// Parameter initialisation: element i of a parameter as a function of (seed, name, i).
//
// InitValues writes out[i] for every index of its launch: a constant (ones, zeros), a
// normal(0, std), a normal(0, std) truncated to [lo, hi] by rejection over the
// attempts of the same Philox counter, or a uniform on (lo, hi) (core/rng.hpp). Both backends run this same code
// (the CPU backend loops over it, the CUDA backend launches it), and the normal transform
// uses only operations that round the same way on host and device, so a parameter made on
// a GPU holds bitwise the values the CPU backend makes. `where` maps out[i] to its element
// of the whole parameter, for initialising a piece of one (a tensor-parallel piece, or a
// stretch of one in a data-parallel shard): the values are those of the whole, bitwise.
#pragma once

#include <cstdint>
#include <type_traits>

#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// How the values are drawn (nn::Init's kinds).
enum class InitKind : std::uint8_t { ones, zeros, normal, truncated_normal, uniform };

/// Where element i of a stretch of a piece lies in the whole parameter. The whole is
/// seen as a matrix of `whole_cols` columns (a vector as one row); the piece is the
/// rectangle of `piece_cols` columns whose first element is (row0, col0) of the whole,
/// read row by row; the stretch starts at element `first` of the piece. The defaults
/// are the whole itself (element first + i).
struct PieceIndex {
  std::uint64_t first = 0;
  std::uint64_t whole_cols = 1, piece_cols = 1;
  std::uint64_t row0 = 0, col0 = 0;

  TESSERA_HD std::uint64_t operator()(std::uint64_t i) const {
    const std::uint64_t e = first + i;
    return (row0 + e / piece_cols) * whole_cols + col0 + e % piece_cols;
  }
};

template <class T>
struct InitValues {
  T* out;
  std::uint64_t key;  // the Philox key: parameter_key(seed, name)
  InitKind kind;
  double std = 0, lo = -2, hi = 2;
  PieceIndex where{};  // out[i] is element where(i) of the whole parameter

  /// The value of element `index` of the whole parameter, in double.
  TESSERA_HD double value(std::uint64_t index) const {
    switch (kind) {
      case InitKind::ones: return 1.0;
      case InitKind::zeros: return 0.0;
      case InitKind::normal: return normal(Philox4x32(key), index, 0.0, std);
      case InitKind::truncated_normal: return truncated_normal(Philox4x32(key), index, 0.0, std, lo, hi);
      case InitKind::uniform: return uniform(Philox4x32(key), index, lo, hi);
    }
    return 0.0;
  }
  TESSERA_HD void operator()(std::int64_t i) const {
    const double v = value(where(static_cast<std::uint64_t>(i)));
    if constexpr (std::is_same_v<T, double>) out[i] = v;
    else out[i] = static_cast<T>(static_cast<float>(v));  // bf16 rounds from the float once rounded
  }
  // Each element written once. Per normal draw: Philox's 10 rounds (2 multiplications and
  // 4 xors or adds each, counted as 60), the uniforms (4), the log (about 30, with its
  // range reduction), the cos (about 25), the product and square root (3); a truncated
  // draw is redrawn with probability P(outside), small for the bounds torchtitan uses,
  // so counted once. fp64 operations count as two fp32 ones (half the rate on the GPUs
  // profiled); the square root is the one transcendental. The index map's division and
  // remainder are integer work, not counted.
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    Traffic t{0, e * sizeof(T), 0, 0};
    if (kind == InitKind::normal || kind == InitKind::truncated_normal) {
      t.flops = e * (60 + 2 * (4 + 30 + 25 + 3));
      t.transcendentals = e;
    } else if (kind == InitKind::uniform) {
      t.flops = e * (60 + 4 + 2);  // Philox, the uniform, the scale and shift
    }
    return t;
  }
};

}  // namespace tessera::ops
