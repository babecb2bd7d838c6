// The ops/ functors on the GPU give the CPU backend's results: every functor that has a
// kernel of its own (backend/cuda/row_kernels.cuh) against the same functor looped over
// on the host by Cpu::for_each, on random inputs (fixed seeds) in odd shapes: rows of
// one element and of 4095, a 128256-column vocabulary, lengths that are not a multiple
// of the vector width, leading dimensions and base pointers that force the scalar path,
// short rows (a warp each) and long ones (a block each). Then determinism (two runs,
// the same bits), the per-index fallback, and a launch on another stream.
//
// Tolerances. The kernels compute each element with the functor's expression, so
// elementwise results differ from the host's only where nvcc fuses a multiply and an
// add (fma) or where the device's expf differs from glibc's, a few ulps (2^-24
// relative each); the checks allow 1e-6 to 1e-5 of the terms' magnitude there. A
// reduction adds its terms in another order than the host's sequential loop (a
// per-thread loop, then a tree). Both orders err by at most about n u sum|terms|
// (u = 2^-24), in practice by a random walk of about u sqrt(n) / 3 sum|terms|: 2e-6 for
// n = 8192. Sums over rows of up to 8192 terms, and what depends on them linearly, are
// allowed 2e-5 of sum|terms|: ten times that, far below a wrong result. A vocabulary row
// of 128256 exponentials is different: the host's running sum grows so large that
// small terms are rounded away, so the CPU's own error there is measured (the same
// terms added in double) and allowed, plus a bound for the kernel's order. A bf16 output
// is one rounding of the float result on either side; when the two floats straddle a
// rounding boundary they round to neighbouring bf16 values, one ulp <= 2^-7 |v| apart,
// which is added to the allowance (rounding_of<T>). Padding beyond a row's n and rows
// the functor leaves alone must be bitwise unchanged, and maxima are exact. AdamW is
// written without fusable expressions (ops::mul_rn, add_rn), so its results, bf16
// moments included, are compared bit for bit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/kernel_class.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/ops.hpp"

namespace test_gpu_ops {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using gpu_test::DeviceArray;

namespace {

// ---- Values -------------------------------------------------------------------------

template <class P>
using pointee = std::remove_cv_t<std::remove_pointer_t<P>>;

/// v as element type U (rounded to nearest even for bf16).
template <class U>
U as(double v) {
  if constexpr (std::is_same_v<U, bf16>) return bf16(static_cast<float>(v));
  else return static_cast<U>(v);
}

/// An element of any type as double.
template <class U>
double value(U v) {
  if constexpr (std::is_same_v<U, bf16>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

/// How far apart two roundings to U of nearly equal floats may land, relative to |v|:
/// one bf16 ulp (<= 2^-7 |v|); nothing for float and double.
template <class U>
constexpr double rounding_of() {
  return std::is_same_v<U, bf16> ? 1.0 / 128.0 : 0.0;
}

/// n uniform values in [lo, hi) as U, from a fixed seed.
template <class U>
std::vector<U> random_values(std::size_t n, double lo, double hi, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<U> v(n);
  for (auto& e : v) e = as<U>(dist(gen));
  return v;
}

/// Checks |got[i] - want[i]| <= allowed(i) for every i (NaN never passes); on failure
/// names `what`, the number of mismatches and the first one.
template <class U, class V>
void check_close(const std::vector<U>& got, const std::vector<V>& want,
                 const std::function<double(std::size_t)>& allowed, const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(value(got[i]) - value(want[i])) <= allowed(i))) {
      if (bad == 0) first = i;
      ++bad;
    }
  }
  std::ostringstream msg;
  msg.precision(9);
  msg << what << ": " << bad << " of " << got.size() << " values out of tolerance";
  if (bad > 0)
    msg << "; first at " << first << ": GPU " << value(got[first]) << ", CPU " << value(want[first]) << ", allowed "
        << allowed(first);
  CHECK_MESSAGE(bad == 0, msg.str());
}

/// Checks two arrays hold the same bytes.
template <class U>
void check_same_bits(const std::vector<U>& a, const std::vector<U>& b, const std::string& what) {
  REQUIRE(a.size() == b.size());
  CHECK_MESSAGE((a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(U)) == 0), what, ": two runs differ");
}

/// Allowance of the reductions over rows of up to 8192 terms, per unit of sum|terms|.
constexpr double kRowSumTol = 2e-5;
/// Allowance of the kernels' own summation order, relative: a thread adds at most
/// n / threads terms (125 for a 128256-logit row on 1024 threads), then 5 shuffle steps
/// and at most 32 warp sums; (125 + 37) u < 1e-5 bounds its error, doubled here.
constexpr double kKernelSumTol = 2e-5;
/// Allowance of one expression evaluated with fma or the device's expf, per unit of
/// the magnitudes of its terms.
constexpr double kExprTol = 1e-5;

/// A row-major (rows, n) case with leading dimension ld; `offset` elements shift every
/// device array off its 16-byte aligned start.
struct RowCase {
  std::int64_t rows, n, ld;
  std::size_t offset;
  const char* what;
};

std::string describe(const RowCase& c) {
  return std::string(c.what) + " (rows " + std::to_string(c.rows) + ", n " + std::to_string(c.n) + ", ld " +
         std::to_string(c.ld) + ", offset " + std::to_string(c.offset) + ")";
}

/// Whether element i of a (rows, ld) array is inside the first n columns.
bool inside(std::size_t i, std::int64_t ld, std::int64_t n) { return static_cast<std::int64_t>(i) % ld < n; }

// ---- RMSNorm ------------------------------------------------------------------------------

const RowCase kNormCases[] = {
    {37, 4096, 4096, 0, "a block per row, vector loads"},
    {64, 4095, 4096, 0, "a block per row, vector loads and a scalar tail"},
    {1, 4095, 4095, 0, "one row whose ld breaks the alignment: scalar loads"},
    {5, 3000, 3000, 1, "a misaligned base: scalar loads"},
    {3, 8191, 8192, 0, "a block of 512 threads"},
    {33, 96, 96, 0, "a warp per row, vector loads"},
    {19, 1000, 1003, 0, "a warp per row, scalar loads"},
    {6, 1, 1, 0, "rows of one element"},
};

template <class T>
struct NormInputs {
  std::vector<T> x, w, dy;
  explicit NormInputs(const RowCase& c, std::uint32_t seed)
      : x(random_values<T>(static_cast<std::size_t>(c.rows * c.ld), -2, 2, seed)),
        w(random_values<T>(static_cast<std::size_t>(c.n), 0.5, 1.5, seed + 1)),
        dy(random_values<T>(static_cast<std::size_t>(c.rows * c.ld), -1, 1, seed + 2)) {}
};

template <class T>
using RstdOf = pointee<decltype(ops::RmsNormForward<T>::rstd)>;

/// RmsNormForward on the GPU (lowered) and on the CPU for one case: y and rstd of each.
template <class T>
void check_rmsnorm_forward(const RowCase& c, std::uint32_t seed) {
  using F = ops::RmsNormForward<T>;
  using R = RstdOf<T>;
  const NormInputs<T> in(c, seed);
  const std::vector<T> y0 = random_values<T>(in.x.size(), 7, 8, seed + 3);  // padding must stay
  const std::vector<R> rstd0(static_cast<std::size_t>(c.rows), as<R>(-1));
  F f{};
  f.ldx = f.ldy = c.ld;
  f.n = c.n;
  f.eps = static_cast<decltype(f.eps)>(1e-5f);

  std::vector<T> y_cpu = y0;
  std::vector<R> rstd_cpu = rstd0;
  F fc = f;
  fc.x = in.x.data();
  fc.w = in.w.data();
  fc.y = y_cpu.data();
  fc.rstd = rstd_cpu.data();
  Cpu::for_each(c.rows, fc);

  DeviceArray<T> dx(in.x, c.offset), dw(in.w, c.offset), dy(y0, c.offset);
  DeviceArray<R> drstd(rstd0);
  F fg = f;
  fg.x = dx.data();
  fg.w = dw.data();
  fg.y = dy.data();
  fg.rstd = drstd.data();
  gpu_test::launch_op(c.rows, fg);

  const std::vector<R> rstd_gpu = drstd.download();
  check_close(rstd_gpu, rstd_cpu,
              [&](std::size_t i) { return (kRowSumTol + rounding_of<R>()) * std::fabs(value(rstd_cpu[i])); },
              "rstd, " + describe(c));
  // y = w x rstd: rstd's error plus one rounding; padding exact.
  const std::vector<T> y_gpu = dy.download();
  check_close(y_gpu, y_cpu,
              [&](std::size_t i) {
                return inside(i, c.ld, c.n) ? (kRowSumTol + rounding_of<T>()) * std::fabs(value(y_cpu[i])) : 0.0;
              },
              "y, " + describe(c));

  // With the rows' amaxes of y (for a float8 cast of it, ops::RmsNormForward::y_amax):
  // the same y bit for bit, and each row's amax RowAbsMax's of that y as stored.
  DeviceArray<T> dy_amaxed(y0, c.offset);
  DeviceArray<float> damax(std::vector<float>(static_cast<std::size_t>(c.rows), -1.0f));
  F fa = fg;
  fa.y = dy_amaxed.data();
  fa.y_amax = damax.data();
  gpu_test::launch_op(c.rows, fa);
  check_same_bits(dy_amaxed.download(), y_gpu, "y with its rows' amaxes against y without, " + describe(c));
  std::vector<float> want(static_cast<std::size_t>(c.rows));
  Cpu::for_each(c.rows, ops::RowAbsMax<T>{y_gpu.data(), c.ld, c.n, want.data()});
  check_same_bits(damax.download(), want, "y's row amaxes against RowAbsMax of y, " + describe(c));
}

