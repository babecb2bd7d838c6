// The cost model's arithmetic (plan/cost.hpp) and the machine profiles (plan/machine.hpp):
// each class of operation priced as the model says, on a profile made for the test; every
// built-in profile loads; a profile with a figure missing, not positive or without a
// source is refused, naming the file and the key; float8 GEMMs priced at the profile's
// float8 rates, and refused by name on a profile without them.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "../support/errors.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/machine.hpp"

#ifndef TESSERA_MACHINES
#error "TESSERA_MACHINES must name the examples/machines folder (tests/plan/meson.build defines it)"
#endif

namespace test_cost {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

/// A profile with round numbers: 100 TFLOP/s bf16, 10 fp32, 1 TB/s at 0.5 reached, 100
/// SMs at 1 GHz with 128 shared bytes per clock, launches of 2 us, syncs of 10 us.
const char* kProfile = R"(
[machine]
name = "test-gpu"
description = "a GPU with round numbers"
device = "cuda"
[memory.capacity_bytes]
value = 1e10
source = "test"
[memory.reserved_bytes]
value = 1e9
source = "test"
[compute.bf16_tflops]
value = 100
source = "test"
[compute.fp32_tflops]
value = 25.6
source = "test: 100 SMs x 128 lanes x 2 x 1 GHz"
[compute.sm_count]
value = 100
source = "test"
[compute.boost_clock_ghz]
value = 1.0
source = "test"
[compute.shared_memory_bytes_per_clock_per_sm]
value = 128
source = "test"
[gemm.bf16_efficiency]
points = [[1.0, 0.1], [100.0, 0.5]]
source = "test"
[gemm.fp32_efficiency]
points = [[1.0, 0.5]]
source = "test"
[hbm.bandwidth_gbs]
value = 1000
source = "test"
[hbm.achieved_fraction]
value = 0.5
source = "test"
[host.launch_us]
value = 2
source = "test"
[host.sync_us]
value = 10
source = "test"
[host.link_gbs]
value = 10
source = "test"
)";

plan::GpuPricer pricer() { return plan::GpuPricer(plan::parse_machine(kProfile, "test.toml")); }

std::string read(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// kProfile with `from` replaced by `to` (which must occur).
std::string edited(const std::string& from, const std::string& to) {
  std::string s = kProfile;
  const auto at = s.find(from);
  REQUIRE(at != std::string::npos);
  return s.replace(at, from.size(), to);
}

}  // namespace

TEST_CASE("cost: a GEMM takes its FLOPs at the curve's efficiency, or its bytes at the bandwidth, or a launch") {
  const plan::GpuPricer p = pricer();
  // 2 x 4096^3 = 137 GFLOP, past the curve's last point: 50% of 100 TFLOP/s.
  const trace::Gemm big{4096, 4096, 4096, Trans::no, Trans::no, DType::bf16, DType::bf16, false};
  CHECK(p.seconds(big) == doctest::Approx(big.flops() / 50e12).epsilon(1e-12));
  // 10 GFLOP: halfway in log between 1 and 100, so 30%.
  const trace::Gemm mid{1000, 1000, 5000, Trans::no, Trans::yes, DType::bf16, DType::bf16, false};
  CHECK(p.seconds(mid) == doctest::Approx(mid.flops() / 30e12).epsilon(1e-9));
  // A thin GEMM is bound by its bytes: 32 rows against a 8192 x 32768 matrix.
  const trace::Gemm thin{32, 32768, 8192, Trans::no, Trans::yes, DType::bf16, DType::f32, true};
  const double bytes = (32.0 * 8192 + 8192.0 * 32768) * 2 + 32.0 * 32768 * 4 * 2;
  CHECK(plan::gemm_bytes(thin) == bytes);
  CHECK(p.seconds(thin) == doctest::Approx(bytes / 0.5e12).epsilon(1e-12));
  // fp32 operands run on the CUDA cores at their own curve.
  const trace::Gemm f32{1024, 1024, 1024, Trans::no, Trans::no, DType::f32, DType::f32, false};
  CHECK(p.seconds(f32) == doctest::Approx(f32.flops() / (25.6e12 * 0.5)).epsilon(1e-12));
  // Nothing runs in less than a launch.
  const trace::Gemm tiny{2, 2, 2, Trans::no, Trans::no, DType::bf16, DType::bf16, false};
  CHECK(p.seconds(tiny) == doctest::Approx(2e-6));
}

TEST_CASE("cost: a host loop (CPU offload) takes its bytes at host.memory_gbs, no launch; without the rate it is refused") {
  trace::Kernel k;
  k.functor = "AdamWMultiStep<float, float>";
  k.n = 1000;
  k.traffic = {4e9, 2e9, 0, 0};
  k.on_host = true;
  const plan::GpuPricer with_host(plan::parse_machine(std::string(kProfile) + "[host.memory_gbs]\nvalue = 50\nsource = \"test\"\n", "host.toml"));
  CHECK(with_host.seconds(k) == doctest::Approx(6e9 / 50e9).epsilon(1e-12));
  k.traffic = {8, 8, 0, 0};
  CHECK(with_host.seconds(k) == doctest::Approx(16 / 50e9).epsilon(1e-12));  // under a launch: no launch
  CHECK_THROWS_WITH_AS(pricer().seconds(k), doctest::Contains("host.memory_gbs is missing"), Error);
}

