// Flash attention's row functors (ops/flash_attention.hpp), driven tile by tile on the
// host, against the CPU backend's grouped-query attention, causal and full (no mask),
// and after a KV cache's keys (the forward's runs of keys and their merge), and against
// a naive reference in double: o, lse, dq, dk, dv.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../support/documents.hpp"
#include "../support/errors.hpp"
#include "../support/gradcheck.hpp"
#include "../support/naive_attention.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/ops/flash_attention.hpp"

namespace test_flash_attention {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, bf16>) return static_cast<float>(x);
  else return static_cast<double>(x);
}

/// A (rows, cols) view whose ld is cols + pad, over storage it keeps alive.
template <class T>
struct Matrix {
  Tensor<T> storage;
  TensorView<T> view;
  TensorView<const T> cview() const { return view; }
};

template <class T>
Matrix<T> matrix(std::int64_t rows, std::int64_t cols, std::int64_t pad, T fill = T(0)) {
  Tensor<T> t(Shape{rows, cols + pad});
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = fill;
  return {t, t.view().slice_cols(0, cols)};
}

/// normal(0, std) values drawn from (seed, name), stored as T.
template <class T>
Matrix<T> random_matrix(std::int64_t rows, std::int64_t cols, std::int64_t pad, const std::string& name,
                        double std = 1.0) {
  Tensor<double> d(Shape{rows, cols});
  testing::fill_normal(d, 7, name, std);
  auto m = matrix<T>(rows, cols, pad);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) m.view(r, c) = convert<T>(d[r * cols + c]);
  return m;
}

/// The same values in another storage type.
template <class To, class From>
Matrix<To> converted(const Matrix<From>& m, std::int64_t pad) {
  auto out = matrix<To>(m.view.rows(), m.view.cols(), pad);
  for (std::int64_t r = 0; r < m.view.rows(); ++r)
    for (std::int64_t c = 0; c < m.view.cols(); ++c) out.view(r, c) = convert<To>(m.view(r, c));
  return out;
}

/// max |a - b| / max |b| over two views of equal shape.
template <class U, class V>
double max_rel_diff(TensorView<U> a, TensorView<V> b) {
  REQUIRE(a.shape() == b.shape());
  double diff = 0, ref = 0;
  for (std::int64_t r = 0; r < a.rows(); ++r)
    for (std::int64_t c = 0; c < a.cols(); ++c) {
      const double x = to_double(a(r, c)), y = to_double(b(r, c));
      if (x == y) continue;  // infinities too: the -inf lse of a row that sees no key
      diff = std::max(diff, std::isnan(x) ? std::numeric_limits<double>::infinity() : std::abs(x - y));
      if (std::isfinite(y)) ref = std::max(ref, std::abs(y));
    }
  return diff == 0 ? 0 : diff / ref;
}

template <class U, class V>
double max_rel_diff(const std::vector<U>& a, const std::vector<V>& b) {
  REQUIRE(a.size() == b.size());
  return max_rel_diff(TensorView<const U>(a.data(), Shape{1, static_cast<std::int64_t>(a.size())}),
                      TensorView<const V>(b.data(), Shape{1, static_cast<std::int64_t>(b.size())}));
}

/// start + b, elementwise, as R.
template <class R, class T>
Matrix<R> sum_of(const Matrix<T>& start, const Matrix<R>& b) {
  auto out = matrix<R>(b.view.rows(), b.view.cols(), 0);
  for (std::int64_t r = 0; r < b.view.rows(); ++r)
    for (std::int64_t c = 0; c < b.view.cols(); ++c)
      out.view(r, c) = static_cast<R>(to_double(start.view(r, c)) + to_double(b.view(r, c)));
  return out;
}

struct Config {
  std::int64_t batch, seq_len, n_heads, n_kv_heads, tile;
  double q_std = 1.0;  // spread of q: large values make scores far apart
  bool causal = true;  // false: full attention, no mask
};

struct Errors {
  double o, lse, dq, dk, dv;
};