TEST_CASE_TEMPLATE("RMSNorm forward: the lowered kernel gives the CPU functor's y and rstd", T, float, bf16) {
  std::uint32_t seed = 100;
  for (const RowCase& c : kNormCases) check_rmsnorm_forward<T>(c, seed += 10);
}

/// How far the GPU's dx (RMSNorm's input gradient, plus `res` where given) may be from
/// the CPU's `dx_cpu`, per element: dx_j = rs w_j dy_j - c x_j with c = rs^3 sum_k(w dy
/// x) / n, so the sum's error reaches dx_j through c x_j; the padding exact.
template <class T, class R>
std::function<double(std::size_t)> dx_tolerance(const RowCase& c, const NormInputs<T>& in, const std::vector<R>& rstd,
                                                const std::vector<T>* res, const std::vector<T>& dx_cpu) {
  std::vector<double> abs_dot(static_cast<std::size_t>(c.rows)), coef(static_cast<std::size_t>(c.rows));
  for (std::int64_t r = 0; r < c.rows; ++r) {
    double a = 0, d = 0;
    for (std::int64_t j = 0; j < c.n; ++j) {
      const double t = value(in.w[j]) * value(in.dy[r * c.ld + j]) * value(in.x[r * c.ld + j]);
      a += std::fabs(t);
      d += t;
    }
    const double rs = value(rstd[r]);
    abs_dot[r] = a;
    coef[r] = rs * rs * rs * d / static_cast<double>(c.n);
  }
  return [&c, &in, &rstd, res, &dx_cpu, abs_dot, coef](std::size_t i) {
    const std::int64_t r = static_cast<std::int64_t>(i) / c.ld, j = static_cast<std::int64_t>(i) % c.ld;
    if (j >= c.n) return 0.0;
    const double rs = value(rstd[r]), x = value(in.x[i]);
    const double terms = std::fabs(rs * value(in.w[j]) * value(in.dy[i])) + std::fabs(coef[r] * x) +
                         (res != nullptr ? std::fabs(value((*res)[i])) : 0.0);
    const double through_c = kRowSumTol * rs * rs * rs * abs_dot[r] / static_cast<double>(c.n);
    return kExprTol * terms + through_c * std::fabs(x) + rounding_of<T>() * std::fabs(value(dx_cpu[i]));
  };
}

/// How far the GPU's dw (RMSNorm's weight gradient: column sums of dy x rs, added to dw0
/// when `add`) may be from the CPU's `dw_cpu`, per column.
template <class T, class R, class D>
std::function<double(std::size_t)> dw_tolerance(const RowCase& c, const NormInputs<T>& in, const std::vector<R>& rstd,
                                                const std::vector<D>& dw0, bool add, const std::vector<D>& dw_cpu) {
  std::vector<double> abs_sum(static_cast<std::size_t>(c.n), 0.0);
  for (std::int64_t r = 0; r < c.rows; ++r)
    for (std::int64_t j = 0; j < c.n; ++j)
      abs_sum[j] += std::fabs(value(in.dy[r * c.ld + j]) * value(in.x[r * c.ld + j]) * value(rstd[r]));
  return [&dw0, add, &dw_cpu, abs_sum](std::size_t j) {
    return kRowSumTol * (abs_sum[j] + (add ? std::fabs(value(dw0[j])) : 0.0)) +
           rounding_of<D>() * std::fabs(value(dw_cpu[j]));
  };
}

/// RmsNormBackwardInput on the GPU and on the CPU for one case, from the CPU forward's
/// rstd; with `residual`, a residual's gradient added in the same pass.
template <class T>
void check_rmsnorm_backward_input(const RowCase& c, std::uint32_t seed, bool residual = false) {
  using R = RstdOf<T>;
  const NormInputs<T> in(c, seed);
  std::vector<T> y(in.x.size());
  std::vector<R> rstd(static_cast<std::size_t>(c.rows));
  ops::RmsNormForward<T> fwd{};
  fwd.x = in.x.data();
  fwd.ldx = fwd.ldy = c.ld;
  fwd.w = in.w.data();
  fwd.y = y.data();
  fwd.rstd = rstd.data();
  fwd.n = c.n;
  fwd.eps = static_cast<decltype(fwd.eps)>(1e-5f);
  Cpu::for_each(c.rows, fwd);

  using F = ops::RmsNormBackwardInput<T>;
  const std::vector<T> dx0 = random_values<T>(in.x.size(), 7, 8, seed + 3);
  const std::vector<T> res = random_values<T>(in.x.size(), -1, 1, seed + 4);
  F f{};
  f.ldx = f.lddy = f.lddx = f.ldres = c.ld;
  f.n = c.n;
  std::vector<T> dx_cpu = dx0;
  F fc = f;
  fc.x = in.x.data();
  fc.w = in.w.data();
  fc.rstd = rstd.data();
  fc.dy = in.dy.data();
  fc.dx = dx_cpu.data();
  if (residual) fc.residual = res.data();
  Cpu::for_each(c.rows, fc);

  DeviceArray<T> dxin(in.x, c.offset), dw(in.w, c.offset), ddy(in.dy, c.offset), ddx(dx0, c.offset),
      dres(res, c.offset);
  DeviceArray<R> drstd(rstd);
  F fg = f;
  fg.x = dxin.data();
  fg.w = dw.data();
  fg.rstd = drstd.data();
  fg.dy = ddy.data();
  fg.dx = ddx.data();
  if (residual) fg.residual = dres.data();
  gpu_test::launch_op(c.rows, fg);

  check_close(ddx.download(), dx_cpu, dx_tolerance(c, in, rstd, residual ? &res : nullptr, dx_cpu),
              (residual ? "dx + residual, " : "dx, ") + describe(c));
}

TEST_CASE_TEMPLATE("RMSNorm backward (input): the lowered kernel gives the CPU functor's dx, with and without a residual", T,
                   float, bf16) {
  std::uint32_t seed = 200;
  for (const RowCase& c : kNormCases) {
    check_rmsnorm_backward_input<T>(c, seed += 10);
    check_rmsnorm_backward_input<T>(c, seed += 10, true);
  }
}

/// RmsNormBackwardWeight (dw += over rows) on the GPU, on the compute stream or another
/// one, and on the CPU; returns the GPU's dw.
template <class T>
std::vector<pointee<decltype(ops::RmsNormBackwardWeight<T>::dw)>> check_rmsnorm_backward_weight(
    const RowCase& c, std::uint32_t seed, bool side_stream = false, bool add = true) {
  using F = ops::RmsNormBackwardWeight<T>;
  using D = pointee<decltype(F::dw)>;
  using R = pointee<decltype(F::rstd)>;
  const NormInputs<T> in(c, seed);
  const std::vector<R> rstd = random_values<R>(static_cast<std::size_t>(c.rows), 0.5, 2, seed + 4);
  const std::vector<D> dw0 = random_values<D>(static_cast<std::size_t>(c.n), -1, 1, seed + 5);  // accumulated into
  F f{};
  f.ldx = f.lddy = c.ld;
  f.rows = c.rows;
  f.add = add;  // without it, dw0 is written over (the step's first write)
  std::vector<D> dw_cpu = dw0;
  F fc = f;
  fc.x = in.x.data();
  fc.rstd = rstd.data();
  fc.dy = in.dy.data();
  fc.dw = dw_cpu.data();
  Cpu::for_each(c.n, fc);

  DeviceArray<T> dx(in.x, c.offset), ddy(in.dy, c.offset);
  DeviceArray<R> drstd(rstd);
  DeviceArray<D> ddw(dw0);
  F fg = f;
  fg.x = dx.data();
  fg.rstd = drstd.data();
  fg.dy = ddy.data();
  fg.dw = ddw.data();
  if (side_stream) gpu_test::launch_op_on_side_stream(c.n, fg);
  else gpu_test::launch_op(c.n, fg);

  const std::vector<D> dw_gpu = ddw.download();
  check_close(dw_gpu, dw_cpu, dw_tolerance(c, in, rstd, dw0, add, dw_cpu),
              std::string(side_stream ? "dw on a side stream, " : "dw, ") + (add ? "" : "written, ") + describe(c));
  return dw_gpu;
}

const RowCase kWeightCases[] = {
    {1000, 4095, 4096, 0, "8 chunks of 128 rows, vector loads and a column tail"},
    {1, 4096, 4096, 0, "one row"},
    {300, 1001, 1001, 0, "a partial last chunk, scalar loads"},
    {129, 96, 96, 1, "a misaligned base: scalar loads"},
    {140000, 8, 8, 0, "140000 rows: 1022 chunks of 137 rows"},
};

TEST_CASE_TEMPLATE("RMSNorm backward (weight): the two-stage column sums give the CPU functor's dw", T, float, bf16) {
  std::uint32_t seed = 300;
  for (const RowCase& c : kWeightCases) {
    check_rmsnorm_backward_weight<T>(c, seed += 10);
    check_rmsnorm_backward_weight<T>(c, seed += 10, false, /*add=*/false);
  }
}