namespace {
/// Float8 rates for the test profile: 200 TFLOP/s, 5% of it at 1 GFLOP up to 40% at 100.
const char* kFloat8Rates = R"(
[compute.fp8_tflops]
value = 200
source = "test"
[gemm.fp8_efficiency]
points = [[1.0, 0.05], [100.0, 0.4]]
source = "test"
)";
plan::Machine with_float8() { return plan::parse_machine(std::string(kProfile) + kFloat8Rates, "fp8.toml"); }

/// A float8 GEMM as a trace records one (backend/traced.hpp): "TN", cuBLASLt's layout.
trace::Gemm float8_gemm(std::int64_t m, std::int64_t n, std::int64_t k, DType operands = DType::f8e4m3,
                        DType result = DType::bf16, bool accumulate = false) {
  return trace::Gemm{m, n, k, Trans::no, Trans::yes, operands, result, accumulate};
}
}  // namespace

TEST_CASE("cost: a float8 GEMM takes its FLOPs at the profile's float8 peak and curve, or its one-byte operands' bytes") {
  const plan::GpuPricer p(with_float8());
  // 2 x 4096^3 = 137 GFLOP, past the curve's last point: 40% of 200 TFLOP/s = 80, where
  // the bf16 GEMM of the same shape runs at 50% of 100.
  const trace::Gemm big = float8_gemm(4096, 4096, 4096);
  CHECK(p.seconds(big) == doctest::Approx(big.flops() / 80e12).epsilon(1e-12));
  trace::Gemm same_in_bf16 = big;
  same_in_bf16.operands = DType::bf16;
  CHECK(p.seconds(same_in_bf16) == doctest::Approx(big.flops() / 50e12).epsilon(1e-12));
  CHECK(p.seconds(big) < p.seconds(same_in_bf16));
  // 10 GFLOP: halfway in log between 1 and 100, so 22.5% of 200; e5m2 operands (a
  // gradient's) at the same rate; a float32 result accumulated changes only the bytes.
  const trace::Gemm mid = float8_gemm(1000, 1000, 5000, DType::f8e5m2, DType::f32, true);
  CHECK(p.seconds(mid) == doctest::Approx(mid.flops() / 45e12).epsilon(1e-9));
  // A thin float8 GEMM is bound by its bytes, its operands one byte an element: half the
  // operand bytes of the bf16 one.
  const trace::Gemm thin = float8_gemm(32, 32768, 8192, DType::f8e4m3, DType::f32, true);
  const double bytes = (32.0 * 8192 + 8192.0 * 32768) * 1 + 32.0 * 32768 * 4 * 2;
  CHECK(plan::gemm_bytes(thin) == bytes);
  CHECK(p.seconds(thin) == doctest::Approx(bytes / 0.5e12).epsilon(1e-12));
  trace::Gemm thin_bf16 = thin;
  thin_bf16.operands = DType::bf16;
  CHECK(p.seconds(thin) < p.seconds(thin_bf16));
  // Nothing runs in less than a launch.
  CHECK(p.seconds(float8_gemm(16, 16, 16)) == doctest::Approx(2e-6));
}

TEST_CASE("cost: a step's float8 GEMMs on a built-in profile: the profile's float8 rate, under bf16's, MFU against bf16") {
  const std::filesystem::path file = std::filesystem::path(TESSERA_MACHINES) / "h100-sxm.toml";
  const plan::Machine m = plan::load_machine(file);
  REQUIRE(m.has_float8());
  const plan::GpuPricer p(m);
  // Llama 3 8B's feed-forward at 8192 tokens, in float8 and in bf16.
  const trace::Gemm f8 = float8_gemm(8192, 14336, 4096);
  trace::Gemm bf = f8;
  bf.operands = DType::bf16;
  trace::Trace t;
  t.add(f8);
  plan::StepShape shape;
  shape.args = nn::model_flavor("debugmodel");
  shape.tokens = 8192;
  shape.seq_len = 8192;
  shape.dtype = DType::bf16;  // a float8 run's model is bf16
  const plan::Prediction pr = plan::predict(t, p, shape, 1'000'000, MemoryBreakdown{});
  const double gflop = f8.flops() / 1e9;
  const double expected = std::max(f8.flops() / (m.fp8_tflops->value * 1e12 * m.gemm_fp8->at(gflop)),
                                   plan::gemm_bytes(f8) / m.stream_bandwidth());
  CHECK(pr.step_seconds == doctest::Approx(expected).epsilon(1e-12));
  CHECK(pr.step_seconds == doctest::Approx(f8.flops() / (m.fp8_tflops->value * 1e12 * m.gemm_fp8->at(gflop))));
  CHECK(pr.step_seconds < p.seconds(bf));
  CHECK(pr.float8_gemms == 1);
  // The costliest list names the float8 dtype.
  REQUIRE(pr.top.size() == 1);
  CHECK(pr.top.front().what == "gemm 8192x14336x4096 float8_e4m3fn->bfloat16 (nt)");
  // MFU stays against the bf16 peak, not the float8 one.
  CHECK(pr.peak_flops == doctest::Approx(m.bf16_tflops.value * 1e12));
  CHECK(pr.mfu_pct == doctest::Approx(100 * pr.tokens_per_sec * shape.args.flops_per_token(8192) / (m.bf16_tflops.value * 1e12)));
}