/// Runs the flash drivers with storage T and the CPU backend with R (= T, or float for
/// bf16) on the same values, and returns the relative differences. dq is pre-filled with
/// NaN (it must be overwritten), dk and dv with random values (they must be added to).
template <class T, class R, int HD>
Errors flash_vs_cpu(const Config& c) {
  const AttentionShape s{c.batch, c.seq_len, c.n_heads, c.n_kv_heads, HD, c.causal};
  const std::int64_t rows = s.rows(), qc = s.n_heads * HD, kc = s.n_kv_heads * HD;
  const auto q = random_matrix<T>(rows, qc, 3, "q", c.q_std), k = random_matrix<T>(rows, kc, 1, "k");
  const auto v = random_matrix<T>(rows, kc, 0, "v"), d_o = random_matrix<T>(rows, qc, 2, "dO");
  const auto dk0 = random_matrix<T>(rows, kc, 4, "dk0", 0.5), dv0 = random_matrix<T>(rows, kc, 1, "dv0", 0.5);

  // The CPU backend in R on exactly the values T holds.
  const auto rq = converted<R>(q, 0), rk = converted<R>(k, 0), rv = converted<R>(v, 0);
  const auto rdo = converted<R>(d_o, 0);
  auto ro = matrix<R>(rows, qc, 0), rdq = matrix<R>(rows, qc, 0);
  auto rdk = matrix<R>(rows, kc, 0), rdv = matrix<R>(rows, kc, 0);
  std::vector<R> rlse(static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len));
  Cpu::attention_forward<R>(s, rq.cview(), rk.cview(), rv.cview(), ro.view, rlse.data());
  Cpu::attention_backward<R>(s, rq.cview(), rk.cview(), rv.cview(), ro.cview(), rlse.data(), rdo.cview(), rdq.view,
                             rdk.view, rdv.view);

  auto o = matrix<T>(rows, qc, 5);
  std::vector<accum_t<T>> lse(rlse.size());
  ops::flash_attention_forward_rows<T, HD>(s, q.cview(), k.cview(), v.cview(), o.view, lse.data(), c.tile);
  auto dq = matrix<T>(rows, qc, 1, convert<T>(std::numeric_limits<float>::quiet_NaN()));
  auto dk = converted<T>(dk0, 2), dv = converted<T>(dv0, 0);
  ops::flash_attention_backward_rows<T, HD>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), d_o.cview(),
                                            dq.view, dk.view, dv.view, c.tile);
  return {max_rel_diff(o.view, ro.view), max_rel_diff(lse, rlse), max_rel_diff(dq.view, rdq.view),
          max_rel_diff(dk.view, sum_of(dk0, rdk).view), max_rel_diff(dv.view, sum_of(dv0, rdv).view)};
}

template <class T, class R, int HD>
void check_flash(const Config& c, double tol, double grad_tol) {
  CAPTURE(HD);
  CAPTURE(c.batch);
  CAPTURE(c.seq_len);
  CAPTURE(c.n_heads);
  CAPTURE(c.n_kv_heads);
  CAPTURE(c.tile);
  CAPTURE(c.causal);
  const Errors e = flash_vs_cpu<T, R, HD>(c);
  CHECK(e.o < tol);
  CHECK(e.lse < tol);
  CHECK(e.dq < grad_tol);
  CHECK(e.dk < grad_tol);
  CHECK(e.dv < grad_tol);
}

/// GQA groups of 4, 2 and 1 q heads per kv head; tiles of 1, 16 and 64 rows against
/// sequences that are not multiples of them; hd 128 on a short sequence; hd 16 and 32.
template <class T, class R>
void check_all(double tol, double grad_tol) {
  for (std::int64_t kv : {1, 2, 4}) {
    check_flash<T, R, 64>({2, 37, 4, kv, 1}, tol, grad_tol);
    check_flash<T, R, 64>({2, 45, 4, kv, 16}, tol, grad_tol);
    check_flash<T, R, 64>({2, 70, 4, kv, 64}, tol, grad_tol);
  }
  check_flash<T, R, 128>({2, 19, 4, 2, 16}, tol, grad_tol);
  check_flash<T, R, 128>({2, 11, 4, 1, 1}, tol, grad_tol);
  // The small head dims: torchtitan's debug model (dim 256 over 16 heads) has 16.
  check_flash<T, R, 16>({2, 41, 4, 2, 16}, tol, grad_tol);
  check_flash<T, R, 32>({2, 23, 4, 1, 64}, tol, grad_tol);
  // Full attention (no mask): every key tile for every query, every query tile for
  // every key, over the same groups and ragged tiles.
  for (std::int64_t kv : {1, 2, 4}) check_flash<T, R, 64>({2, 45, 4, kv, 16, 1.0, false}, tol, grad_tol);
  check_flash<T, R, 64>({2, 70, 4, 2, 64, 1.0, false}, tol, grad_tol);
  check_flash<T, R, 64>({1, 37, 4, 1, 1, 1.0, false}, tol, grad_tol);
  check_flash<T, R, 128>({2, 19, 4, 2, 16, 1.0, false}, tol, grad_tol);
  check_flash<T, R, 16>({2, 41, 4, 2, 16, 1.0, false}, tol, grad_tol);
}

template <class T, class R>
void check_far_apart_scores(double tol, double grad_tol) {
  // Scores with a spread of about 25: exp(s - m) over a stale max would overflow float.
  check_flash<T, R, 64>({1, 70, 2, 1, 16, 25.0}, tol, grad_tol);
  check_flash<T, R, 64>({1, 70, 2, 1, 16, 25.0, false}, tol, grad_tol);
}

}  // namespace

TEST_CASE("flash attention rows match the CPU backend in double") {
  check_all<double, double>(1e-12, 1e-12);
  check_far_apart_scores<double, double>(1e-12, 1e-12);
}

TEST_CASE("flash attention rows match the CPU backend in float") {
  check_all<float, float>(1e-5, 1e-5);
  check_far_apart_scores<float, float>(1e-5, 1e-5);
}