/// RmsNormBackward (both passes in one launch: the fused kernel where the rows allow it,
/// the two kernels otherwise) on the GPU against the two CPU functors: dx (plus the
/// residual) and dw (written, or added to).
template <class T>
void check_rmsnorm_backward_fused(const RowCase& c, std::uint32_t seed, bool residual, bool add) {
  using R = RstdOf<T>;
  using D = pointee<decltype(ops::RmsNormBackwardWeight<T>::dw)>;
  const NormInputs<T> in(c, seed);
  const std::vector<R> rstd = random_values<R>(static_cast<std::size_t>(c.rows), 0.5, 2, seed + 3);
  const std::vector<T> res = random_values<T>(in.x.size(), -1, 1, seed + 4);
  const std::vector<T> dx0 = random_values<T>(in.x.size(), 7, 8, seed + 5);
  const std::vector<D> dw0 = random_values<D>(static_cast<std::size_t>(c.n), -1, 1, seed + 6);
  ops::RmsNormBackward<T> f{};
  f.input.ldx = f.input.lddy = f.input.lddx = f.input.ldres = c.ld;
  f.input.n = c.n;
  f.weight.ldx = f.weight.lddy = c.ld;
  f.weight.rows = c.rows;
  f.weight.add = add;

  std::vector<T> dx_cpu = dx0;
  std::vector<D> dw_cpu = dw0;
  ops::RmsNormBackward<T> fc = f;
  fc.input.x = fc.weight.x = in.x.data();
  fc.input.w = in.w.data();
  fc.input.rstd = fc.weight.rstd = rstd.data();
  fc.input.dy = fc.weight.dy = in.dy.data();
  fc.input.dx = dx_cpu.data();
  if (residual) fc.input.residual = res.data();
  fc.weight.dw = dw_cpu.data();
  Cpu::for_each(c.rows + c.n, fc);

  DeviceArray<T> dxin(in.x, c.offset), dwt(in.w, c.offset), ddy(in.dy, c.offset), ddx(dx0, c.offset),
      dres(res, c.offset);
  DeviceArray<R> drstd(rstd);
  DeviceArray<D> ddw(dw0);
  ops::RmsNormBackward<T> fg = f;
  fg.input.x = fg.weight.x = dxin.data();
  fg.input.w = dwt.data();
  fg.input.rstd = fg.weight.rstd = drstd.data();
  fg.input.dy = fg.weight.dy = ddy.data();
  fg.input.dx = ddx.data();
  if (residual) fg.input.residual = dres.data();
  fg.weight.dw = ddw.data();
  gpu_test::launch_op(c.rows + c.n, fg);

  const std::string what = std::string(residual ? "residual, " : "") + (add ? "dw added to, " : "dw written, ");
  check_close(ddx.download(), dx_cpu, dx_tolerance(c, in, rstd, residual ? &res : nullptr, dx_cpu),
              "fused dx, " + what + describe(c));
  check_close(ddw.download(), dw_cpu, dw_tolerance(c, in, rstd, dw0, add, dw_cpu),
              "fused dw, " + what + describe(c));
}

TEST_CASE_TEMPLATE("RMSNorm backward, both passes in one launch: the fused kernel gives the CPU functors' dx and dw", T,
                   float, bf16) {
  const RowCase cases[] = {
      {1000, 2048, 2048, 0, "Llama 3.2 1B's width: fused, 62 chunks of 16 rows and a short one"},
      {48, 4096, 4096, 0, "Llama 3 8B's width: fused"},
      {20, 16384, 16384, 0, "2 vectors a thread (bf16), fused; a float row of 4096 vectors takes the two kernels"},
      {7, 24, 24, 0, "a row of 3 or 6 vectors: fused, one warp"},
      {300, 1001, 1001, 0, "a row not whole vectors: the two kernels"},
      {129, 96, 96, 1, "a misaligned base: the two kernels"},
  };
  std::uint32_t seed = 700;
  for (const RowCase& c : cases)
    for (const bool residual : {false, true})
      for (const bool add : {false, true}) check_rmsnorm_backward_fused<T>(c, seed += 10, residual, add);
}

TEST_CASE_TEMPLATE("RMSNorm backward (weight) on another stream gives the compute stream's bits", T, float, bf16) {
  const RowCase c{1000, 4095, 4096, 0, "8 chunks"};
  const auto on_compute = check_rmsnorm_backward_weight<T>(c, 400);
  const auto on_side = check_rmsnorm_backward_weight<T>(c, 400, true);
  check_same_bits(on_side, on_compute, "dw on two streams");
}

// ---- Cross-entropy ------------------------------------------------------------------------

/// Row r's target: ignore_index on every third row, else a column spread over [0, vocab)
/// (the first and the last column among them).
std::vector<std::int32_t> targets_for(std::int64_t rows, std::int64_t vocab) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (r % 3 == 1) t[r] = ops::kIgnoreIndex;
    else if (r == 0) t[r] = 0;
    else if (r == 2) t[r] = static_cast<std::int32_t>(vocab - 1);
    else t[r] = static_cast<std::int32_t>((r * 7919) % vocab);
  }
  return t;
}

struct CrossEntropyCase {
  RowCase shape;  // n is the vocabulary
  bool write_grad;
};

const CrossEntropyCase kCrossEntropyCases[] = {
    {{6, 128256, 128256, 0, "a Llama 3 vocabulary, gradient"}, true},
    {{6, 128256, 128256, 0, "a Llama 3 vocabulary, loss only"}, false},
    {{5, 1001, 1003, 0, "odd vocabulary and ld: scalar loads"}, true},
    {{4, 1001, 1001, 1, "a misaligned base: scalar loads"}, true},
    {{4, 1001, 1001, 1, "a misaligned base, loss only"}, false},
    {{3, 1, 1, 0, "a vocabulary of one"}, true},
    // Rows the one-read kernel takes on sm_90 (8193 to 131072 logits, aligned), then
    // rows it leaves to the passes.
    {{4, 20000, 20000, 0, "a Llama 2 sized vocabulary: one read, 8 logits a thread"}, true},
    {{3, 50001, 50004, 0, "one read, the row's last vector short"}, true},
    {{3, 50001, 50004, 0, "one read, the last vector short, loss only"}, false},
    {{3, 131072, 131072, 0, "the longest row one read takes"}, true},
    {{2, 131073, 131076, 0, "a row past one read: the passes"}, true},
    {{3, 20000, 20000, 1, "a misaligned base past one read's rule: the passes"}, true},
};

template <class T>
void check_cross_entropy(const CrossEntropyCase& cc, std::uint32_t seed) {
  using F = ops::CrossEntropyRow<T>;
  const RowCase& c = cc.shape;
  const std::vector<T> z = random_values<T>(static_cast<std::size_t>(c.rows * c.ld), -8, 8, seed);
  const std::vector<std::int32_t> t = targets_for(c.rows, c.n);
  const std::vector<double> loss0(static_cast<std::size_t>(c.rows), -1.0);
  const double scale = 1.0 / 3.0;
  F f{};
  f.ld = c.ld;
  f.vocab = c.n;
  f.scale = static_cast<decltype(f.scale)>(static_cast<float>(scale));
  f.write_grad = cc.write_grad;

  std::vector<T> z_cpu = z;
  std::vector<double> loss_cpu = loss0;
  F fc = f;
  fc.logits = z_cpu.data();
  fc.targets = t.data();
  fc.loss = loss_cpu.data();
  Cpu::for_each(c.rows, fc);

  DeviceArray<T> dz(z, c.offset);
  DeviceArray<std::int32_t> dt(t);
  DeviceArray<double> dloss(loss0);
  F fg = f;
  fg.logits = dz.data();
  fg.targets = dt.data();
  fg.loss = dloss.data();
  gpu_test::launch_op(c.rows, fg);

  // The CPU functor adds the row's exponentials one after another in float; over a
  // vocabulary row its partial sum grows so large that small terms are rounded away,
  // which makes its sum too small by more than the random-walk estimate (1e-4 at
  // 128256 logits in [-8, 8]). That error is measured here against the same terms
  // added in double; the GPU may differ from the CPU by it plus kKernelSumTol.
  const auto rows = static_cast<std::size_t>(c.rows);
  std::vector<double> cpu_sum_error(rows, 0.0), abs_terms(rows, 0.0);
  for (std::int64_t r = 0; r < c.rows; ++r) {
    if (t[r] == ops::kIgnoreIndex) continue;
    const T* row = z.data() + r * c.ld;
    float m = static_cast<float>(value(row[0]));
    for (std::int64_t j = 1; j < c.n; ++j) m = std::max(m, static_cast<float>(value(row[j])));
    float sum = 0;
    double exact = 0;
    for (std::int64_t j = 0; j < c.n; ++j) {
      const float e = ops::exp_nonpositive(static_cast<float>(value(row[j])) - m);
      sum += e;
      exact += e;
    }
    cpu_sum_error[r] = std::fabs(sum - exact) / exact;
    abs_terms[r] = std::fabs(m) + std::fabs(std::log(exact)) + std::fabs(value(row[t[r]]));
  }
  // loss = max + log(sum) - z_t: the sums' relative difference, plus the expression's
  // roundings on its terms.
  check_close(
      dloss.download(), loss_cpu,
      [&](std::size_t r) {
        return t[r] == ops::kIgnoreIndex ? 0.0 : cpu_sum_error[r] + kKernelSumTol + 1e-6 * abs_terms[r];
      },
      "loss, " + describe(c));
  // Gradient: scale exp(z_j - max) / sum (minus scale at the target): the sums'
  // relative difference in every element, and the exponential's few ulps; loss only:
  // exp(z - max), one expression. Ignored rows exact (zeros, or untouched), as is the
  // padding.
  check_close(
      dz.download(), z_cpu,
      [&](std::size_t i) {
        const std::int64_t r = static_cast<std::int64_t>(i) / c.ld, j = static_cast<std::int64_t>(i) % c.ld;
        if (j >= c.n || t[r] == ops::kIgnoreIndex) return 0.0;
        const double v = std::fabs(value(z_cpu[i]));
        if (!cc.write_grad) return (kExprTol + rounding_of<T>()) * v;
        const double p = v + (j == t[r] ? scale : 0.0);  // |scale softmax_j|, bounding the target's too
        return (cpu_sum_error[r] + kKernelSumTol) * p + 1e-6 * p + rounding_of<T>() * v;
      },
      std::string(cc.write_grad ? "gradient, " : "exp(z - max), ") + describe(c));
}

