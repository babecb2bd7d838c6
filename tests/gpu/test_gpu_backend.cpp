// The CUDA backend against the CPU backend: cuBLASLt GEMMs (every transpose pair,
// strided views, alpha and beta, k == 0, float and bf16), transfers, zeros, functor
// launches, the caching allocator's counters, and the errors.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "backend_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/ops/ops.hpp"

namespace test_gpu_backend {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

/// Deterministic values in [-1, 1) with full fp32 mantissas (so TF32 would show).
Tensor<float> values(Shape shape, std::uint32_t seed) {
  Tensor<float> t(shape);
  std::uint64_t x = 0x9e3779b97f4a7c15ull * (seed + 1);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const auto bits = static_cast<std::uint32_t>((x * 0x2545f4914f6cdd1dull) >> 40);  // 24 bits
    t[i] = static_cast<float>(bits) / static_cast<float>(1u << 23) - 1.0f;
  }
  return t;
}

Tensor<float> abs_of(const Tensor<float>& t) {
  Tensor<float> r = t.clone();
  for (std::int64_t i = 0; i < r.numel(); ++i) r[i] = std::fabs(r[i]);
  return r;
}

Tensor<bf16> to_bf16(const Tensor<float>& t) {
  Tensor<bf16> r(t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) r[i] = bf16(t[i]);
  return r;
}

Tensor<float> to_float(const Tensor<bf16>& t) {
  Tensor<float> r(t.shape());
  for (std::int64_t i = 0; i < t.numel(); ++i) r[i] = static_cast<float>(t[i]);
  return r;
}

/// The same view (offset and strides) into another tensor of the same shape.
template <class T, class U>
TensorView<T> view_like(const Tensor<T>& store, const Tensor<U>& other_store, TensorView<const U> other) {
  const std::int64_t offset = other_store.data() == nullptr ? 0 : other.data() - other_store.data();
  std::array<std::int64_t, kMaxRank> strides{};
  for (int i = 0; i < other.rank(); ++i) strides[static_cast<std::size_t>(i)] = other.stride(i);
  return TensorView<T>(store.data() == nullptr ? nullptr : store.data() + offset, other.shape(), strides);
}

template <class T, class U>
TensorView<const T> cview_like(const Tensor<T>& store, const Tensor<U>& other_store, TensorView<const U> other) {
  return view_like(store, other_store, other);
}

/// One GEMM problem: operand stores, the views into them, and the scalars.
struct GemmProblem {
  Trans ta = Trans::no, tb = Trans::no;
  float alpha = 1.0f, beta = 0.0f;
  Tensor<float> a, b, c;  // stores (c: C's initial values)
  TensorView<const float> av, bv;
  TensorView<float> cv;
};

/// The GEMM over whole stores a, b, c (no padding, views at offset 0).
GemmProblem whole_problem(Trans ta, Trans tb, float alpha, float beta, const Tensor<float>& a, const Tensor<float>& b,
                          const Tensor<float>& c) {
  GemmProblem p;
  p.ta = ta;
  p.tb = tb;
  p.alpha = alpha;
  p.beta = beta;
  p.a = a;
  p.b = b;
  p.c = c;
  p.av = p.a.cview();
  p.bv = p.b.cview();
  p.cv = p.c.view();
  return p;
}

/// C (m x n) = op(A) op(B) with k inner; `pad` extra columns in every store, the views
/// starting at column `offset` (so ld exceeds the width and the data is less aligned).
GemmProblem make_problem(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta,
                         std::int64_t pad, std::int64_t offset, std::uint32_t seed) {
  GemmProblem p;
  p.ta = ta;
  p.tb = tb;
  p.alpha = alpha;
  p.beta = beta;
  const std::int64_t ar = ta == Trans::no ? m : k, ac = ta == Trans::no ? k : m;
  const std::int64_t br = tb == Trans::no ? k : n, bc = tb == Trans::no ? n : k;
  p.a = values({ar, ac + pad}, seed);
  p.b = values({br, bc + pad}, seed + 1);
  p.c = values({m, n + pad}, seed + 2);
  p.av = p.a.cview().slice_cols(offset, offset + ac);
  p.bv = p.b.cview().slice_cols(offset, offset + bc);
  p.cv = p.c.view().slice_cols(offset, offset + n);
  return p;
}

/// C after the GEMM on the CPU, and the bound |alpha| |op(A)| |op(B)| + |beta| |C| on
/// every element's rounding, from the same stores.
struct Reference {
  Tensor<float> c, bound;
};