TEST_CASE("flash attention rows on bf16 storage stay within bf16 rounding of the float backend") {
  // Inputs rounded to bf16; the reference computes in float on those values. o, dq, dk
  // and dv are rounded to bf16 on output (2^-9 relative), and the backward reads the
  // rounded o through D = dO . O; lse stays float.
  const Config configs[] = {{2, 45, 4, 2, 16}, {2, 70, 4, 1, 64}, {2, 33, 4, 4, 1}, {2, 45, 4, 2, 16, 1.0, false},
                            {2, 33, 4, 4, 1, 1.0, false}};
  for (const Config& c : configs) {
    CAPTURE(c.tile);
    CAPTURE(c.n_kv_heads);
    CAPTURE(c.causal);
    const Errors e = flash_vs_cpu<bf16, float, 64>(c);
    CHECK(e.o < 5e-3);
    CHECK(e.lse < 1e-5);
    CHECK(e.dq < 1e-2);
    CHECK(e.dk < 1e-2);
    CHECK(e.dv < 1e-2);
  }
  const Errors e = flash_vs_cpu<bf16, float, 128>({2, 19, 4, 2, 16});
  CHECK(e.o < 5e-3);
  CHECK(e.lse < 1e-5);
  CHECK(e.dq < 1e-2);
  CHECK(e.dk < 1e-2);
  CHECK(e.dv < 1e-2);
}

namespace {

/// max over elements of |a - b| / (rel |b| + abs): at most 1 when every element of a is
/// within the bound of b.
template <class U, class V>
double worst_ratio(TensorView<U> a, TensorView<V> b, double rel, double abs) {
  REQUIRE(a.shape() == b.shape());
  double worst = 0;
  for (std::int64_t r = 0; r < a.rows(); ++r)
    for (std::int64_t c = 0; c < a.cols(); ++c) {
      const double x = to_double(a(r, c)), y = to_double(b(r, c));
      const double diff = std::abs(x - y), bound = rel * std::abs(y) + abs;
      worst = std::max(worst, std::isnan(diff) ? HUGE_VAL : (diff == 0 ? 0.0 : diff / bound));
    }
  return worst;
}

template <class U, class V>
double worst_ratio(const std::vector<U>& a, const std::vector<V>& b, double rel, double abs) {
  REQUIRE(a.size() == b.size());
  return worst_ratio(TensorView<const U>(a.data(), Shape{1, static_cast<std::int64_t>(a.size())}),
                     TensorView<const V>(b.data(), Shape{1, static_cast<std::int64_t>(b.size())}), rel, abs);
}

template <class T>
double max_abs(TensorView<T> m) {
  double x = 0;
  for (std::int64_t r = 0; r < m.rows(); ++r)
    for (std::int64_t c = 0; c < m.cols(); ++c) x = std::max(x, std::abs(to_double(m(r, c))));
  return x;
}

/// The flash rows with bf16 storage against the same rows with float storage on the
/// same (bf16) values. The float backward reads the bf16 run's o, rounded as the bf16
/// backward reads it, so both compute D from the same O. Tolerances:
///   o, dq, dk, dv: 2^-8 relative: the bf16 rows do the float rows' float arithmetic and
///     round each output once (at most 2^-9 of it); plus 1e-6 of the largest element,
///     as each is a sum of terms of both signs (weights times v rows, dS times q or k
///     rows) that float holds to a few 2^-24 of the terms.
///   lse: 1e-6 relative (float in both runs; one bf16 rounding would be 2e-3), plus
///     1e-6 absolute for values near zero (lse = m + log l with terms of order 1).
template <int HD>
void check_bf16_rows_against_float(const Config& c) {
  CAPTURE(HD);
  CAPTURE(c.batch);
  CAPTURE(c.seq_len);
  CAPTURE(c.n_heads);
  CAPTURE(c.n_kv_heads);
  CAPTURE(c.tile);
  CAPTURE(c.q_std);
  CAPTURE(c.causal);
  const AttentionShape s{c.batch, c.seq_len, c.n_heads, c.n_kv_heads, HD, c.causal};
  const std::int64_t rows = s.rows(), qc = s.n_heads * HD, kc = s.n_kv_heads * HD;
  const auto q = random_matrix<bf16>(rows, qc, 3, "q", c.q_std), k = random_matrix<bf16>(rows, kc, 1, "k");
  const auto v = random_matrix<bf16>(rows, kc, 0, "v"), d_o = random_matrix<bf16>(rows, qc, 2, "dO");
  const auto dk0 = random_matrix<bf16>(rows, kc, 4, "dk0", 0.5), dv0 = random_matrix<bf16>(rows, kc, 1, "dv0", 0.5);
  const auto fq = converted<float>(q, 1), fk = converted<float>(k, 0), fv = converted<float>(v, 2);
  const auto fdo = converted<float>(d_o, 0);
  const std::size_t n_lse = static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len);

  auto o = matrix<bf16>(rows, qc, 5);
  auto fo = matrix<float>(rows, qc, 0);
  std::vector<float> lse(n_lse), flse(n_lse);
  ops::flash_attention_forward_rows<bf16, HD>(s, q.cview(), k.cview(), v.cview(), o.view, lse.data(), c.tile);
  ops::flash_attention_forward_rows<float, HD>(s, fq.cview(), fk.cview(), fv.cview(), fo.view, flse.data(), c.tile);
  CHECK(worst_ratio(o.view, fo.view, 0x1p-8, 1e-6 * max_abs(fo.view)) <= 1.0);
  CHECK(worst_ratio(lse, flse, 1e-6, 1e-6) <= 1.0);