TEST_CASE("cost: a float8 GEMM on a profile without float8 rates is refused, naming the profile and the key") {
  const plan::GpuPricer bare = pricer();  // test.toml: no compute.fp8_tflops
  CHECK_ERROR_CONTAINS(bare.seconds(float8_gemm(4096, 4096, 4096)),
                       "test.toml: machine profile: compute.fp8_tflops is missing, so a float8 GEMM (4096x4096x4096 "
                       "float8_e4m3fn) cannot be priced on test-gpu");
  CHECK_ERROR_CONTAINS(bare.require_float8("float8 layouts"), "test.toml: machine profile: compute.fp8_tflops is missing, "
                       "so float8 layouts cannot be priced");
  // The A100's profile has no float8 tensor cores to price: a step with a float8 GEMM
  // is refused, never priced at another dtype's rate.
  const std::filesystem::path file = std::filesystem::path(TESSERA_MACHINES) / "a100-80gb-sxm.toml";
  const plan::GpuPricer a100(plan::load_machine(file));
  trace::Trace t;
  t.add(trace::Gemm{4096, 4096, 4096, Trans::no, Trans::no, DType::bf16, DType::bf16, false});
  t.add(float8_gemm(4096, 4096, 4096, DType::f8e5m2));
  plan::StepShape shape;
  shape.args = nn::model_flavor("debugmodel");
  shape.tokens = shape.seq_len = 1024;
  shape.dtype = DType::bf16;
  CHECK_ERROR_CONTAINS(plan::predict(t, a100, shape, 1, MemoryBreakdown{}),
                       file.string() + ": machine profile: compute.fp8_tflops is missing, so a float8 GEMM (4096x4096x4096 "
                       "float8_e5m2) cannot be priced on a100-80gb-sxm");
  // A machine without float8 GEMMs at all (a pricer that does not say otherwise) refuses too.
  struct NoFloat8 final : plan::Pricer {
    double seconds(const trace::Op&) const override { return 0; }
    double peak_flops(DType) const override { return 1; }
    double usable_bytes() const override { return 1; }
    std::string name() const override { return "plain"; }
  } plain;
  CHECK_ERROR_CONTAINS(plain.require_float8("float8 layouts"),
                       "plain: float8 layouts cannot be priced: this machine has no float8 GEMM rate");
}

TEST_CASE("cost: the portable flash kernel runs at the shared-memory bound, a quarter of the fp32 rate") {
  const plan::GpuPricer p = pricer();
  CHECK(p.flash_efficiency() == doctest::Approx(0.25));  // 128 B/clk / 4 B = 32 loads against 128 lanes
  trace::Attention fwd{{1, 1024, 8, 2, 64}, DType::bf16, false};
  const double pairs = 8.0 * 1024 * 1025 / 2;
  CHECK(plan::flash_kernel_fmas(fwd) == pairs * 64 * 2);
  CHECK(p.seconds(fwd) == doctest::Approx(2 * pairs * 64 * 2 / (25.6e12 * 0.25)).epsilon(1e-12));
  trace::Attention bwd = fwd;
  bwd.backward = true;
  CHECK(plan::flash_kernel_fmas(bwd) == pairs * 64 * 7);
  // The causal FLOPs the formula counts: q k^T and p v over the pairs, 2.5 times that backward.
  CHECK(fwd.flops() == 4 * pairs * 64);
  CHECK(bwd.flops() == 2.5 * fwd.flops());
  // Full attention (no mask) computes every pair.
  trace::Attention full = fwd;
  full.shape.causal = false;
  CHECK(plan::flash_kernel_fmas(full) == 8.0 * 1024 * 1024 * 64 * 2);
  CHECK(full.flops() == 4 * 8.0 * 1024 * 1024 * 64);
  CHECK(p.seconds(full) == doctest::Approx(2 * 8.0 * 1024 * 1024 * 64 * 2 / (25.6e12 * 0.25)).epsilon(1e-12));
}

namespace {
/// cuDNN rates for the test profile: head dims 64 and 128, 100 and 200 TFLOP/s forward at
/// 1k and 4k, backward at 80% of that.
const char* kCudnnRates = R"(
[attention.cudnn_bf16_hd64_forward]
points = [[1024, 100], [4096, 200]]
source = "test"
[attention.cudnn_bf16_hd64_backward]
points = [[1024, 80], [4096, 160]]
source = "test"
[attention.cudnn_bf16_hd128_forward]
points = [[1024, 50]]
source = "test"
[attention.cudnn_bf16_hd128_backward]
points = [[1024, 40]]
source = "test"
)";
plan::Machine with_cudnn() { return plan::parse_machine(std::string(kProfile) + kCudnnRates, "test.toml"); }
}  // namespace