TEST_CASE_TEMPLATE("Cross-entropy rows: the lowered kernel gives the CPU functor's loss and gradient", T, float, bf16) {
  std::uint32_t seed = 500;
  for (const CrossEntropyCase& c : kCrossEntropyCases) check_cross_entropy<T>(c, seed += 10);
}

TEST_CASE("Cross-entropy: a Llama 3 row is read once on an sm_90 GPU") {
  // The one-read kernel falls back to the passes where it cannot run; on the GPUs the
  // project is tuned for it must run, or the loss head moves 14 bytes a logit, not 6.
  if (gpu_test::device_compute_major() < 9) return;
  CHECK(gpu_test::cross_entropy_one_read_runs());
}

TEST_CASE("Cross-entropy rows into a bf16 gradient: the in-place kernel's gradient rounded to bf16, bit for bit") {
  // The bf16 model's loss head: float logits only read, the gradient written as bf16 in
  // the same pass. Its sum and exponentials are the in-place kernel's, so each element is
  // that kernel's float gradient rounded once. Vector and scalar paths, an ignored row.
  std::uint32_t seed = 900;
  for (const CrossEntropyCase& cc : kCrossEntropyCases) {
    const RowCase& c = cc.shape;
    CAPTURE(describe(c));
    CAPTURE(cc.write_grad);
    const std::vector<float> z = random_values<float>(static_cast<std::size_t>(c.rows * c.ld), -8, 8, seed += 10);
    const std::vector<std::int32_t> t = targets_for(c.rows, c.n);
    const std::vector<double> loss0(static_cast<std::size_t>(c.rows), -1.0);
    const bf16 sentinel(123.0f);
    DeviceArray<float> in_place(z, c.offset), read_only(z, c.offset);
    DeviceArray<bf16> grad(std::vector<bf16>(static_cast<std::size_t>(c.rows * c.ld), sentinel), c.offset);
    DeviceArray<std::int32_t> dt(t);
    DeviceArray<double> loss_a(loss0), loss_b(loss0);
    gpu_test::launch_op(c.rows, ops::CrossEntropyRow<float>{in_place.data(), c.ld, c.n, dt.data(), 1.0f / 3,
                                                            cc.write_grad, loss_a.data()});
    gpu_test::launch_op(c.rows, ops::CrossEntropyRow<float, bf16>{read_only.data(), c.ld, c.n, dt.data(), 1.0f / 3,
                                                                  cc.write_grad, loss_b.data(), grad.data(), c.ld});
    CHECK(loss_b.download() == loss_a.download());
    CHECK(read_only.download() == z);
    const std::vector<float> want = in_place.download();
    const std::vector<bf16> got = grad.download();
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const std::int64_t j = static_cast<std::int64_t>(i) % c.ld;
      const bf16 expect = cc.write_grad && j < c.n ? bf16(want[i]) : sentinel;
      if (got[i].bits != expect.bits && differ++ == 0)
        MESSAGE("first difference: row ", static_cast<std::int64_t>(i) / c.ld, ", column ", j, " (target ",
                t[static_cast<std::size_t>(static_cast<std::int64_t>(i) / c.ld)], "): bf16 bits ", got[i].bits,
                ", the in-place float ", want[i], " rounds to bits ", expect.bits);
    }
    CHECK(differ == 0);
  }
}

/// Targets for a rank holding columns [lo, lo + n) of a vocabulary of 3 n: its first
/// and last column, ignore_index, a column on another rank, its middle column.
std::vector<std::int32_t> shard_targets(std::int64_t rows, std::int64_t n, std::int64_t lo) {
  const std::int64_t pattern[] = {lo, ops::kIgnoreIndex, lo + n - 1, (lo + n) % (3 * n), lo + n / 2};
  std::vector<std::int32_t> t(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) t[r] = static_cast<std::int32_t>(pattern[r % 5]);
  return t;
}

/// The vocabulary-parallel passes of one rank holding columns [lo, lo + n) of each row:
/// max, exp and its sum, gradient, each from the CPU's result of the pass before.
template <class T>
void check_cross_entropy_shards(const RowCase& c, std::int64_t lo, std::uint32_t seed) {
  const std::vector<T> z = random_values<T>(static_cast<std::size_t>(c.rows * c.ld), -8, 8, seed);
  const std::vector<std::int32_t> t = shard_targets(c.rows, c.n, lo);
  DeviceArray<std::int32_t> dt(t);
  const auto rows = static_cast<std::size_t>(c.rows);

  using FMax = ops::CrossEntropyShardMax<T>;
  using M = pointee<decltype(FMax::max)>;
  const std::vector<M> max0(rows, as<M>(-1));
  FMax fm{};
  fm.ld = c.ld;
  fm.vocab = c.n;
  std::vector<M> max_cpu = max0;
  FMax fmc = fm;
  fmc.logits = z.data();
  fmc.targets = t.data();
  fmc.max = max_cpu.data();
  Cpu::for_each(c.rows, fmc);
  {
    DeviceArray<T> dz(z, c.offset);
    DeviceArray<M> dmax(max0);
    FMax fmg = fm;
    fmg.logits = dz.data();
    fmg.targets = dt.data();
    fmg.max = dmax.data();
    gpu_test::launch_op(c.rows, fmg);
    check_close(dmax.download(), max_cpu, [](std::size_t) { return 0.0; }, "shard max, " + describe(c));
  }

  using FExp = ops::CrossEntropyShardExp<T>;
  using S = pointee<decltype(FExp::sums)>;
  const std::vector<S> sums0(2 * rows, as<S>(-1));
  FExp fe{};
  fe.ld = c.ld;
  fe.vocab = c.n;
  fe.lo = lo;
  std::vector<T> e_cpu = z;
  std::vector<S> sums_cpu = sums0;
  FExp fec = fe;
  fec.logits = e_cpu.data();
  fec.targets = t.data();
  fec.max = max_cpu.data();
  fec.sums = sums_cpu.data();
  Cpu::for_each(c.rows, fec);
  {
    DeviceArray<T> dz(z, c.offset);
    DeviceArray<M> dmax(max_cpu);
    DeviceArray<S> dsums(sums0);
    FExp feg = fe;
    feg.logits = dz.data();
    feg.targets = dt.data();
    feg.max = dmax.data();
    feg.sums = dsums.data();
    gpu_test::launch_op(c.rows, feg);
    check_close(dz.download(), e_cpu,
                [&](std::size_t i) {
                  const std::int64_t r = static_cast<std::int64_t>(i) / c.ld, j = static_cast<std::int64_t>(i) % c.ld;
                  if (j >= c.n || t[r] == ops::kIgnoreIndex) return 0.0;
                  return (kExprTol + rounding_of<T>()) * std::fabs(value(e_cpu[i]));
                },
                "shard exp, " + describe(c));
    // [2r]: a sum of n exponentials; [2r + 1]: the target's logit, copied.
    check_close(dsums.download(), sums_cpu,
                [&](std::size_t i) {
                  return i % 2 == 1 ? 0.0 : (kRowSumTol + rounding_of<S>()) * std::fabs(value(sums_cpu[i]));
                },
                "shard sums, " + describe(c));
  }

  using FGrad = ops::CrossEntropyShardGrad<T>;
  const double scale = 0.25;
  for (const bool write_grad : {true, false}) {
    const std::vector<double> loss0(rows, -1.0);
    FGrad fg{};
    fg.ld = c.ld;
    fg.vocab = c.n;
    fg.lo = lo;
    fg.scale = static_cast<decltype(fg.scale)>(static_cast<float>(scale));
    fg.write_grad = write_grad;
    std::vector<T> g_cpu = e_cpu;
    std::vector<double> loss_cpu = loss0;
    FGrad fgc = fg;
    fgc.logits = g_cpu.data();
    fgc.targets = t.data();
    fgc.max = max_cpu.data();
    fgc.sums = sums_cpu.data();
    fgc.loss = loss_cpu.data();
    Cpu::for_each(c.rows, fgc);

    DeviceArray<T> dz(e_cpu, c.offset);
    DeviceArray<M> dmax(max_cpu);
    DeviceArray<S> dsums(sums_cpu);
    DeviceArray<double> dloss(loss0);
    FGrad fgg = fg;
    fgg.logits = dz.data();
    fgg.targets = dt.data();
    fgg.max = dmax.data();
    fgg.sums = dsums.data();
    fgg.loss = dloss.data();
    gpu_test::launch_op(c.rows, fgg);
    const std::string what = std::string(write_grad ? "shard gradient, " : "shard loss only, ") + describe(c);
    check_close(dloss.download(), loss_cpu,
                [&](std::size_t r) { return kExprTol * (1 + std::fabs(loss_cpu[r])); }, "loss of the " + what);
    check_close(dz.download(), g_cpu,
                [&](std::size_t i) {
                  const std::int64_t j = static_cast<std::int64_t>(i) % c.ld;
                  if (j >= c.n) return 0.0;
                  const double v = std::fabs(value(g_cpu[i]));
                  return kExprTol * (v + scale) + rounding_of<T>() * v;
                },
                what);
  }
}

TEST_CASE_TEMPLATE("Vocabulary-parallel cross-entropy passes: the lowered kernels give the CPU functors' results", T,
                   float, bf16) {
  check_cross_entropy_shards<T>({6, 1000, 1000, 0, "columns [1000, 2000) of 3000, vector loads"}, 1000, 600);
  check_cross_entropy_shards<T>({6, 1000, 1001, 0, "columns [0, 1000) of 3000, scalar loads"}, 0, 610);
  check_cross_entropy_shards<T>({5, 9000, 9000, 1, "columns [18000, 27000), misaligned base"}, 18000, 620);
}