  const auto fo_rounded = converted<float>(o, 0);
  auto dq = matrix<bf16>(rows, qc, 1, convert<bf16>(std::numeric_limits<float>::quiet_NaN()));
  auto fdq = matrix<float>(rows, qc, 0, std::numeric_limits<float>::quiet_NaN());
  auto dk = converted<bf16>(dk0, 2), dv = converted<bf16>(dv0, 0);
  auto fdk = converted<float>(dk0, 0), fdv = converted<float>(dv0, 3);
  ops::flash_attention_backward_rows<bf16, HD>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), d_o.cview(),
                                               dq.view, dk.view, dv.view, c.tile);
  ops::flash_attention_backward_rows<float, HD>(s, fq.cview(), fk.cview(), fv.cview(), fo_rounded.cview(),
                                                flse.data(), fdo.cview(), fdq.view, fdk.view, fdv.view, c.tile);
  CHECK(worst_ratio(dq.view, fdq.view, 0x1p-8, 1e-6 * max_abs(fdq.view)) <= 1.0);
  CHECK(worst_ratio(dk.view, fdk.view, 0x1p-8, 1e-6 * max_abs(fdk.view)) <= 1.0);
  CHECK(worst_ratio(dv.view, fdv.view, 0x1p-8, 1e-6 * max_abs(fdv.view)) <= 1.0);
}

}  // namespace

TEST_CASE("flash attention rows on bf16 storage: lse in float, outputs within one rounding of the float rows") {
  // GQA groups of 4, 2 and 1 q heads per kv head; tiles of 1, 16 and 64 rows against
  // odd sequence lengths; head dims 64 and 128.
  for (std::int64_t kv : {1, 2, 4}) {
    check_bf16_rows_against_float<64>({2, 37, 4, kv, 16});
    check_bf16_rows_against_float<128>({1, 21, 4, kv, 1});
  }
  check_bf16_rows_against_float<64>({2, 45, 4, 2, 64});
  check_bf16_rows_against_float<128>({2, 19, 4, 2, 16});
  // The small head dims (torchtitan's debug model has 16).
  check_bf16_rows_against_float<16>({2, 33, 4, 2, 16});
  check_bf16_rows_against_float<32>({1, 29, 4, 1, 64});
  // Scores spread by about 25: rescaling under a new max, in float.
  check_bf16_rows_against_float<64>({1, 70, 2, 1, 16, 25.0});
  // 301 keys for the last query: l (the sum of exponentials), acc, dk and dv sum over
  // hundreds of terms, which a bf16 accumulator would visibly lose.
  check_bf16_rows_against_float<64>({1, 301, 2, 1, 64});
  // Full attention: every query over all 301 keys.
  check_bf16_rows_against_float<64>({1, 301, 2, 1, 64, 1.0, false});
  check_bf16_rows_against_float<128>({2, 37, 4, 2, 16, 1.0, false});
}

TEST_CASE("flash attention D on bf16 storage is the float D of the same values") {
  // D = dO . O over head dims of 64 and 128, for 3 heads of 2 x 13 rows; the sum of 128
  // products in bf16 would be off by far more than 1e-6.
  for (std::int64_t hd : {64, 128}) {
    CAPTURE(hd);
    const std::int64_t rows = 26, heads = 3, cols = heads * hd;
    const auto o = random_matrix<bf16>(rows, cols, 3, "o.delta"), d_o = random_matrix<bf16>(rows, cols, 1, "dO.delta");
    const auto fo = converted<float>(o, 0), fdo = converted<float>(d_o, 2);
    std::vector<float> delta(rows * heads), fdelta(rows * heads), sum_abs(rows * heads);
    const ops::FlashDelta<bf16> bd{o.view.data(), o.view.ld(), d_o.view.data(), d_o.view.ld(), delta.data(), 13,
                                   heads, hd};
    const ops::FlashDelta<float> fd{fo.view.data(), fo.view.ld(), fdo.view.data(), fdo.view.ld(), fdelta.data(), 13,
                                    heads, hd};
    for (std::int64_t i = 0; i < rows * heads; ++i) {
      bd(i);
      fd(i);
    }
    // Absolute term: hd products of both signs, each of order 1; 1e-6 per product.
    CHECK(worst_ratio(delta, fdelta, 1e-6, 1e-6 * static_cast<double>(hd)) <= 1.0);
    // Index (b * H + h) * T + t is head h of row b * T + t, against double.
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t t = 0; t < 13; ++t) {
          double ref = 0;
          for (std::int64_t d = 0; d < hd; ++d)
            ref += to_double(o.view(b * 13 + t, h * hd + d)) * to_double(d_o.view(b * 13 + t, h * hd + d));
          REQUIRE(delta[static_cast<std::size_t>((b * heads + h) * 13 + t)] ==
                  doctest::Approx(ref).epsilon(1e-5));
        }
  }
}