TEST_CASE("cost: cuDNN's attention takes its FLOPs at the profile's rate for its head dim, direction and length") {
  const plan::GpuPricer p(with_cudnn(), plan::AttentionKernel::cudnn);
  trace::Attention fwd{{1, 1024, 8, 2, 64}, DType::bf16, false};
  CHECK(p.seconds(fwd) == doctest::Approx(fwd.flops() / 100e12).epsilon(1e-12));
  trace::Attention bwd = fwd;
  bwd.backward = true;
  CHECK(p.seconds(bwd) == doctest::Approx(bwd.flops() / 80e12).epsilon(1e-12));
  // 2048 is halfway in log between 1k and 4k: 150 TFLOP/s; past the last point, flat.
  trace::Attention mid{{1, 2048, 8, 2, 64}, DType::bf16, false};
  CHECK(p.seconds(mid) == doctest::Approx(mid.flops() / 150e12).epsilon(1e-9));
  trace::Attention longer{{1, 16384, 8, 2, 64}, DType::bf16, false};
  CHECK(p.seconds(longer) == doctest::Approx(longer.flops() / 200e12).epsilon(1e-12));
  // A full block (context parallelism's, off the diagonal) takes its own FLOPs, all T^2
  // pairs, at the causal curve's rate for the same length.
  trace::Attention full = fwd;
  full.shape.causal = false;
  CHECK(full.flops() == doctest::Approx(2 * fwd.flops() * 1024 / 1025).epsilon(1e-12));
  CHECK(p.seconds(full) == doctest::Approx(full.flops() / 100e12).epsilon(1e-12));
  full.backward = true;
  CHECK(p.seconds(full) == doctest::Approx(full.flops() / 80e12).epsilon(1e-12));
  // Head dims take the smallest curve at or above them (96 -> 128), else the largest.
  trace::Attention hd96{{1, 1024, 8, 2, 96}, DType::bf16, false}, hd256{{1, 1024, 8, 2, 256}, DType::bf16, false};
  CHECK(p.seconds(hd96) == doctest::Approx(hd96.flops() / 50e12).epsilon(1e-12));
  CHECK(p.seconds(hd256) == doctest::Approx(hd256.flops() / 50e12).epsilon(1e-12));
  // A float32 call runs tessera's kernel whatever is asked.
  trace::Attention f32 = fwd;
  f32.dtype = DType::f32;
  CHECK(p.seconds(f32) == doctest::Approx(2 * plan::flash_kernel_fmas(f32) / (25.6e12 * 0.25)).epsilon(1e-12));
  // And a pricer for tessera's kernel prices bf16 calls as the portable kernel.
  const plan::GpuPricer own(with_cudnn(), plan::AttentionKernel::tessera);
  CHECK(own.seconds(fwd) == doctest::Approx(2 * plan::flash_kernel_fmas(fwd) / (25.6e12 * 0.25)).epsilon(1e-12));
}

TEST_CASE("cost: training.attention picks cuDNN as llama-train would, where the profile has its rates, and says why") {
  const plan::Machine rated = with_cudnn(), bare = plan::parse_machine(kProfile, "bare.toml");
  CHECK(plan::choose_attention("auto", DType::bf16, 128, rated).kernel == plan::AttentionKernel::cudnn);
  CHECK(plan::choose_attention("cudnn", DType::bf16, 64, rated).kernel == plan::AttentionKernel::cudnn);
  CHECK(plan::choose_attention("cudnn", DType::bf16, 64, rated).why == "cudnn (training.attention = cudnn)");
  CHECK(plan::choose_attention("tessera", DType::bf16, 128, rated).kernel == plan::AttentionKernel::tessera);
  const plan::AttentionChoice f32 = plan::choose_attention("auto", DType::f32, 128, rated);
  CHECK(f32.kernel == plan::AttentionKernel::tessera);
  CHECK(f32.why.find("tessera (auto: the model is float32") == 0);
  const plan::AttentionChoice odd = plan::choose_attention("auto", DType::bf16, 12, rated);
  CHECK(odd.kernel == plan::AttentionKernel::tessera);
  CHECK(odd.why.find("head dim 12 is not one cuDNN accepts") != std::string::npos);
  const plan::AttentionChoice unrated = plan::choose_attention("auto", DType::bf16, 128, bare);
  CHECK(unrated.kernel == plan::AttentionKernel::tessera);
  CHECK(unrated.why.find("the machine profile bare.toml gives no cuDNN attention rates") != std::string::npos);
  CHECK_ERROR_CONTAINS(plan::choose_attention("cudnn", DType::f32, 128, rated),
                       "training.attention = \"cudnn\": the model is float32");
  CHECK_ERROR_CONTAINS(plan::choose_attention("cudnn", DType::bf16, 128, bare),
                       "training.attention = \"cudnn\": the machine profile bare.toml gives no cuDNN attention rates");
  CHECK_ERROR_CONTAINS(plan::choose_attention("flash", DType::bf16, 128, rated),
                       "training.attention must be one of auto, cudnn, tessera; got \"flash\"");
}

TEST_CASE("cost: a kernel takes its bytes at the bandwidth, or walks them a wavefront at a time, or its transcendentals") {
  const plan::GpuPricer p = pricer();
  trace::Kernel k;
  k.functor = "K";
  k.n = 1 << 20;
  k.traffic.bytes_read = 6e8;
  k.traffic.bytes_written = 4e8;
  k.cuda_class = KernelClass::row;
  CHECK(p.seconds(k) == doctest::Approx(1e9 / 0.5e12));
  // One index per thread walking its own rows: 4 useful bytes per wavefront, 100 SMs at 1 GHz.
  k.cuda_class = KernelClass::per_index;
  k.traffic.walk_bytes = 1e9;
  CHECK(p.seconds(k) == doctest::Approx(1e9 / 4e11));
  // The same functor lowered to its own kernel coalesces whatever it walks.
  k.cuda_class = KernelClass::row;
  CHECK(p.seconds(k) == doctest::Approx(1e9 / 0.5e12));
  // exp-heavy: 16 per SM per clock.
  k.traffic = {};
  k.traffic.transcendentals = 1.6e10;
  CHECK(p.seconds(k) == doctest::Approx(1.6e10 / (100 * 16 * 1e9)));
}

