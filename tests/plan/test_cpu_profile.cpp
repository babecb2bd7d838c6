// The CPU's measured profile (plan/cpu.hpp): which instance of a large call is timed in
// its place, the peak for MFU being the fastest GEMM measured, and float8 GEMMs refused.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/plan/cpu.hpp"

namespace test_cpu_profile {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {
std::int64_t tasks(const trace::Attention& a) {
  return a.shape.batch * (a.backward ? a.shape.n_kv_heads : a.shape.n_heads);
}
}  // namespace

TEST_CASE("cpu profile: a large GEMM is timed on fewer rows and columns, k kept, and scaled by its FLOPs") {
  const trace::Gemm g{8192, 14336, 4096, Trans::no, Trans::yes, DType::f32, DType::f32, false};
  const auto [t, scale] = plan::detail::timed_instance(g);
  CHECK(t.k == g.k);
  CHECK(t.flops() <= plan::detail::kMaxGemmFlops);
  CHECK(t.flops() > plan::detail::kMaxGemmFlops / 4);  // halved no further than needed
  CHECK(scale * t.flops() == doctest::Approx(g.flops()));
  const trace::Gemm small{1024, 256, 256, Trans::no, Trans::yes, DType::f32, DType::f32, false};
  CHECK(plan::detail::timed_instance(small).second == 1.0);
}

TEST_CASE("cpu profile: a large attention call is timed with as many parallel tasks as it keeps the threads busy with") {
  // The debug model at batch 4 x seq 1024: 64 tasks forward (batch x heads), 4.3 GFLOP.
  trace::Attention fwd{AttentionShape{4, 1024, 16, 16, 16}, DType::f32, false};
  auto [t, scale] = plan::detail::timed_instance(fwd, 2);
  CHECK(t.flops() <= plan::detail::kMaxGemmFlops);
  CHECK(tasks(t) >= Cpu::kMinParallel);  // still run in parallel, as the call is
  CHECK(t.shape.seq_len == 1024);         // the sequence (which sets the rate) kept
  CHECK(scale * t.flops() == doctest::Approx(fwd.flops()));
  // Llama 3 8B's backward at seq 8192: 8 tasks (kv heads) are all it has: they stay, and
  // the sequence is shortened instead.
  trace::Attention bwd{AttentionShape{1, 8192, 32, 8, 128}, DType::f32, true};
  const auto [b, bscale] = plan::detail::timed_instance(bwd, 2);
  CHECK(b.shape.n_kv_heads == 8);
  CHECK(b.shape.n_heads == 32);
  CHECK(b.shape.seq_len < 8192);
  CHECK(b.flops() <= plan::detail::kMaxGemmFlops);
  CHECK(bscale * b.flops() == doctest::Approx(bwd.flops()));
  // A call within the limit is timed as it is.
  trace::Attention small{AttentionShape{8, 128, 16, 16, 16}, DType::f32, false};
  CHECK(plan::detail::timed_instance(small, 2).second == 1.0);
}

TEST_CASE("cpu profile: the peak for MFU is the fastest GEMM measured, the step's own shapes among them") {
  trace::Trace tr;
  tr.add(trace::Gemm{256, 256, 256, Trans::no, Trans::yes, DType::f32, DType::f32, false});
  tr.add(trace::Gemm{64, 512, 128, Trans::yes, Trans::no, DType::f32, DType::f32, true});
  tr.add(trace::Gemm{256, 256, 256, Trans::no, Trans::yes, DType::f32, DType::f32, false});  // measured once
  plan::CpuProfile p;
  plan::measure_gemms(tr, 0.005, p);
  REQUIRE(p.gemm_seconds.size() == 2);
  for (const auto& g : tr.all<trace::Gemm>()) {
    const double s = p.gemm_seconds.at(plan::detail::key_of(g));
    CHECK(s > 0);
    CHECK(g.flops() / s <= p.peak_gemm_flops);
  }
}

TEST_CASE("cpu profile: a float8 GEMM, which the CPU backend runs only emulated, is refused rather than priced as free") {
  trace::Trace tr;
  tr.add(trace::Gemm{256, 256, 256, Trans::no, Trans::yes, DType::f8e4m3, DType::bf16, false});
  plan::CpuProfile p;
  CHECK_ERROR_CONTAINS(plan::measure_gemms(tr, 0.005, p),
                       "a float8 GEMM (256x256x256 float8_e4m3fn) has no rate here: the CPU backend runs float8 GEMMs "
                       "emulated (float8.emulate = true)");
  CHECK(p.gemm_seconds.empty());
}

}  // namespace test_cpu_profile
