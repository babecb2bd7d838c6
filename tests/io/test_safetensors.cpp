// safetensors: half-precision rounding, round trips per dtype, the writer's exact bytes,
// and one hand-written malformed file per validation rule, each checked for a message
// that names the file and the tensor.
#include <doctest/doctest.h>

#include "../support/temp_dir.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/io/mapped_file.hpp"
#include "tessera/io/safetensors.hpp"

namespace test_safetensors {  // unity build: this file's names stay in here (tests/meson.build)

namespace fs = std::filesystem;
using tessera::bf16;
using tessera::io::SafetensorsFile;
using tessera::io::SafetensorsWriter;
using tessera::io::StDtype;

namespace {

using tessera::test::TempDir;

// Runs f, which must throw tessera::Error with a one-line message containing every part.
template <class F>
void check_error(F&& f, std::initializer_list<std::string_view> parts) {
  try {
    f();
    FAIL("expected a tessera::Error");
  } catch (const tessera::Error& e) {
    const std::string message = e.what();
    CHECK_MESSAGE(message.find('\n') == std::string::npos, "message spans lines: ", message);
    for (std::string_view part : parts) {
      CHECK_MESSAGE(message.find(part) != std::string::npos, "message '", message, "' lacks '",
                    std::string(part), "'");
    }
  }
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A file made by hand: the given header text (its true length) and data bytes.
std::string hand_file(const TempDir& dir, const std::string& header, const std::string& data,
                      const std::string& name = "hand.safetensors") {
  const std::string path = dir.file(name);
  write_bytes(path, le64(header.size()) + header + data);
  return path;
}

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
std::uint64_t bits_of(double d) { return std::bit_cast<std::uint64_t>(d); }

// Reference rounding: the nearest of two neighbours, ties to the even bit pattern.
std::uint16_t nearest_of(double x, std::uint16_t lo, double lo_value, std::uint16_t hi, double hi_value) {
  const double dlo = x - lo_value, dhi = hi_value - x;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

}  // namespace

TEST_CASE("f16: known values") {
  using tessera::io::f16_to_float;
  using tessera::io::float_to_f16;
  CHECK(float_to_f16(1.0f) == 0x3c00);
  CHECK(float_to_f16(-2.0f) == 0xc000);
  CHECK(float_to_f16(0.1f) == 0x2e66);
  CHECK(float_to_f16(65504.0f) == 0x7bff);
  CHECK(float_to_f16(65519.0f) == 0x7bff);
  CHECK(float_to_f16(65520.0f) == 0x7c00);  // the tie above the largest half rounds to infinity
  CHECK(float_to_f16(6.103515625e-05f) == 0x0400);  // smallest normal, 2^-14
  CHECK(float_to_f16(1e-7f) == 0x0002);             // subnormal: 1e-7 / 2^-24 = 1.68 -> 2
  CHECK(float_to_f16(6e-5f) == 0x03ef);             // subnormal near the top: 1006.6 -> 1007
  CHECK(float_to_f16(1e-8f) == 0x0000);             // below half the smallest subnormal
  CHECK(float_to_f16(-1e-8f) == 0x8000);
  CHECK(float_to_f16(std::ldexp(1.0f, -25)) == 0x0000);        // tie -> even (zero)
  CHECK(float_to_f16(std::ldexp(3.0f, -25)) == 0x0002);        // tie between 1 and 2 -> 2
  CHECK(float_to_f16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(float_to_f16(-0.0f) == 0x8000);
  CHECK(float_to_f16(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(float_to_f16(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(float_to_f16(1e30f) == 0x7c00);
  const std::uint16_t nan = float_to_f16(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7c00) == 0x7c00);
  CHECK((nan & 0x03ff) != 0);
  CHECK(std::isnan(f16_to_float(nan)));

  CHECK(f16_to_float(0x3c00) == 1.0f);
  CHECK(f16_to_float(0x2e66) == 0.0999755859375f);
  CHECK(f16_to_float(0x7bff) == 65504.0f);
  CHECK(f16_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  CHECK(f16_to_float(0x7c00) == std::numeric_limits<float>::infinity());
  CHECK(f16_to_float(0xfc00) == -std::numeric_limits<float>::infinity());
  CHECK(std::signbit(f16_to_float(0x8000)));
  CHECK(std::isnan(f16_to_float(0x7e00)));
}

TEST_CASE("f16: every half decodes exactly and re-encodes to itself") {
  using tessera::io::f16_to_float;
  using tessera::io::float_to_f16;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const std::uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    const float sign = (h & 0x8000) ? -1.0f : 1.0f;
    const float f = f16_to_float(static_cast<std::uint16_t>(h));
    if (exponent == 0x1f) {
      CHECK((mantissa == 0 ? std::isinf(f) : std::isnan(f)));
      if (mantissa != 0) continue;
    } else {
      const float expected = exponent == 0 ? sign * std::ldexp(static_cast<float>(mantissa), -24)
                                           : sign * std::ldexp(1.0f + mantissa / 1024.0f, int(exponent) - 15);
      REQUIRE(bits_of(f) == bits_of(expected));
    }
    REQUIRE(float_to_f16(f) == h);
  }
}

TEST_CASE("f16: rounding at every midpoint, from float and from double") {
  using tessera::io::double_to_f16;
  using tessera::io::f16_to_float;
  using tessera::io::float_to_f16;
  for (std::uint16_t h = 0; h < 0x7bff; ++h) {
    const auto lo = h, hi = static_cast<std::uint16_t>(h + 1);
    const double mid = (double(f16_to_float(lo)) + double(f16_to_float(hi))) / 2;  // exact in float
    const float mid_f = static_cast<float>(mid);
    REQUIRE(double(mid_f) == mid);
    const std::uint16_t even = (lo & 1) ? hi : lo;
    REQUIRE(float_to_f16(mid_f) == even);
    REQUIRE(float_to_f16(std::nextafter(mid_f, 0.0f)) == lo);
    REQUIRE(float_to_f16(std::nextafter(mid_f, 1e9f)) == hi);
    REQUIRE(float_to_f16(-mid_f) == (even | 0x8000));
    // Just off the midpoint by less than a float ulp: rounding through float would tie.
    REQUIRE(double_to_f16(mid * (1 + std::ldexp(1.0, -40))) == hi);
    REQUIRE(double_to_f16(mid * (1 - std::ldexp(1.0, -40))) == lo);
    REQUIRE(double_to_f16(mid) == even);
  }
  CHECK(double_to_f16(65520.0) == 0x7c00);
  CHECK(double_to_f16(65520.0 - 1e-9) == 0x7bff);
  CHECK(double_to_f16(1e-300) == 0x0000);
  CHECK(double_to_f16(-1e-300) == 0x8000);
  CHECK(double_to_f16(1e300) == 0x7c00);
  CHECK(double_to_f16(std::numeric_limits<double>::infinity()) == 0x7c00);
  CHECK(std::isnan(tessera::io::f16_to_float(double_to_f16(std::nan("")))));
}

TEST_CASE("f16: random floats match a nearest-neighbour reference") {
  using tessera::io::f16_to_float;
  using tessera::io::float_to_f16;
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> exponent(-30.0f, 17.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(exponent(rng));
    std::uint16_t expected;
    if (x >= 65520.0f) {
      expected = 0x7c00;
    } else {
      // Largest half <= x, by bisection over the monotonic positive bit patterns.
      std::uint16_t lo = 0, hi = 0x7bff;
      while (lo < hi) {
        const auto m = static_cast<std::uint16_t>((lo + hi + 1) / 2);
        if (f16_to_float(m) <= x) lo = m; else hi = static_cast<std::uint16_t>(m - 1);
      }
      expected = lo == 0x7bff ? lo
                              : nearest_of(x, lo, f16_to_float(lo), static_cast<std::uint16_t>(lo + 1),
                                           f16_to_float(static_cast<std::uint16_t>(lo + 1)));
    }
    REQUIRE_MESSAGE(float_to_f16(x) == expected, "x = ", x);
  }
}

TEST_CASE("bf16 from double rounds once") {
  using tessera::io::double_to_bf16;
  CHECK(double_to_bf16(1.0).bits == 0x3f80);
  CHECK(double_to_bf16(0.1).bits == 0x3dcd);
  for (std::uint16_t b = 0; b < 0x7f7f; b = static_cast<std::uint16_t>(b + 7)) {
    const double lo = bf16::from_bits_to_float(b);
    const double hi = bf16::from_bits_to_float(static_cast<std::uint16_t>(b + 1));
    const double mid = (lo + hi) / 2;
    const std::uint16_t even = (b & 1) ? static_cast<std::uint16_t>(b + 1) : b;
    REQUIRE(double_to_bf16(mid).bits == even);
    REQUIRE(double_to_bf16(mid * (1 + std::ldexp(1.0, -40))).bits == b + 1);
    REQUIRE(double_to_bf16(mid * (1 - std::ldexp(1.0, -40))).bits == b);
  }
  CHECK(double_to_bf16(1e39).bits == 0x7f80);
  CHECK(double_to_bf16(-1e39).bits == 0xff80);
}

TEST_CASE("dtype names and sizes") {
  using tessera::io::parse_st_dtype;
  for (StDtype t : {StDtype::f32, StDtype::f16, StDtype::bf16, StDtype::f64, StDtype::i32, StDtype::i64}) {
    REQUIRE(parse_st_dtype(tessera::io::name_of(t)) == t);
  }
  CHECK(tessera::io::size_of(StDtype::bf16) == 2);
  CHECK(tessera::io::size_of(StDtype::f16) == 2);
  CHECK(tessera::io::size_of(StDtype::f32) == 4);
  CHECK(tessera::io::size_of(StDtype::i32) == 4);
  CHECK(tessera::io::size_of(StDtype::f64) == 8);
  CHECK(tessera::io::size_of(StDtype::i64) == 8);
  CHECK_FALSE(parse_st_dtype("f32").has_value());
  CHECK_FALSE(parse_st_dtype("U8").has_value());
}

TEST_CASE("round trip: F32 and F64 are exact") {
  TempDir dir;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<float> f(6 * 5);
  std::vector<double> d(4 * 3 * 2);
  for (auto& v : f) v = static_cast<float>(normal(rng));
  for (auto& v : d) v = normal(rng);
  f[0] = std::numeric_limits<float>::infinity();
  f[1] = -0.0f;
  f[2] = std::numeric_limits<float>::denorm_min();
  d[0] = std::numeric_limits<double>::max();
  d[1] = std::numeric_limits<double>::denorm_min();

  SafetensorsWriter w;
  w.add("layers.0.weight", StDtype::f32, {6, 5}, std::span<const float>(f));
  w.add("grad_check", StDtype::f64, {4, 3, 2}, std::span<const double>(d));
  const std::string path = dir.file("exact.safetensors");
  w.write(path);

  const SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.path() == path);
  REQUIRE(file.tensors().size() == 2);
  CHECK(file.tensors()[0].name == "grad_check");  // sorted by name
  CHECK(file.tensors()[1].name == "layers.0.weight");
  CHECK(file.entry("layers.0.weight").dtype == StDtype::f32);
  CHECK(file.entry("layers.0.weight").shape == std::vector<std::int64_t>{6, 5});
  CHECK(file.entry("grad_check").dtype == StDtype::f64);

  const std::vector<float> f2 = file.read_all<float>("layers.0.weight");
  REQUIRE(f2.size() == f.size());
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(bits_of(f2[i]) == bits_of(f[i]));
  std::vector<double> d2(d.size());
  file.read<double>("grad_check", std::span<double>(d2), {4, 3, 2});
  for (std::size_t i = 0; i < d.size(); ++i) REQUIRE(bits_of(d2[i]) == bits_of(d[i]));

  // Conversions on read: F32 widened to double exactly, F64 narrowed to float by rounding.
  const std::vector<double> f_as_d = file.read_all<double>("layers.0.weight");
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(bits_of(f_as_d[i]) == bits_of(double(f[i])));
  const std::vector<float> d_as_f = file.read_all<float>("grad_check");
  for (std::size_t i = 0; i < d.size(); ++i) REQUIRE(bits_of(d_as_f[i]) == bits_of(static_cast<float>(d[i])));
  const std::vector<bf16> f_as_b = file.read_all<bf16>("layers.0.weight");
  for (std::size_t i = 0; i < f.size(); ++i) REQUIRE(f_as_b[i].bits == bf16(f[i]).bits);
}

TEST_CASE("round trip: BF16 and F16 round to nearest even") {
  TempDir dir;
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> values = {1.0f, 0.1f, 65504.0f, 1e-8f, inf, -inf,
                                     std::numeric_limits<float>::quiet_NaN(), -0.0f, 1e-7f, 70000.0f};
  const std::vector<std::uint16_t> bf16_bits = {0x3f80, 0x3dcd, 0x4780, 0x322c, 0x7f80, 0xff80,
                                                0x7fc0, 0x8000, 0x33d7, 0x4789};
  const std::vector<std::uint16_t> f16_bits = {0x3c00, 0x2e66, 0x7bff, 0x0000, 0x7c00, 0xfc00,
                                               0x7e00, 0x8000, 0x0002, 0x7c00};
  SafetensorsWriter w;
  w.add("b", StDtype::bf16, {2, 5}, std::span<const float>(values));
  w.add("h", StDtype::f16, {10}, std::span<const float>(values));
  const std::string path = dir.file("half.safetensors");
  w.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);

  const auto raw_b = file.raw("b");
  const auto raw_h = file.raw("h");
  REQUIRE(raw_b.size() == 20);
  REQUIRE(raw_h.size() == 20);
  for (std::size_t i = 0; i < values.size(); ++i) {
    CAPTURE(i);
    const auto stored_b = static_cast<std::uint16_t>(std::to_integer<unsigned>(raw_b[2 * i]) |
                                                     std::to_integer<unsigned>(raw_b[2 * i + 1]) << 8);
    const auto stored_h = static_cast<std::uint16_t>(std::to_integer<unsigned>(raw_h[2 * i]) |
                                                     std::to_integer<unsigned>(raw_h[2 * i + 1]) << 8);
    CHECK(stored_b == bf16_bits[i]);
    if (std::isnan(values[i])) {
      CHECK((stored_h & 0x7c00) == 0x7c00);
      CHECK((stored_h & 0x3ff) != 0);
    } else {
      CHECK(stored_h == f16_bits[i]);
    }
  }

  const std::vector<float> b = file.read_all<float>("b");
  const std::vector<bf16> b_native = file.read_all<bf16>("b");
  const std::vector<float> h = file.read_all<float>("h");
  const std::vector<double> h_d = file.read_all<double>("h");
  const std::vector<bf16> h_b = file.read_all<bf16>("h");
  for (std::size_t i = 0; i < values.size(); ++i) {
    CAPTURE(i);
    CHECK(b_native[i].bits == bf16_bits[i]);
    if (std::isnan(values[i])) {
      CHECK(std::isnan(b[i]));
      CHECK(std::isnan(h[i]));
      CHECK(std::isnan(h_d[i]));
      CHECK(std::isnan(static_cast<float>(h_b[i])));
      continue;
    }
    CHECK(bits_of(b[i]) == bits_of(tessera::round_to_bf16(values[i])));
    CHECK(bits_of(h[i]) == bits_of(tessera::io::f16_to_float(f16_bits[i])));
    CHECK(h_d[i] == double(h[i]));
    CHECK(h_b[i].bits == bf16(h[i]).bits);
  }
  CHECK(b[1] == 0.10009765625f);
  CHECK(h[1] == 0.0999755859375f);
  CHECK(h[2] == 65504.0f);
  CHECK(b[2] == 65536.0f);

  // Stored from double and from bf16.
  SafetensorsWriter w2;
  const std::vector<double> d = {1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40), 0.1};
  const std::vector<bf16> bv = {bf16(0.1f), bf16(-3.0f)};
  w2.add("from_double_f16", StDtype::f16, {2}, std::span<const double>(d));
  w2.add("from_double_bf16", StDtype::bf16, {2}, std::span<const double>(d));
  w2.add("from_bf16", StDtype::bf16, {2}, std::span<const bf16>(bv));
  w2.add("from_bf16_f32", StDtype::f32, {2}, std::span<const bf16>(bv));
  const std::string path2 = dir.file("from_double.safetensors");
  w2.write(path2);
  const SafetensorsFile file2 = SafetensorsFile::open(path2);
  CHECK(file2.read_all<float>("from_double_f16")[0] == 1.0f + std::ldexp(1.0f, -10));  // one rounding
  CHECK(file2.read_all<bf16>("from_double_bf16")[1].bits == 0x3dcd);
  CHECK(file2.read_all<bf16>("from_bf16")[0].bits == bv[0].bits);
  CHECK(file2.read_all<float>("from_bf16_f32")[1] == -3.0f);
}

TEST_CASE("round trip: I32, I64, scalars and empty tensors") {
  TempDir dir;
  const std::vector<std::int32_t> i32 = {0, -1, 2147483647, -2147483647 - 1};
  const std::vector<std::int64_t> i64 = {std::numeric_limits<std::int64_t>::min(), 5, 1LL << 40};
  const std::vector<float> scalar = {2.5f};
  const std::vector<float> none;
  SafetensorsWriter w;
  w.add("ids", StDtype::i32, {4}, std::span<const std::int32_t>(i32));
  w.add("big", StDtype::i64, {3}, std::span<const std::int64_t>(i64));
  w.add("step", StDtype::f32, {}, std::span<const float>(scalar));
  w.add("empty", StDtype::f32, {0, 3}, std::span<const float>(none));
  const std::string path = dir.file("ints.safetensors");
  w.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  CHECK(file.read_all<std::int32_t>("ids") == i32);
  CHECK(file.read_all<std::int64_t>("big") == i64);
  CHECK(file.read_all<std::int64_t>("ids") == std::vector<std::int64_t>(i32.begin(), i32.end()));
  std::vector<float> s(1);
  file.read<float>("step", std::span<float>(s), {});
  CHECK(s[0] == 2.5f);
  CHECK(file.entry("empty").shape == std::vector<std::int64_t>{0, 3});
  CHECK(file.read_all<float>("empty").empty());

  check_error([&] { (void)file.read_all<std::int32_t>("big"); }, {path, "'big'", "element 0", "int32"});
  check_error([&] { (void)file.read_all<float>("ids"); }, {path, "'ids'", "I32", "float"});
  check_error([&] { (void)file.read_all<std::int64_t>("step"); }, {path, "'step'", "F32", "int64"});
}

TEST_CASE("metadata round trip") {
  TempDir dir;
  const std::vector<float> v = {1.0f};
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("step", "100");
  w.set_metadata("step", "120");  // replaces
  w.set_metadata("note", "température \"quoted\"\n");
  w.add("x", StDtype::f32, {1}, std::span<const float>(v));
  const std::string path = dir.file("meta.safetensors");
  w.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  const std::map<std::string, std::string> expected = {
      {"format", "pt"}, {"note", "température \"quoted\"\n"}, {"step", "120"}};
  CHECK(file.metadata() == expected);
  CHECK_FALSE(file.contains("__metadata__"));
  CHECK(file.tensors().size() == 1);

  SafetensorsWriter bare;
  bare.add("x", StDtype::f32, {1}, std::span<const float>(v));
  CHECK(bare.header().find("__metadata__") == std::string::npos);
}

TEST_CASE("writer: exact bytes, alignment, contiguous layout, order-independent") {
  TempDir dir;
  const std::vector<float> one = {1.0f};
  const std::vector<float> two = {1.0f, 2.0f};

  SafetensorsWriter w;
  w.add("b", StDtype::f32, {2}, std::span<const float>(two));
  w.add("a", StDtype::bf16, {}, std::span<const float>(one));
  const std::string path = dir.file("exact.safetensors");
  w.write(path);
  const std::string json = R"({"a":{"dtype":"BF16","shape":[],"data_offsets":[0,2]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}})";
  std::string header = json;
  header.append((8 - (8 + json.size()) % 8) % 8, ' ');
  const std::string data("\x80\x3f" "\x00\x00\x80\x3f" "\x00\x00\x00\x40", 10);
  CHECK(read_bytes(path) == le64(header.size()) + header + data);
  CHECK(w.header() == header);

  // Alignment of the data start, for header lengths of every residue.
  for (int n = 1; n <= 8; ++n) {
    SafetensorsWriter wn;
    wn.add(std::string(static_cast<std::size_t>(n), 'w'), StDtype::f32, {1}, std::span<const float>(one));
    const std::string p = dir.file("align" + std::to_string(n) + ".safetensors");
    wn.write(p);
    const SafetensorsFile f = SafetensorsFile::open(p);
    CHECK(f.tensors()[0].begin % 8 == 0);
    const std::string bytes = read_bytes(p);
    CHECK(bytes[8] == '{');
    CHECK(bytes.size() == f.tensors()[0].end);  // no trailing bytes
  }

  // Same tensors and metadata added in another order: identical bytes.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::vector<float>> values(5);
  for (auto& v : values) {
    v.resize(12);
    for (auto& x : v) x = u(rng);
  }
  const std::vector<std::string> names = {"tok_embeddings.weight", "layers.0.attention.wq.weight",
                                          "norm.weight", "layers.1.feed_forward.w1.weight", "output.weight"};
  const std::vector<StDtype> dtypes = {StDtype::bf16, StDtype::f32, StDtype::f16, StDtype::f64, StDtype::bf16};
  SafetensorsWriter forward, backward;
  for (std::size_t i = 0; i < 5; ++i) forward.add(names[i], dtypes[i], {3, 4}, std::span<const float>(values[i]));
  for (std::size_t i = 5; i-- > 0;) backward.add(names[i], dtypes[i], {3, 4}, std::span<const float>(values[i]));
  forward.set_metadata("a", "1");
  forward.set_metadata("b", "2");
  backward.set_metadata("b", "2");
  backward.set_metadata("a", "1");
  forward.write(dir.file("forward.safetensors"));
  backward.write(dir.file("backward.safetensors"));
  const std::string fb = read_bytes(dir.file("forward.safetensors"));
  CHECK(fb == read_bytes(dir.file("backward.safetensors")));

  // Tensors lie in name order, back to back from the aligned data start to the end.
  const SafetensorsFile f = SafetensorsFile::open(dir.file("forward.safetensors"));
  std::uint64_t offset = f.tensors()[0].begin;
  CHECK(offset % 8 == 0);
  for (const auto& e : f.tensors()) {
    CHECK(e.begin == offset);
    offset = e.end;
  }
  CHECK(offset == fb.size());
}

TEST_CASE("writer: replaces atomically and creates directories") {
  TempDir dir;
  const std::vector<float> a = {1.0f, 2.0f};
  const std::vector<float> b = {3.0f, 4.0f, 5.0f};
  const std::string path = dir.file("nested/deeper/model.safetensors");
  SafetensorsWriter w1;
  w1.add("x", StDtype::f32, {2}, std::span<const float>(a));
  w1.write(path);
  SafetensorsWriter w2;
  w2.add("x", StDtype::f32, {3}, std::span<const float>(b));
  w2.write(path);
  CHECK(SafetensorsFile::open(path).read_all<float>("x") == b);
  CHECK_FALSE(fs::exists(path + ".tmp"));

  // A target that cannot be replaced: the error names it, and no temporary is left.
  const std::string blocked = dir.file("blocked.safetensors");
  fs::create_directories(fs::path(blocked) / "inside");
  check_error([&] { w1.write(blocked); }, {blocked});
  CHECK_FALSE(fs::exists(blocked + ".tmp"));
}

TEST_CASE("writer: rejects bad tensors") {
  const std::vector<float> six(6, 1.0f);
  const std::vector<std::int64_t> big = {1LL << 40};
  SafetensorsWriter w;
  w.add("w", StDtype::f32, {2, 3}, std::span<const float>(six));
  check_error([&] { w.add("w", StDtype::bf16, {6}, std::span<const float>(six)); }, {"'w'", "twice"});
  check_error([&] { w.add("", StDtype::f32, {6}, std::span<const float>(six)); }, {"empty"});
  check_error([&] { w.add("v", StDtype::f32, {5}, std::span<const float>(six)); },
              {"'v'", "[5]", "5 elements", "6 values"});
  check_error([&] { w.add("v", StDtype::f32, {-2, -3}, std::span<const float>(six)); }, {"'v'", "negative"});
  check_error([&] { w.add("__metadata__", StDtype::f32, {6}, std::span<const float>(six)); }, {"reserved"});
  check_error([&] { w.add("v", StDtype::i32, {6}, std::span<const float>(six)); }, {"'v'", "float", "I32"});
  check_error([&] { w.add("v", StDtype::i32, {1}, std::span<const std::int64_t>(big)); }, {"'v'", "I32"});
  check_error([&] { w.add("v", StDtype::f32, {1}, std::span<const std::int64_t>(big)); }, {"'v'", "F32"});
  check_error([&] { w.add("bad\xff", StDtype::f32, {6}, std::span<const float>(six)); }, {"UTF-8"});
  CHECK(w.size() == 1);
  CHECK(w.contains("w"));
  CHECK_FALSE(w.contains("v"));
}

TEST_CASE("reader: hand-written files in the published layout") {
  TempDir dir;
  // Offsets relative to the data section, a gap between tensors and trailing bytes.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"h":{"dtype":"F16","shape":[1],"data_offsets":[12,14]},)"
      R"("a":{"shape":[2],"dtype":"F32","data_offsets":[0,8],"extra":true}, "e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
  const std::string data("\x00\x00\x80\x3f" "\x00\x00\x00\x40" "\xff\xff\xff\xff" "\x00\x3c" "\xff", 15);
  const std::string path = hand_file(dir, header, data);
  const SafetensorsFile f = SafetensorsFile::open(path);
  CHECK(f.read_all<float>("a") == std::vector<float>{1.0f, 2.0f});
  CHECK(f.read_all<double>("h") == std::vector<double>{1.0});
  CHECK(f.read_all<float>("e").empty());
  CHECK(f.metadata().at("format") == "pt");
  REQUIRE(f.tensors().size() == 3);
  CHECK(f.tensors()[0].name == "a");
  CHECK(f.tensors()[0].begin == 8 + header.size());
  CHECK(f.tensors()[0].end == 8 + header.size() + 8);
  CHECK(f.tensors()[2].name == "h");
  CHECK(f.entry("h").begin == 8 + header.size() + 12);
  CHECK(f.contains("a"));
  CHECK_FALSE(f.contains("b"));

  // An empty header object is a valid file with no tensors.
  const SafetensorsFile empty = SafetensorsFile::open(hand_file(dir, "{}      ", "", "empty.safetensors"));
  CHECK(empty.tensors().empty());
  CHECK(empty.metadata().empty());
}

TEST_CASE("reader: malformed files name the file and the tensor") {
  TempDir dir;
  auto open_bytes = [&](const std::string& name, const std::string& bytes) {
    const std::string path = dir.file(name);
    write_bytes(path, bytes);
    return path;
  };
  auto open_header = [&](const std::string& name, const std::string& header, std::size_t data_bytes = 64) {
    return hand_file(dir, header, std::string(data_bytes, '\0'), name);
  };
  auto open_fails = [](const std::string& path, std::initializer_list<std::string_view> parts) {
    check_error([&] { (void)SafetensorsFile::open(path); }, parts);
    check_error([&] { (void)SafetensorsFile::open(path); }, {path});
  };

  SUBCASE("missing file and directory") {
    open_fails(dir.file("absent.safetensors"), {"cannot open"});
    open_fails(dir.path.string(), {"not a regular file"});
  }
  SUBCASE("truncated before the header length") {
    open_fails(open_bytes("short.safetensors", std::string("\x10\x00\x00", 3)), {"3 bytes", "too short"});
    open_fails(open_bytes("zero.safetensors", ""), {"0 bytes"});
  }
  SUBCASE("header length beyond the file") {
    open_fails(open_bytes("long.safetensors", le64(100) + "{}"), {"header length 100", "past the end", "10 bytes"});
    open_fails(open_bytes("huge.safetensors", le64(1ULL << 40) + "{}"), {"exceeds"});
    open_fails(open_bytes("max.safetensors", le64(~0ULL) + "{}"), {"exceeds"});
  }
  SUBCASE("header not JSON, or not an object") {
    open_fails(open_header("json.safetensors", R"({"w": {"dtype": "F32",)"), {"not valid JSON"});
    open_fails(open_header("utf8.safetensors", "{\"w\xff\": 1}"), {"not valid JSON"});
    open_fails(open_header("empty_header.safetensors", ""), {"not valid JSON"});
    open_fails(open_header("array.safetensors", "[1, 2]"), {"not a JSON object", "array"});
    open_fails(open_header("dup.safetensors",
                           R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})"),
               {"'w'", "twice"});
  }
  SUBCASE("bad metadata") {
    open_fails(open_header("meta1.safetensors", R"({"__metadata__": {"step": 5}})"), {"__metadata__", "'step'", "not a string"});
    open_fails(open_header("meta2.safetensors", R"({"__metadata__": []})"), {"__metadata__", "not a JSON object"});
  }
  SUBCASE("entry missing fields or with wrong JSON types") {
    open_fails(open_header("t1.safetensors", R"({"w": 3})"), {"tensor 'w'", "not a JSON object"});
    open_fails(open_header("t2.safetensors", R"({"w": {"shape": [1], "data_offsets": [0, 4]}})"),
               {"tensor 'w'", "\"dtype\""});
    open_fails(open_header("t3.safetensors", R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})"),
               {"tensor 'w'", "\"shape\""});
    open_fails(open_header("t4.safetensors", R"({"w": {"dtype": "F32", "shape": [1]}})"),
               {"tensor 'w'", "\"data_offsets\""});
    open_fails(open_header("t5.safetensors", R"({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})"),
               {"tensor 'w'", "\"dtype\" is not a string"});
    open_fails(open_header("t6.safetensors", R"({"w": {"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}})"),
               {"tensor 'w'", "\"shape\" is not an array"});
    open_fails(open_header("t7.safetensors", R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})"),
               {"tensor 'w'", "1.5"});
    open_fails(open_header("t8.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}})"),
               {"tensor 'w'", "\"data_offsets\"", "[4]"});
    open_fails(open_header("t9.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})"),
               {"tensor 'w'", "\"data_offsets\""});
    open_fails(open_header("t10.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})"),
               {"tensor 'w'", "\"data_offsets\""});
  }
  SUBCASE("unknown dtype") {
    open_fails(open_header("dtype.safetensors", R"({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}})"),
               {"tensor 'w'", "unsupported dtype 'Q4'"});
  }
  SUBCASE("negative or absurd dimensions") {
    open_fails(open_header("neg.safetensors", R"({"w": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 4]}})"),
               {"tensor 'w'", "negative dimension -3"});
    open_fails(open_header("vast.safetensors",
                           R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})"),
               {"tensor 'w'", "too large"});
    open_fails(open_header("vast2.safetensors",
                           R"({"w": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 0]}})"),
               {"tensor 'w'", "not a dimension"});
  }
  SUBCASE("offsets reversed or out of range") {
    open_fails(open_header("rev.safetensors", R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})"),
               {"tensor 'w'", "[8,4]", "begin after"});
    open_fails(open_header("range.safetensors", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [56, 72]}})"),
               {"tensor 'w'", "[56,72]", "past the end of the data section (64 bytes)"});
    open_fails(open_header("range2.safetensors",
                           R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [18446744073709551615, 18446744073709551615]}})"),
               {"tensor 'w'", "past the end"});
  }
  SUBCASE("byte size not matching the shape") {
    open_fails(open_header("size.safetensors", R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}})"),
               {"tensor 'w'", "24 bytes", "[2, 3]", "BF16", "needs 12"});
  }
  SUBCASE("overlapping tensors") {
    open_fails(open_header("overlap.safetensors",
                           R"({"first": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                           R"( "second": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}})"),
               {"tensor 'first'", "tensor 'second'", "overlap"});
    open_fails(open_header("same.safetensors",
                           R"({"p": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
                           R"( "q": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}})"),
               {"'p'", "'q'", "overlap"});
  }
}