Reference cpu_reference(const GemmProblem& p, const Tensor<float>& a, const Tensor<float>& b, const Tensor<float>& c) {
  Reference r{c.clone(), abs_of(c)};
  const Tensor<float> aa = abs_of(a), ab = abs_of(b);
  Cpu::gemm(p.ta, p.tb, p.alpha, cview_like(a, p.a, p.av), cview_like(b, p.b, p.bv), p.beta,
            view_like(r.c, p.c, TensorView<const float>(p.cv)));
  Cpu::gemm(p.ta, p.tb, std::fabs(p.alpha), cview_like(aa, p.a, p.av),
            cview_like(ab, p.b, p.bv), std::fabs(p.beta),
            view_like(r.bound, p.c, TensorView<const float>(p.cv)));
  return r;
}

/// Every element of `got` within rel * bound + abs_rel * (|ref| + |rounded|) of the
/// reference, where `rounded` (when given) is a term the GPU rounds on its own before
/// the last addition (elements outside C's view are untouched, so they must be equal).
void check_close(const Tensor<float>& got, const Reference& ref, float rel, float abs_rel,
                 const Tensor<float>* rounded = nullptr) {
  REQUIRE(got.numel() == ref.c.numel());
  int bad = 0;
  for (std::int64_t i = 0; i < got.numel() && bad < 5; ++i) {
    const float tol = rel * ref.bound[i] + abs_rel * (std::fabs(ref.c[i]) + (rounded ? std::fabs((*rounded)[i]) : 0.0f)) +
                      1e-30f;
    if (!(std::fabs(got[i] - ref.c[i]) <= tol)) {
      ++bad;
      FAIL_CHECK("element ", i, ": got ", got[i], ", expected ", ref.c[i], " (tolerance ", tol, ")");
    }
  }
}

void check_float_gemm(const GemmProblem& p) {
  const Tensor<float> got = gpu_test::cuda_gemm<float>(p.ta, p.tb, p.alpha, p.a, p.av, p.b, p.bv, p.beta, p.c, p.cv);
  check_close(got, cpu_reference(p, p.a, p.b, p.c), 1e-5f, 0.0f);
}

/// alpha op(A) op(B) alone, as the GPU rounds it to bf16 before adding beta C: cuBLASLt
/// with a bf16 C and beta != 0 computes bf16(bf16(alpha op(A) op(B)) + beta C), two
/// roundings, with every algorithm it offers (seen on an H200, cuBLASLt 13.1; the GPU
/// results matched that formula to the bit). PyTorch's `c + a @ b` in bf16 rounds the
/// same two times.
Tensor<float> product_term(GemmProblem p, const Tensor<float>& a, const Tensor<float>& b) {
  p.beta = 0.0f;
  return cpu_reference(p, a, b, Tensor<float>(p.c.shape())).c;
}

/// The same problem in bf16: inputs rounded to bf16, the reference computed in fp32 on
/// those values; the GPU's output is rounded to bf16 once (half an ulp: 2^-9 relative),
/// and with beta != 0 its product term once before (product_term).
void check_bf16_gemm(const GemmProblem& p) {
  INFO("m x n x k = ", p.cv.shape()[0], " x ", p.cv.shape()[1], " x ", p.ta == Trans::no ? p.av.shape()[1] : p.av.shape()[0],
       ", alpha ", p.alpha, ", beta ", p.beta, ", ld(C) ", p.cv.stride(0));
  const Tensor<bf16> a = to_bf16(p.a), b = to_bf16(p.b), c = to_bf16(p.c);
  const Tensor<bf16> got = gpu_test::cuda_gemm<bf16>(p.ta, p.tb, p.alpha, a, cview_like(a, p.a, p.av), b,
                                                     cview_like(b, p.b, p.bv), p.beta, c,
                                                     view_like(c, p.c, TensorView<const float>(p.cv)));
  const Tensor<float> af = to_float(a), bff = to_float(b), cf = to_float(c);
  const Tensor<float> product = product_term(p, af, bff);
  check_close(to_float(got), cpu_reference(p, af, bff, cf), 1e-5f, 1.0f / 256, p.beta != 0.0f ? &product : nullptr);
}