// ---- Softmax rows ---------------------------------------------------------------------------

struct SoftmaxCase {
  RowCase shape;  // n is cols
  std::int64_t offset;  // the tile's first query
};

const SoftmaxCase kSoftmaxCases[] = {
    {{70, 300, 300, 0, "a warp per row, the causal diagonal inside the tile"}, 0},
    {{70, 300, 304, 0, "a warp per row, queries past the last key"}, 250},
    {{9, 1500, 1504, 0, "a block per row, vector loads"}, 1400},
    {{9, 1500, 1501, 0, "a block per row, scalar loads"}, 0},
    {{9, 1500, 1500, 1, "a misaligned base"}, 700},
    {{5, 1, 1, 0, "one key"}, 0},
};

/// Whether column j of row r is visible (the functors' causal bound).
bool visible(std::int64_t r, std::int64_t j, std::int64_t offset, std::int64_t cols) {
  const std::int64_t i = r + offset, end = i < cols - 1 ? i + 1 : cols;
  return j < end;
}

template <class T>
using LseOf = pointee<decltype(ops::CausalSoftmaxForward<T>::lse)>;

template <class T>
void check_softmax(const SoftmaxCase& sc, std::uint32_t seed) {
  const RowCase& c = sc.shape;
  const auto rows = static_cast<std::size_t>(c.rows);
  const std::vector<T> s = random_values<T>(static_cast<std::size_t>(c.rows * c.ld), -20, 20, seed);
  const float scale = 0.125f;
  using L = LseOf<T>;
  const std::vector<L> lse0(rows, as<L>(-1));

  // Forward: probabilities in place and lse.
  using FF = ops::CausalSoftmaxForward<T>;
  FF ff{};
  ff.ld = c.ld;
  ff.cols = c.n;
  ff.offset = sc.offset;
  ff.scale = static_cast<decltype(ff.scale)>(scale);
  std::vector<T> p_cpu = s;
  std::vector<L> lse_cpu = lse0;
  FF ffc = ff;
  ffc.s = p_cpu.data();
  ffc.lse = lse_cpu.data();
  Cpu::for_each(c.rows, ffc);
  {
    DeviceArray<T> ds(s, c.offset);
    DeviceArray<L> dlse(lse0);
    FF ffg = ff;
    ffg.s = ds.data();
    ffg.lse = dlse.data();
    gpu_test::launch_op(c.rows, ffg);
    check_close(dlse.download(), lse_cpu,
                [&](std::size_t r) { return (kRowSumTol + rounding_of<L>()) * (1 + std::fabs(value(lse_cpu[r]))); },
                "softmax lse, " + describe(c));
    check_close(ds.download(), p_cpu,
                [&](std::size_t i) {
                  const std::int64_t r = static_cast<std::int64_t>(i) / c.ld, j = static_cast<std::int64_t>(i) % c.ld;
                  if (j >= c.n || !visible(r, j, sc.offset, c.n)) return 0.0;
                  return (kRowSumTol + rounding_of<T>()) * std::fabs(value(p_cpu[i]));
                },
                "softmax probabilities, " + describe(c));
  }

  // Recompute from the scores and the CPU's lse.
  using FR = ops::CausalSoftmaxRecompute<T>;
  FR fr{};
  fr.ld = c.ld;
  fr.cols = c.n;
  fr.offset = sc.offset;
  fr.scale = static_cast<decltype(fr.scale)>(scale);
  std::vector<T> r_cpu = s;
  FR frc = fr;
  frc.s = r_cpu.data();
  frc.lse = lse_cpu.data();
  Cpu::for_each(c.rows, frc);
  {
    DeviceArray<T> ds(s, c.offset);
    DeviceArray<L> dlse(lse_cpu);
    FR frg = fr;
    frg.s = ds.data();
    frg.lse = dlse.data();
    gpu_test::launch_op(c.rows, frg);
    check_close(ds.download(), r_cpu,
                [&](std::size_t i) {
                  const std::int64_t r = static_cast<std::int64_t>(i) / c.ld, j = static_cast<std::int64_t>(i) % c.ld;
                  if (j >= c.n || !visible(r, j, sc.offset, c.n)) return 0.0;
                  return (kExprTol + rounding_of<T>()) * std::fabs(value(r_cpu[i]));
                },
                "softmax recompute, " + describe(c));
  }

  // Backward: dS = scale p (dP - D) in place on dP, from the CPU's probabilities.
  using FB = ops::CausalSoftmaxBackward<T>;
  using DD = pointee<decltype(FB::d)>;
  const std::vector<T> dp = random_values<T>(s.size(), -1, 1, seed + 1);
  const std::vector<DD> d = random_values<DD>(rows, -0.5, 0.5, seed + 2);
  FB fb{};
  fb.ldp = fb.lddp = c.ld;
  fb.cols = c.n;
  fb.offset = sc.offset;
  fb.scale = static_cast<decltype(fb.scale)>(scale);
  std::vector<T> ds_cpu = dp;
  FB fbc = fb;
  fbc.p = p_cpu.data();
  fbc.dp = ds_cpu.data();
  fbc.d = d.data();
  Cpu::for_each(c.rows, fbc);
  {
    DeviceArray<T> dprob(p_cpu, c.offset), ddp(dp, c.offset);
    DeviceArray<DD> dd(d);
    FB fbg = fb;
    fbg.p = dprob.data();
    fbg.dp = ddp.data();
    fbg.d = dd.data();
    gpu_test::launch_op(c.rows, fbg);
    check_close(ddp.download(), ds_cpu,
                [&](std::size_t i) {
                  const std::int64_t r = static_cast<std::int64_t>(i) / c.ld, j = static_cast<std::int64_t>(i) % c.ld;
                  if (j >= c.n || !visible(r, j, sc.offset, c.n)) return 0.0;
                  const double terms =
                      std::fabs(scale * value(p_cpu[i])) * (std::fabs(value(dp[i])) + std::fabs(value(d[r])));
                  return kExprTol * terms + rounding_of<T>() * std::fabs(value(ds_cpu[i]));
                },
                "softmax backward, " + describe(c));
  }
}

TEST_CASE_TEMPLATE("Causal softmax rows (forward, recompute, backward): the lowered kernels give the CPU functors'",
                   T, float, bf16) {
  std::uint32_t seed = 700;
  for (const SoftmaxCase& c : kSoftmaxCases) check_softmax<T>(c, seed += 10);
}

const RowCase kRowDotCases[] = {
    {50, 64, 64, 0, "head dim 64: a warp per row"},
    {50, 128, 130, 0, "head dim 128, odd ld: scalar loads"},
    {7, 2000, 2000, 0, "a block per row"},
    {3, 3, 3, 1, "rows of three, misaligned"},
};

template <class T>
void check_row_dot(const RowCase& c, std::uint32_t seed) {
  using F = ops::RowDot<T>;
  using O = pointee<decltype(F::out)>;
  const std::vector<T> a = random_values<T>(static_cast<std::size_t>(c.rows * c.ld), -1, 1, seed);
  const std::vector<T> b = random_values<T>(a.size(), -1, 1, seed + 1);
  const std::vector<O> out0(static_cast<std::size_t>(c.rows), as<O>(-7));
  F f{};
  f.lda = f.ldb = c.ld;
  f.n = c.n;
  std::vector<O> out_cpu = out0;
  F fc = f;
  fc.a = a.data();
  fc.b = b.data();
  fc.out = out_cpu.data();
  Cpu::for_each(c.rows, fc);

  DeviceArray<T> da(a, c.offset), db(b, c.offset);
  DeviceArray<O> dout(out0);
  F fg = f;
  fg.a = da.data();
  fg.b = db.data();
  fg.out = dout.data();
  gpu_test::launch_op(c.rows, fg);
  check_close(dout.download(), out_cpu,
              [&](std::size_t r) {
                double s = 0;
                for (std::int64_t j = 0; j < c.n; ++j)
                  s += std::fabs(value(a[r * c.ld + j]) * value(b[r * c.ld + j]));
                return kRowSumTol * s + rounding_of<O>() * std::fabs(value(out_cpu[r]));
              },
              "row dot, " + describe(c));
}

TEST_CASE_TEMPLATE("Row dot products: the lowered kernel gives the CPU functor's sums", T, float, bf16) {
  std::uint32_t seed = 800;
  for (const RowCase& c : kRowDotCases) check_row_dot<T>(c, seed += 10);
}

// ---- RoPE and the elementwise ops ----------------------------------------------------------

struct RopeCase {
  std::int64_t head_dim, ld_pad;
  std::size_t offset;
  bool inverse, separate_src;
  const char* what;
};

