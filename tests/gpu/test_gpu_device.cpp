// The training step's device-side work against the CPU backend: parameter
// initialisation (bitwise), uploads staged without a synchronisation, the embedding
// kernels (bitwise, repeated ids, a tensor-parallel vocabulary range), the gradient
// norm's sums of squares (bitwise) and the cuBLASLt plan cache (a cached plan gives the
// bits of a fresh one; shapes do not collide).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "backend_launchers.hpp"
#include "device_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/ops/ops.hpp"
#include "tessera/optim/clip.hpp"

namespace test_gpu_device {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using gpu_test::clear_gemm_plans;
using gpu_test::gemm_plans_cached;

namespace {

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// The index of the first element whose bits differ, or -1.
template <class T>
std::int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<std::int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<std::int64_t>(std::min(a.size(), b.size()));
}

template <class T>
std::vector<T> cpu_init_values(std::int64_t n, std::uint64_t key, ops::InitKind kind, double std, double lo,
                               double hi, ops::PieceIndex where) {
  std::vector<T> out(static_cast<std::size_t>(n));
  Cpu::for_each(n, ops::InitValues<T>{out.data(), key, kind, std, lo, hi, where});
  return out;
}

template <class T>
void check_init_bitwise(const char* what, ops::InitKind kind, double std, double lo, double hi,
                        ops::PieceIndex where = {}) {
  CAPTURE(what);
  const std::int64_t n = (std::int64_t{1} << 20) + 3;
  const std::uint64_t key = parameter_key(11, what);
  const std::vector<T> gpu = gpu_test::cuda_init_values<T>(n, key, kind, std, lo, hi, where);
  const std::vector<T> cpu = cpu_init_values<T>(n, key, kind, std, lo, hi, where);
  CAPTURE(first_difference(gpu, cpu));
  CHECK(same_bits(gpu, cpu));
}

/// Values of full mantissa in [-1, 1).
std::vector<float> values(std::int64_t n, std::uint32_t seed) {
  std::vector<float> v(static_cast<std::size_t>(n));
  const Philox4x32 rng(seed);
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t w[4];
    rng.draw(static_cast<std::uint64_t>(i), 1, 0, w);
    v[static_cast<std::size_t>(i)] = static_cast<float>(w[0] >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return v;
}

template <class T>
std::vector<T> as(const std::vector<float>& v) {
  std::vector<T> out;
  for (float x : v) out.push_back(static_cast<T>(x));
  return out;
}

/// Token ids with heavy repetition: every id of a small vocabulary hundreds of times,
/// a few ids once, in no order.
std::vector<std::int32_t> repeated_ids(std::int64_t rows, std::int32_t vocab) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r)
    ids[static_cast<std::size_t>(r)] = static_cast<std::int32_t>(r % 7 == 3 ? (r * 131) % vocab : (r * 7) % 11);
  return ids;
}

template <class T>
void check_embedding(std::int64_t lo, std::int64_t hi) {
  using A = accum_t<T>;
  const std::int64_t rows = 4099, dim = 96;
  const std::int32_t vocab = 64;
  CAPTURE(lo);
  CAPTURE(hi);
  const std::vector<std::int32_t> ids = repeated_ids(rows, vocab);
  const std::vector<T> table = as<T>(values((hi - lo) * dim, 1));
  const std::vector<T> dout = as<T>(values(rows * dim, 2));
  const std::vector<A> dtable0 = as<A>(values((hi - lo) * dim, 3));

  std::vector<T> cpu_out(static_cast<std::size_t>(rows * dim));
  Cpu::for_each(rows * dim, ops::EmbeddingForward<T>{ids.data(), table.data(), cpu_out.data(), dim, lo, hi});
  const std::vector<T> gpu_out = gpu_test::cuda_embedding_forward<T>(ids, table, dim, lo, hi);
  CAPTURE(first_difference(gpu_out, cpu_out));
  CHECK(same_bits(gpu_out, cpu_out));

  std::vector<A> cpu_grad = dtable0;
  const ops::EmbeddingSegments seg = ops::embedding_segments(ids, lo, hi);
  const std::int32_t* base = seg.packed.data();
  Cpu::for_each(seg.count * dim, ops::EmbeddingBackward<T>{seg.ids(base), seg.offsets(base), seg.order(base),
                                                           dout.data(), cpu_grad.data(), dim, lo, seg.positions});
  // The CPU's result is the sequential scatter-add over the positions (tests/ops), so the
  // GPU's equal bits are that sum too.
  const std::vector<A> gpu_grad = gpu_test::cuda_embedding_backward<T>(ids, dout, dtable0, dim, lo, hi);
  CAPTURE(first_difference(gpu_grad, cpu_grad));
  CHECK(same_bits(gpu_grad, cpu_grad));
  CHECK(!same_bits(cpu_grad, dtable0));  // something was added
}

