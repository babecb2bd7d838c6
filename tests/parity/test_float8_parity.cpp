// The float8 conversions (core/float8.hpp) against the ml_dtypes package: every bf16
// value and a sample of floats (random, and every tie between neighbouring float8 values
// with the floats beside it) converted with saturation, and every code's value, replayed
// from tests/fixtures/float8 (tools/make_fixtures.py --only float8; docs/parity.md).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tessera/core/dtype.hpp"
#include "tessera/core/float8.hpp"

#ifndef TESSERA_FIXTURES
#error "TESSERA_FIXTURES must name the tests/fixtures folder (tests/parity/meson.build defines it)"
#endif

namespace test_float8_parity {  // unity build: this file's names stay in here

using namespace tessera;
namespace fs = std::filesystem;

namespace {

std::vector<std::uint8_t> read_bytes(const std::string& name) {
  const fs::path path = fs::path(TESSERA_FIXTURES) / "float8" / name;
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open ", path.string());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<float> read_floats(const std::string& name) {
  const std::vector<std::uint8_t> bytes = read_bytes(name);
  REQUIRE(bytes.size() % 4 == 0);
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());  // little-endian, as written
  return v;
}

std::string hex(std::uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%x", v);
  return s;
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// tools/make_fixtures.py's splitmix64.
std::uint64_t splitmix64(std::uint64_t& state) {
  state += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The sample's inputs, as tools/make_fixtures.py's float8_sample_bits makes them; the
/// structured part from ml_dtypes' values of each format (the fixture), so nothing of
/// the code under test decides which floats are asked about.
std::vector<float> sample_inputs(const std::vector<float>& e4m3_values, const std::vector<float>& e5m2_values) {
  std::vector<float> in;
  std::uint64_t state = 0x5EEDF10A78ull;
  for (int i = 0; i < (1 << 16); ++i) {
    auto u = static_cast<std::uint32_t>(splitmix64(state) >> 32);
    if (i % 2 == 1) {
      const std::uint32_t exponent = 127 - 20 + (u >> 23) % 38;
      u = (u & 0x807FFFFFu) | (exponent << 23);
    }
    in.push_back(float_of(u));
  }
  for (const std::vector<float>* values : {&e4m3_values, &e5m2_values}) {
    std::vector<float> finite;
    for (int c = 0; c < 128; ++c)
      if (std::isfinite((*values)[static_cast<std::size_t>(c)])) finite.push_back((*values)[static_cast<std::size_t>(c)]);
    std::sort(finite.begin(), finite.end());
    for (std::size_t k = 0; k + 1 < finite.size(); ++k) {
      const auto mid = static_cast<float>((static_cast<double>(finite[k]) + finite[k + 1]) / 2);
      for (const float v : {std::nextafter(mid, -INFINITY), mid, std::nextafter(mid, INFINITY)}) {
        in.push_back(v);
        in.push_back(-v);
      }
    }
    for (const float v : finite) in.push_back(v);
  }
  return in;
}

/// Whether codes a (ours) and b (ml_dtypes') are the same value: the same byte, or both
/// NaN (each format has several NaN codes).
template <class F>
bool same_code(std::uint8_t a, std::uint8_t b) {
  const float x = F::format::decode(a), y = F::format::decode(b);
  return a == b || (std::isnan(x) && std::isnan(y));
}

template <class F>
void check_format(const char* name) {
  CAPTURE(name);
  const std::vector<float> values = read_floats(std::string(name) + "_values.bin");
  REQUIRE(values.size() == 256);
  // Every code's value, exactly (NaN codes as NaN).
  int mismatched = 0;
  for (int c = 0; c < 256; ++c) {
    const float ours = static_cast<float>(F::from_bits(static_cast<std::uint8_t>(c)));
    const float theirs = values[static_cast<std::size_t>(c)];
    if (!(bits_of(ours) == bits_of(theirs) || (std::isnan(ours) && std::isnan(theirs)))) {
      if (++mismatched <= 5) MESSAGE("code ", c, ": ", ours, " where ml_dtypes has ", theirs);
    }
  }
  CHECK(mismatched == 0);
  // Every bf16 value.
  const std::vector<std::uint8_t> from_bf16 = read_bytes(std::string("bf16_to_") + name + ".bin");
  REQUIRE(from_bf16.size() == 65536);
  mismatched = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float x = static_cast<float>(bf16::from_bits(static_cast<std::uint16_t>(b)));
    const std::uint8_t ours = F(x).bits;
    if (!same_code<F>(ours, from_bf16[b]) && ++mismatched <= 5)
      MESSAGE("bf16 ", hex(b), " (", x, "): code ", int(ours), " where ml_dtypes gives ", int(from_bf16[b]));
  }
  CHECK(mismatched == 0);
}

}  // namespace

TEST_CASE("float8 e4m3 and e5m2: every code's value and every bf16 value's conversion are ml_dtypes'") {
  check_format<float8_e4m3>("e4m3");
  check_format<float8_e5m2>("e5m2");
}

TEST_CASE("float8 e4m3 and e5m2: a sample of floats, ties and their neighbours included, converts as ml_dtypes does") {
  const std::vector<float> in = sample_inputs(read_floats("e4m3_values.bin"), read_floats("e5m2_values.bin"));
  const std::vector<std::uint8_t> e4m3 = read_bytes("sample_to_e4m3.bin"), e5m2 = read_bytes("sample_to_e5m2.bin");
  REQUIRE(e4m3.size() == in.size());  // the same inputs, counted
  REQUIRE(e5m2.size() == in.size());
  int mismatched = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint8_t a = float8_e4m3(in[i]).bits, b = float8_e5m2(in[i]).bits;
    const bool ok = same_code<float8_e4m3>(a, e4m3[i]) && same_code<float8_e5m2>(b, e5m2[i]);
    if (!ok && ++mismatched <= 5)
      MESSAGE("input ", i, " (bits ", hex(bits_of(in[i])), ", ", in[i], "): e4m3 ", int(a), " / ",
              int(e4m3[i]), ", e5m2 ", int(b), " / ", int(e5m2[i]));
  }
  CHECK(mismatched == 0);
}