template <class T>
void check_rope(const RopeCase& rc, std::uint32_t seed) {
  using F = ops::RopeRotate<T>;
  using C = pointee<decltype(F::cos)>;
  const std::int64_t seq = 33, rows = 2 * seq, heads = 5, half = rc.head_dim / 2;
  const std::int64_t ld = heads * rc.head_dim + rc.ld_pad;
  std::vector<C> cos_t(static_cast<std::size_t>(seq * half)), sin_t(cos_t.size());
  for (std::int64_t p = 0; p < seq; ++p)
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(p) * std::pow(500000.0, -2.0 * static_cast<double>(i) / static_cast<double>(rc.head_dim));
      cos_t[p * half + i] = as<C>(std::cos(angle));
      sin_t[p * half + i] = as<C>(std::sin(angle));
    }
  const std::vector<T> x = random_values<T>(static_cast<std::size_t>(rows * ld), -3, 3, seed);
  const std::vector<T> src = random_values<T>(x.size(), -3, 3, seed + 1);
  F f{};
  f.ld = ld;
  f.n_heads = heads;
  f.head_dim = rc.head_dim;
  f.positions = seq;
  f.inverse = rc.inverse;

  std::vector<T> x_cpu = x;
  F fc = f;
  fc.x = x_cpu.data();
  fc.cos = cos_t.data();
  fc.sin = sin_t.data();
  fc.src = rc.separate_src ? src.data() : nullptr;
  Cpu::for_each(rows, fc);

  DeviceArray<T> dx(x, rc.offset), dsrc(src, rc.offset);
  DeviceArray<C> dcos(cos_t, rc.offset), dsin(sin_t, rc.offset);
  F fg = f;
  fg.x = dx.data();
  fg.cos = dcos.data();
  fg.sin = dsin.data();
  fg.src = rc.separate_src ? dsrc.data() : nullptr;
  gpu_test::launch_op(rows, fg);

  const std::vector<T>& in = rc.separate_src ? src : x;
  check_close(dx.download(), x_cpu,
              [&](std::size_t i) {
                const std::int64_t col = static_cast<std::int64_t>(i) % ld;
                if (col >= heads * rc.head_dim || col % rc.head_dim >= 2 * half) return 0.0;
                const std::int64_t k = col % rc.head_dim;
                const auto h = static_cast<std::size_t>(half);
                const std::size_t partner = k < half ? i + h : i - h;
                return kExprTol * (std::fabs(value(in[i])) + std::fabs(value(in[partner]))) +
                       rounding_of<T>() * std::fabs(value(x_cpu[i]));
              },
              std::string("rope, ") + rc.what);
}

TEST_CASE_TEMPLATE("RoPE: the lowered kernel gives the CPU functor's rotation", T, float, bf16) {
  const RopeCase cases[] = {
      {64, 0, 0, false, false, "head dim 64 in place, vector loads"},
      {64, 8, 0, true, true, "head dim 64, inverse, from a source, padded rows"},
      {62, 0, 0, false, true, "head dim 62: scalar loads"},
      {63, 2, 0, true, false, "odd head dim 63 (its last element untouched)"},
      {128, 0, 1, false, false, "head dim 128, misaligned base: scalar loads"},
  };
  std::uint32_t seed = 900;
  for (const RopeCase& c : cases) check_rope<T>(c, seed += 10);
}

const std::size_t kElementwiseSizes[] = {100003, 4096, 1};
const std::size_t kElementwiseOffsets[] = {0, 1};

TEST_CASE_TEMPLATE("SwiGLU forward and backward: the vectorised kernels give the CPU functors' values", T, float,
                   bf16) {
  std::uint32_t seed = 1000;
  for (const std::size_t n : kElementwiseSizes)
    for (const std::size_t off : kElementwiseOffsets) {
      const std::string what = "n " + std::to_string(n) + ", offset " + std::to_string(off);
      const auto a = random_values<T>(n, -6, 6, seed += 10), b = random_values<T>(n, -6, 6, seed + 1),
                 dg = random_values<T>(n, -1, 1, seed + 2);
      const auto g0 = random_values<T>(n, 7, 8, seed + 3);
      const auto count = static_cast<std::int64_t>(n);

      std::vector<T> g_cpu = g0;
      Cpu::for_each(count, ops::SwiGluForward<T>{a.data(), b.data(), g_cpu.data()});
      DeviceArray<T> da(a, off), db(b, off), ddg(dg, off), dg_out(g0, off);
      gpu_test::launch_op(count, ops::SwiGluForward<T>{da.data(), db.data(), dg_out.data()});
      check_close(dg_out.download(), g_cpu,
                  [&](std::size_t i) { return (kExprTol + rounding_of<T>()) * std::fabs(value(g_cpu[i])); },
                  "swiglu forward, " + what);

      std::vector<T> da_cpu = g0, db_cpu = g0;
      Cpu::for_each(count, ops::SwiGluBackward<T>{a.data(), b.data(), dg.data(), da_cpu.data(), db_cpu.data()});
      DeviceArray<T> dda(g0, off), ddb(g0, off);
      gpu_test::launch_op(count, ops::SwiGluBackward<T>{da.data(), db.data(), ddg.data(), dda.data(), ddb.data()});
      // da = dg b s (1 + a (1 - s)): the bracket may cancel, so the allowance is on its terms.
      check_close(dda.download(), da_cpu,
                  [&](std::size_t i) {
                    const double av = value(a[i]), s = 1 / (1 + std::exp(-av));
                    const double terms = std::fabs(value(dg[i]) * value(b[i]) * s) * (1 + std::fabs(av * (1 - s)));
                    return kExprTol * terms + rounding_of<T>() * std::fabs(value(da_cpu[i]));
                  },
                  "swiglu backward da, " + what);
      check_close(ddb.download(), db_cpu,
                  [&](std::size_t i) { return (kExprTol + rounding_of<T>()) * std::fabs(value(db_cpu[i])); },
                  "swiglu backward db, " + what);
    }
}

struct SwiGluRowsCase {
  std::int64_t rows, cols;
  std::size_t offset;
  const char* what;
};
const SwiGluRowsCase kSwiGluRowsCases[] = {
    {37, 8192, 0, "a block per row, vector loads"},
    {3, 14336, 0, "Llama 3 8B's hidden size, a block per row"},
    {64, 1000, 0, "a warp per row, vector loads"},
    {5, 1003, 0, "rows not whole vectors: scalar loads"},
    {9, 4096, 1, "a misaligned base: scalar loads"},
    {7, 1, 0, "rows of one element"},
};

/// The amax of each of `rows` rows of `cols` elements of x as stored (RowAbsMax on the CPU).
template <class T>
std::vector<float> row_amaxes(const std::vector<T>& x, std::int64_t rows, std::int64_t cols) {
  std::vector<float> m(static_cast<std::size_t>(rows));
  Cpu::for_each(rows, ops::RowAbsMax<T>{x.data(), cols, cols, m.data()});
  return m;
}

TEST_CASE_TEMPLATE("SwiGLU by rows: the row kernels give the CPU functors' values and their own outputs' row amaxes",
                   T, float, bf16) {
  // backend/cuda/elementwise_kernels.cuh's SwiGluForwardRowsBody and SwiGluBackwardRowsBody,
  // whose amaxes feed the float8 casts of g, da and db (nn::Float8RowAmaxes): each
  // output within the elementwise check's tolerance of the CPU's, each row's amax exactly
  // RowAbsMax's of the GPU's own output, a NaN in a row its amax.
  std::uint32_t seed = 1100;
  for (const SwiGluRowsCase& c : kSwiGluRowsCases) {
    const std::string what = std::string(c.what) + " (rows " + std::to_string(c.rows) + ", cols " +
                             std::to_string(c.cols) + ", offset " + std::to_string(c.offset) + ")";
    const auto n = static_cast<std::size_t>(c.rows * c.cols);
    auto a = random_values<T>(n, -6, 6, seed += 10);
    const auto b = random_values<T>(n, -6, 6, seed + 1), dg = random_values<T>(n, -1, 1, seed + 2);
    const auto g0 = random_values<T>(n, 7, 8, seed + 3);
    const std::vector<float> amax0(static_cast<std::size_t>(c.rows), -1.0f);

    std::vector<T> g_cpu = g0, da_cpu = g0, db_cpu = g0;
    Cpu::for_each(static_cast<std::int64_t>(n), ops::SwiGluForward<T>{a.data(), b.data(), g_cpu.data()});
    Cpu::for_each(static_cast<std::int64_t>(n),
                  ops::SwiGluBackward<T>{a.data(), b.data(), dg.data(), da_cpu.data(), db_cpu.data()});
    DeviceArray<T> da(a, c.offset), db(b, c.offset), ddg(dg, c.offset), dgo(g0, c.offset), dda(g0, c.offset),
        ddb(g0, c.offset);
    DeviceArray<float> g_amax(amax0), da_amax(amax0), db_amax(amax0);
    gpu_test::launch_op(c.rows, ops::SwiGluForwardRows<T>{{da.data(), db.data(), dgo.data()}, c.cols, g_amax.data()});
    gpu_test::launch_op(c.rows, ops::SwiGluBackwardRows<T>{{da.data(), db.data(), ddg.data(), dda.data(), ddb.data()},
                                                           c.cols, da_amax.data(), db_amax.data()});
    const std::vector<T> g = dgo.download(), dav = dda.download(), dbv = ddb.download();
    check_close(g, g_cpu, [&](std::size_t i) { return (kExprTol + rounding_of<T>()) * std::fabs(value(g_cpu[i])); },
                "swiglu forward by rows, " + what);
    check_close(dav, da_cpu,
                [&](std::size_t i) {
                  const double av = value(a[i]), s = 1 / (1 + std::exp(-av));
                  const double terms = std::fabs(value(dg[i]) * value(b[i]) * s) * (1 + std::fabs(av * (1 - s)));
                  return kExprTol * terms + rounding_of<T>() * std::fabs(value(da_cpu[i]));
                },
                "swiglu backward by rows da, " + what);
    check_close(dbv, db_cpu, [&](std::size_t i) { return (kExprTol + rounding_of<T>()) * std::fabs(value(db_cpu[i])); },
                "swiglu backward by rows db, " + what);
    check_same_bits(g_amax.download(), row_amaxes(g, c.rows, c.cols), "g's row amaxes, " + what);
    check_same_bits(da_amax.download(), row_amaxes(dav, c.rows, c.cols), "da's row amaxes, " + what);
    check_same_bits(db_amax.download(), row_amaxes(dbv, c.rows, c.cols), "db's row amaxes, " + what);

    // A NaN in the last row's a: that row's amaxes NaN (a NaN wins), the others as before.
    a[n - 1] = as<T>(std::numeric_limits<float>::quiet_NaN());
    DeviceArray<T> na(a, c.offset);
    DeviceArray<float> nan_amax(amax0), nan_da(amax0), nan_db(amax0);
    gpu_test::launch_op(c.rows, ops::SwiGluForwardRows<T>{{na.data(), db.data(), dgo.data()}, c.cols, nan_amax.data()});
    gpu_test::launch_op(c.rows, ops::SwiGluBackwardRows<T>{{na.data(), db.data(), ddg.data(), dda.data(), ddb.data()},
                                                           c.cols, nan_da.data(), nan_db.data()});
    for (const std::vector<float>& m : {nan_amax.download(), nan_da.download(), nan_db.download()}) {
      CHECK_MESSAGE(std::isnan(m.back()), "a NaN's row amax, ", what);
      for (std::size_t r = 0; r + 1 < m.size(); ++r)
        CHECK_MESSAGE(!std::isnan(m[r]), "row ", r, ", ", what);
    }
  }
}

