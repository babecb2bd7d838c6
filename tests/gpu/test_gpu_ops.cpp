// The ops/ functors run on the GPU give the CPU backend's results. The main exits 77
// (Meson's skip) when no device is present.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <vector>

#include "ops_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/ops/ops.hpp"

using namespace tessera;

namespace {
std::vector<float> ramp(std::size_t n, float scale) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * (static_cast<float>(i % 17) - 8.0f);
  return v;
}
}  // namespace

TEST_CASE("RMSNorm forward on the GPU matches the CPU") {
  const std::int64_t rows = 64, n = 96;
  auto x = ramp(rows * n, 0.1f), w = ramp(n, 0.05f);
  auto gpu = gpu_test::rmsnorm_forward(x, w, rows, 1e-5f);
  std::vector<float> cpu(x.size()), rstd(rows);
  Cpu::for_each(rows, ops::RmsNormForward<float>{x.data(), n, w.data(), cpu.data(), n, rstd.data(), n, 1e-5f});
  for (std::size_t i = 0; i < cpu.size(); ++i) CHECK(gpu[i] == doctest::Approx(cpu[i]).epsilon(1e-5));
}

TEST_CASE("SwiGLU and AdamW on the GPU match the CPU") {
  auto a = ramp(1000, 0.3f), b = ramp(1000, -0.2f);
  auto gpu = gpu_test::swiglu_forward(a, b);
  std::vector<float> cpu(a.size());
  Cpu::for_each(1000, ops::SwiGluForward<float>{a.data(), b.data(), cpu.data()});
  for (std::size_t i = 0; i < cpu.size(); ++i) CHECK(gpu[i] == doctest::Approx(cpu[i]).epsilon(1e-5));
  auto p = ramp(500, 0.01f), g = ramp(500, 0.02f);
  auto gp = gpu_test::adamw_step(p, g, 1e-3f);
  std::vector<float> m(500), v(500);
  Cpu::for_each(500, ops::AdamWStep<float>{p.data(), g.data(), m.data(), v.data(), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                                           0.1f, 0.05f, 1.0f});
  for (std::size_t i = 0; i < p.size(); ++i) CHECK(gp[i] == doctest::Approx(p[i]).epsilon(1e-6));
}

int main(int argc, char** argv) {
  if (gpu_test::device_count() == 0) {
    std::printf("no CUDA device: GPU tests skipped\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