Tensor<float> matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  Tensor<float> t(Shape{rows, cols});
  const std::vector<float> v = values(rows * cols, seed);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = v[static_cast<std::size_t>(i)];
  return t;
}

struct GemmCase {
  Trans ta, tb;
  std::int64_t m, n, k;
};

/// The GEMM on the GPU (through the plan cache) and on the CPU.
std::pair<Tensor<float>, Tensor<float>> run_case(const GemmCase& g) {
  const Tensor<float> a = g.ta == Trans::no ? matrix(g.m, g.k, 5) : matrix(g.k, g.m, 5);
  const Tensor<float> b = g.tb == Trans::no ? matrix(g.k, g.n, 6) : matrix(g.n, g.k, 6);
  const Tensor<float> c = matrix(g.m, g.n, 7);
  const Tensor<float> gpu =
      gpu_test::cuda_gemm<float>(g.ta, g.tb, 0.5f, a, a.cview(), b, b.cview(), 1.0f, c, c.view());
  Tensor<float> cpu = c.clone();
  Cpu::gemm(g.ta, g.tb, 0.5f, a.cview(), b.cview(), 1.0f, cpu.view());
  return {gpu, cpu};
}

bool same_bits(const Tensor<float>& a, const Tensor<float>& b) {
  return a.numel() == b.numel() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

double worst_relative(const Tensor<float>& a, const Tensor<float>& b) {
  double worst = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = a[i], y = b[i];
    worst = std::max(worst, std::abs(x - y) / std::max(1.0, std::abs(y)));
  }
  return worst;
}

}  // namespace

TEST_CASE("Parameter initialisation on the GPU gives the CPU backend's values bit for bit") {
  check_init_bitwise<float>("normal", ops::InitKind::normal, 1.0, -2, 2);
  check_init_bitwise<float>("normal, small std", ops::InitKind::normal, 0.02, -2, 2);
  check_init_bitwise<double>("normal in double", ops::InitKind::normal, 1.0, -2, 2);
  check_init_bitwise<bf16>("normal in bf16", ops::InitKind::normal, 0.02, -2, 2);
  check_init_bitwise<float>("trunc_normal, torchtitan's", ops::InitKind::truncated_normal, 0.02, -2, 2);
  // Bounds of +-0.3 std: about 3 draws in 4 are rejected, so most elements redraw.
  check_init_bitwise<double>("trunc_normal, narrow", ops::InitKind::truncated_normal, 1.0, -0.3, 0.3);
  check_init_bitwise<bf16>("trunc_normal in bf16", ops::InitKind::truncated_normal, 0.05, -0.15, 0.15);
  check_init_bitwise<float>("uniform, a LoRA adapter's A", ops::InitKind::uniform, 0.0, -0.0625, 0.0625);
  check_init_bitwise<bf16>("uniform in bf16", ops::InitKind::uniform, 0.0, -0.25, 0.25);
  check_init_bitwise<float>("a piece at an offset", ops::InitKind::normal, 1.0, -2, 2,
                            ops::PieceIndex{(std::uint64_t{1} << 32) + 5});
  // A column piece (a row-parallel weight's) from the middle of a shard: the index map's
  // division and remainder on the device.
  check_init_bitwise<float>("a column piece", ops::InitKind::normal, 0.02, -2, 2, ops::PieceIndex{777, 14336, 1792, 0, 5376});
  check_init_bitwise<float>("ones", ops::InitKind::ones, 0, 0, 0);
  check_init_bitwise<bf16>("zeros", ops::InitKind::zeros, 0, 0, 0);
}