TEST_CASE_TEMPLATE("SwiGLU over a and b side by side (w1 and w3 as one GEMM): the row kernels give the CPU "
                   "functors' values, in that layout", T, float, bf16) {
  // backend/cuda/elementwise_kernels.cuh's PairedRowsBody: row r's elementwise functor over
  // a and b in the two halves of row r of ab (leading dimension 2 cols), g (rows, cols),
  // and da and db written side by side in dab. Each output within the elementwise check's
  // tolerance of the CPU's, in its place; the rows' other half untouched where it should be.
  std::uint32_t seed = 1300;
  for (const SwiGluRowsCase& c : kSwiGluRowsCases) {
    const std::string what = std::string(c.what) + " (rows " + std::to_string(c.rows) + ", cols " +
                             std::to_string(c.cols) + ", offset " + std::to_string(c.offset) + ")";
    const auto n = static_cast<std::size_t>(c.rows * c.cols);
    const auto ab = random_values<T>(2 * n, -6, 6, seed += 10), dg = random_values<T>(n, -1, 1, seed + 2);
    const auto g0 = random_values<T>(n, 7, 8, seed + 3), dab0 = random_values<T>(2 * n, 7, 8, seed + 4);
    std::vector<T> g_cpu = g0, dab_cpu = dab0;
    Cpu::for_each(c.rows, ops::SwiGluForwardPaired<T>{ab.data(), g_cpu.data(), c.cols});
    Cpu::for_each(c.rows, ops::SwiGluBackwardPaired<T>{ab.data(), dg.data(), dab_cpu.data(), c.cols});
    DeviceArray<T> dab_in(ab, c.offset), ddg(dg, c.offset), dgo(g0, c.offset), ddab(dab0, c.offset);
    gpu_test::launch_op(c.rows, ops::SwiGluForwardPaired<T>{dab_in.data(), dgo.data(), c.cols});
    gpu_test::launch_op(c.rows, ops::SwiGluBackwardPaired<T>{dab_in.data(), ddg.data(), ddab.data(), c.cols});
    const std::vector<T> g = dgo.download(), dabv = ddab.download();
    check_close(g, g_cpu, [&](std::size_t i) { return (kExprTol + rounding_of<T>()) * std::fabs(value(g_cpu[i])); },
                "swiglu forward paired, " + what);
    check_close(dabv, dab_cpu,
                [&](std::size_t i) {
                  // element i of dab: row r, column j of a's half (da) or b's (db)
                  const std::size_t cols = static_cast<std::size_t>(c.cols), r = i / (2 * cols), j = i % (2 * cols);
                  const std::size_t e = r * 2 * cols + j % cols;  // a's element of that row and column in ab
                  const double av = value(ab[e]), bv = value(ab[e + cols]), s = 1 / (1 + std::exp(-av));
                  const double d = value(dg[r * cols + j % cols]);
                  const double terms = j < cols ? std::fabs(d * bv * s) * (1 + std::fabs(av * (1 - s)))
                                                : std::fabs(d * av * s);
                  return kExprTol * terms + rounding_of<T>() * std::fabs(value(dab_cpu[i]));
                },
                "swiglu backward paired, " + what);
  }
}

TEST_CASE_TEMPLATE("Add, Copy, Axpy, Scale and Fill: the vectorised kernels give the CPU functors' values", T, float,
                   bf16) {
  std::uint32_t seed = 1100;
  for (const std::size_t n : kElementwiseSizes)
    for (const std::size_t off : kElementwiseOffsets) {
      const std::string what = "n " + std::to_string(n) + ", offset " + std::to_string(off);
      const auto a = random_values<T>(n, -4, 4, seed += 10), b = random_values<T>(n, -4, 4, seed + 1);
      const auto count = static_cast<std::int64_t>(n);
      const auto exact = [](std::size_t) { return 0.0; };
      const double alpha = -0.375, fill = 2.5;  // exact in every element type
      DeviceArray<T> da(a, off), db(b, off);

      std::vector<T> out_cpu = b;  // Add: one rounded sum on either side, the same bits
      Cpu::for_each(count, ops::Add<T>{a.data(), b.data(), out_cpu.data()});
      DeviceArray<T> dout(b, off);
      gpu_test::launch_op(count, ops::Add<T>{da.data(), db.data(), dout.data()});
      check_close(dout.download(), out_cpu, exact, "add, " + what);

      std::vector<T> copy_cpu = b;
      Cpu::for_each(count, ops::Copy<T>{a.data(), copy_cpu.data()});
      DeviceArray<T> dcopy(b, off);
      gpu_test::launch_op(count, ops::Copy<T>{da.data(), dcopy.data()});
      check_close(dcopy.download(), copy_cpu, exact, "copy, " + what);

      std::vector<T> axpy_cpu = b;  // y + alpha x may be one fma on the device
      ops::Axpy<T> axpy{};
      axpy.alpha = static_cast<decltype(axpy.alpha)>(static_cast<float>(alpha));
      axpy.x = a.data();
      axpy.y = axpy_cpu.data();
      Cpu::for_each(count, axpy);
      DeviceArray<T> daxpy(b, off);
      axpy.x = da.data();
      axpy.y = daxpy.data();
      gpu_test::launch_op(count, axpy);
      check_close(daxpy.download(), axpy_cpu,
                  [&](std::size_t i) {
                    return kExprTol * (std::fabs(value(b[i])) + std::fabs(alpha * value(a[i]))) +
                           rounding_of<T>() * std::fabs(value(axpy_cpu[i]));
                  },
                  "axpy, " + what);

      std::vector<T> scale_cpu = a;
      ops::Scale<T> sc{};
      sc.alpha = static_cast<decltype(sc.alpha)>(static_cast<float>(alpha));
      sc.x = scale_cpu.data();
      Cpu::for_each(count, sc);
      DeviceArray<T> dscale(a, off);
      sc.x = dscale.data();
      gpu_test::launch_op(count, sc);
      check_close(dscale.download(), scale_cpu, exact, "scale, " + what);

      std::vector<T> fill_cpu = a;
      ops::Fill<T> fl{};
      fl.value = static_cast<decltype(fl.value)>(static_cast<float>(fill));
      fl.x = fill_cpu.data();
      Cpu::for_each(count, fl);
      DeviceArray<T> dfill(a, off);
      fl.x = dfill.data();
      gpu_test::launch_op(count, fl);
      check_close(dfill.download(), fill_cpu, exact, "fill, " + what);
    }
}

// ---- Determinism, fallback --------------------------------------------------------------------

/// Checks that two calls of `run` (each on fresh outputs) return the same bits.
template <class Run>
void check_twice(const Run& run, const std::string& what) {
  const auto first = run(), second = run();
  check_same_bits(first.first, second.first, what);
  check_same_bits(first.second, second.second, what);
}

