// Float8 scaling, as torchao's float8 training does it (torchao/float8/float8_utils.py):
// a tensor's scale is the format's largest value over the tensor's largest magnitude
// (amax, at least 1e-12), taken in double and stored as a float, optionally rounded down to
// a power of two; the tensor is multiplied by it in float and converted with saturation
// (core/float8.hpp); a GEMM of float8 operands multiplies its float sums by the two
// inverses (cuBLASLt's A and B scales: D = scale_a scale_b (A B)). A scale is taken over
// the whole tensor, or one per row or per column (torchao's axiswise scaling along the
// dimension a GEMM reduces over).
//
// A linear layer's three GEMMs cast their operands by torchao's recipes (the names
// torchtitan's float8.recipe_name takes):
//
//   recipe              y = x W^T             dx = dy W                  dW = dy^T x
//   tensorwise          x e4m3, W e4m3        dy e5m2, W e4m3            dy e5m2, x e4m3
//   rowwise             x, W e4m3 by row      dy e4m3 by row,            dy, x e4m3 by column
//                                             W e4m3 by column
//   rowwise_with_gw_hp  x, W e4m3 by row      dy e4m3 by row, W e4m3     in the model's precision
//
// "by row" / "by column": one scale per row or column of the matrix as stored, along the
// dimension the GEMM reduces over; rowwise rounds its scales down to powers of two
// (round_scales_to_power_of_2).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::ops {

/// torchao's EPS: the smallest amax a scale is taken from.
inline constexpr double kFloat8AmaxFloor = 1e-12;

/// Which of a rows x cols matrix's elements share a scale.
enum class Float8Axis : std::uint8_t {
  tensor,   // one scale
  rows,     // one per row (amax along the row: the GEMM reduces over columns)
  columns,  // one per column (amax down the column: the GEMM reduces over rows)
};

/// The scale index of element (r, c) for `axis`.
TESSERA_HD inline std::int64_t float8_scale_index(Float8Axis axis, std::int64_t r, std::int64_t c) {
  return axis == Float8Axis::tensor ? 0 : axis == Float8Axis::rows ? r : c;
}

/// out[r] = max_j |x[r, j]|, as a float; index r.
template <class T>
struct RowAbsMax {
  const T* x;
  std::int64_t ld, cols;
  float* out;
  TESSERA_HD void operator()(std::int64_t r) const {
    float m = 0;
    for (std::int64_t j = 0; j < cols; ++j) m = max_abs(m, static_cast<float>(to_accum(x[r * ld + j])));
    out[r] = m;
  }
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(cols);
    return {e * sizeof(T), r * sizeof(float), e, 0};
  }
};

/// out[c] = max_i |x[i, c]| over `rows` rows, as a float; index c (each walks its column).
template <class T>
struct ColumnAbsMax {
  const T* x;
  std::int64_t ld, rows;
  float* out;
  TESSERA_HD void operator()(std::int64_t c) const {
    float m = 0;
    for (std::int64_t i = 0; i < rows; ++i) m = max_abs(m, static_cast<float>(to_accum(x[i * ld + c])));
    out[c] = m;
  }
  Traffic traffic(std::int64_t cols) const {
    const double c = static_cast<double>(cols), e = c * static_cast<double>(rows);
    return {e * sizeof(T), c * sizeof(float), e, 0};
  }
};

/// The largest of in[0..n) (NaN wins; 0 for n = 0), walked in order.
TESSERA_HD inline float max_of(const float* in, std::int64_t n) {
  float m = 0;
  for (std::int64_t i = 0; i < n; ++i) m = max_nan(m, in[i]);
  return m;
}

/// out[0] = max of in[0..n) (NaN wins; 0 for n = 0); one index. `finish` is what the
/// one index does with the maximum (the CUDA kernel reduces over a block, then calls it).
struct MaxOf {
  const float* in;
  std::int64_t n;
  float* out;
  TESSERA_HD void finish(float m) const { out[0] = m; }
  TESSERA_HD void operator()(std::int64_t) const { finish(max_of(in, n)); }
  Traffic traffic(std::int64_t) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(float), sizeof(float), e, 0};
  }
};

