// Element types, tensor views, buffers and memory accounting, the Philox generator.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <sstream>
#include <string>

#include "tessera/core/core.hpp"

using namespace tessera;

TEST_CASE("bf16 rounds to nearest even and keeps specials") {
  CHECK(bf16(1.0f).bits == 0x3f80);
  CHECK(static_cast<float>(bf16(1.0f)) == 1.0f);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(round_to_bf16(1.0f + 0x1p-8f) == 1.0f);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties to even go up.
  CHECK(round_to_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
  CHECK(round_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
  CHECK(std::isinf(round_to_bf16(std::numeric_limits<float>::infinity())));
  CHECK(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  CHECK(round_to_bf16(-2.5f) == -2.5f);
  CHECK(convert<float>(bf16(0.15625f)) == 0.15625f);
  CHECK(parse_dtype("bfloat16", "k") == DType::bf16);
  CHECK_THROWS_WITH_AS(parse_dtype("fp8", "training.mixed_precision_param"),
                       doctest::Contains("training.mixed_precision_param: unknown dtype 'fp8'"), Error);
}

TEST_CASE("Tensor views: strides, slices, reshapes") {
  Tensor<float> t(Shape{3, 4});
  for (std::int64_t i = 0; i < 12; ++i) t[i] = static_cast<float>(i);
  auto v = t.view();
  CHECK(v.is_contiguous());
  CHECK(v(2, 1) == 9.0f);
  auto rows = v.slice_rows(1, 3);
  CHECK(rows.rows() == 2);
  CHECK(rows(0, 0) == 4.0f);
  auto cols = v.slice_cols(1, 3);
  CHECK(!cols.is_contiguous());
  CHECK(cols.ld() == 4);
  CHECK(cols(2, 1) == 10.0f);
  CHECK(v.reshape(Shape{2, 6})(1, 0) == 6.0f);
  CHECK_THROWS_WITH_AS(cols.reshape(Shape{6}), doctest::Contains("contiguous"), Error);
  CHECK_THROWS_WITH_AS(v.slice_rows(2, 5), doctest::Contains("slice_rows"), Error);
}

TEST_CASE("Tensors share storage on copy; clone copies") {
  Tensor<float> a(Shape{4});
  Tensor<float> b = a;
  b[1] = 5;
  CHECK(a[1] == 5);
  Tensor<float> c = a.clone();
  c[1] = 7;
  CHECK(a[1] == 5);
  CHECK(a.reshape(Shape{2, 2}).data() == a.data());
  CHECK_THROWS_WITH_AS(a.reshape(Shape{3}), doctest::Contains("changes the size"), Error);
}

TEST_CASE("Buffers report to the memory counters") {
  auto& stats = memory_stats(Device::cpu);
  const auto before = stats.current();
  stats.reset_peak();
  {
    Buffer<double> b(1000);
    CHECK(stats.current() == before + 8000);
    Buffer<double> moved = std::move(b);
    CHECK(stats.current() == before + 8000);
    CHECK(b.empty());
  }
  CHECK(stats.current() == before);
  CHECK(stats.peak() >= before + 8000);
  stats.reset_peak();
  CHECK(stats.peak() == stats.current());
}

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors") {
  auto run = [](std::uint64_t key, std::uint32_t c0, std::uint32_t c1, std::uint32_t c2, std::uint32_t c3) {
    std::uint32_t ctr[4] = {c0, c1, c2, c3}, out[4];
    const Philox4x32 gen(key);
    gen(ctr, out);
    return std::array<std::uint32_t, 4>{out[0], out[1], out[2], out[3]};
  };
  CHECK(run(0, 0, 0, 0, 0) == std::array<std::uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(run(0xffffffffffffffffull, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff) ==
        std::array<std::uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(run(0x299f31d0a4093822ull, 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344) ==
        std::array<std::uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
}

TEST_CASE("Parameter draws depend on seed, name and index only") {
  auto a = parameter_rng(1, "layers.0.attention.wq.weight");
  auto b = parameter_rng(1, "layers.0.attention.wk.weight");
  auto c = parameter_rng(2, "layers.0.attention.wq.weight");
  CHECK(normal(a, 5, 0, 1) == normal(parameter_rng(1, "layers.0.attention.wq.weight"), 5, 0, 1));
  CHECK(normal(a, 5, 0, 1) != normal(b, 5, 0, 1));
  CHECK(normal(a, 5, 0, 1) != normal(c, 5, 0, 1));
  // Moments of the normal and the truncation of the truncated normal.
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = normal(a, static_cast<std::uint64_t>(i), 0, 1);
    s += x, s2 += x * x;
  }
  CHECK(std::abs(s / n) < 0.01);
  CHECK(std::abs(s2 / n - 1) < 0.01);
  for (int i = 0; i < 10000; ++i) {
    double x = truncated_normal(a, static_cast<std::uint64_t>(i), 0, 1, -0.5, 0.5);
    CHECK_UNARY(x >= -0.5 && x <= 0.5);
  }
}

TEST_CASE("The portable log and cos follow libm to a few ulp over the ranges the normal draws use") {
  // log over (0, 1): uniforms of every binade the 53-bit draws reach, and around 1.
  double worst_log = 0;
  for (int e = 0; e <= 54; ++e)
    for (int i = 0; i < 2000; ++i) {
      const double u = std::ldexp(1.0 + i / 2000.0, -e - 1);
      const double ref = std::log(u);
      const double err = std::abs(portable_log(u) - ref) / std::max(std::abs(ref), 1e-300);
      worst_log = std::max(worst_log, err);
    }
  for (int i = -1000; i <= 1000; ++i) {
    const double u = 1.0 + i * 1e-6;
    if (u >= 1.0) continue;
    const double ref = std::log(u);
    worst_log = std::max(worst_log, std::abs(portable_log(u) - ref) / std::abs(ref));
  }
  CHECK(worst_log < 4 * std::numeric_limits<double>::epsilon());
  // cos(2 pi t) over [0, 1]: absolute error (its zeros have no relative accuracy in libm's
  // cos(2 pi t) either, whose argument is rounded).
  double worst_cos = 0;
  for (int i = 0; i <= 100000; ++i) {
    const double t = i / 100000.0;
    worst_cos = std::max(worst_cos, std::abs(portable_cos_2pi(t) - std::cos(6.283185307179586 * t)));
  }
  CHECK(worst_cos < 4 * std::numeric_limits<double>::epsilon());
  CHECK(portable_cos_2pi(0.0) == 1.0);
  CHECK(portable_cos_2pi(0.5) == -1.0);
  CHECK(portable_cos_2pi(1.0) == 1.0);
}

TEST_CASE("A normal draw is Box-Muller on the draw's words, to a few ulp of libm's") {
  const auto rng = parameter_rng(3, "layers.1.feed_forward.w2.weight");
  double worst = 0;
  for (std::uint64_t i = 0; i < 100000; ++i) {
    std::uint32_t w[4];
    rng.draw(i, 0, 0, w);
    const double ref = std::sqrt(-2.0 * std::log(uniform_open(w[0], w[1]))) *
                       std::cos(6.283185307179586 * uniform_open(w[2], w[3]));
    worst = std::max(worst, std::abs(normal(rng, i, 0, 1) - ref));
  }
  CHECK(worst < 1e-14);
}

TEST_CASE("An empty or released tensor holds no bytes; a slice counts its own elements") {
  tessera::Tensor<float> t;
  CHECK(t.bytes() == 0);
  CHECK(t.empty());
  tessera::Tensor<float> u(tessera::Shape{10});
  CHECK(u.slice(2, tessera::Shape{3}).bytes() == 12);
  CHECK(u.slice(2, tessera::Shape{3}).data() == u.data() + 2);
  u.release();
  CHECK(u.bytes() == 0);
}

TEST_CASE("Error messages read as the stream writes their parts, on either path") {
  // Text, chars and integers take concat's direct path; anything else the stream's.
  auto streamed = [](const auto&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
  };
  const std::string name = "layers.3.w1";
  const std::int64_t big = std::numeric_limits<std::int64_t>::min();
  const std::uint64_t huge = std::numeric_limits<std::uint64_t>::max();
  CHECK(detail::concat("tensor ", name, " has ", -12, " rows, ", big, ' ', huge, std::string_view(" ok"), 7u) ==
        streamed("tensor ", name, " has ", -12, " rows, ", big, ' ', huge, std::string_view(" ok"), 7u));
  CHECK(detail::concat("lr ", 0.5, " step ", 3) == "lr 0.5 step 3");
  CHECK(detail::concat("flag ", true) == streamed("flag ", true));
  CHECK(detail::concat(static_cast<signed char>('a'), short{-3}) == streamed(static_cast<signed char>('a'), short{-3}));
  CHECK(detail::concat() == "");
  REQUIRE_THROWS_WITH_AS(fail("rank ", 3, " of ", 8, ": ", std::string("bad")), "rank 3 of 8: bad", Error);
}

TEST_CASE("Memory running out is its own kind of error, and keeps it when context is added") {
  REQUIRE_THROWS_WITH_AS(fail_out_of_memory("out of host memory allocating ", 64, " bytes"),
                         "out of host memory allocating 64 bytes", OutOfMemory);
#ifndef __SANITIZE_ADDRESS__  // AddressSanitizer's allocator ends the process instead (unless told not to)
  // A buffer no host can give (4 EiB): the allocator's error, not std::bad_alloc.
  CHECK_THROWS_AS(Buffer<float>(std::size_t{1} << 60), OutOfMemory);
#endif
  // fail_like: the caught error's kind, the new message.
  auto rethrown = [](const std::exception& cause) {
    try {
      fail_like(cause, cause.what(), " (for layers.0.w1)");
    } catch (const OutOfMemory& e) {
      return "OutOfMemory: " + std::string(e.what());
    } catch (const Error& e) {
      return "Error: " + std::string(e.what());
    }
    return std::string();
  };
  CHECK(rethrown(OutOfMemory("out of device memory")) == "OutOfMemory: out of device memory (for layers.0.w1)");
  CHECK(rethrown(Error("bad shape")) == "Error: bad shape (for layers.0.w1)");
  CHECK(rethrown(std::runtime_error("io")) == "Error: io (for layers.0.w1)");
}