/// bf16 operands into an fp32 C (a weight gradient accumulated in fp32): no rounding of
/// the output, so the float bound holds.
void check_bf16_into_float_gemm(const GemmProblem& p) {
  const Tensor<bf16> a = to_bf16(p.a), b = to_bf16(p.b);
  const Tensor<float> got = gpu_test::cuda_gemm<bf16, float>(p.ta, p.tb, p.alpha, a, cview_like(a, p.a, p.av), b,
                                                             cview_like(b, p.b, p.bv), p.beta, p.c, p.cv);
  check_close(got, cpu_reference(p, to_float(a), to_float(b), p.c), 1e-5f, 0.0f);
  // The CPU backend's own bf16-into-float GEMM gives the same within the same bound.
  Tensor<float> cpu = p.c.clone();
  Cpu::gemm(p.ta, p.tb, p.alpha, cview_like(a, p.a, p.av), cview_like(b, p.b, p.bv), p.beta,
            view_like(cpu, p.c, TensorView<const float>(p.cv)));
  check_close(cpu, cpu_reference(p, to_float(a), to_float(b), p.c), 1e-5f, 0.0f);
}

const Trans kTrans[] = {Trans::no, Trans::yes};

std::string name(Trans t) { return t == Trans::no ? "N" : "T"; }

}  // namespace

TEST_CASE("Cuda::gemm matches Cpu::gemm in float for every transpose pair, contiguous and strided") {
  for (Trans ta : kTrans)
    for (Trans tb : kTrans) {
      INFO("op(A)=", name(ta), " op(B)=", name(tb));
      check_float_gemm(make_problem(ta, tb, 37, 29, 45, 1.0f, 0.0f, 0, 0, 1));
      check_float_gemm(make_problem(ta, tb, 37, 29, 45, 0.75f, -0.5f, 3, 1, 2));  // ld > width, 4-byte aligned
      check_float_gemm(make_problem(ta, tb, 128, 96, 256, -1.25f, 1.0f, 0, 0, 3));
    }
}

TEST_CASE("Cuda::gemm matches Cpu::gemm in bf16 for every transpose pair, contiguous and strided") {
  for (Trans ta : kTrans)
    for (Trans tb : kTrans) {
      INFO("op(A)=", name(ta), " op(B)=", name(tb));
      check_bf16_gemm(make_problem(ta, tb, 37, 29, 45, 1.0f, 0.0f, 0, 0, 4));
      check_bf16_gemm(make_problem(ta, tb, 37, 29, 45, 0.75f, -0.5f, 3, 1, 5));  // ld > width, 2-byte aligned
      check_bf16_gemm(make_problem(ta, tb, 128, 96, 256, 0.5f, 1.0f, 8, 8, 6));
    }
}

TEST_CASE("Cuda::gemm from bf16 operands into an fp32 C matches the fp32 product of the bf16 values") {
  for (Trans ta : kTrans)
    for (Trans tb : kTrans) {
      INFO("op(A)=", name(ta), " op(B)=", name(tb));
      check_bf16_into_float_gemm(make_problem(ta, tb, 37, 29, 45, 1.0f, 0.0f, 0, 0, 14));
      check_bf16_into_float_gemm(make_problem(ta, tb, 64, 48, 96, 1.0f, 1.0f, 3, 1, 15));  // accumulate, strided
    }
}

TEST_CASE("Cuda::gemm with beta zero ignores what C held, NaN included") {
  GemmProblem p = make_problem(Trans::no, Trans::yes, 33, 17, 20, 1.5f, 0.0f, 2, 1, 7);
  const Tensor<float> zeros_c(p.c.shape());
  const Reference ref = cpu_reference(p, p.a, p.b, zeros_c);
  for (std::int64_t i = 0; i < p.c.numel(); ++i) p.c[i] = std::numeric_limits<float>::quiet_NaN();
  Tensor<float> got = gpu_test::cuda_gemm<float>(p.ta, p.tb, p.alpha, p.a, p.av, p.b, p.bv, p.beta, p.c, p.cv);
  // Outside the view the NaNs stay; inside, the product alone.
  for (std::int64_t r = 0; r < 33; ++r)
    for (std::int64_t j = 0; j < 19; ++j) {
      const std::int64_t i = r * 19 + j;
      if (j >= 1 && j < 18) {
        CHECK(std::fabs(got[i] - ref.c[i]) <= 1e-5f * ref.bound[i] + 1e-30f);
      } else {
        CHECK(std::isnan(got[i]));
      }
    }
}