TEST_CASE("float8: saturation, signed zeros, NaN and the ends of each range") {
  CHECK(static_cast<float>(float8_e4m3(1e9f)) == 448.0f);
  CHECK(static_cast<float>(float8_e4m3(-INFINITY)) == -448.0f);
  CHECK(static_cast<float>(float8_e4m3(464.0f)) == 448.0f);  // past the largest: saturated, not NaN
  CHECK(static_cast<float>(float8_e5m2(INFINITY)) == 57344.0f);
  CHECK(std::isnan(static_cast<float>(float8_e4m3(NAN))));
  CHECK(std::isnan(static_cast<float>(float8_e5m2(NAN))));
  CHECK(float8_e4m3(-0.0f).bits == 0x80);
  CHECK(float8_e4m3(-1e-30f).bits == 0x80);                       // rounds to zero, keeps its sign
  CHECK(static_cast<float>(float8_e4m3(0x1p-9f)) == 0x1p-9f);    // the smallest subnormal
  CHECK(float8_e4m3(0x1p-10f).bits == 0x00);                       // half of it: ties to even, zero
  CHECK(float8_e4m3(0x1.8p-9f).bits == 0x02);                      // 1.5 of it: ties to even, 2
  CHECK(static_cast<float>(float8_e5m2(0x1p-16f)) == 0x1p-16f);
  CHECK(float8_e4m3::max() == static_cast<float>(float8_e4m3::from_bits(0x7e)));
  CHECK(float8_e5m2::max() == static_cast<float>(float8_e5m2::from_bits(0x7b)));
  CHECK(size_of(DType::f8e4m3) == 1);
  CHECK(name_of(DType::f8e5m2) == "float8_e5m2");
  CHECK(dtype_of<float8_e4m3>() == DType::f8e4m3);
}

}  // namespace test_float8_parity