TEST_CASE_TEMPLATE("The reductions are deterministic: two runs give the same bits", T, float, bf16) {
  const RowCase c{37, 4096, 4096, 0, ""};
  const NormInputs<T> in(c, 1200);
  const auto rows = static_cast<std::size_t>(c.rows), n = static_cast<std::size_t>(c.n);
  DeviceArray<T> dx(in.x), dw(in.w), ddy(in.dy);
  using R = RstdOf<T>;
  const std::vector<R> rstd = random_values<R>(rows, 0.5, 2, 1201);
  DeviceArray<R> drstd(rstd);

  check_twice(
      [&] {
        DeviceArray<T> y(in.x);
        DeviceArray<R> r(rstd);
        ops::RmsNormForward<T> f{};
        f.x = dx.data();
        f.ldx = f.ldy = c.ld;
        f.w = dw.data();
        f.y = y.data();
        f.rstd = r.data();
        f.n = c.n;
        f.eps = static_cast<decltype(f.eps)>(1e-5f);
        gpu_test::launch_op(c.rows, f);
        return std::pair{y.download(), r.download()};
      },
      "RMSNorm forward");
  check_twice(
      [&] {
        DeviceArray<T> out(in.x);
        ops::RmsNormBackwardInput<T> f{};
        f.x = dx.data();
        f.ldx = f.lddy = f.lddx = c.ld;
        f.w = dw.data();
        f.rstd = drstd.data();
        f.dy = ddy.data();
        f.dx = out.data();
        f.n = c.n;
        gpu_test::launch_op(c.rows, f);
        return std::pair{out.download(), std::vector<T>{}};
      },
      "RMSNorm backward (input)");
  check_twice(
      [&] {
        using F = ops::RmsNormBackwardWeight<T>;
        using D = pointee<decltype(F::dw)>;
        DeviceArray<D> out(random_values<D>(n, -1, 1, 1202));
        F f{};
        f.x = dx.data();
        f.ldx = f.lddy = c.ld;
        f.rstd = drstd.data();
        f.dy = ddy.data();
        f.dw = out.data();
        f.rows = c.rows;
        gpu_test::launch_op(c.n, f);
        return std::pair{out.download(), std::vector<D>{}};
      },
      "RMSNorm backward (weight)");
  check_twice(
      [&] {
        using F = ops::RowDot<T>;
        using O = pointee<decltype(F::out)>;
        DeviceArray<O> out{std::vector<O>(rows)};
        F f{};
        f.a = dx.data();
        f.lda = f.ldb = c.ld;
        f.b = ddy.data();
        f.n = c.n;
        f.out = out.data();
        gpu_test::launch_op(c.rows, f);
        return std::pair{out.download(), std::vector<O>{}};
      },
      "row dot");

  const std::int64_t ce_rows = 6, vocab = 128256;
  const std::vector<T> z = random_values<T>(static_cast<std::size_t>(ce_rows * vocab), -8, 8, 1210);
  DeviceArray<std::int32_t> dt(targets_for(ce_rows, vocab));
  check_twice(
      [&] {
        DeviceArray<T> logits(z);
        DeviceArray<double> loss(std::vector<double>(static_cast<std::size_t>(ce_rows)));
        ops::CrossEntropyRow<T> f{};
        f.logits = logits.data();
        f.ld = f.vocab = vocab;
        f.targets = dt.data();
        f.scale = static_cast<decltype(f.scale)>(1.0f / 4096);
        f.write_grad = true;
        f.loss = loss.data();
        gpu_test::launch_op(ce_rows, f);
        return std::pair{logits.download(), loss.download()};
      },
      "cross-entropy");

  const SoftmaxCase sc{{9, 1500, 1504, 0, ""}, 1400};
  const std::vector<T> s = random_values<T>(static_cast<std::size_t>(sc.shape.rows * sc.shape.ld), -20, 20, 1220);
  check_twice(
      [&] {
        DeviceArray<T> scores(s);
        DeviceArray<LseOf<T>> lse(std::vector<LseOf<T>>(static_cast<std::size_t>(sc.shape.rows)));
        ops::CausalSoftmaxForward<T> f{};
        f.s = scores.data();
        f.ld = sc.shape.ld;
        f.cols = sc.shape.n;
        f.offset = sc.offset;
        f.scale = static_cast<decltype(f.scale)>(0.125f);
        f.lse = lse.data();
        gpu_test::launch_op(sc.shape.rows, f);
        return std::pair{scores.download(), lse.download()};
      },
      "causal softmax forward");
}

TEST_CASE("A functor without a kernel of its own runs one index per thread: RMSNorm in double") {
  const RowCase c{9, 300, 301, 0, "double"};
  const NormInputs<double> in(c, 1300);
  std::vector<double> y_cpu(in.x.size(), 7.0), rstd_cpu(static_cast<std::size_t>(c.rows));
  Cpu::for_each(c.rows, ops::RmsNormForward<double>{in.x.data(), c.ld, in.w.data(), y_cpu.data(), c.ld, rstd_cpu.data(),
                                                    c.n, 1e-5});
  DeviceArray<double> dx(in.x), dw(in.w), dy(std::vector<double>(in.x.size(), 7.0)),
      drstd(std::vector<double>(static_cast<std::size_t>(c.rows)));
  gpu_test::launch_op(
      c.rows, ops::RmsNormForward<double>{dx.data(), c.ld, dw.data(), dy.data(), c.ld, drstd.data(), c.n, 1e-5});
  // The same sequential loop in double on both sides; only fma contraction differs.
  check_close(dy.download(), y_cpu, [&](std::size_t i) { return 1e-13 * std::fabs(y_cpu[i]); }, "y in double");
  check_close(drstd.download(), rstd_cpu, [&](std::size_t i) { return 1e-13 * rstd_cpu[i]; }, "rstd in double");
}

TEST_CASE("One tensor's AdamW (not lowered) on the GPU gives the CPU's bits") {
  const auto p = random_values<float>(500, -0.1, 0.1, 1400), g = random_values<float>(500, -0.2, 0.2, 1401);
  const auto gp = gpu_test::adamw_step(p, g, 1e-3f);
  std::vector<float> cpu = p, m(500), v(500);
  Cpu::for_each(500, ops::AdamWStep<float>{cpu.data(), g.data(), m.data(), v.data(), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                                           0.1f, 0.05f, 1.0f});
  // ops::adamw_update rounds every product and sum on its own (mul_rn, add_rn: no fma on
  // either side), and IEEE division and sqrt are correctly rounded on both.
  CHECK(std::memcmp(gp.data(), cpu.data(), cpu.size() * sizeof(float)) == 0);
}

namespace {
/// Two tensors (3000 and 517 elements: a padded last block each) of a multi-tensor AdamW
/// launch with moments M (bf16 or fp32), over parameters P; fp32 masters or none.
template <class P, class M>
struct AdamWCase {
  std::vector<P> param;
  std::vector<float> grad, master;
  std::vector<M> m, v;
  static constexpr std::int64_t kSizes[2] = {3000, 517};

  AdamWCase(bool masters, std::uint32_t seed)
      : param(random_values<P>(3517, -0.1, 0.1, seed)),
        grad(random_values<float>(3517, -0.2, 0.2, seed + 1)),
        m(3517, M(0.0f)),
        v(3517, M(0.0f)) {
    if (masters)
      for (const P& x : param) master.push_back(static_cast<float>(value(x)));
  }

  /// The launch's tables over these arrays (or their device copies at the given bases).
  static std::vector<ops::AdamWTensor<P, M>> table(P* p, const float* g, M* m, M* v, float* master) {
    return {{p, g, m, v, master, kSizes[0], 0},
            {p + kSizes[0], g + kSizes[0], m + kSizes[0], v + kSizes[0], master ? master + kSizes[0] : nullptr,
             kSizes[1], 2 * ops::kAdamWBlock}};
  }
  static std::vector<std::int32_t> blocks() { return {0, 0, 1}; }
};

/// Three steps of the launch on the device, by the kernel training runs (the lowered one)
/// or by the per-index kernel, against the CPU backend: the same bits.
template <class P, class M>
void check_adamw_multi(bool masters, std::uint32_t seed, bool lowered) {
  CAPTURE(masters);
  CAPTURE(lowered);
  AdamWCase<P, M> cpu(masters, seed);
  DeviceArray<P> dp(cpu.param);
  DeviceArray<float> dg(cpu.grad), dmaster(masters ? cpu.master : std::vector<float>(1));
  DeviceArray<M> dm(cpu.m), dv(cpu.v);
  const auto host_table = AdamWCase<P, M>::table(cpu.param.data(), cpu.grad.data(), cpu.m.data(), cpu.v.data(),
                                                 masters ? cpu.master.data() : nullptr);
  DeviceArray<ops::AdamWTensor<P, M>> dtable(
      AdamWCase<P, M>::table(dp.data(), dg.data(), dm.data(), dv.data(), masters ? dmaster.data() : nullptr));
  const std::vector<std::int32_t> blocks = AdamWCase<P, M>::blocks();
  DeviceArray<std::int32_t> dblocks(blocks);
  // Step 2's gradient scale is read from device memory on the GPU (the clip scale the
  // trainer leaves there) and given by value on the CPU; a 4th step on the GPU alone reads
  // a NaN scale there and must change nothing.
  DeviceArray<float> half(std::vector<float>{0.5f}), nan(std::vector<float>{std::numeric_limits<float>::quiet_NaN()});
  for (int t = 1; t <= 4; ++t) {
    const ops::AdamWScalars<float> s{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, float(1 - std::pow(0.9, t)),
                                     float(1 - std::pow(0.95, t)), t == 2 ? 0.5f : 1.0f};
    ops::AdamWMultiStep<P, M> gpu_step{dtable.data(), dblocks.data(), s, 3517, 2, masters};
    if (t == 2) gpu_step.s.grad_scale = 1.0f, gpu_step.grad_scale = half.data();
    if (t == 4) gpu_step.grad_scale = nan.data();
    if (lowered) gpu_test::launch_op(3 * ops::kAdamWBlock, gpu_step);
    else gpu_test::launch_per_index(3 * ops::kAdamWBlock, gpu_step);
    if (t <= 3)
      Cpu::for_each(3 * ops::kAdamWBlock,
                    ops::AdamWMultiStep<P, M>{host_table.data(), blocks.data(), s, 3517, 2, masters});
  }
  // The same fp32 update on both sides (bf16 moments rounded to nearest even by the same
  // code): the same bits, moments, parameters and masters.
  auto same = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  CHECK(same(dm.download(), cpu.m));
  CHECK(same(dv.download(), cpu.v));
  CHECK(same(dp.download(), cpu.param));
  if (masters) CHECK(same(dmaster.download(), cpu.master));
  std::size_t moved = 0;
  for (const M& x : cpu.v) moved += static_cast<float>(x) != 0.0f;
  CHECK(moved > 3000);
}
}  // namespace

TEST_CASE("Multi-tensor AdamW on the GPU, lowered and per index, gives the CPU's bits; a device-held scale, NaN skipping") {
  static_assert(cuda_kernel_class<ops::AdamWMultiStep<bf16, float>> == KernelClass::multi_tensor);
  for (const bool lowered : {true, false}) {
    check_adamw_multi<float, bf16>(false, 1500, lowered);  // bf16 moments
    check_adamw_multi<float, bf16>(true, 1510, lowered);
    check_adamw_multi<bf16, bf16>(true, 1520, lowered);
    check_adamw_multi<bf16, float>(true, 1530, lowered);   // fp32 moments, a bf16 model
    check_adamw_multi<float, float>(false, 1540, lowered);  // an fp32 model
  }
}

}  // namespace

}  // namespace test_gpu_ops