namespace {

/// A view's values, dense row-major.
template <class T>
std::vector<double> dense(TensorView<T> m) {
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(m.rows() * m.cols()));
  for (std::int64_t r = 0; r < m.rows(); ++r)
    for (std::int64_t c = 0; c < m.cols(); ++c) out.push_back(to_double(m(r, c)));
  return out;
}

/// The inputs, the naive reference and the flash rows' lse of one check_flash_rows run.
struct RowsRun {
  Matrix<double> q, k, v, d_o;
  testing::NaiveAttention ref;
  std::vector<double> lse;
};

/// The flash rows (head dim HD, tiles of `tile` rows) in double on `s` against the naive
/// reference: o, lse, dq, dk, dv to 1e-12 of the largest value. The backward takes the
/// forward's lse with each -inf (a row that saw no key of a context-parallel ring block)
/// made finite, as the ring's merged lse is: such a row's terms are all zero.
template <int HD>
RowsRun check_flash_rows(const AttentionShape& s, std::int64_t tile) {
  const std::int64_t rows = s.rows(), qc = s.n_heads * HD, kc = s.n_kv_heads * HD;
  RowsRun run{random_matrix<double>(rows, qc, 3, "q.naive"), random_matrix<double>(rows, kc, 1, "k.naive"),
              random_matrix<double>(rows, kc, 2, "v.naive"), random_matrix<double>(rows, qc, 0, "dO.naive"),
              {}, {}};
  const auto &q = run.q, &k = run.k, &v = run.v, &d_o = run.d_o;
  run.ref = testing::naive_attention(s, dense(q.cview()), dense(k.cview()), dense(v.cview()), dense(d_o.cview()));
  const testing::NaiveAttention& ref = run.ref;

  auto o = matrix<double>(rows, qc, 5);
  run.lse.resize(ref.lse.size());
  ops::flash_attention_forward_rows<double, HD>(s, q.cview(), k.cview(), v.cview(), o.view, run.lse.data(), tile);
  std::vector<double> merged = run.lse;
  for (double& x : merged) x = std::isfinite(x) ? x : 0.5;
  auto dq = matrix<double>(rows, qc, 1, std::numeric_limits<double>::quiet_NaN());
  auto dk = matrix<double>(rows, kc, 2), dv = matrix<double>(rows, kc, 0);  // zeros: added into
  ops::flash_attention_backward_rows<double, HD>(s, q.cview(), k.cview(), v.cview(), o.cview(), merged.data(),
                                                 d_o.cview(), dq.view, dk.view, dv.view, tile);
  CHECK(max_rel_diff(dense(o.cview()), ref.o) < 1e-12);
  CHECK(max_rel_diff(run.lse, ref.lse) < 1e-12);
  CHECK(max_rel_diff(dense(dq.view), ref.dq) < 1e-12);
  CHECK(max_rel_diff(dense(dk.view), ref.dk) < 1e-12);
  CHECK(max_rel_diff(dense(dv.view), ref.dv) < 1e-12);
  return run;
}

/// check_flash_rows on c's shape, causal or full as c.causal, and that the inputs tell
/// the masks apart: the other mask's reference is far from this one.
template <int HD>
void check_rows_against_naive(const Config& c) {
  CAPTURE(HD);
  CAPTURE(c.seq_len);
  CAPTURE(c.n_kv_heads);
  CAPTURE(c.tile);
  CAPTURE(c.causal);
  const AttentionShape s{c.batch, c.seq_len, c.n_heads, c.n_kv_heads, HD, c.causal};
  const RowsRun run = check_flash_rows<HD>(s, c.tile);
  AttentionShape other = s;
  other.causal = !s.causal;
  const testing::NaiveAttention wrong = testing::naive_attention(other, dense(run.q.cview()), dense(run.k.cview()),
                                                                 dense(run.v.cview()), dense(run.d_o.cview()));
  CHECK(max_rel_diff(wrong.o, run.ref.o) > 1e-2);
  CHECK(max_rel_diff(wrong.dk, run.ref.dk) > 1e-2);
}

}  // namespace

TEST_CASE("flash attention rows, causal and full, match a naive reference in double") {
  // Groups of 4, 2 and 1 q heads per kv head; tiles of 1, 16 and 64 rows against
  // sequences that are not multiples of them; head dims 16, 64 and 128.
  for (bool causal : {true, false}) {
    for (std::int64_t kv : {1, 2, 4}) {
      check_rows_against_naive<64>({2, 45, 4, kv, 16, 1.0, causal});
      check_rows_against_naive<16>({1, 37, 4, kv, 1, 1.0, causal});
    }
    check_rows_against_naive<64>({2, 70, 4, 2, 64, 1.0, causal});
    check_rows_against_naive<128>({2, 19, 4, 2, 16, 1.0, causal});
  }
}