TEST_CASE("cost: a pass run inside the launch before it takes its work alone, no launch interval") {
  const plan::GpuPricer p = pricer();
  trace::Kernel k;  // a one-block pass over 8192 floats: far under a launch
  k.functor = "Float8ScaleFromAmaxes";
  k.n = 1;
  k.traffic.bytes_read = 8192 * 4;
  k.cuda_class = KernelClass::row;
  const double own = p.seconds(k);
  CHECK(own == doctest::Approx(2e-6));  // the profile's host.launch_us
  k.own_launch = false;  // ops::RowAbsMaxScale's second part
  CHECK(p.seconds(k) == doctest::Approx(8192 * 4 / 0.5e12));
  CHECK(p.seconds(k) < own);
}

TEST_CASE("cost: transfers and synchronisations wait for the device; the step sums every operation by class") {
  const plan::GpuPricer p = pricer();
  CHECK(p.seconds(trace::Synchronize{}) == doctest::Approx(10e-6));
  CHECK(p.seconds(trace::Transfer{1'000'000, true, "x", 1}) == doctest::Approx(10e-6 + 1e6 / 1e10));
  // An upload through pinned staging waits for nothing: its bytes over the link alone
  // (at least the launch interval).
  CHECK(p.seconds(trace::Transfer{1'000'000, false, "x", 1, false}) == doctest::Approx(1e6 / 1e10));
  CHECK(p.seconds(trace::Fill{1'000'000'000}) == doctest::Approx(1e9 / 0.5e12));

  trace::Trace t;
  const trace::Gemm g{4096, 4096, 4096, Trans::no, Trans::no, DType::bf16, DType::bf16, false};
  t.add(g);
  {
    Region r(region::kLossHead);
    t.add(g);
  }
  {
    Region r(region::kOptimizer);
    t.add(trace::Fill{1'000'000});
  }
  t.add(trace::Attention{{1, 1024, 8, 2, 64}, DType::bf16, false});
  t.add(trace::Transfer{8, true, "y", 2});
  t.add(trace::Memory{Device::meta, 100, MemoryUse::temporary, 100});  // free
  plan::StepShape shape;
  shape.args = nn::model_flavor("debugmodel");
  shape.tokens = 1024;
  shape.seq_len = 1024;
  shape.dtype = DType::bf16;
  MemoryBreakdown b;
  b.by_use[static_cast<int>(MemoryUse::parameters)] = 100;
  const plan::Prediction pr = plan::predict(t, p, shape, 5'000'000'000, b);
  double sum = 0;
  for (const auto& [name, c] : pr.by_class) sum += c.seconds;
  CHECK(pr.step_seconds == doctest::Approx(sum));
  auto cls = [&](const char* name) {
    for (const auto& [n, c] : pr.by_class)
      if (n == name) return c;
    return plan::ClassTime{};
  };
  CHECK(cls(plan::kClassGemm).count == 1);
  CHECK(cls(plan::kClassLossHead).count == 1);
  CHECK(cls(plan::kClassLossHead).seconds == doctest::Approx(p.seconds(g)));
  CHECK(cls(plan::kClassOptimizer).count == 1);
  CHECK(cls(plan::kClassAttention).count == 1);
  CHECK(cls(plan::kClassHost).count == 1);
  CHECK(pr.host_reads == 1);
  CHECK(pr.tokens_per_sec == doctest::Approx(1024 / pr.step_seconds));
  CHECK(pr.mfu_pct == doctest::Approx(100 * pr.tokens_per_sec * shape.args.flops_per_token(1024) / 100e12));
  CHECK(pr.mfu_causal_pct < pr.mfu_pct);
  CHECK(pr.fits);  // 5 GB of 10 - 1
  CHECK(pr.reserved_memory_bytes == pr.peak_memory_bytes);  // no reservation given: the peak
  CHECK(!plan::predict(t, p, shape, 9'500'000'000, b).fits);
  // What the allocator reserves decides: live bytes that fit, segments that do not.
  const plan::Prediction held = plan::predict(t, p, shape, 8'900'000'000, b, 12, 9'100'000'000);
  CHECK(held.peak_memory_bytes == 8'900'000'000);
  CHECK(held.reserved_memory_bytes == 9'100'000'000);
  CHECK(!held.fits);
  CHECK(plan::predict(t, p, shape, 8'900'000'000, b, 12, 8'950'000'000).fits);
}

TEST_CASE("cost: packed documents run cuDNN's variable-length attention where the profile's GPU takes it") {
  // The profile's compute capability decides, as the GPU's does in llama-train: sm_90 runs
  // cuDNN over packed documents, sm_80 (and a profile that gives none) tessera's kernels,
  // and a context-parallel ring tessera's kernels anywhere.
  const plan::Machine ampere = with_cudnn();
  const plan::Machine hopper = plan::parse_machine(edited("device = \"cuda\"", "device = \"cuda\"\ncompute_capability = \"9.0\""),
                                                   "hopper.toml");
  CHECK(ampere.cc_major == 0);
  REQUIRE(hopper.cc_major == 9);
  CHECK(hopper.cc_minor == 0);
  const plan::Machine blackwell =
      plan::parse_machine(edited("device = \"cuda\"", "device = \"cuda\"\ncompute_capability = \"10.0\""), "b.toml");
  CHECK(blackwell.cc_major == 10);
  plan::Machine hopper_rated = ampere;
  hopper_rated.cc_major = 9;
  CHECK(plan::choose_attention("auto", DType::bf16, 128, hopper_rated, true).kernel == plan::AttentionKernel::cudnn);
  const plan::AttentionChoice old = plan::choose_attention("auto", DType::bf16, 128, ampere, true);
  CHECK(old.kernel == plan::AttentionKernel::tessera);
  CHECK(old.why.find("token-major statistics on sm_90 and sm_100 only (this is sm_80)") != std::string::npos);
  const plan::AttentionChoice ring = plan::choose_attention("auto", DType::bf16, 128, hopper_rated, true, true);
  CHECK(ring.kernel == plan::AttentionKernel::tessera);
  CHECK(ring.why.find("under context parallelism") != std::string::npos);
  CHECK(plan::choose_attention("auto", DType::bf16, 128, hopper_rated, false, true).kernel ==
        plan::AttentionKernel::cudnn);
  for (const char* bad : {"9", "nine", "9.0.1", "9.10", "99999999999.0", "-1.0", ".0", "9.x"}) {
    CAPTURE(bad);
    CHECK_ERROR_CONTAINS(
        plan::parse_machine(edited("device = \"cuda\"", std::string("device = \"cuda\"\ncompute_capability = \"") + bad + "\""),
                            "gpu.toml"),
        "machine profile: machine.compute_capability must be a string such as \"9.0\"");
  }
}

TEST_CASE("machine profiles: every built-in profile loads, each figure with its source") {
  for (const std::string name : {"h100-sxm", "h200", "a100-80gb-sxm", "a100-80gb-p4de"}) {
    CAPTURE(name);
    const std::filesystem::path file = std::filesystem::path(TESSERA_MACHINES) / (name + ".toml");
    const plan::Machine m = plan::load_machine(file);
    CHECK(m.name == name);
    CHECK(m.cc_major == (name.find("a100") == 0 ? 8 : 9));
    CHECK(m.bf16_tflops.value > m.fp32_tflops.value);
    CHECK(m.usable_bytes() > 70e9);
    CHECK(m.gemm_bf16.points.size() >= 4);
    CHECK(!m.bf16_tflops.source.empty());
    CHECK(!m.gemm_bf16.source.empty());
    CHECK(m.hbm_fraction.value <= 1);
    // The big GEMMs of an 8B step run at more than half of the peak; small ones less.
    CHECK(m.gemm_bf16.at(1000) > 0.5);
    CHECK(m.gemm_bf16.at(0.1) < m.gemm_bf16.at(1000));
    // Every profile prices cuDNN's attention at head dims 64 and 128, above a quarter of
    // the tensor-core peak at 8k (head dim 64 on Hopper is the slowest: 29%) and below it;
    // the backward no faster than the forward (the A100 figure is forward + backward
    // together, taken for both).
    for (std::int64_t hd : {64, 128}) {
      CAPTURE(hd);
      const plan::AttentionRates* r = m.cudnn_attention_rates(hd);
      REQUIRE(r != nullptr);
      CHECK(!r->forward.source.empty());
      CHECK(!r->backward.source.empty());
      CHECK(r->forward.at(8192) > 0.25 * m.bf16_tflops.value);
      CHECK(r->forward.at(8192) < m.bf16_tflops.value);
      CHECK(r->backward.at(8192) <= r->forward.at(8192));
    }
    // Float8 on the Hopper profiles, none on the A100's (it has no float8 tensor cores):
    // the float8 peak twice the bf16 one; large GEMMs faster in float8 than in bf16, the
    // smallest no faster than twice (they are bound by what every kernel takes).
    CHECK(m.has_float8() == name.starts_with("h"));
    if (m.has_float8()) {
      CHECK(!m.fp8_tflops->source.empty());
      CHECK(!m.gemm_fp8->source.empty());
      CHECK(m.fp8_tflops->value == doctest::Approx(2 * m.bf16_tflops.value).epsilon(1e-3));
      for (const double gflop : {17.2, 275.0, 1000.0, 8000.0}) {
        CAPTURE(gflop);
        const double f8 = m.fp8_tflops->value * m.gemm_fp8->at(gflop), bf = m.bf16_tflops.value * m.gemm_bf16.at(gflop);
        CHECK(f8 > 1.3 * bf);
        CHECK(f8 < 2 * bf);
      }
      CHECK(m.fp8_tflops->value * m.gemm_fp8->at(0.134) <= 1.1 * m.bf16_tflops.value * m.gemm_bf16.at(0.134));
    } else {
      CHECK(!m.fp8_tflops.has_value());
      CHECK(!m.gemm_fp8.has_value());
    }
    // A GEMM beside held SMs: measured on the Hopper profiles (over the SMs' share), the
    // SMs' share alone on the A100's, where nothing was measured.
    CHECK(m.gemm_beside_held_sms.has_value() == name.starts_with("h"));
    if (m.gemm_beside_held_sms) {
      CHECK(!m.gemm_beside_held_sms->source.empty());
      const double spread = m.sm_count.value / (m.sm_count.value - 16);
      CHECK(m.gemm_beside_held_sms->at(16, spread) > spread);
    }
    (void)read(file);
  }
}

TEST_CASE("machine profiles: a figure missing, not positive or without its source is refused by name") {
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[hbm.bandwidth_gbs]\nvalue = 1000", "[hbm.bandwidth]\nvalue = 1000"),
                                           "gpu.toml"),
                       "gpu.toml: machine profile: hbm.bandwidth_gbs is missing");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[host.sync_us]\nvalue = 10", "[host.sync_us]\nvalue = 0"), "gpu.toml"),
                       "host.sync_us.value must be a positive number, got 0");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[host.sync_us]\nvalue = 10", "[host.sync_us]\nvalue = -3"), "gpu.toml"),
                       "host.sync_us.value must be a positive number, got -3");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("value = 25.6\nsource = \"test: 100 SMs x 128 lanes x 2 x 1 GHz\"",
                                                  "value = 25.6"),
                                           "gpu.toml"),
                       "compute.fp32_tflops has no source");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[compute.sm_count]\nvalue = 100", "[compute.sm_count]\nvalue = \"many\""),
                                           "gpu.toml"),
                       "gpu.toml:19: machine profile: compute.sm_count.value must be a number");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[compute.sm_count]\nvalue = 100", "[compute.sm_count]\nvalue = 100.5"),
                                           "gpu.toml"),
                       "gpu.toml: machine profile: compute.sm_count must be a whole number up to 65536, got 100.5");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[memory.capacity_bytes]\nvalue = 1e10", "[memory.capacity_bytes]\nvalue = 1e30"),
                                           "gpu.toml"),
                       "gpu.toml: machine profile: memory.capacity_bytes must be at most 2^60 (1 EiB), got 1e+30");
  CHECK_ERROR_CONTAINS(
      plan::parse_machine(edited("points = [[1.0, 0.1], [100.0, 0.5]]", "points = [[100.0, 0.1], [1.0, 0.5]]"), "gpu.toml"),
      "gemm.bf16_efficiency.points must have increasing gflop");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("[memory.reserved_bytes]\nvalue = 1e9", "[memory.reserved_bytes]\nvalue = 2e10"),
                                           "gpu.toml"),
                       "memory.reserved_bytes must be less than memory.capacity_bytes");
  CHECK_ERROR_CONTAINS(plan::parse_machine(edited("device = \"cuda\"", "device = \"cpu\""), "gpu.toml"),
                       "machine.device must be \"cuda\"");
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine\nname = 1", "broken.toml"), "broken.toml:1: TOML syntax error");
  // The optional cuDNN attention rates: known keys, both directions, positive increasing points.
  const std::string base = kProfile;
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + "[attention.cudnn_hd64_forward]\npoints = [[1, 1]]\nsource = \"t\"\n", "gpu.toml"),
                       "unknown key attention.cudnn_hd64_forward (expected cudnn_bf16_hd<head dim>_forward or _backward)");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + "[attention.cudnn_bf16_hd64_forward]\npoints = [[1, 1]]\nsource = \"t\"\n",
                                           "gpu.toml"),
                       "gpu.toml: machine profile: attention.cudnn_bf16_hd64_backward is missing");
  CHECK_ERROR_CONTAINS(
      plan::parse_machine(base + "[attention.cudnn_bf16_hd64_forward]\npoints = [[4096, 1], [1024, 2]]\nsource = \"t\"\n",
                          "gpu.toml"),
      "attention.cudnn_bf16_hd64_forward.points must have increasing seq_len");
  CHECK_ERROR_CONTAINS(
      plan::parse_machine(base + "[attention.cudnn_bf16_hd64_backward]\npoints = [[1024, 0]]\nsource = \"t\"\n", "gpu.toml"),
      "seq_len, tflops must be positive and finite, got [1024, 0]");
  CHECK_ERROR_CONTAINS(
      plan::parse_machine(base + "[attention.cudnn_bf16_hd64_backward]\npoints = [[1024, inf]]\nsource = \"t\"\n", "gpu.toml"),
      "seq_len, tflops must be positive and finite, got [1024, inf]");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + "[attention.cudnn_bf16_hd64_backward]\npoints = [[1024, 5]]\n", "gpu.toml"),
                       "attention.cudnn_bf16_hd64_backward has no source");
  CHECK_ERROR_CONTAINS(plan::load_machine("/nonexistent/gpu.toml"), "/nonexistent/gpu.toml: cannot open the machine profile");
}

