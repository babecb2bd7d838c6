// Float8 scaling and GEMMs (ops/float8.hpp, nn/float8.hpp) against the formula written out
// here in double: torchao's scales (largest value over amax, at least 1e-12, in double,
// stored as a float, powers of two for rowwise), the saturating cast, and each recipe's
// three GEMMs of a linear layer as sums of the float8 values over the two scales.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/float8.hpp"

namespace test_float8_gemm {  // unity build: this file's names stay in here

using namespace tessera;
using ops::Float8Axis;

namespace {

Tensor<float> random_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed, float spread) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensor<float> t(Shape{rows, cols});
  // Rows of different magnitudes, so row scales differ from the tensor's.
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      t.view()(r, c) = normal(gen) * std::pow(spread, static_cast<float>(r % 5) - 2.0f);
  return t;
}

/// The formula: the scale of each element's group, and its float8 value.
struct Reference {
  std::vector<float> scale;  // by group
  std::vector<float> value;  // the float8 values, rows x cols
};

Reference reference_cast(const Tensor<float>& x, ops::Float8Cast cast) {
  const std::int64_t rows = x.size(0), cols = x.size(1);
  const std::int64_t groups = cast.axis == Float8Axis::tensor ? 1 : cast.axis == Float8Axis::rows ? rows : cols;
  std::vector<double> amax(static_cast<std::size_t>(groups), 0.0);
  auto group = [&](std::int64_t r, std::int64_t c) {
    return static_cast<std::size_t>(cast.axis == Float8Axis::tensor ? 0 : cast.axis == Float8Axis::rows ? r : c);
  };
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      amax[group(r, c)] = std::max(amax[group(r, c)], std::fabs(static_cast<double>(x.cview()(r, c))));
  const double fmax = cast.format == DType::f8e4m3 ? 448.0 : 57344.0;
  Reference ref;
  for (double a : amax) {
    auto s = static_cast<float>(fmax / std::max(a, 1e-12));
    if (cast.power_of_two) s = std::exp2(std::floor(std::log2(s)));
    ref.scale.push_back(s);
  }
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const float v = x.cview()(r, c) * ref.scale[group(r, c)];
      ref.value.push_back(cast.format == DType::f8e4m3 ? static_cast<float>(float8_e4m3(v))
                                                       : static_cast<float>(float8_e5m2(v)));
    }
  return ref;
}

/// op(A) op(B) / (scale_a scale_b) in double, from the formula's casts, and the same of
/// the terms' magnitudes (what a float sum's rounding is measured against).
struct GemmReference {
  std::vector<double> c, magnitude;
};
GemmReference reference_gemm(Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca,
                                   const Tensor<float>& b, ops::Float8Cast cb) {
  const Reference ra = reference_cast(a, ca), rb = reference_cast(b, cb);
  const std::int64_t m = ta == Trans::no ? a.size(0) : a.size(1), k = ta == Trans::no ? a.size(1) : a.size(0);
  const std::int64_t n = tb == Trans::no ? b.size(1) : b.size(0);
  auto at = [&](std::int64_t i, std::int64_t p) {
    return ta == Trans::no ? ra.value[static_cast<std::size_t>(i * a.size(1) + p)]
                           : ra.value[static_cast<std::size_t>(p * a.size(1) + i)];
  };
  auto bt = [&](std::int64_t p, std::int64_t j) {
    return tb == Trans::no ? rb.value[static_cast<std::size_t>(p * b.size(1) + j)]
                           : rb.value[static_cast<std::size_t>(j * b.size(1) + p)];
  };
  GemmReference r;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0, mag = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        s += static_cast<double>(at(i, p)) * bt(p, j);
        mag += std::fabs(static_cast<double>(at(i, p)) * bt(p, j));
      }
      const float sa = ra.scale[ca.axis == Float8Axis::tensor ? 0 : static_cast<std::size_t>(i)];
      const float sb = rb.scale[cb.axis == Float8Axis::tensor ? 0 : static_cast<std::size_t>(j)];
      r.c.push_back(s / (static_cast<double>(sa) * sb));
      r.magnitude.push_back(mag / (static_cast<double>(sa) * sb));
    }
  return r;
}

}  // namespace

TEST_CASE("float8 casts: the scales and values are the formula's, bit for bit, by tensor, row and column") {
  const Tensor<float> x = random_matrix(12, 40, 7, 8.0f);
  for (const DType format : {DType::f8e4m3, DType::f8e5m2})
    for (const Float8Axis axis : {Float8Axis::tensor, Float8Axis::rows, Float8Axis::columns})
      for (const bool pow2 : {false, true}) {
        const ops::Float8Cast cast{format, axis, pow2};
        CAPTURE(name_of(format));
        CAPTURE(static_cast<int>(axis));
        CAPTURE(pow2);
        const nn::Float8Operand<Cpu> q = nn::cast_to_float8<Cpu>(x.cview(), cast);
        const Reference ref = reference_cast(x, cast);
        REQUIRE(q.scale.numel() == static_cast<std::int64_t>(ref.scale.size()));
        for (std::size_t g = 0; g < ref.scale.size(); ++g) {
          CHECK(q.scale[static_cast<std::int64_t>(g)] == ref.scale[g]);
          CHECK(q.inverse[static_cast<std::int64_t>(g)] == 1.0f / ref.scale[g]);
        }
        const Tensor<float> values = nn::float8_values<Cpu>(q);
        int differ = 0;
        for (std::int64_t i = 0; i < values.numel(); ++i) differ += values[i] != ref.value[static_cast<std::size_t>(i)];
        CHECK(differ == 0);
        // The group's largest magnitude lands on the format's largest value (not a power of
        // two: the scale is exact enough that it may round a hair under it).
        if (!pow2) {
          float largest = 0;
          for (std::int64_t i = 0; i < values.numel(); ++i) largest = std::max(largest, std::fabs(values[i]));
          CHECK(largest == (format == DType::f8e4m3 ? 448.0f : 57344.0f));
        }
      }
}