TEST_CASE("Cuda::gemm with k == 0 scales C by beta, or zeroes it") {
  for (float beta : {0.0f, 0.5f}) {
    INFO("beta ", beta);
    GemmProblem p = make_problem(Trans::no, Trans::no, 6, 5, 0, 2.0f, beta, 1, 1, 8);
    Tensor<float> expected = p.c.clone();
    Cpu::gemm(p.ta, p.tb, p.alpha, p.av, p.bv, p.beta, view_like(expected, p.c, TensorView<const float>(p.cv)));
    if (beta == 0.0f)  // what C held must not matter
      for (std::int64_t r = 0; r < 6; ++r)
        for (std::int64_t j = 1; j < 6; ++j) p.c[r * 6 + j] = std::numeric_limits<float>::quiet_NaN();
    const Tensor<float> got =
        gpu_test::cuda_gemm<float>(p.ta, p.tb, p.alpha, p.a, p.av, p.b, p.bv, p.beta, p.c, p.cv);
    for (std::int64_t i = 0; i < got.numel(); ++i) CHECK(got[i] == expected[i]);
  }
  GemmProblem p = make_problem(Trans::yes, Trans::yes, 4, 3, 0, 1.0f, -2.0f, 0, 0, 9);
  const Tensor<bf16> c = to_bf16(p.c);
  const Tensor<bf16> got = gpu_test::cuda_gemm<bf16>(p.ta, p.tb, 1.0f, Tensor<bf16>(p.a.shape()),
                                                     TensorView<const bf16>(nullptr, p.a.shape()),
                                                     Tensor<bf16>(p.b.shape()),
                                                     TensorView<const bf16>(nullptr, p.b.shape()), -2.0f, c,
                                                     c.view());
  for (std::int64_t i = 0; i < got.numel(); ++i)
    CHECK(static_cast<float>(got[i]) == round_to_bf16(-2.0f * static_cast<float>(c[i])));
}

TEST_CASE("Cuda::gemm reading C apart from D (a residual added in the GEMM) matches the CPU's, C unchanged") {
  // cuBLASLt's out-of-place matmul: D = alpha op(A) op(B) + beta C, C and D one layout.
  // bf16: the product term rounded on its own before beta C is added (product_term), as
  // the CPU's out-of-place gemm rounds it.
  for (Trans ta : kTrans)
    for (Trans tb : kTrans) {
      INFO("op(A)=", name(ta), " op(B)=", name(tb));
      const GemmProblem p = make_problem(ta, tb, 64, 48, 96, 0.75f, 1.0f, 0, 0, 16);
      const auto [d, c_after] = gpu_test::cuda_gemm_apart<float>(ta, tb, p.alpha, p.a, p.b, p.beta, p.c);
      check_close(d, cpu_reference(p, p.a, p.b, p.c), 1e-5f, 0.0f);
      for (std::int64_t i = 0; i < p.c.numel(); ++i) CHECK(c_after[i] == p.c[i]);

      const Tensor<bf16> a = to_bf16(p.a), b = to_bf16(p.b), c = to_bf16(p.c);
      const auto [d16, c16_after] = gpu_test::cuda_gemm_apart<bf16>(ta, tb, p.alpha, a, b, p.beta, c);
      Tensor<bf16> cpu(c.shape());
      Cpu::gemm(ta, tb, p.alpha, a.cview(), b.cview(), p.beta, c.cview(), cpu.view());
      const Tensor<float> af = to_float(a), bf = to_float(b), cf = to_float(c);
      const Tensor<float> product = product_term(p, af, bf);
      const Reference ref = cpu_reference(p, af, bf, cf);
      check_close(to_float(d16), ref, 1e-5f, 1.0f / 256, &product);
      check_close(to_float(cpu), ref, 1e-5f, 1.0f / 256, &product);
      for (std::int64_t i = 0; i < c.numel(); ++i) CHECK(c16_after[i].bits == c[i].bits);

      const auto [d32, c32_after] = gpu_test::cuda_gemm_apart<bf16, float>(ta, tb, p.alpha, a, b, p.beta, p.c);
      check_close(d32, cpu_reference(p, af, bf, p.c), 1e-5f, 0.0f);
      for (std::int64_t i = 0; i < p.c.numel(); ++i) CHECK(c32_after[i] == p.c[i]);
    }
}