TEST_CASE("reader: missing tensor, shape and size mismatches on read") {
  TempDir dir;
  const std::vector<float> v(6, 0.5f);
  SafetensorsWriter w;
  w.add("layers.3.attention.wk.weight", StDtype::bf16, {2, 3}, std::span<const float>(v));
  const std::string path = dir.file("model.safetensors");
  w.write(path);
  const SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<float> dest(6);
  check_error([&] { (void)f.entry("layers.3.attention.wv.weight"); }, {path, "'layers.3.attention.wv.weight'"});
  check_error([&] { f.read<float>("nope", std::span<float>(dest), {2, 3}); }, {path, "'nope'"});
  check_error([&] { f.read<float>("layers.3.attention.wk.weight", std::span<float>(dest), {3, 2}); },
              {path, "'layers.3.attention.wk.weight'", "[2, 3]", "[3, 2]"});
  check_error([&] { f.read<float>("layers.3.attention.wk.weight", std::span<float>(dest), {6}); },
              {path, "'layers.3.attention.wk.weight'", "[2, 3]", "[6]"});
  std::vector<float> small(5);
  check_error([&] { f.read<float>("layers.3.attention.wk.weight", std::span<float>(small), {2, 3}); },
              {path, "'layers.3.attention.wk.weight'", "5"});
  f.read<float>("layers.3.attention.wk.weight", std::span<float>(dest), {2, 3});
  CHECK(dest == v);
}

TEST_CASE("mapped file") {
  TempDir dir;
  const std::string path = dir.file("bytes.bin");
  write_bytes(path, "hello");
  tessera::io::MappedFile m = tessera::io::MappedFile::open(path);
  REQUIRE(m.size() == 5);
  CHECK(std::memcmp(m.data(), "hello", 5) == 0);
  tessera::io::MappedFile moved = std::move(m);
  CHECK(moved.size() == 5);
  CHECK(m.size() == 0);
  CHECK(moved.path() == path);
  write_bytes(dir.file("empty.bin"), "");
  CHECK(tessera::io::MappedFile::open(dir.file("empty.bin")).size() == 0);
  check_error([&] { (void)tessera::io::MappedFile::open(dir.file("none.bin")); }, {dir.file("none.bin"), "cannot open"});
}

}  // namespace test_safetensors