TEST_CASE("float8 casts: an all-zero tensor takes the floor amax, a power-of-two scale rounds down") {
  const Tensor<float> zeros(Shape{3, 4});
  const nn::Float8Operand<Cpu> q = nn::cast_to_float8<Cpu>(zeros.cview(), {DType::f8e4m3, Float8Axis::tensor, false});
  CHECK(q.scale[0] == static_cast<float>(448.0 / 1e-12));
  CHECK(ops::power_of_two_below(3.0f) == 2.0f);
  CHECK(ops::power_of_two_below(0.75f) == 0.5f);
  CHECK(ops::power_of_two_below(4.0f) == 4.0f);
  CHECK(ops::power_of_two_below(0x1.8p-140f) == 0x1p-140f);  // a subnormal
  CHECK(std::isinf(ops::power_of_two_below(std::numeric_limits<float>::infinity())));
}

TEST_CASE("float8 scales: a tensor's one scale from its rows' amaxes in one functor is MaxOf's then the scale's") {
  // Float8ScaleFromAmaxes (one launch) against MaxOf then Float8ScaleFromAmax (two): the
  // same bits, a NaN winning wherever it stands, an all-zero tensor at the floor, none.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<std::vector<float>> cases{
      {0.5f, 3.25f, 448.0f, 1e-3f}, {0.0f, 0.0f}, {}, {2.0f, nan, 7.0f}, {nan, 1.0f}, {1.0f, inf}, {1e-30f, 3e-20f}};
  for (const auto& amaxes : cases)
    for (const double format_max : {448.0, 57344.0})
      for (const bool power_of_two : {false, true}) {
        CAPTURE(amaxes.size());
        CAPTURE(format_max);
        CAPTURE(power_of_two);
        const auto n = static_cast<std::int64_t>(amaxes.size());
        float max = -1, scale[2] = {-1, -1}, inverse[2] = {-1, -1};
        ops::MaxOf{amaxes.data(), n, &max}(0);
        ops::Float8ScaleFromAmax{&max, &scale[0], &inverse[0], format_max, power_of_two}(0);
        ops::Float8ScaleFromAmaxes{amaxes.data(), n, &scale[1], &inverse[1], format_max, power_of_two}(0);
        CHECK(std::memcmp(&scale[0], &scale[1], sizeof(float)) == 0);
        CHECK(std::memcmp(&inverse[0], &inverse[1], sizeof(float)) == 0);
        const bool any_nan = std::any_of(amaxes.begin(), amaxes.end(), [](float a) { return a != a; });
        CHECK(std::isnan(scale[1]) == any_nan);
      }
}