TEST_CASE("The backend runs on a created compute stream, and Cuda::capture makes a CUDA graph of its work there") {
  Tensor<float> a = Cpu::empty<float>(Shape{96, 64}), b = Cpu::empty<float>(Shape{64, 80});
  for (std::int64_t i = 0; i < a.numel(); ++i) a.data()[i] = static_cast<float>((i * 37) % 17) / 8 - 1;
  for (std::int64_t i = 0; i < b.numel(); ++i) b.data()[i] = static_cast<float>((i * 11) % 13) / 6 - 1;
  const gpu_test::CaptureCheck r = gpu_test::capture_backend_work(a, b);
  CHECK(r.created);
  CHECK(r.stable);
  CHECK(r.nodes >= 3);  // the GEMM's kernel(s), the scale's and the copy's
  CHECK(r.scratch_from_pool);
  CHECK(r.copy_refused);
  CHECK(r.capture_ended);
  REQUIRE(r.eager.numel() == 96 * 80);
  REQUIRE(r.replayed.numel() == r.eager.numel());
  CHECK(std::memcmp(r.eager.data(), r.replayed.data(), r.eager.bytes()) == 0);
  CHECK(r.eager.data()[0] != 0.0f);
}

TEST_CASE("Every algorithm gemm_candidates offers gives the CPU's result") {
  const Tensor<float> a = values({64, 48}, 10), b = values({40, 48}, 11), c = values({64, 40}, 12);
  const auto results = gpu_test::cuda_gemm_each_candidate(Trans::no, Trans::yes, 1.0f, a, b, 0.5f, c);
  REQUIRE(!results.empty());
  const GemmProblem p = whole_problem(Trans::no, Trans::yes, 1.0f, 0.5f, a, b, c);
  const Reference ref = cpu_reference(p, a, b, c);
  for (std::size_t i = 0; i < results.size(); ++i) {
    INFO("candidate ", i, " of ", results.size());
    check_close(results[i], ref, 1e-5f, 0.0f);
  }
  // The cached choice is one of them (a benchmark compares it with the fastest).
  CHECK(gpu_test::chosen_algo_index(Trans::no, Trans::yes, a, b, c) >= 0);
}

TEST_CASE("Every algorithm gemm_candidates offers gives the CPU's result in bf16, accumulating into C") {
  // k = 256 over a 128 x 96 C, beta 1: the sum cuBLASLt rounds in two steps (product_term).
  const Tensor<float> a = values({128, 256}, 16), b = values({96, 256}, 17), c = values({128, 96}, 18);
  const Tensor<bf16> ah = to_bf16(a), bh = to_bf16(b), ch = to_bf16(c);
  std::vector<std::string> described;
  const auto results = gpu_test::cuda_gemm_each_candidate(Trans::no, Trans::yes, 0.5f, ah, bh, 1.0f, ch, &described);
  REQUIRE(!results.empty());
  const GemmProblem p = whole_problem(Trans::no, Trans::yes, 0.5f, 1.0f, to_float(ah), to_float(bh), to_float(ch));
  const Reference ref = cpu_reference(p, p.a, p.b, p.c);
  const Tensor<float> product = product_term(p, p.a, p.b);
  for (std::size_t i = 0; i < results.size(); ++i) {
    INFO("candidate ", i, " of ", results.size(), ": ", described[i]);
    check_close(to_float(results[i]), ref, 1e-5f, 1.0f / 256, &product);
  }
}