/// The largest power of two not above `s` (a positive float; 0 and infinity stay), as
/// torch.exp2(torch.floor(torch.log2(s))) gives it.
TESSERA_HD inline float power_of_two_below(float s) {
  const std::uint32_t u = tessera::detail::float_bits(s);
  if (u >= 0x7f800000u || u == 0) return s;  // infinity, NaN, zero
  if (u >= 0x00800000u) return tessera::detail::bits_float(u & 0xff800000u);
  std::uint32_t top = 0x00400000u;  // a subnormal: its highest set bit
  while ((u & top) == 0) top >>= 1;
  return tessera::detail::bits_float(top);
}

/// float(max / max(double(amax), 1e-12)), a power of two not above it when `power_of_two`:
/// the scale of a float8 cast whose values' largest magnitude is amax.
TESSERA_HD inline float float8_scale(float amax, double format_max, bool power_of_two) {
  const double a = static_cast<double>(amax);
  const float s = static_cast<float>(format_max / (a > kFloat8AmaxFloor || a != a ? a : kFloat8AmaxFloor));
  return power_of_two ? power_of_two_below(s) : s;
}

/// scale[i] = float8_scale(amax[i]), and inverse[i] = 1 / scale[i], the GEMM's; index i.
struct Float8ScaleFromAmax {
  const float* amax;
  float* scale;
  float* inverse;
  double format_max;
  bool power_of_two;
  TESSERA_HD void operator()(std::int64_t i) const {
    const float s = float8_scale(amax[i], format_max, power_of_two);
    scale[i] = s;
    inverse[i] = 1.0f / s;
  }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(float), 2 * e * sizeof(float), 3 * e, 0};
  }
};

/// A tensor's one scale from the amaxes of its n rows (or of any split of it): scale[0] =
/// float8_scale(max of amax[0..n)) (NaN wins) and inverse[0] = 1 / scale[0], as MaxOf
/// then Float8ScaleFromAmax give them, in one launch; one index (the CUDA kernel is
/// MaxOf's, reducing over a block, then `finish`).
struct Float8ScaleFromAmaxes {
  const float* in;  // the amaxes
  std::int64_t n;
  float* scale;
  float* inverse;
  double format_max;
  bool power_of_two;
  TESSERA_HD void finish(float m) const {
    const float s = float8_scale(m, format_max, power_of_two);
    scale[0] = s;
    inverse[0] = 1.0f / s;
  }
  TESSERA_HD void operator()(std::int64_t) const { finish(max_of(in, n)); }
  Traffic traffic(std::int64_t) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(float), 2 * sizeof(float), e + 3, 0};
  }
};

/// A tensorwise cast's row amaxes and its one scale, in one launch: RowAbsMax over the
/// rows into `rows.out`, then Float8ScaleFromAmaxes over those amaxes (`scale.in` is
/// `rows.out`, `scale.n` the rows), the two launches' values bit for bit (a maximum is exact
/// in any order, and a NaN wins either way). Its two passes (ops::FusesParts): the CPU
/// backend runs them as two loops; the CUDA kernel runs the rows, and the block that
/// finishes last reduces their amaxes to the scale (backend/cuda/float8_kernels.cuh), so a
/// trace records the scale as run in the rows' launch.
template <class T>
struct RowAbsMaxScale {
  RowAbsMax<T> rows;
  Float8ScaleFromAmaxes scale;
  static constexpr bool kFusesParts = true;
  template <class Record>
  void parts(std::int64_t n, Record&& record) const {
    record(rows, n, rows.traffic(n), true);
    record(scale, std::int64_t{1}, scale.traffic(1), false);
  }
};

/// visit(i, outer, inner) for each index i in [begin, end) of a row-major matrix of
/// `inner_size` elements a row (i = outer * inner_size + inner): one division for the
/// range rather than one an index (a functor's range, ops::RunsRanges).
template <class Visit>
inline void walk_row_major(std::int64_t begin, std::int64_t end, std::int64_t inner_size, const Visit& visit) {
  if (begin >= end) return;
  std::int64_t outer = begin / inner_size, inner = begin - outer * inner_size;
  for (std::int64_t i = begin; i < end; ++i) {
    visit(i, outer, inner);
    if (++inner == inner_size) {
      inner = 0;
      ++outer;
    }
  }
}