TEST_CASE("flash attention rows over packed documents match a naive masked reference in double") {
  // Documents that start mid-tile, on a tile's first row, one token long; tiles of 1, 16
  // and 64 rows, so whole tiles before a document (or after a key's) are skipped.
  const std::int64_t t = 70;
  const std::vector<ops::DocumentSpan> spans = testing::spans_starting_at(2, t, {5, 16, 17, 40, t + 33});
  for (std::int64_t tile : {1, 16, 64})
    for (std::int64_t kv : {1, 4}) {
      CAPTURE(tile);
      CAPTURE(kv);
      check_flash_rows<16>({2, t, 4, kv, 16, true, spans.data()}, tile);
    }
}

TEST_CASE("flash attention rows over a full ring block of packed documents match the naive reference") {
  // Queries at positions 210..279 and keys at 0..69 of sequences of 280 (a CP 2 block
  // below the diagonal), bounds from ops::BlockDocuments: the document from 40 to 230
  // reaches the first 20 queries, which see keys 40..69; the later queries see no key
  // (lse -inf, o and dq zero), and keys 0..39 are seen by none (dk, dv zero).
  const std::int64_t S = 280, c = 70;
  const std::vector<ops::DocumentSpan> bounds =
      testing::ring_block_bounds(testing::spans_starting_at(2, S, {40, 230, 250}), 2, S, c, 3, 0);
  for (std::int64_t tile : {1, 16, 64}) {
    CAPTURE(tile);
    const RowsRun run = check_flash_rows<16>({2, c, 4, 2, 16, false, bounds.data()}, tile);
    CHECK(std::isinf(run.lse[25]));  // (b 0, head 0, query 25): past the document
  }
}

TEST_CASE("flash attention: the first query sees only the first key; tiles past the causal edge change nothing") {
  constexpr int kHd = 64;
  const auto q = random_matrix<double>(8, kHd, 0, "q1"), k = random_matrix<double>(8, kHd, 0, "k1");
  const auto v = random_matrix<double>(8, kHd, 0, "v1"), d_o = random_matrix<double>(8, kHd, 0, "dO1");
  const double scale = 1.0 / 8.0;

  ops::FlashForwardRow<double, kHd> row;
  row.start(q.view.row(0), 0, scale);
  row.update(k.view.row(1), kHd, v.view.row(1), kHd, 1, 7);  // keys 1..7: all after query 0
  CHECK(row.l == 0.0);
  CHECK(row.m == -std::numeric_limits<double>::infinity());
  row.update(k.view.row(0), kHd, v.view.row(0), kHd, 0, 8);  // only key 0 is visible
  std::vector<double> o(kHd);
  double lse = 0;
  row.finish(o.data(), &lse);
  double s = 0;
  for (int d = 0; d < kHd; ++d) s += q.view(0, d) * k.view(0, d);
  CHECK(lse == doctest::Approx(s * scale).epsilon(1e-14));
  for (int d = 0; d < kHd; ++d) CHECK(o[static_cast<std::size_t>(d)] == doctest::Approx(v.view(0, d)).epsilon(1e-14));

  // Key 5 against queries 0..3 (all before it): nothing is added to dk, dv.
  ops::FlashBackwardKeyRow<double, kHd> key_row;
  key_row.start(k.view.row(5), v.view.row(5), 5, scale);
  const std::vector<double> lse4(4, 1.0), delta4(4, 0.5);
  key_row.update(q.view.row(0), kHd, d_o.view.row(0), kHd, lse4.data(), delta4.data(), 0, 4);
  std::vector<double> dk(kHd, 2.0), dv(kHd, -3.0);
  key_row.finish(dk.data(), dv.data());
  CHECK(std::all_of(dk.begin(), dk.end(), [](double x) { return x == 2.0; }));
  CHECK(std::all_of(dv.begin(), dv.end(), [](double x) { return x == -3.0; }));
  // Seen from query 0 on (full attention), the same key row takes every query's terms.
  ops::FlashBackwardKeyRow<double, kHd> full_key_row;
  full_key_row.start(k.view.row(5), v.view.row(5), 0, scale);
  full_key_row.update(q.view.row(0), kHd, d_o.view.row(0), kHd, lse4.data(), delta4.data(), 0, 4);
  full_key_row.finish(dk.data(), dv.data());
  CHECK(std::any_of(dv.begin(), dv.end(), [](double x) { return x != -3.0; }));

  // Seeing keys up to 7 (full attention), query 0 takes keys 1..7 as well.
  ops::FlashForwardRow<double, kHd> full_row;
  full_row.start(q.view.row(0), 7, scale);
  full_row.update(k.view.row(1), kHd, v.view.row(1), kHd, 1, 7);
  CHECK(full_row.l > 0.0);

  // Query 2 against keys 3..7: dq is overwritten with zeros.
  ops::FlashBackwardQueryRow<double, kHd> query_row;
  query_row.start(q.view.row(2), d_o.view.row(2), 1.0, 0.5, 2, scale);
  query_row.update(k.view.row(3), kHd, v.view.row(3), kHd, 3, 5);
  std::vector<double> dq(kHd, 9.0);
  query_row.finish(dq.data());
  CHECK(std::all_of(dq.begin(), dq.end(), [](double x) { return x == 0.0; }));
}