TEST_CASE("A bad Cuda::gemm gives Cpu::gemm's error") {
  auto both = [](Trans ta, Trans tb, const Tensor<float>& a, TensorView<const float> av, const Tensor<float>& b,
                 TensorView<const float> bv, const Tensor<float>& c, TensorView<float> cv) {
    const std::string cpu = testing::error_of([&] { Cpu::gemm(ta, tb, 1.0f, av, bv, 0.0f, cv); });
    const std::string gpu =
        testing::error_of([&] { gpu_test::cuda_gemm<float>(ta, tb, 1.0f, a, av, b, bv, 0.0f, c, cv); });
    INFO("cpu: ", cpu);
    INFO("gpu: ", gpu);
    CHECK(cpu.rfind("gemm: ", 0) == 0);
    CHECK(gpu == cpu);
  };
  const Tensor<float> a = values({4, 6}, 20), b = values({5, 3}, 21), c = values({4, 3}, 22);
  // op(A) 4x6 against op(B) 5x3: the inner dimensions differ.
  both(Trans::no, Trans::no, a, a.cview(), b, b.cview(), c, c.view());
  CHECK_ERROR_CONTAINS(gpu_test::cuda_gemm<float>(Trans::no, Trans::no, 1.0f, a, a.cview(), b, b.cview(), 0.0f, c,
                                                  c.view()),
                       "gemm: shapes do not chain: op(A) 4x6, op(B) 5x3, C 4x3");
  // A rank-3 operand.
  const Tensor<float> a3 = values({2, 2, 6}, 23);
  both(Trans::no, Trans::no, a3, a3.cview(), b, b.cview(), c, c.view());
  // A column stride of 2.
  const Tensor<float> wide = values({4, 12}, 24);
  const TensorView<const float> strided(wide.data(), Shape{4, 6}, {12, 2, 0, 0});
  const Tensor<float> b6 = values({6, 3}, 25);
  both(Trans::no, Trans::no, wide, strided, b6, b6.cview(), c, c.view());
  CHECK_ERROR_CONTAINS(gpu_test::cuda_gemm<float>(Trans::no, Trans::no, 1.0f, wide, strided, b6, b6.cview(), 0.0f,
                                                  c, c.view()),
                       "gemm: operands need unit column stride");
}

TEST_CASE("cuBLASLt failures name the call, the status and the GEMM") {
  CHECK_ERROR_CONTAINS(gpu_test::failing_cublas_call(),
                       "cuBLASLt: cublasLtMatmulPreferenceSetAttribute failed: CUBLAS_STATUS_INVALID_VALUE");
  CHECK_ERROR_CONTAINS(gpu_test::failing_cublas_call(), "for float32 GEMM m=4 n=5 k=6 op(A)=A op(B)=B lda=6");
  // No algorithm reads a float matrix one byte off alignment: the error names the GEMM.
  CHECK_ERROR_CONTAINS(gpu_test::candidates_for_misaligned_gemm(), "float32 GEMM m=8 n=8 k=8");
  CHECK_ERROR_CONTAINS(gpu_test::candidates_for_misaligned_gemm(), "alignment(A,B,C)=1,256,256 bytes on cuda:");
}

TEST_CASE("Without a visible device the backend says so") {
  CHECK_ERROR_CONTAINS(gpu_test::check_device_count(true),
                       "CUDA backend: no CUDA device is visible (cudaGetDeviceCount: cudaErrorNoDevice: ");
  CHECK_ERROR_CONTAINS(gpu_test::check_device_count(false),
                       "CUDA backend: no CUDA device is visible (cudaGetDeviceCount: 0 devices)");
}

TEST_CASE("Cuda attention on bf16 tensors matches the CPU backend's bf16 attention") {
  AttentionShape s;
  s.batch = 2;
  s.seq_len = 37;
  s.n_heads = 4;
  s.n_kv_heads = 2;
  s.head_dim = 64;
  const Tensor<bf16> q = to_bf16(values({s.batch * s.seq_len, s.n_heads * s.head_dim}, 41));
  const Tensor<bf16> k = to_bf16(values({s.batch * s.seq_len, s.n_kv_heads * s.head_dim}, 42));
  const Tensor<bf16> v = to_bf16(values({s.batch * s.seq_len, s.n_kv_heads * s.head_dim}, 43));
  Tensor<bf16> o(q.shape());
  Tensor<float> lse(Shape{s.batch, s.n_heads, s.seq_len});
  Cpu::attention_forward<bf16>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  const auto [got_o, got_lse] = gpu_test::cuda_attention_forward_bf16(s, q, k, v);
  // lse: fp32 on both sides from the same bf16 scores, summed in different orders; the
  // CPU rounds the scores to bf16 before the softmax (its score GEMM writes T), the GPU
  // keeps them in fp32: 2^-8 relative on a score of magnitude up to ~8 moves lse by
  // at most ~0.03.
  for (std::int64_t i = 0; i < lse.numel(); ++i) CHECK(got_lse[i] == doctest::Approx(lse[i]).epsilon(0.01));
  // o: a convex combination of bf16 values rounded once to bf16 on each side, with the
  // CPU's probabilities also rounded to bf16 first: within a few bf16 ulps.
  for (std::int64_t i = 0; i < o.numel(); ++i)
    CHECK(std::fabs(static_cast<float>(got_o[i]) - static_cast<float>(o[i])) <= 0.03f);
}

