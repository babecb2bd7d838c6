// Float8 GEMMs of a linear layer (ops/float8.hpp holds the recipes' casts and the functors).
//
// float8_gemm is the arithmetic every backend runs: the operands cast to float8, the
// float8 values multiplied in float, the float sums multiplied by the two inverse scales.
// cuBLASLt's float8 matmul computes the same with the same cast operands (its own order of
// sums, with fast accumulation on the forward as torchao asks); on a backend without it this
// is the emulation (float8.emulate): the operands bitwise those of the GPU, the sums in float.
// Scales are taken from each tensor's amax when it is cast (dynamic scaling), the weight
// again in the backward, as torchao recasts it there.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tessera/backend/backend.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/float8.hpp"

namespace tessera::nn {

using ops::Float8Cast;
using ops::Float8LinearCasts;
using ops::Float8Recipe;

/// An operand cast to float8: its values, the inverse scales (one, or one per row or
/// column as its cast says), and the cast.
template <Backend B>
struct Float8Operand {
  Tensor<float8_e4m3> e4m3;  // one of the two, as cast.format says
  Tensor<float8_e5m2> e5m2;
  Tensor<float> scale, inverse;
  Float8Cast cast;
  std::int64_t rows = 0, cols = 0;
};

/// `x` (rows x cols, leading dimension ld) cast to float8 by `cast`: amaxes, scales, values.
template <Backend B, class T>
Float8Operand<B> cast_to_float8(TensorView<const T> x, Float8Cast cast) {
  using ops::Float8Axis;
  Float8Operand<B> q;
  q.cast = cast;
  q.rows = x.rows();
  q.cols = x.cols();
  const std::int64_t ld = x.cols() <= 1 ? x.cols() : x.ld();
  const std::int64_t n_scales = cast.axis == Float8Axis::rows ? q.rows : cast.axis == Float8Axis::columns ? q.cols : 1;
  Tensor<float> amax = B::template empty<float>(Shape{cast.axis == Float8Axis::columns ? q.cols : q.rows});
  if (cast.axis == Float8Axis::columns)
    B::for_each(q.cols, ops::ColumnAbsMax<T>{x.data(), ld, q.rows, amax.data()});
  else
    B::for_each(q.rows, ops::RowAbsMax<T>{x.data(), ld, q.cols, amax.data()});
  if (cast.axis == Float8Axis::tensor) {
    Tensor<float> all = B::template empty<float>(Shape{1});
    B::for_each(1, ops::MaxOf{amax.data(), q.rows, all.data()});
    amax = all;
  }
  q.scale = B::template empty<float>(Shape{n_scales});
  q.inverse = B::template empty<float>(Shape{n_scales});
  const double format_max = cast.format == DType::f8e4m3 ? float8_e4m3::max() : float8_e5m2::max();
  B::for_each(n_scales, ops::Float8ScaleFromAmax{amax.data(), q.scale.data(), q.inverse.data(), format_max,
                                                 cast.power_of_two});
  const std::int64_t n = q.rows * q.cols;
  if (cast.format == DType::f8e4m3) {
    q.e4m3 = B::template empty<float8_e4m3>(Shape{q.rows, q.cols});
    B::for_each(n, ops::QuantizeFloat8<T, float8_e4m3>{x.data(), ld, q.cols, q.scale.data(), cast.axis, q.e4m3.data()});
  } else {
    TESSERA_CHECK(cast.format == DType::f8e5m2, "float8: a cast to ", name_of(cast.format), " (not a float8 format)");
    q.e5m2 = B::template empty<float8_e5m2>(Shape{q.rows, q.cols});
    B::for_each(n, ops::QuantizeFloat8<T, float8_e5m2>{x.data(), ld, q.cols, q.scale.data(), cast.axis, q.e5m2.data()});
  }
  return q;
}

/// The float8 values of `q` as floats (exact), rows x cols.
template <Backend B>
Tensor<float> float8_values(const Float8Operand<B>& q) {
  Tensor<float> f = B::template empty<float>(Shape{q.rows, q.cols});
  const std::int64_t n = q.rows * q.cols;
  if (q.cast.format == DType::f8e4m3)
    B::for_each(n, ops::Float8ToFloat<float8_e4m3>{q.e4m3.data(), f.data()});
  else
    B::for_each(n, ops::Float8ToFloat<float8_e5m2>{q.e5m2.data(), f.data()});
  return f;
}

/// C = (op(A) op(B)) / (scale_a scale_b) + beta C, A and B cast to float8 by `cast_a` and
/// `cast_b`: a scale per row of op(A) or one, per column of op(B) or one (each cast's
/// axis must run along the reduction: `what` names the GEMM in the error).
template <Backend B, class T, class C>
void float8_gemm(Trans ta, Trans tb, TensorView<const T> a, Float8Cast cast_a, TensorView<const T> b, Float8Cast cast_b,
                 float beta, TensorView<C> c, std::string_view what) {
  using ops::Float8Axis;
  const auto [m, n, k] = check_gemm(ta, tb, a, b, c);
  const Float8Axis a_along = ta == Trans::no ? Float8Axis::rows : Float8Axis::columns;
  const Float8Axis b_along = tb == Trans::no ? Float8Axis::columns : Float8Axis::rows;
  TESSERA_CHECK(cast_a.axis == Float8Axis::tensor || cast_a.axis == a_along, what,
                ": the first operand's float8 scales do not run along the GEMM's reduction");
  TESSERA_CHECK(cast_b.axis == Float8Axis::tensor || cast_b.axis == b_along, what,
                ": the second operand's float8 scales do not run along the GEMM's reduction");
  if (m == 0 || n == 0) return;
  const Float8Operand<B> qa = cast_to_float8<B>(a, cast_a), qb = cast_to_float8<B>(b, cast_b);
  const Tensor<float> fa = float8_values<B>(qa), fb = float8_values<B>(qb);
  Tensor<float> sum = B::template empty<float>(Shape{m, n});
  B::gemm(ta, tb, 1.0f, fa.cview(), fb.cview(), 0.0f, sum.view());
  B::for_each(m * n, ops::Float8GemmScale<C>{sum.data(), n, qa.inverse.data(), cast_a.axis != Float8Axis::tensor,
                                             qb.inverse.data(), cast_b.axis != Float8Axis::tensor, beta, c.data(),
                                             c.cols() <= 1 ? c.cols() : c.ld()});
}

}  // namespace tessera::nn
