// The GEMMs a traced step issues (plan/step_gemms.hpp), which bench-kernels times: one
// entry per distinct GEMM in the order of its first issue, counted, with its region and
// what it computes for a linear layer; and on a real step, the shapes the model runs.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/region.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/step_gemms.hpp"
#include "tessera/train/config.hpp"

namespace test_plan_step_gemms {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using plan::StepGemm;

namespace {
trace::Gemm gemm(std::int64_t m, std::int64_t n, std::int64_t k, Trans ta, Trans tb, bool accumulate,
                 DType operands = DType::bf16, DType result = DType::bf16) {
  return trace::Gemm{m, n, k, ta, tb, operands, result, accumulate};
}

/// The entry of `gemms` equal to `g`, or nullptr.
const StepGemm* find(const std::vector<StepGemm>& gemms, const trace::Gemm& g) {
  for (const StepGemm& s : gemms)
    if (s.gemm == g) return &s;
  return nullptr;
}
}  // namespace

TEST_CASE("step_gemms: each distinct GEMM once, in the order of its first issue, counted, with its first region") {
  trace::Trace t;
  const trace::Gemm fwd = gemm(64, 96, 32, Trans::no, Trans::yes, false);
  const trace::Gemm fwd_residual = gemm(64, 32, 96, Trans::no, Trans::yes, true);
  const trace::Gemm head = gemm(16, 1000, 32, Trans::no, Trans::yes, false, DType::bf16, DType::f32);
  const trace::Gemm dx = gemm(64, 32, 96, Trans::no, Trans::no, false);
  const trace::Gemm dw_first = gemm(96, 32, 64, Trans::yes, Trans::no, false, DType::bf16, DType::f32);
  const trace::Gemm dw_sum = gemm(96, 32, 64, Trans::yes, Trans::no, true, DType::bf16, DType::f32);
  t.add(fwd);
  t.add(trace::Fill{128});
  t.add(fwd_residual);
  t.add(fwd);
  {
    Region r(region::kLossHead);
    t.add(head);
    t.add(head);
  }
  t.add(dx);
  t.add(dw_first);
  t.add(dw_sum);
  t.add(dw_sum);
  t.add(dx);

  const std::vector<StepGemm> g = plan::step_gemms(t);
  REQUIRE(g.size() == 6);
  CHECK(g[0].gemm == fwd);
  CHECK(g[0].count == 2);
  CHECK(g[0].region.empty());
  CHECK(g[0].pass() == "y = x W^T");
  CHECK(g[1].gemm == fwd_residual);
  CHECK(g[1].count == 1);
  CHECK(g[1].pass() == "y = x W^T + C");
  CHECK(g[2].gemm == head);
  CHECK(g[2].count == 2);
  CHECK(g[2].region == region::kLossHead);
  CHECK(g[3].gemm == dx);
  CHECK(g[3].count == 2);
  CHECK(g[3].pass() == "dx = dy W");
  // A first write and a sum into the same gradient are two GEMMs: beta 0 reads no C.
  CHECK(g[4].gemm == dw_first);
  CHECK(g[4].pass() == "dW = dy^T x");
  CHECK(g[5].gemm == dw_sum);
  CHECK(g[5].count == 2);
  CHECK(g[5].pass() == "dW += dy^T x");

  // A float8 GEMM is always nt: a gradient's e5m2 first operand tells the backward's.
  CHECK(StepGemm{gemm(64, 96, 32, Trans::no, Trans::yes, false, DType::f8e4m3), 1, ""}.pass() == "y = x W^T");
  CHECK(StepGemm{gemm(64, 96, 32, Trans::no, Trans::yes, true, DType::f8e5m2), 1, ""}.pass() ==
        "dx or dW += (e5m2 dy)");
  CHECK(plan::step_gemms(trace::Trace{}).empty());
}

TEST_CASE("step_gemms of Llama 3.2 1B's bf16 step: the fused projections, the first writes, the residuals, the head") {
  const train::JobConfig c = train::parse_config(R"(
    [model]
    flavor = "llama3.2_1b"
    [training]
    local_batch_size = 1
    seq_len = 8192
    mixed_precision_param = "bfloat16"
    [activation_checkpoint]
    mode = "none"
  )",
                                                 "test_step_gemms");
  constexpr std::size_t kH200 = std::size_t{143771} << 20;  // nvidia-smi's 143771 MiB
  const plan::StepTrace st = plan::dry_run_step<bf16>(c, kH200);
  const std::vector<StepGemm> g = plan::step_gemms(st.trace);

  // Every GEMM of the step is counted once, under one entry.
  std::int64_t counted = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    counted += g[i].count;
    for (std::size_t j = 0; j < i; ++j) CHECK_FALSE(g[i].gemm == g[j].gemm);
  }
  CHECK(counted == static_cast<std::int64_t>(st.trace.all<trace::Gemm>().size()));

  const std::int64_t t = 8192, d = 2048, qkv = 2048 + 2 * 512, f = 8192, v = 128256;
  const auto bf = DType::bf16, f32 = DType::f32;
  // wq, wk and wv as one GEMM each way, w1 and w3 too (model.fuse_projections), 16 blocks.
  const StepGemm* s = find(g, gemm(t, qkv, d, Trans::no, Trans::yes, false));
  REQUIRE(s != nullptr);
  CHECK(s->count == 16);
  CHECK(s->region.empty());
  s = find(g, gemm(t, 2 * f, d, Trans::no, Trans::yes, false));
  REQUIRE(s != nullptr);
  CHECK(s->count == 16);
  // wo and w2 take the residual as C: read, so beta 1.
  s = find(g, gemm(t, d, d, Trans::no, Trans::yes, true));
  REQUIRE(s != nullptr);
  CHECK(s->pass() == "y = x W^T + C");
  CHECK(find(g, gemm(t, d, f, Trans::no, Trans::yes, true)) != nullptr);
  // The weights' gradients are written first (beta 0), in fp32.
  s = find(g, gemm(2 * f, d, t, Trans::yes, Trans::no, false, bf, f32));
  REQUIRE(s != nullptr);
  CHECK(s->count == 16);
  CHECK(find(g, gemm(2 * f, d, t, Trans::yes, Trans::no, true, bf, f32)) == nullptr);
  // No separate wk or wv GEMM is left.
  CHECK(find(g, gemm(t, 512, d, Trans::no, Trans::yes, false)) == nullptr);
  // The loss head's chunks: fp32 logits, the first chunk's dW written and the others summed.
  bool logits = false, head_first = false, head_sum = false;
  for (const StepGemm& e : g) {
    if (e.region != region::kLossHead) continue;
    logits = logits || (e.gemm.n == v && e.gemm.k == d && e.gemm.result == f32 && e.gemm.tb == Trans::yes);
    if (e.gemm.m == v && e.gemm.ta == Trans::yes) (e.gemm.accumulate ? head_sum : head_first) = true;
  }
  CHECK(logits);
  CHECK(head_first);
  CHECK(head_sum);
}

}  // namespace test_plan_step_gemms