namespace {

/// The flash rows after `past` keys of a KV cache (storage T, tiles of `tile` rows, runs
/// of `split_keys`) against the CPU backend's attention after the same keys in R: o and
/// lse, relative to the largest value. k and v hold past + seq_len rows a sequence.
template <class T, class R, int HD>
std::pair<double, double> decode_vs_cpu(const AttentionShape& s, std::int64_t tile, std::int64_t split_keys,
                                        std::int64_t pad) {
  const std::int64_t rows = s.rows(), keys = s.batch * s.key_len(), qc = s.n_heads * HD, kc = s.n_kv_heads * HD;
  const auto q = random_matrix<T>(rows, qc, pad, "q.decode"), k = random_matrix<T>(keys, kc, pad, "k.decode");
  const auto v = random_matrix<T>(keys, kc, pad, "v.decode");
  const auto rq = converted<R>(q, 0), rk = converted<R>(k, 0), rv = converted<R>(v, 0);
  auto ro = matrix<R>(rows, qc, 0);
  std::vector<R> rlse(static_cast<std::size_t>(s.batch * s.n_heads * s.seq_len));
  Cpu::attention_forward<R>(s, rq.cview(), rk.cview(), rv.cview(), ro.view, rlse.data());
  auto o = matrix<T>(rows, qc, pad, convert<T>(std::numeric_limits<float>::quiet_NaN()));  // every value written
  std::vector<accum_t<T>> lse(rlse.size(), std::numeric_limits<accum_t<T>>::quiet_NaN());
  ops::flash_attention_forward_rows<T, HD>(s, q.cview(), k.cview(), v.cview(), o.view, lse.data(), tile, split_keys);
  return {max_rel_diff(o.view, ro.view), max_rel_diff(lse, rlse)};
}

template <class T, class R, int HD>
void check_decode(const AttentionShape& s, std::int64_t tile, std::int64_t split_keys, double tol,
                  std::int64_t pad = 0) {
  CAPTURE(HD);
  CAPTURE(s.batch);
  CAPTURE(s.seq_len);
  CAPTURE(s.past);
  CAPTURE(s.n_kv_heads);
  CAPTURE(tile);
  CAPTURE(split_keys);
  const auto [o, lse] = decode_vs_cpu<T, R, HD>(s, tile, split_keys, pad);
  CHECK(o < tol);
  CHECK(lse < tol);
}

}  // namespace

TEST_CASE("flash attention rows after a KV cache's keys, in runs merged at the end, match the CPU backend") {
  // One new token and a few (a block's worth and more) after caches shorter than a run,
  // a run's length exactly, and several runs with a partial last one; runs of the
  // kernel's 128 keys, of 16 (many runs, most of them past a row's causal edge) and one
  // run of every key; tiles that do not divide the runs.
  const std::int64_t split = ops::kFlashSplitKeys;
  for (const std::int64_t past : {1, 127, 128, 300})
    for (const std::int64_t t : {1, 5, 70}) {
      AttentionShape s{2, t, 4, 2, 16};
      s.past = past;
      for (const std::int64_t tile : {7, 64})
        for (const std::int64_t runs : {split, std::int64_t{16}, std::int64_t{100000}}) {
          check_decode<double, double, 16>(s, tile, runs, 1e-12);
          check_decode<float, float, 16>(s, tile, runs, 1e-5);
        }
    }
  // The Llama head dims, one kv head for every query head, padded rows; bf16 storage to
  // one rounding of the float backend on the same values.
  AttentionShape s{1, 1, 4, 1, 64};
  s.past = 299;
  check_decode<float, float, 64>(s, 64, split, 1e-5, 3);
  check_decode<bf16, float, 64>(s, 64, split, 1e-2, 3);
  s.head_dim = 128;
  s.n_kv_heads = 4;
  check_decode<float, float, 128>(s, 32, split, 1e-5);
  check_decode<bf16, float, 128>(s, 32, split, 1e-2);
  // Full attention (no mask) after the cache: every key for every query.
  AttentionShape full{2, 5, 4, 2, 16, false};
  full.past = 200;
  check_decode<double, double, 16>(full, 7, split, 1e-12);
}

TEST_CASE("flash attention's merge of key runs: a run that saw no key adds nothing, a row that saw none is zeros") {
  // Two (row, head) pairs of head dim 2 over three runs: the first pair's middle run saw
  // no key (lse -inf, its o ignored even as NaN); the second pair saw none in any run.
  using Merge = ops::FlashMergeSplits<float>;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // Runs' o: (1 row, 2 heads x 2) each; lse: (1, 2 heads, 1) each.
  const std::vector<float> o_parts = {1, 2, nan, nan, /**/ nan, nan, nan, nan, /**/ 3, 4, nan, nan};
  const std::vector<float> lse_parts = {0.5f, -inf, /**/ -inf, -inf, /**/ 1.5f, -inf};
  std::vector<float> o(4, 7.0f), lse(2, 7.0f);
  const Merge merge{o_parts.data(), lse_parts.data(), o.data(), 4, lse.data(), 3, 1, 1, 2, 2};
  for (std::int64_t i = 0; i < 4; ++i) merge(i);
  const double w0 = 1 / (1 + std::exp(1.0)), w2 = 1 - w0;  // exp(0.5) : exp(1.5)
  CHECK(o[0] == doctest::Approx(w0 * 1 + w2 * 3).epsilon(1e-6));
  CHECK(o[1] == doctest::Approx(w0 * 2 + w2 * 4).epsilon(1e-6));
  CHECK(lse[0] == doctest::Approx(std::log(std::exp(0.5) + std::exp(1.5))).epsilon(1e-6));
  CHECK(o[2] == 0.0f);
  CHECK(o[3] == 0.0f);
  CHECK(lse[1] == -inf);
}