TEST_CASE("machine profiles: the float8 rates come together, each a sourced figure, or are refused by name") {
  const plan::Machine m = with_float8();
  REQUIRE(m.has_float8());
  CHECK(m.fp8_tflops->value == 200);
  CHECK(m.fp8_tflops->source == "test");
  CHECK(m.gemm_fp8->points.size() == 2);
  CHECK(!plan::parse_machine(kProfile, "gpu.toml").has_float8());  // optional: no float8 tensor cores
  const std::string base = kProfile;
  const std::string peak = "[compute.fp8_tflops]\nvalue = 200\nsource = \"t\"\n";
  const auto curve = [](const std::string& points, const std::string& source = "source = \"t\"\n") {
    return "[gemm.fp8_efficiency]\n" + points + "\n" + source;
  };
  // A malformed curve: decreasing sizes, a fraction over 1, not pairs, no source, empty.
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + peak + curve("points = [[100.0, 0.4], [1.0, 0.05]]"), "gpu.toml"),
                       "gemm.fp8_efficiency.points must have increasing gflop");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + peak + curve("points = [[1.0, 1.5]]"), "gpu.toml"),
                       "machine profile: gemm.fp8_efficiency.points[0]: gflop, fraction must be positive and finite, the second at most 1");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + peak + curve("points = [[1.0, 0.5, 3.0]]"), "gpu.toml"),
                       "gemm.fp8_efficiency.points[0] must be a pair [gflop, fraction] of numbers");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + peak + curve("points = [[1.0, 0.5]]", ""), "gpu.toml"),
                       "gemm.fp8_efficiency has no source");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + peak + curve("points = []"), "gpu.toml"),
                       "gemm.fp8_efficiency.points must be a non-empty list of [gflop, fraction] pairs");
  // The peak: a positive number with its source.
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + "[compute.fp8_tflops]\nvalue = 0\nsource = \"t\"\n" +
                                               curve("points = [[1.0, 0.5]]"),
                                           "gpu.toml"),
                       "compute.fp8_tflops.value must be a positive number, got 0");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + "[compute.fp8_tflops]\nvalue = 200\n" + curve("points = [[1.0, 0.5]]"),
                                           "gpu.toml"),
                       "compute.fp8_tflops has no source");
  // One without the other.
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + peak, "gpu.toml"),
                       "gpu.toml: machine profile: compute.fp8_tflops is given without gemm.fp8_efficiency");
  CHECK_ERROR_CONTAINS(plan::parse_machine(base + curve("points = [[1.0, 0.5]]"), "gpu.toml"),
                       "gpu.toml: machine profile: gemm.fp8_efficiency is given without compute.fp8_tflops");
}