/// x (rows x cols, leading dimension ld) cast to F (float8_e4m3 or float8_e5m2), each
/// element multiplied in float by its scale (`axis` of x) and converted with saturation:
/// out = F(x * scale), rows x cols contiguous (index r * cols + c); or, when `transpose`,
/// out = F(x * scale)^T, cols x rows contiguous (index c * rows + r), the layout a float8
/// GEMM takes an operand reduced over x's rows in (Float8GemmOperand: the reduction along
/// each row). Each index writes one element of out, so writes are coalesced; a
/// transposed cast reads x down its columns.
/// `straight` (transposing only; null: none): the same values also as x lies, rows x cols
/// contiguous, so that an operand both of whose GEMMs take it by one scale (a tensorwise
/// output gradient: dx = dy W and dW = dy^T x) is read once for its two layouts, where
/// two casts read it twice.
template <class T, class F>
struct QuantizeFloat8 {
  const T* x;
  std::int64_t ld, rows, cols;
  const float* scale;
  Float8Axis axis;
  bool transpose;
  F* out;
  F* straight = nullptr;
  TESSERA_HD void operator()(std::int64_t i) const {
    std::int64_t r, c;
    if (transpose) {
      c = i / rows;
      r = i - c * rows;
    } else {
      r = i / cols;
      c = i - r * cols;
    }
    write(i, r, c);
  }
  /// Indices [begin, end), as operator() (the CPU backend's share of a thread).
  void range(std::int64_t begin, std::int64_t end) const {
    if (transpose)
      walk_row_major(begin, end, rows, [&](std::int64_t i, std::int64_t c, std::int64_t r) { write(i, r, c); });
    else
      walk_row_major(begin, end, cols, [&](std::int64_t i, std::int64_t r, std::int64_t c) { write(i, r, c); });
  }
  TESSERA_HD F element(std::int64_t r, std::int64_t c) const {
    return F(static_cast<float>(to_accum(x[r * ld + c])) * scale[float8_scale_index(axis, r, c)]);
  }
  TESSERA_HD void write(std::int64_t i, std::int64_t r, std::int64_t c) const {
    const F v = element(r, c);
    out[i] = v;
    if (straight != nullptr) straight[r * cols + c] = v;
  }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    Traffic t{e * (sizeof(T) + sizeof(float)), e * sizeof(F) * (straight != nullptr ? 2 : 1), e, 0};
    // Neighbouring indices read elements a row apart: each read walks alone.
    if (transpose) t.walk_bytes = e * sizeof(T);
    return t;
  }
  /// The CUDA kernel's (backend/cuda/float8_kernels.cuh): x read once, in tiles or rows
  /// of vectors, a scale per row or column of the tile, out (and straight) written once.
  Traffic cuda_traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(T), e * sizeof(F) * (straight != nullptr ? 2 : 1), e, 0};
  }
};

/// A cast by rows in one pass a row (index r): the row's amax (RowAbsMax's, or known[r]
/// where the kernel that wrote x kept it), its scale and inverse (Float8ScaleFromAmax's)
/// and its values, not transposed (QuantizeFloat8's): the three launches' results bit
/// for bit, in one. The CUDA kernel (backend/cuda/float8_kernels.cuh) runs a row a warp or
/// block, reading the row twice, the second time from cache: x crosses memory once, where
/// the three launches read it twice.
template <class T, class F>
struct CastRowsFloat8 {
  const T* x;
  std::int64_t ld, cols;
  const float* known;  // the rows' amaxes, or null: taken here
  double format_max;
  bool power_of_two;
  float* scale;    // one a row
  float* inverse;  // 1 / scale, the GEMM's
  F* out;          // rows x cols, contiguous
  TESSERA_HD void operator()(std::int64_t r) const {
    const T* xr = x + r * ld;
    float m = 0;
    if (known != nullptr) m = known[r];
    else
      for (std::int64_t j = 0; j < cols; ++j) m = max_abs(m, static_cast<float>(to_accum(xr[j])));
    const float s = float8_scale(m, format_max, power_of_two);
    scale[r] = s;
    inverse[r] = 1.0f / s;
    for (std::int64_t j = 0; j < cols; ++j) out[r * cols + j] = F(static_cast<float>(to_accum(xr[j])) * s);
  }
  /// x read once: the second pass over a row finds it in cache (a row of Llama 3 70B's
  /// widest cast, 28,672 bf16, is 56 KiB).
  Traffic traffic(std::int64_t rows) const {
    const double r = static_cast<double>(rows), e = r * static_cast<double>(cols);
    return {e * sizeof(T) + (known != nullptr ? r * sizeof(float) : 0), e * sizeof(F) + 2 * r * sizeof(float),
            2 * e + 3 * r, 0};
  }
};