TEST_CASE("float8 scales: the rows' amaxes and the one scale in one launch are RowAbsMax's then the scale's, and a "
          "trace records the scale as run inside the rows' launch") {
  // 37 rows of 29, a NaN in row 5 in the second case: ops::RowAbsMaxScale against RowAbsMax
  // then Float8ScaleFromAmaxes, the amaxes and the scale bit for bit.
  const std::int64_t rows = 37, cols = 29, ld = 31;
  for (const bool with_nan : {false, true}) {
    CAPTURE(with_nan);
    std::vector<float> x(static_cast<std::size_t>(rows * ld), 7e9f);  // the columns past cols are not read
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        x[static_cast<std::size_t>(r * ld + c)] = std::sin(0.7f * static_cast<float>(r * cols + c)) * static_cast<float>(r + 1);
    if (with_nan) x[static_cast<std::size_t>(5 * ld + 3)] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> amax(rows, -1), fused_amax(rows, -1);
    float scale[2] = {-1, -1}, inverse[2] = {-1, -1};
    Cpu::for_each(rows, ops::RowAbsMax<float>{x.data(), ld, cols, amax.data()});
    Cpu::for_each(1, ops::Float8ScaleFromAmaxes{amax.data(), rows, &scale[0], &inverse[0], 448.0, false});
    const ops::RowAbsMaxScale<float> fused{{x.data(), ld, cols, fused_amax.data()},
                                           {fused_amax.data(), rows, &scale[1], &inverse[1], 448.0, false}};
    Cpu::for_each(rows, fused);
    CHECK(std::memcmp(amax.data(), fused_amax.data(), amax.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(&scale[0], &scale[1], sizeof(float)) == 0);
    CHECK(std::memcmp(&inverse[0], &inverse[1], sizeof(float)) == 0);
    CHECK(std::isnan(scale[1]) == with_nan);
    CHECK(fused_amax[36] == doctest::Approx(37.0f).epsilon(0.05));
  }
  // Its parts, as a trace records them: the rows with their traffic and a launch of their
  // own, then the scale inside that launch.
  struct Part {
    std::int64_t n;
    double read;
    bool own_launch;
  };
  std::vector<Part> parts;
  const ops::RowAbsMaxScale<float> f{{nullptr, 64, 64, nullptr}, {nullptr, 100, nullptr, nullptr, 448.0, false}};
  f.parts(100, [&](const auto&, std::int64_t m, const ops::Traffic& t, bool own) { parts.push_back({m, t.bytes_read, own}); });
  REQUIRE(parts.size() == 2);
  CHECK((parts[0].n == 100 && parts[0].read == 100 * 64 * 4 && parts[0].own_launch));
  CHECK((parts[1].n == 1 && parts[1].read == 100 * 4 && !parts[1].own_launch));
}

TEST_CASE("float8 casts by rows in one pass: RowAbsMax's amaxes, Float8ScaleFromAmax's scales and QuantizeFloat8's "
          "values, bit for bit") {
  // 37 rows of 29 at a leading dimension of 31 (the columns past 29 are not read): a NaN
  // in row 5, an infinity in row 8, row 11 all zeros, row 14 past e4m3's range; the amaxes
  // taken here or given (a kernel that wrote x kept them), each format, with and without
  // power-of-two scales.
  const std::int64_t rows = 37, cols = 29, ld = 31;
  std::vector<float> x(static_cast<std::size_t>(rows * ld), 7e9f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      x[static_cast<std::size_t>(r * ld + c)] =
          r == 11 ? 0.0f : std::sin(0.7f * static_cast<float>(r * cols + c)) * std::pow(3.0f, static_cast<float>(r % 9) - 4);
  x[static_cast<std::size_t>(5 * ld + 3)] = std::numeric_limits<float>::quiet_NaN();
  x[static_cast<std::size_t>(8 * ld + 20)] = -std::numeric_limits<float>::infinity();
  x[static_cast<std::size_t>(14 * ld + 7)] = 1e6f;
  const auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  const auto check = [&]<class F>(F, double format_max) {
    for (const bool power_of_two : {false, true})
      for (const bool known : {false, true}) {
        CAPTURE(format_max);
        CAPTURE(power_of_two);
        CAPTURE(known);
        std::vector<float> amax(rows), scale(rows), inverse(rows), scale1(rows, -1), inverse1(rows, -1);
        std::vector<F> values(static_cast<std::size_t>(rows * cols)), values1(values.size());
        Cpu::for_each(rows, ops::RowAbsMax<float>{x.data(), ld, cols, amax.data()});
        Cpu::for_each(rows, ops::Float8ScaleFromAmax{amax.data(), scale.data(), inverse.data(), format_max, power_of_two});
        Cpu::for_each(rows * cols, ops::QuantizeFloat8<float, F>{x.data(), ld, rows, cols, scale.data(), Float8Axis::rows,
                                                                 false, values.data()});
        Cpu::for_each(rows, ops::CastRowsFloat8<float, F>{x.data(), ld, cols, known ? amax.data() : nullptr, format_max,
                                                          power_of_two, scale1.data(), inverse1.data(), values1.data()});
        CHECK(same(scale, scale1));
        CHECK(same(inverse, inverse1));
        CHECK(same(values, values1));
        CHECK(std::isnan(scale1[5]));
        CHECK(scale1[11] == ops::float8_scale(0.0f, format_max, power_of_two));
      }
  };
  check(float8_e4m3{}, float8_e4m3::max());
  check(float8_e5m2{}, float8_e5m2::max());
}

TEST_CASE("float8 GEMMs: each recipe's three GEMMs of a linear layer are the formula's") {
  // y = x W^T (x: M x K, W: N x K); dx = dy W; dW = dy^T x.
  const std::int64_t M = 24, K = 32, N = 16;
  const Tensor<float> x = random_matrix(M, K, 1, 4.0f), w = random_matrix(N, K, 2, 2.0f),
                      dy = random_matrix(M, N, 3, 16.0f);
  for (const ops::Float8Recipe recipe :
       {ops::Float8Recipe::tensorwise, ops::Float8Recipe::rowwise, ops::Float8Recipe::rowwise_with_gw_hp}) {
    CAPTURE(ops::name_of(recipe));
    const ops::Float8LinearCasts c = ops::float8_casts(recipe);
    auto check = [&](Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca, const Tensor<float>& b,
                     ops::Float8Cast cb, std::int64_t m, std::int64_t n, const char* label) {
      const std::string what = label;
      CAPTURE(what);
      // Accumulated into C with beta = 1 (the weight gradient's second micro-batch).
      Tensor<float> out(Shape{m, n});
      for (std::int64_t i = 0; i < out.numel(); ++i) out[i] = 0.25f * static_cast<float>(i % 7);
      const Tensor<float> before = out.clone();
      nn::float8_gemm<Cpu>(ta, tb, a.cview(), ca, b.cview(), cb, 1.0f, out.view(), what);
      const GemmReference want = reference_gemm(ta, tb, a, ca, b, cb);
      double worst = 0;  // the error over what float sums of these terms may lose
      for (std::int64_t i = 0; i < out.numel(); ++i) {
        const auto k = static_cast<std::size_t>(i);
        const double expected = want.c[k] + before[i];
        const double bound = 2.0 * (static_cast<double>(a.size(0) + a.size(1)) + 2) * 0x1p-24 *
                             (want.magnitude[k] + std::fabs(before[i]));
        worst = std::max(worst, std::fabs(out[i] - expected) / bound);
      }
      CAPTURE(worst);
      CHECK(worst <= 1.0);  // float sums of exact products, within float's rounding of them
    };
    check(Trans::no, Trans::yes, x, c.input, w, c.weight, M, N, "y = x W^T");
    check(Trans::no, Trans::no, dy, c.grad_output, w, c.weight_for_grad_input, M, K, "dx = dy W");
    if (!c.grad_weight_high_precision)
      check(Trans::yes, Trans::no, dy, c.grad_output_for_grad_weight, x, c.input_for_grad_weight, N, K, "dW = dy^T x");
  }
  // The recipes' formats: tensorwise's gradients e5m2, rowwise's all e4m3 with power-of-two scales.
  CHECK(ops::float8_casts(ops::Float8Recipe::tensorwise).grad_output.format == DType::f8e5m2);
  CHECK(ops::float8_casts(ops::Float8Recipe::rowwise).grad_output.format == DType::f8e4m3);
  CHECK(ops::float8_casts(ops::Float8Recipe::rowwise).weight.power_of_two);
  CHECK(ops::float8_casts(ops::Float8Recipe::rowwise_with_gw_hp).grad_weight_high_precision);
}

TEST_CASE("float8 GEMMs refuse scales across the reduction, and an unknown recipe, by name") {
  const Tensor<float> a = random_matrix(4, 8, 1, 1.0f), b = random_matrix(6, 8, 2, 1.0f);
  Tensor<float> c(Shape{4, 6});
  CHECK_THROWS_WITH_AS(nn::float8_gemm<Cpu>(Trans::no, Trans::yes, a.cview(), {DType::f8e4m3, Float8Axis::columns, false},
                                            b.cview(), {}, 0.0f, c.view(), "layers.0.attention.wq"),
                       doctest::Contains("layers.0.attention.wq: the first operand's float8 scales do not run along"),
                       Error);
  CHECK_THROWS_WITH_AS(ops::parse_float8_recipe("blockwise", "float8.recipe_name"),
                       doctest::Contains("float8.recipe_name: unknown float8 recipe 'blockwise'"), Error);
}


TEST_CASE("float8 casts transposed: the values of x^T and the scales of x, bit for bit, by tensor, row and column") {
  const Tensor<float> x = random_matrix(12, 40, 9, 8.0f);
  for (const Float8Axis axis : {Float8Axis::tensor, Float8Axis::rows, Float8Axis::columns}) {
    CAPTURE(static_cast<int>(axis));
    const ops::Float8Cast cast{DType::f8e5m2, axis, false};
    const nn::Float8Operand<Cpu> plain = nn::cast_to_float8<Cpu>(x.cview(), cast);
    const nn::Float8Operand<Cpu> t = nn::cast_to_float8<Cpu>(x.cview(), cast, true);
    CHECK(t.transposed);
    CHECK((t.rows == 40 && t.cols == 12));
    REQUIRE(t.scale.numel() == plain.scale.numel());
    for (std::int64_t g = 0; g < t.scale.numel(); ++g) CHECK(t.scale[g] == plain.scale[g]);
    const Tensor<float> vp = nn::float8_values<Cpu>(plain), vt = nn::float8_values<Cpu>(t);
    int differ = 0;
    for (std::int64_t r = 0; r < 12; ++r)
      for (std::int64_t c = 0; c < 40; ++c) differ += vp.cview()(r, c) != vt.cview()(c, r);
    CHECK(differ == 0);
  }
}

namespace {

/// The CPU backend with a float8 GEMM written from the contract alone (backend.hpp's
/// Float8GemmOperand: rows x k values, the reduction along each row, inverse scales one or
/// by row), in double: what nn::float8_gemm hands the CUDA backend's cuBLASLt matmul is
/// checked here against the formula, operands, layouts and scales.
struct Float8Cpu : Cpu {
  static inline int calls = 0;
  static inline bool last_fast = false;
  template <class C>
  static void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<C> c,
                          bool fast_accumulation) {
    const GemmSizes s = check_float8_gemm(a, b, c);
    ++calls;
    last_fast = fast_accumulation;
    auto value = [](const Float8GemmOperand& o, std::int64_t r, std::int64_t p) {
      const std::uint8_t code = static_cast<const std::uint8_t*>(o.data)[r * o.k + p];
      return static_cast<double>(o.format == DType::f8e4m3 ? static_cast<float>(float8_e4m3::from_bits(code))
                                                           : static_cast<float>(float8_e5m2::from_bits(code)));
    };
    for (std::int64_t i = 0; i < s.m; ++i)
      for (std::int64_t j = 0; j < s.n; ++j) {
        double sum = 0;
        for (std::int64_t p = 0; p < s.k; ++p) sum += value(a, i, p) * value(b, j, p);
        sum *= static_cast<double>(a.inverse[a.per_row ? i : 0]) * b.inverse[b.per_row ? j : 0];
        C& out = c(i, j);
        out = static_cast<C>(sum + (beta != 0.0f ? beta * static_cast<double>(out) : 0.0));
      }
  }
};
static_assert(HasFloat8Gemm<Float8Cpu>);

}  // namespace

TEST_CASE("float8 GEMMs on a backend's own float8 GEMM: each recipe's three GEMMs are the formula's, fast "
          "accumulation on the forward only") {
  const std::int64_t M = 32, K = 48, N = 16;  // cuBLASLt's multiples of 16: M is the weight gradient's reduction
  const Tensor<float> x = random_matrix(M, K, 4, 4.0f), w = random_matrix(N, K, 5, 2.0f),
                      dy = random_matrix(M, N, 6, 16.0f);
  for (const ops::Float8Recipe recipe :
       {ops::Float8Recipe::tensorwise, ops::Float8Recipe::rowwise, ops::Float8Recipe::rowwise_with_gw_hp}) {
    CAPTURE(ops::name_of(recipe));
    const ops::Float8LinearCasts c = ops::float8_casts(recipe);
    auto check = [&](Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca, const Tensor<float>& b,
                     ops::Float8Cast cb, std::int64_t m, std::int64_t n, bool fast, const char* label) {
      const std::string what = label;
      CAPTURE(what);
      Tensor<float> out(Shape{m, n});
      for (std::int64_t i = 0; i < out.numel(); ++i) out[i] = 0.25f * static_cast<float>(i % 7);
      const Tensor<float> before = out.clone();
      const int calls = Float8Cpu::calls;
      nn::float8_gemm<Float8Cpu>(ta, tb, a.cview(), ca, b.cview(), cb, 1.0f, out.view(), what, {false, fast});
      CHECK(Float8Cpu::calls == calls + 1);  // not emulated
      CHECK(Float8Cpu::last_fast == fast);
      const GemmReference want = reference_gemm(ta, tb, a, ca, b, cb);
      double worst = 0;
      for (std::int64_t i = 0; i < out.numel(); ++i) {
        const auto k = static_cast<std::size_t>(i);
        const double expected = want.c[k] + before[i];
        worst = std::max(worst, std::fabs(out[i] - expected) / (want.magnitude[k] + std::fabs(before[i]) + 1e-30));
      }
      CAPTURE(worst);
      CHECK(worst <= 1e-7);  // the same sums in double, rounded once to float
      // Emulated, the same GEMM runs on the float GEMM: the same operands, float sums.
      Tensor<float> emulated = before.clone();
      nn::float8_gemm<Float8Cpu>(ta, tb, a.cview(), ca, b.cview(), cb, 1.0f, emulated.view(), what, {true, fast});
      CHECK(Float8Cpu::calls == calls + 1);
    };
    check(Trans::no, Trans::yes, x, c.input, w, c.weight, M, N, c.fast_accumulation_forward, "y = x W^T");
    check(Trans::no, Trans::no, dy, c.grad_output, w, c.weight_for_grad_input, M, K, false, "dx = dy W");
    if (!c.grad_weight_high_precision)
      check(Trans::yes, Trans::no, dy, c.grad_output_for_grad_weight, x, c.input_for_grad_weight, N, K, false,
            "dW = dy^T x");
  }
  CHECK(ops::float8_casts(ops::Float8Recipe::tensorwise).fast_accumulation_forward);

  // Sizes cuBLASLt's float8 matmul cannot take are refused, naming the GEMM: 24 tokens
  // reduced over by the weight gradient.
  const Tensor<float> dy24 = random_matrix(24, N, 7, 1.0f), x24 = random_matrix(24, K, 8, 1.0f);
  Tensor<float> dw(Shape{N, K});
  const ops::Float8Cast e4m3{DType::f8e4m3, Float8Axis::tensor, false};
  CHECK_THROWS_WITH_AS(nn::float8_gemm<Float8Cpu>(Trans::yes, Trans::no, dy24.cview(), e4m3, x24.cview(), e4m3, 0.0f,
                                                  dw.view(), "layers.0.feed_forward.w2", {false, false}),
                       doctest::Contains("layers.0.feed_forward.w2: a float8 GEMM needs its reduction and its output's "
                                         "columns in multiples of 16 (cuBLASLt), not k = 24, n = 48"),
                       Error);
  // The contract's own refusals: two e5m2 operands, scales unalike.
  std::vector<std::uint8_t> bytes(64 * 16, 0);
  const float one = 1.0f;
  Tensor<float> c16(Shape{64, 64});
  const Float8GemmOperand e5{bytes.data(), DType::f8e5m2, 64, 16, &one, false};
  CHECK_THROWS_WITH_AS(Float8Cpu::gemm_float8(e5, e5, 0.0f, c16.view(), false),
                       doctest::Contains("gemm_float8: both operands float8_e5m2"), Error);
  Float8GemmOperand by_row{bytes.data(), DType::f8e4m3, 64, 16, &one, true};
  CHECK_THROWS_WITH_AS(Float8Cpu::gemm_float8(by_row, e5, 0.0f, c16.view(), false),
                       doctest::Contains("gemm_float8: one operand scaled by row and the other by one scale"), Error);
}


TEST_CASE("float8 GEMMs reading C apart from the D they write: the product into D, then beta C added, C unchanged") {
  // A residual added in the forward GEMM (nn::Linear::forward_adding): emulated, and on a
  // backend whose float8 GEMM runs in place only (its product, then ops::Axpy), each bit
  // for bit the GEMM with beta 0 followed by the add.
  const std::int64_t M = 32, K = 48, N = 16;
  const Tensor<float> x = random_matrix(M, K, 9, 4.0f), w = random_matrix(N, K, 10, 2.0f),
                      residual = random_matrix(M, N, 11, 3.0f);
  static_assert(!HasOutOfPlaceFloat8Gemm<Float8Cpu>);
  for (const ops::Float8Recipe recipe : {ops::Float8Recipe::tensorwise, ops::Float8Recipe::rowwise}) {
    CAPTURE(ops::name_of(recipe));
    const ops::Float8LinearCasts c = ops::float8_casts(recipe);
    for (const bool emulate : {true, false}) {
      CAPTURE(emulate);
      Tensor<float> expected(Shape{M, N}), got(Shape{M, N});
      nn::float8_gemm<Float8Cpu>(Trans::no, Trans::yes, x.cview(), c.input, w.cview(), c.weight, 0.0f,
                                 expected.view(), "y", {emulate, false});
      Cpu::for_each(expected.numel(), ops::Axpy<float>{1.0f, residual.data(), expected.data()});
      const int calls = Float8Cpu::calls;
      nn::float8_gemm<Float8Cpu>(Trans::no, Trans::yes, x.cview(), c.input, w.cview(), c.weight, 1.0f, got.view(),
                                 "y", {emulate, false}, residual.cview());
      CHECK(Float8Cpu::calls == calls + (emulate ? 0 : 1));
      for (std::int64_t i = 0; i < got.numel(); ++i) CHECK(got[i] == expected[i]);
    }
  }
  // A C of another shape is refused, naming the GEMM's contract.
  const Tensor<float> wide = random_matrix(M, N + 1, 12, 1.0f);
  Tensor<float> out(Shape{M, N});
  CHECK_THROWS_WITH_AS(nn::float8_gemm<Cpu>(Trans::no, Trans::yes, x.cview(), ops::float8_casts(ops::Float8Recipe::tensorwise).input,
                                            w.cview(), ops::float8_casts(ops::Float8Recipe::tensorwise).weight, 1.0f,
                                            out.view(), "y", {true, false}, wide.cview()),
                       doctest::Contains("gemm_float8: C read apart from D needs D's shape and leading dimension: C 32x17"),
                       Error);
}

TEST_CASE("float8 casts shared while a Float8SharedCasts is open: the same tensor and cast cast once, the rest apart") {
  const Tensor<float> x = random_matrix(16, 32, 11, 2.0f), y = random_matrix(16, 32, 12, 2.0f);
  const ops::Float8Cast e4m3{DType::f8e4m3, Float8Axis::tensor, false}, e5m2{DType::f8e5m2, Float8Axis::tensor, false};
  const void* first = nullptr;
  {
    nn::Float8SharedCasts<Cpu> shared;
    const nn::Float8Operand<Cpu> a = nn::cast_to_float8<Cpu>(x.cview(), e4m3);
    const nn::Float8Operand<Cpu> b = nn::cast_to_float8<Cpu>(x.cview(), e4m3);
    CHECK(a.e4m3.data() == b.e4m3.data());  // handed the kept one
    first = a.e4m3.data();
    // Transposed: its own values, the kept one's scale (tensorwise: the same amax).
    const nn::Float8Operand<Cpu> t = nn::cast_to_float8<Cpu>(x.cview(), e4m3, true);
    CHECK(t.e4m3.data() != first);
    CHECK(t.scale.data() == a.scale.data());
    CHECK(t.inverse.data() == a.inverse.data());
    CHECK(nn::cast_to_float8<Cpu>(x.cview(), e5m2).e5m2.data() != nullptr);      // another format: its own
    CHECK(nn::cast_to_float8<Cpu>(y.cview(), e4m3).e4m3.data() != first);        // another tensor: its own
    CHECK(shared.kept() == 4);
    {
      nn::Float8SharedCasts<Cpu> inner;  // sees the casts of the one open around it
      CHECK(nn::cast_to_float8<Cpu>(x.cview(), e4m3).e4m3.data() == first);
      CHECK(inner.kept() == 0);
      const void* own = nn::cast_to_float8<Cpu>(x.cview(), e5m2, true).e5m2.data();  // kept by the inner one
      CHECK(inner.kept() == 1);
      CHECK(nn::cast_to_float8<Cpu>(x.cview(), e5m2, true).e5m2.data() == own);
    }
    CHECK(shared.kept() == 4);
    CHECK(nn::cast_to_float8<Cpu>(x.cview(), e4m3).e4m3.data() == first);
  }
  CHECK(nn::Float8SharedCasts<Cpu>::current() == nullptr);
  // Closed: each cast its own, with the same values; the transposed cast's values and
  // scale are those it was given while the scale was shared.
  const nn::Float8Operand<Cpu> c = nn::cast_to_float8<Cpu>(x.cview(), e4m3), d = nn::cast_to_float8<Cpu>(x.cview(), e4m3);
  CHECK(c.e4m3.data() != d.e4m3.data());
  CHECK(nn::float8_values<Cpu>(c).cview()(3, 5) == nn::float8_values<Cpu>(d).cview()(3, 5));
  for (const ops::Float8Cast cast : {e4m3, e5m2, ops::Float8Cast{DType::f8e4m3, Float8Axis::tensor, true}}) {
    const nn::Float8Operand<Cpu> alone = nn::cast_to_float8<Cpu>(x.cview(), cast, true);
    nn::Float8SharedCasts<Cpu> shared;
    (void)nn::cast_to_float8<Cpu>(x.cview(), cast);
    const nn::Float8Operand<Cpu> given = nn::cast_to_float8<Cpu>(x.cview(), cast, true);
    CHECK(given.scale[0] == alone.scale[0]);
    CHECK(given.inverse[0] == alone.inverse[0]);
    const Tensor<float> va = nn::float8_values<Cpu>(alone), vg = nn::float8_values<Cpu>(given);
    CHECK(std::memcmp(va.data(), vg.data(), sizeof(float) * static_cast<std::size_t>(va.numel())) == 0);
  }
  // Scales by row or column are not shared between the layouts: a transposed rowwise
  // cast (scales by x's columns) takes its own.
  {
    const ops::Float8Cast by_rows{DType::f8e4m3, Float8Axis::rows, true}, by_columns{DType::f8e4m3, Float8Axis::columns, true};
    nn::Float8SharedCasts<Cpu> shared;
    const nn::Float8Operand<Cpu> r = nn::cast_to_float8<Cpu>(x.cview(), by_rows);
    CHECK(nn::cast_to_float8<Cpu>(x.cview(), by_rows, true).scale.data() != r.scale.data());
    CHECK(nn::cast_to_float8<Cpu>(x.cview(), by_columns, true).scale.data() != r.scale.data());
  }
}

TEST_CASE("a tensorwise float8 cast into both layouts in one pass: each layout the single cast's, bit for bit") {
  // ops::QuantizeFloat8 with `straight`: x read once, the values written transposed and
  // as x lies (nn::cast_to_float8_both_layouts, a tensorwise output gradient's two casts).
  // A leading dimension past the columns (never read), odd sizes, a NaN, an infinity and
  // a value past e4m3's range; every axis of scales, each format.
  const std::int64_t rows = 13, cols = 21, ld = 24;
  Tensor<float> x(Shape{rows, ld});
  for (std::int64_t i = 0; i < x.numel(); ++i)
    x[i] = (i % ld) >= cols ? 7e9f : std::sin(0.37f * static_cast<float>(i)) * std::pow(4.0f, static_cast<float>(i % 5) - 2);
  x[3 * ld + 4] = std::numeric_limits<float>::quiet_NaN();
  x[7 * ld + 9] = -std::numeric_limits<float>::infinity();
  x[11 * ld + 2] = 3e5f;
  const auto same = [](const auto* a, const auto* b, std::int64_t n) {
    return std::memcmp(a, b, sizeof(a[0]) * static_cast<std::size_t>(n)) == 0;
  };
  const auto check = [&]<class F>(F) {
    std::vector<float> scale(static_cast<std::size_t>(rows * cols));
    for (std::size_t i = 0; i < scale.size(); ++i) scale[i] = 0.5f + 0.125f * static_cast<float>(i % 11);
    for (const Float8Axis axis : {Float8Axis::tensor, Float8Axis::rows, Float8Axis::columns}) {
      CAPTURE(static_cast<int>(axis));
      std::vector<F> as_is(scale.size()), transposed(scale.size()), both_t(scale.size()), both_s(scale.size());
      Cpu::for_each(rows * cols, ops::QuantizeFloat8<float, F>{x.data(), ld, rows, cols, scale.data(), axis, false,
                                                               as_is.data()});
      Cpu::for_each(rows * cols, ops::QuantizeFloat8<float, F>{x.data(), ld, rows, cols, scale.data(), axis, true,
                                                               transposed.data()});
      Cpu::for_each(rows * cols, ops::QuantizeFloat8<float, F>{x.data(), ld, rows, cols, scale.data(), axis, true,
                                                               both_t.data(), both_s.data()});
      CHECK(same(both_t.data(), transposed.data(), rows * cols));
      CHECK(same(both_s.data(), as_is.data(), rows * cols));
    }
  };
  check(float8_e4m3{});
  check(float8_e5m2{});

  // Through nn::cast_to_float8_both_layouts: the operand is cast_to_float8's, the
  // transposed one is kept in the scope, where the cast of that layout finds it.
  const Tensor<float> y = random_matrix(24, 40, 31, 4.0f);
  auto equal = [](const nn::Float8Operand<Cpu>& a, const nn::Float8Operand<Cpu>& b) {
    const Tensor<float> va = nn::float8_values<Cpu>(a), vb = nn::float8_values<Cpu>(b);
    return a.rows == b.rows && a.cols == b.cols && a.transposed == b.transposed && a.scale[0] == b.scale[0] &&
           a.inverse[0] == b.inverse[0] &&
           std::memcmp(va.data(), vb.data(), sizeof(float) * static_cast<std::size_t>(va.numel())) == 0;
  };
  for (const ops::Float8Cast cast : {ops::Float8Cast{DType::f8e4m3, Float8Axis::tensor, false},
                                     ops::Float8Cast{DType::f8e5m2, Float8Axis::tensor, false},
                                     ops::Float8Cast{DType::f8e5m2, Float8Axis::tensor, true}}) {
    CAPTURE(static_cast<int>(cast.format));
    const nn::Float8Operand<Cpu> alone = nn::cast_to_float8<Cpu>(y.cview(), cast, false),
                                 alone_t = nn::cast_to_float8<Cpu>(y.cview(), cast, true);
    nn::Float8SharedCasts<Cpu> shared;
    const nn::Float8Operand<Cpu> q = nn::cast_to_float8_both_layouts<Cpu>(y.cview(), cast);
    CHECK(shared.kept() == 2);
    CHECK(equal(q, alone));
    const nn::Float8Operand<Cpu> t = nn::cast_to_float8<Cpu>(y.cview(), cast, true);  // the kept one
    CHECK(t.values() != alone_t.values());
    CHECK(equal(t, alone_t));
    CHECK(t.scale.data() == q.scale.data());
    CHECK(nn::cast_to_float8<Cpu>(y.cview(), cast, false).values() == q.values());
    // Again in the same scope: the kept casts, nothing new.
    CHECK(nn::cast_to_float8_both_layouts<Cpu>(y.cview(), cast).values() == q.values());
    CHECK(shared.kept() == 2);
  }
  {  // A scale kept for the other layout (a layer's forward's, keep_scale) serves both.
    const ops::Float8Cast cast{DType::f8e4m3, Float8Axis::tensor, false};
    const nn::Float8Operand<Cpu> alone = nn::cast_to_float8<Cpu>(y.cview(), cast, false);
    Tensor<float> scale(Shape{1}), inverse(Shape{1});
    scale[0] = 2.0f * alone.scale[0];
    inverse[0] = 1.0f / scale[0];
    nn::Float8SharedCasts<Cpu> shared;
    shared.keep_scale(nn::Float8SharedCasts<Cpu>::key_of(y.cview(), cast, true), scale, inverse);
    const nn::Float8Operand<Cpu> q = nn::cast_to_float8_both_layouts<Cpu>(y.cview(), cast);
    CHECK(q.scale.data() == scale.data());
    CHECK(nn::cast_to_float8<Cpu>(y.cview(), cast, true).scale.data() == scale.data());
  }
  {  // With no scope open, the transposed operand handed back.
    const ops::Float8Cast cast{DType::f8e5m2, Float8Axis::tensor, false};
    nn::Float8Operand<Cpu> t;
    const nn::Float8Operand<Cpu> q = nn::cast_to_float8_both_layouts<Cpu>(y.cview(), cast, {}, &t);
    CHECK(equal(q, nn::cast_to_float8<Cpu>(y.cview(), cast, false)));
    CHECK(equal(t, nn::cast_to_float8<Cpu>(y.cview(), cast, true)));
    CHECK(t.scale.data() == q.scale.data());
  }
  // Only tensorwise, and its transpose handed back or kept.
  CHECK_THROWS_WITH_AS(nn::cast_to_float8_both_layouts<Cpu>(y.cview(), {DType::f8e4m3, Float8Axis::tensor, false}),
                       doctest::Contains("handed back or kept in a Float8SharedCasts"), Error);
  nn::Float8SharedCasts<Cpu> shared;
  CHECK_THROWS_WITH_AS(nn::cast_to_float8_both_layouts<Cpu>(y.cview(), {DType::f8e4m3, Float8Axis::rows, true}),
                       doctest::Contains("a tensorwise cast"), Error);
}

TEST_CASE("float8 casts take their rows' amaxes from a Float8RowAmaxes: the same bits, and none for scales by column") {
  const Tensor<float> x = random_matrix(16, 32, 21, 2.0f), y = random_matrix(16, 32, 22, 2.0f);
  Tensor<float> row_amax(Shape{16});
  Cpu::for_each(16, ops::RowAbsMax<float>{x.data(), 32, 32, row_amax.data()});
  const ops::Float8Cast tensorwise{DType::f8e4m3, Float8Axis::tensor, false}, by_rows{DType::f8e4m3, Float8Axis::rows, true};
  const ops::Float8Cast by_columns{DType::f8e4m3, Float8Axis::columns, true};
  auto same = [](const nn::Float8Operand<Cpu>& a, const nn::Float8Operand<Cpu>& b) {
    const Tensor<float> va = nn::float8_values<Cpu>(a), vb = nn::float8_values<Cpu>(b);
    return a.scale.numel() == b.scale.numel() &&
           std::memcmp(a.scale.data(), b.scale.data(), sizeof(float) * static_cast<std::size_t>(a.scale.numel())) == 0 &&
           std::memcmp(a.inverse.data(), b.inverse.data(), sizeof(float) * static_cast<std::size_t>(a.scale.numel())) == 0 &&
           std::memcmp(va.data(), vb.data(), sizeof(float) * static_cast<std::size_t>(va.numel())) == 0;
  };
  // The amaxes RowAbsMax gives: every cast whose scales come from rows is the one without.
  for (const bool transpose : {false, true})
    for (const ops::Float8Cast cast : {tensorwise, by_rows, by_columns}) {
      CAPTURE(transpose);
      CAPTURE(static_cast<int>(cast.axis));
      const nn::Float8Operand<Cpu> alone = nn::cast_to_float8<Cpu>(x.cview(), cast, transpose);
      nn::Float8RowAmaxes<Cpu> amaxes;
      amaxes.keep(x.cview(), row_amax);
      REQUIRE(nn::Float8RowAmaxes<Cpu>::find(x.cview()) != nullptr);
      CHECK(nn::Float8RowAmaxes<Cpu>::find(x.cview())->data() == row_amax.data());
      CHECK(same(nn::cast_to_float8<Cpu>(x.cview(), cast, transpose), alone));
    }
  // Amaxes that are not x's show which casts read them: 1 for every row gives a
  // tensorwise scale of 448 (e4m3's largest over 1), rows' of 256 (448 rounded down to a
  // power of two); a cast by columns, or of another tensor, takes its own.
  Tensor<float> ones(Shape{16});
  for (std::int64_t r = 0; r < 16; ++r) ones.data()[r] = 1.0f;
  {
    nn::Float8RowAmaxes<Cpu> outer;
    outer.keep(x.cview(), ones);
    nn::Float8RowAmaxes<Cpu> inner;  // sees the one open around it
    CHECK(nn::cast_to_float8<Cpu>(x.cview(), tensorwise).scale[0] == 448.0f);
    CHECK(nn::cast_to_float8<Cpu>(x.cview(), tensorwise, true).scale[0] == 448.0f);
    const nn::Float8Operand<Cpu> rows = nn::cast_to_float8<Cpu>(x.cview(), by_rows);
    for (std::int64_t r = 0; r < 16; ++r) CHECK(rows.scale[r] == 256.0f);
    CHECK(same(nn::cast_to_float8<Cpu>(x.cview(), by_columns, true), nn::cast_to_float8<Cpu>(y.cview(), by_columns, true)) ==
          false);
    CHECK(nn::cast_to_float8<Cpu>(y.cview(), tensorwise).scale[0] != 448.0f);
    // Another view of the same storage (its first 8 rows) is another tensor.
    CHECK(nn::Float8RowAmaxes<Cpu>::find(x.cview().slice_rows(0, 8)) == nullptr);
    CHECK(nn::Float8RowAmaxes<Cpu>::find(x.cview()) != nullptr);
  }
  CHECK(nn::Float8RowAmaxes<Cpu>::find(x.cview()) == nullptr);  // closed
  CHECK(nn::cast_to_float8<Cpu>(x.cview(), tensorwise).scale[0] != 448.0f);
  // One amax a row, or a clear error.
  nn::Float8RowAmaxes<Cpu> amaxes;
  CHECK_THROWS_WITH_AS(amaxes.keep(x.cview(), Tensor<float>(Shape{15})),
                       doctest::Contains("one amax a row of a 16-row tensor, not 15"), Error);
}

}  // namespace test_float8_gemm