TEST_CASE("machine profiles: a profile with a base takes the base's figures and replaces those it gives") {
  // The resolver stands for llama-plan's built-in names: "test-gpu" is kProfile.
  const plan::MachineResolver resolve = [](std::string_view base, std::string_view) -> std::optional<plan::MachineText> {
    if (base == "test-gpu") return plan::MachineText{kProfile, "test-gpu.toml (built in)"};
    if (base == "loop") return plan::MachineText{"[machine]\nname = \"loop\"\nbase = \"loop\"\n", "loop.toml"};
    return std::nullopt;
  };
  const std::string derived = R"(
[machine]
name = "test-cluster"
base = "test-gpu"
[hbm.achieved_fraction]
value = 0.8
source = "derived"
[network.gpus_per_node]
value = 4
source = "derived"
[network.nvlink_gbs]
value = 100
source = "derived"
[network.nvlink_latency_us]
value = 3
source = "derived"
[network.network_gbs]
value = 10
source = "derived"
[network.network_latency_us]
value = 9
source = "derived"
)";
  const plan::Machine m = plan::parse_machine(derived, "cluster.toml", resolve);
  CHECK(m.name == "test-cluster");
  CHECK(m.description == "a GPU with round numbers");  // [machine]'s keys one by one
  CHECK(m.hbm_fraction.value == 0.8);
  CHECK(m.hbm_fraction.source == "derived");
  CHECK(m.hbm_gbs.value == 1000);  // the base's, with its source
  CHECK(m.hbm_gbs.source == "test");
  CHECK(m.bf16_tflops.value == 100);
  REQUIRE(m.network.has_value());
  CHECK(m.network->network_gbs.value == 10);

  // A figure the profile gives replaces the base's whole: a value without its source is refused.
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine]\nname = \"x\"\nbase = \"test-gpu\"\n[host.sync_us]\nvalue = 5\n",
                                           "x.toml", resolve),
                       "host.sync_us has no source");
  // A bad figure of the base is reported where the base has it.
  const plan::MachineResolver bad = [](std::string_view, std::string_view) -> std::optional<plan::MachineText> {
    return plan::MachineText{edited("[host.sync_us]\nvalue = 10", "[host.sync_us]\nvalue = \"slow\""), "gpu.toml"};
  };
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine]\nname = \"x\"\nbase = \"gpu\"\n", "x.toml", bad),
                       "gpu.toml:43: machine profile: host.sync_us.value must be a number");
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine]\nname = \"x\"\nbase = \"nowhere\"\n", "x.toml", resolve),
                       "x.toml:3: machine profile: machine.base = \"nowhere\": no such profile");
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine]\nname = \"x\"\nbase = 3\n", "x.toml", resolve),
                       "x.toml:3: machine profile: machine.base must name a profile");
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine]\nbase = \"test-gpu\"\n", "x.toml", resolve),
                       "x.toml: machine profile: machine.name is missing (a profile with a base names itself)");
  CHECK_ERROR_CONTAINS(plan::parse_machine("[machine]\nname = \"x\"\nbase = \"loop\"\n", "x.toml", resolve),
                       "more than eight bases in a chain");

  // By default a base is a file beside the profile: the p4de cluster is the A100's GPU.
  const plan::Machine p4de = plan::load_machine(std::filesystem::path(TESSERA_MACHINES) / "a100-80gb-p4de.toml");
  const plan::Machine sxm = plan::load_machine(std::filesystem::path(TESSERA_MACHINES) / "a100-80gb-sxm.toml");
  CHECK(p4de.name == "a100-80gb-p4de");
  CHECK(p4de.bf16_tflops.value == sxm.bf16_tflops.value);
  CHECK(p4de.gemm_bf16.points == sxm.gemm_bf16.points);
  CHECK(p4de.usable_bytes() == sxm.usable_bytes());
  REQUIRE(p4de.network.has_value());
  CHECK(p4de.network->nvlink_gbs.value == sxm.network->nvlink_gbs.value);
  CHECK(p4de.network->network_gbs.value < sxm.network->network_gbs.value / 3);  // 4 x 100 Gb/s for 8 GPUs
  REQUIRE(p4de.network->nics_per_node.has_value());  // its own: 4 EFA NICs, where a DGX A100 has 8
  CHECK(p4de.network->nics_per_node->value == 4);
  CHECK(sxm.network->nics_per_node->value == 8);
}

}  // namespace test_cost