TEST_CASE("flash attention: bad shapes, head dims and tiles are refused by name") {
  CHECK_ERROR_CONTAINS(ops::with_flash_head_dim(96, []<int HD>() { return HD; }),
                       "flash attention: head dim 96 is not supported (16, 32, 64 or 128)");
  CHECK(ops::with_flash_head_dim(128, []<int HD>() { return HD; }) == 128);

  const AttentionShape s{1, 5, 4, 2, 64};
  const auto q = random_matrix<float>(5, 256, 0, "q"), k = random_matrix<float>(5, 128, 0, "k");
  const auto v = random_matrix<float>(5, 128, 0, "v"), d_o = random_matrix<float>(5, 256, 0, "dO");
  auto o = matrix<float>(5, 256, 0), dq = matrix<float>(5, 256, 0);
  auto dk = matrix<float>(5, 128, 0), dv = matrix<float>(5, 128, 0);
  std::vector<float> lse(20);
  auto forward = [&](const AttentionShape& shape, TensorView<const float> qv, std::int64_t tile) {
    ops::flash_attention_forward_rows<float, 64>(shape, qv, k.cview(), v.cview(), o.view, lse.data(), tile);
  };
  forward(s, q.cview(), 16);  // the good call passes

  CHECK_ERROR_CONTAINS(forward(s, k.cview(), 16), "flash attention: q is (5, 128), expected (5, 256)");
  CHECK_ERROR_CONTAINS(forward(s, q.cview(), 0), "flash attention: tiles of 0 rows (at least 1)");
  CHECK_ERROR_CONTAINS(forward({1, 5, 3, 2, 64}, q.cview(), 16),
                       "flash attention: n_heads 3 is not a positive multiple of n_kv_heads 2");
  CHECK_ERROR_CONTAINS(forward({1, 5, 4, 0, 64}, q.cview(), 16),
                       "flash attention: n_heads 4 is not a positive multiple of n_kv_heads 0");
  CHECK_ERROR_CONTAINS(forward({1, 5, 4, 2, 48}, q.cview(), 16),
                       "flash attention: head dim 48 is not supported (16, 32, 64 or 128)");
  CHECK_ERROR_CONTAINS(forward({-1, 5, 4, 2, 64}, q.cview(), 16), "flash attention: batch -1 and seq_len 5");
  // After a KV cache's keys, k and v hold them too.
  AttentionShape after = s;
  after.past = 3;
  CHECK_ERROR_CONTAINS(forward(after, q.cview(), 16), "flash attention: k is (5, 128), expected (8, 128)");
  after.past = -1;
  CHECK_ERROR_CONTAINS(forward(after, q.cview(), 16), "flash attention: -1 keys before the queries");
  CHECK_ERROR_CONTAINS(
      (ops::flash_attention_forward_rows<float, 64>({1, 5, 2, 1, 128}, q.cview(), k.cview(), v.cview(), o.view,
                                                     lse.data(), 16)),
      "flash attention: the shape's head dim 128 is not 64, the head dim the rows were instantiated for");
  // q seen through its transpose: a column stride of 256.
  const TensorView<const float> q_t(q.view.data(), Shape{5, 256}, {1, 256});
  CHECK_ERROR_CONTAINS(forward(s, q_t, 16), "flash attention: q needs unit column stride and ld >= 256 (ld 1");

  auto backward = [&](TensorView<float> dkv) {
    ops::flash_attention_backward_rows<float, 64>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(),
                                                  d_o.cview(), dq.view, dkv, dv.view, 16);
  };
  backward(dk.view);
  AttentionShape decoding = s;
  decoding.past = 2;
  CHECK_ERROR_CONTAINS((ops::flash_attention_backward_rows<float, 64>(decoding, q.cview(), k.cview(), v.cview(),
                                                                     o.cview(), lse.data(), d_o.cview(), dq.view,
                                                                     dk.view, dv.view, 16)),
                       "flash attention backward: keys before the queries (a KV cache's) are for decoding only");
  auto short_dk = matrix<float>(4, 128, 0);
  CHECK_ERROR_CONTAINS(backward(short_dk.view), "flash attention: dk is (4, 128), expected (5, 128)");
  CHECK_ERROR_CONTAINS((ops::flash_attention_backward_rows<float, 64>(s, q.cview(), k.cview(), v.cview(), o.cview(),
                                                                     lse.data(), q.cview(), dq.view, dk.view,
                                                                     dq.view, 16)),
                       "flash attention: dv is (5, 256), expected (5, 128)");
}

}  // namespace test_flash_attention