TEST_CASE("upload<Cuda> and download<Cuda> round-trip every element") {
  const Tensor<float> host = values({7, 33}, 30);
  Device on = Device::cpu;
  const Tensor<float> back = gpu_test::round_trip(host, &on);
  CHECK(on == Device::cuda);
  CHECK(back.device() == Device::cpu);
  REQUIRE(back.shape() == host.shape());
  for (std::int64_t i = 0; i < host.numel(); ++i) CHECK(back[i] == host[i]);
  const Tensor<bf16> hb = to_bf16(values({5, 9}, 31));
  const Tensor<bf16> bb = gpu_test::round_trip(hb, &on);
  for (std::int64_t i = 0; i < hb.numel(); ++i) CHECK(bb[i].bits == hb[i].bits);
}

TEST_CASE("Cuda::zeros are zero even in a reused block") {
  const Tensor<float> z = gpu_test::zeros_after_reuse<float>({13, 7});
  for (std::int64_t i = 0; i < z.numel(); ++i) CHECK(z[i] == 0.0f);
  const Tensor<bf16> zb = gpu_test::zeros_after_reuse<bf16>({3, 101});
  for (std::int64_t i = 0; i < zb.numel(); ++i) CHECK(zb[i].bits == 0);
}

TEST_CASE("Cuda::for_each runs an ops/ functor as the CPU does") {
  const Tensor<float> a = values({1000}, 40), b = values({1000}, 41);
  const Tensor<float> gpu = gpu_test::cuda_swiglu(a, b);
  Tensor<float> cpu({1000});
  Cpu::for_each(1000, ops::SwiGluForward<float>{a.data(), b.data(), cpu.data()});
  for (std::int64_t i = 0; i < 1000; ++i) CHECK(gpu[i] == doctest::Approx(cpu[i]).epsilon(1e-5));
}

TEST_CASE("Device tensors move the caching allocator's counters and the device's memory stats") {
  const auto s0 = gpu_test::allocator_stats();
  const std::size_t held0 = memory_stats(Device::cuda).current();
  {
    Tensor<float> t = gpu_test::cuda_empty({1000});
    CHECK(t.device() == Device::cuda);
    const auto s1 = gpu_test::allocator_stats();
    CHECK(s1.allocated_bytes == s0.allocated_bytes + 4096);  // 4000 bytes in 512-byte units
    CHECK(s1.requested_bytes == s0.requested_bytes + 4000);
    CHECK(s1.allocations == s0.allocations + 1);
    CHECK(memory_stats(Device::cuda).current() == held0 + 4000);
    t.release();
    const auto s2 = gpu_test::allocator_stats();
    CHECK(s2.allocated_bytes == s0.allocated_bytes);
    CHECK(s2.requested_bytes == s0.requested_bytes);
    CHECK(s2.reserved_bytes == s1.reserved_bytes);  // the block stays cached
    CHECK(memory_stats(Device::cuda).current() == held0);
  }
  // A zero-size tensor is CUDA memory that allocates nothing.
  const Tensor<float> empty = gpu_test::cuda_empty({0, 7});
  CHECK(empty.device() == Device::cuda);
  CHECK(empty.data() == nullptr);
  const auto s3 = gpu_test::allocator_stats();
  CHECK(s3.allocations == s0.allocations + 1);
  CHECK(s3.allocated_bytes == s0.allocated_bytes);
}

TEST_CASE("The device allocator grows one expandable segment: a block freed at its end becomes part of a larger one; free pages inside it are unmapped and mapped again") {
  const gpu_test::GrowthCheck r = gpu_test::allocator_growth();
  INFO("allocator: ", r.mode);
  CHECK(r.values_read_back);
  REQUIRE(r.y_at_end);
  if (r.mode == "expandable segments") {
    // 1 GiB where 512 MiB were freed at the end: 512 MiB more, at the same address.
    CHECK(r.same_address);
    CHECK(r.reserved_after - r.reserved_before == std::size_t{512} << 20);
    // Its 1 GiB freed between two blocks in use: unmapped by empty_cache, mapped again
    // under a 768 MiB block at the same place.
    CHECK(r.unmapped_inside == std::size_t{1024} << 20);
    CHECK(r.remapped_same_address);
    CHECK(r.remapped_read_back);
  } else {
    // A segment per block: the freed 512 MiB stays cached and 1 GiB more is taken.
    CHECK(r.reserved_after - r.reserved_before == std::size_t{1024} << 20);
  }
}

}  // namespace test_gpu_backend