/// out = in^T for float8 values (rows x cols in, cols x rows out; the bytes moved, not
/// converted): a weight gathered in float8 (FSDP's float8 all-gather) given to the GEMM
/// that reduces down its columns; index i of out.
template <class F>
struct Float8Transpose {
  const F* in;
  std::int64_t rows, cols;
  F* out;
  TESSERA_HD void operator()(std::int64_t i) const {
    const std::int64_t c = i / rows, r = i - c * rows;
    out[i] = in[r * cols + c];
  }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    Traffic t{e * sizeof(F), e * sizeof(F), 0, 0};
    t.walk_bytes = e * sizeof(F);  // neighbouring indices read a row apart
    return t;
  }
  /// The CUDA kernel's (backend/cuda/float8_kernels.cuh): tiles read along in's rows and
  /// written along out's, each byte once.
  Traffic cuda_traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(F), e * sizeof(F), 0, 0};
  }
};

/// out[i] = in[0]: one float8 scale given to every row, for a GEMM whose other operand
/// is scaled by row (cuBLASLt scales both operands alike).
struct Float8ScaleBroadcast {
  const float* in;
  float* out;
  TESSERA_HD void operator()(std::int64_t i) const { out[i] = in[0]; }
  Traffic traffic(std::int64_t n) const { return {sizeof(float), static_cast<double>(n) * sizeof(float), 0, 0}; }
};

/// out[i] = float(q[i]): a float8 operand widened (exactly) for a GEMM in float.
template <class F>
struct Float8ToFloat {
  const F* q;
  float* out;
  TESSERA_HD void operator()(std::int64_t i) const { out[i] = static_cast<float>(q[i]); }
  Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(F), e * sizeof(float), 0, 0};
  }
};

/// The float8 GEMM's scaling: c[i, j] = C(sum[i, j] * (inverse_a[.] * inverse_b[.]) +
/// beta c[i, j]) over m x n (index i * n + j), sum the float GEMM of the float8 values;
/// inverse_a by row i (or one), inverse_b by column j (or one). beta == 0 ignores what c
/// held, NaN included.
template <class C>
struct Float8GemmScale {
  const float* sum;  // m x n, contiguous
  std::int64_t n;
  const float* inverse_a;
  bool a_per_row;
  const float* inverse_b;
  bool b_per_column;
  float beta;
  C* c;
  std::int64_t ldc;
  TESSERA_HD void operator()(std::int64_t k) const {
    const std::int64_t i = k / n;
    element(k, i, k - i * n);
  }
  /// Indices [begin, end), as operator() (the CPU backend's share of a thread).
  void range(std::int64_t begin, std::int64_t end) const {
    walk_row_major(begin, end, n, [&](std::int64_t k, std::int64_t i, std::int64_t j) { element(k, i, j); });
  }
  /// Index k, element (i, j) of C.
  TESSERA_HD void element(std::int64_t k, std::int64_t i, std::int64_t j) const {
    const float s = inverse_a[a_per_row ? i : 0] * inverse_b[b_per_column ? j : 0];
    float v = sum[k] * s;
    C& out = c[i * ldc + j];
    if (beta != 0.0f) v += beta * static_cast<float>(to_accum(out));
    out = from_accum<C>(v);
  }
  Traffic traffic(std::int64_t e) const {
    const double x = static_cast<double>(e), b = beta != 0.0f ? 1 : 0;
    return {x * (sizeof(float) + b * sizeof(C)), x * sizeof(C), x * (2 + 2 * b), 0};
  }
};

enum class Float8Recipe : std::uint8_t { tensorwise, rowwise, rowwise_with_gw_hp };

inline std::string_view name_of(Float8Recipe r) {
  switch (r) {
    case Float8Recipe::tensorwise: return "tensorwise";
    case Float8Recipe::rowwise: return "rowwise";
    case Float8Recipe::rowwise_with_gw_hp: return "rowwise_with_gw_hp";
  }
  return "?";
}

/// torchtitan's float8.recipe_name; `key` names the setting in the error.
inline Float8Recipe parse_float8_recipe(std::string_view s, std::string_view key) {
  if (s == "tensorwise") return Float8Recipe::tensorwise;
  if (s == "rowwise") return Float8Recipe::rowwise;
  if (s == "rowwise_with_gw_hp") return Float8Recipe::rowwise_with_gw_hp;
  fail(key, ": unknown float8 recipe '", s, "' (expected tensorwise, rowwise or rowwise_with_gw_hp)");
}