TEST_CASE("Uploads: back to back without a synchronisation, the source reusable at once, every value right") {
  CHECK(gpu_test::upload_returns_before_the_device_is_done());
  // More uploads than the staging ring has slots, while the device is busy: the ring
  // wraps and each slot waits for its previous copy.
  for (const auto& [count, elements] : {std::pair<int, std::int64_t>{64, 1000}, {40, 1}, {6, 600'000}}) {
    CAPTURE(count);
    CAPTURE(elements);
    const auto got = gpu_test::cuda_back_to_back_uploads(count, elements);
    REQUIRE(got.size() == static_cast<std::size_t>(count));
    for (int u = 0; u < count; ++u) {
      CAPTURE(u);
      const auto& v = got[static_cast<std::size_t>(u)];
      REQUIRE(v.size() == static_cast<std::size_t>(elements));
      bool right = true;
      for (std::int64_t i = 0; i < elements; ++i)
        right = right && v[static_cast<std::size_t>(i)] == static_cast<std::int32_t>(u * 1000003 + i);
      CHECK(right);
    }
  }
}

TEST_CASE("Embedding kernels: the CPU backend's bits, repeated ids, whole and tensor-parallel vocabulary ranges") {
  check_embedding<float>(0, 64);
  check_embedding<float>(16, 32);  // one of 4 tensor-parallel ranks
  check_embedding<bf16>(0, 64);
  check_embedding<bf16>(48, 64);
}

template <class T>
void check_squared_norms() {
  // Full-mantissa values of mixed sizes, so that the order of the additions shows in the
  // bits; pieces of awkward lengths at awkward offsets, one over several chunks.
  const std::int64_t total = 3 * ops::kNormChunk + 1000;
  std::vector<T> data(static_cast<std::size_t>(total));
  std::uint64_t r = 0x9e3779b97f4a7c15ull;
  for (auto& v : data) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    v = T(std::ldexp(float(r >> 40) / float(1 << 24) - 0.5f, int(r >> 36 & 15) - 8));
  }
  const std::vector<std::pair<std::int64_t, std::int64_t>> pieces = {
      {0, 1}, {1, 255}, {256, 257}, {513, 2 * ops::kNormChunk + 77}, {2 * ops::kNormChunk + 590, ops::kNormChunk + 3}};
  optim::SquaredNorms<Cpu, T> cpu;
  for (const auto& [offset, n] : pieces) cpu.add(data.data() + offset, n);
  const double want = cpu.sum();
  const std::vector<double> gpu = gpu_test::cuda_squared_norms(data, pieces);
  REQUIRE(gpu.size() == 2);
  CAPTURE(want);
  CHECK(gpu[0] == want);
  CHECK(gpu[1] == want);
}

TEST_CASE("Gradient norm: the GPU's sums of squares are the CPU backend's bit for bit") {
  check_squared_norms<float>();
  check_squared_norms<bf16>();
}

TEST_CASE("GEMM plans: cached and fresh plans give the same bits, different shapes do not collide") {
  const GemmCase a{Trans::no, Trans::no, 64, 48, 32};
  const GemmCase b{Trans::no, Trans::yes, 48, 64, 32};  // a's sizes swapped and transposed
  const GemmCase c{Trans::yes, Trans::no, 64, 48, 33};  // another k
  clear_gemm_plans();
  CHECK(gemm_plans_cached() == 0);
  const auto [a1, a_cpu] = run_case(a);
  CHECK(gemm_plans_cached() == 1);
  const auto [a2, a_cpu2] = run_case(a);  // from the cache
  CHECK(gemm_plans_cached() == 1);
  CHECK(same_bits(a1, a2));
  const auto [b1, b_cpu] = run_case(b);
  const auto [c1, c_cpu] = run_case(c);
  CHECK(gemm_plans_cached() == 3);
  CHECK(worst_relative(a1, a_cpu) < 1e-5);
  CHECK(worst_relative(b1, b_cpu) < 1e-5);
  CHECK(worst_relative(c1, c_cpu) < 1e-5);
  const auto [a3, a_cpu3] = run_case(a);  // after the others: its own plan
  CHECK(same_bits(a1, a3));
  clear_gemm_plans();
  const auto [a4, a_cpu4] = run_case(a);  // a fresh plan: descriptors and heuristic again
  CHECK(same_bits(a1, a4));
  CHECK(gemm_plans_cached() == 1);
}

}  // namespace test_gpu_device