/// How one operand of a float8 GEMM is cast: its format, which elements share a scale,
/// and whether scales are rounded down to powers of two.
struct Float8Cast {
  DType format = DType::f8e4m3;
  ops::Float8Axis axis = ops::Float8Axis::tensor;
  bool power_of_two = false;
};

/// The casts of a linear layer's three GEMMs (the table at the top).
struct Float8LinearCasts {
  Float8Cast input, weight;                      // y = x W^T
  Float8Cast grad_output, weight_for_grad_input;  // dx = dy W
  Float8Cast grad_output_for_grad_weight, input_for_grad_weight;  // dW = dy^T x
  bool grad_weight_high_precision = false;        // dW in the model's precision instead
  bool fast_accumulation_forward = true;          // cuBLASLt's fast accumulation, forward only
};

inline Float8LinearCasts float8_casts(Float8Recipe r) {
  Float8LinearCasts c;
  switch (r) {
    case Float8Recipe::tensorwise: {
      const Float8Cast e4m3{DType::f8e4m3, Float8Axis::tensor, false}, e5m2{DType::f8e5m2, Float8Axis::tensor, false};
      c.input = c.weight = c.weight_for_grad_input = c.input_for_grad_weight = e4m3;
      c.grad_output = c.grad_output_for_grad_weight = e5m2;
      return c;
    }
    case Float8Recipe::rowwise:
      c.input = c.weight = c.grad_output = {DType::f8e4m3, Float8Axis::rows, true};
      c.weight_for_grad_input = c.grad_output_for_grad_weight = c.input_for_grad_weight = {DType::f8e4m3,
                                                                                           Float8Axis::columns, true};
      return c;
    case Float8Recipe::rowwise_with_gw_hp:
      c.input = c.weight = c.grad_output = {DType::f8e4m3, Float8Axis::rows, false};
      c.weight_for_grad_input = {DType::f8e4m3, Float8Axis::tensor, false};
      c.grad_weight_high_precision = true;
      return c;
  }
  return c;
}


/// Which linear layers train in float8, and by which recipe: torchtitan's [float8] with
/// model.converters = ["float8"] (train/job_plan.hpp makes it from a config).
struct Float8Policy {
  bool enabled = false;
  Float8Recipe recipe = Float8Recipe::tensorwise;
  /// A layer whose name contains one of these stays in the model's precision (torchtitan's
  /// filter_fqns; "output", its default, names a head tessera computes in its own kernels).
  std::vector<std::string> filter_fqns = {"output"};
  /// torchao's filter of layers too small for float8 to pay ("auto_filter_small_kn" in
  /// torchtitan's filter_fqns): by the recipe, from the weight's whole shape.
  bool auto_filter = false;
  /// The GEMMs emulated (nn::float8_gemm over the backend's float GEMM), as torchao's
  /// emulate: the CPU, and GPUs without float8 tensor cores.
  bool emulate = false;
  /// FSDP's float8 all-gather (torchtitan's enable_fsdp_float8_all_gather, tensorwise):
  /// each weight the policy takes is cast to float8 on its shards, with one scale agreed
  /// over them, and gathered as float8 (parallel/sharding.hpp).
  bool all_gather = false;
  /// Tensor parallelism's sequence-parallel all-gathers in float8 (tensorwise; tessera's
  /// float8.enable_tp_float8_all_gather, torchtitan's float8 tensor parallelism): a float8
  /// layer's input and output gradient gathered as float8 values, each rank's rows cast
  /// by the agreed scale (nn::gather_float8_rows); false gathers them as they are.
  bool tp_all_gather = true;

  /// Whether the layer `name`, `in` -> `out` features whole, trains in float8.
  bool applies(std::string_view name, std::int64_t in, std::int64_t out) const {
    if (!enabled) return false;
    for (const std::string& f : filter_fqns)
      if (!f.empty() && name.find(f) != std::string_view::npos) return false;
    if (!auto_filter) return true;
    // torchao's auto filters, K the input features and N the output ones (measured on H100s).
    const std::int64_t k = in, n = out;
    if (k % 16 != 0 || n % 16 != 0) return false;
    if (recipe == Float8Recipe::tensorwise) return !(k <= 4096 && n <= 1024);
    return !(n <= 2048 || k <= 1024 || (n <= 4096 && k <= 2048));
  }
};

}  // namespace tessera::ops
