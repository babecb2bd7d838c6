// A measured step told by the prediction's classes (plan/measured.hpp): the kernel names
// an H100 ran (cuBLASLt 13.1, cuDNN 9.14, PyTorch 2.11 and tessera's own, as profiled
// 2026-11-27), the regions, the copies, and the sums a profile reports.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "tessera/core/region.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/measured.hpp"

namespace test_plan_measured {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::plan;

namespace {
DeviceActivity kernel(std::string name, std::uint64_t start, std::uint64_t end, std::string region = "") {
  DeviceActivity a;
  a.name = std::move(name);
  a.start_ns = start, a.end_ns = end;
  a.region = std::move(region);
  return a;
}
}  // namespace

TEST_CASE("a measured kernel is filed under the class the prediction files its operation under") {
  const std::vector<std::pair<std::string, const char*>> names = {
      {"nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", kClassGemm},
      {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", kClassGemm},
      {"void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", kClassGemm},
      {"void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", kClassGemm},
      {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1", kClassAttention},
      {"void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*, void const*)", kClassAttention},
      {"void tessera::cuda::detail::flash_query_kernel<tessera::bf16>(tessera::cuda::detail::FlashArgs<tessera::bf16>)",
       kClassAttention},
      {"void tessera::cuda::detail::elementwise_kernel<tessera::ops::SwiGluForward<tessera::bf16> >(long, "
       "tessera::ops::SwiGluForward<tessera::bf16>)",
       kClassKernels},
      {"void tessera::cuda::detail::rope_kernel<tessera::bf16>(tessera::ops::RopeForward<tessera::bf16>)", kClassKernels},
  };
  for (const auto& [name, cls] : names) {
    CAPTURE(name);
    CHECK(std::string(measured_class(kernel(name, 0, 1))) == cls);
  }
}

TEST_CASE("the loss head's and the optimizer's regions take their GEMMs and kernels; host copies stay host work") {
  CHECK(std::string(measured_class(kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", 0, 1, region::kLossHead))) ==
        kClassLossHead);
  CHECK(std::string(measured_class(kernel("void tessera::cuda::detail::for_each_kernel<AdamWUpdate>", 0, 1,
                                          region::kOptimizer))) == kClassOptimizer);
  // A recomputation is the same kernels again: filed by name, as the prediction does.
  CHECK(std::string(measured_class(kernel("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", 0, 1, region::kRecompute))) ==
        kClassGemm);
  DeviceActivity up = kernel("copy host to device", 0, 1, region::kOptimizer);
  up.work = DeviceWork::host_copy;
  CHECK(std::string(measured_class(up)) == kClassHost);
  DeviceActivity fill = kernel("memset", 0, 1);
  fill.work = DeviceWork::fill;
  CHECK(std::string(measured_class(fill)) == kClassKernels);
  DeviceActivity copy = kernel("copy on the device", 0, 1);
  copy.work = DeviceWork::device_copy;
  CHECK(std::string(measured_class(copy)) == kClassKernels);
}

TEST_CASE("a measured step sums its classes, counts overlapping work once as busy time, and lists its kernels") {
  // Two streams: a GEMM 0-100 us beside a kernel 50-120 us; a gap; the optimizer 200-260 us.
  const std::vector<DeviceActivity> work = {
      kernel("nvjet_a", 0, 100'000),
      kernel("void tessera::cuda::detail::elementwise_kernel<Add>", 50'000, 120'000),
      kernel("nvjet_a", 200'000, 230'000, region::kOptimizer),
      kernel("void tessera::cuda::detail::for_each_kernel<AdamWUpdate>", 230'000, 260'000, region::kOptimizer),
      kernel("nvjet_a", 300'000, 310'000),
  };
  const MeasuredStep m = measure_step(work, 3);
  REQUIRE(m.by_class.size() == 6);
  CHECK(m.by_class[0].first == kClassGemm);
  CHECK(m.by_class[0].second.seconds == doctest::Approx(110e-6));
  CHECK(m.by_class[0].second.count == 2);
  CHECK(m.by_class[2].first == kClassKernels);
  CHECK(m.by_class[2].second.seconds == doctest::Approx(70e-6));
  CHECK(m.by_class[4].first == kClassOptimizer);
  CHECK(m.by_class[4].second.seconds == doctest::Approx(60e-6));
  CHECK(m.by_class[4].second.count == 2);
  CHECK(m.device_seconds == doctest::Approx(240e-6));
  CHECK(m.busy_seconds == doctest::Approx(190e-6));  // 0-120, 200-260, 300-310
  // The same kernel in two classes is two rows; the list is costliest first and cut at 3.
  REQUIRE(m.top.size() == 3);
  CHECK(m.top[0].what == "nvjet_a");
  CHECK(m.top[0].cls == kClassGemm);
  CHECK(m.top[0].seconds == doctest::Approx(110e-6));
  CHECK(m.top[1].cls == kClassKernels);
  CHECK(m.top[2].cls == kClassOptimizer);
  CHECK(m.top[2].seconds == doctest::Approx(30e-6));
  // Nothing measured: every class present and empty.
  const MeasuredStep none = measure_step({});
  CHECK(none.by_class.size() == 6);
  CHECK(none.busy_seconds == 0);
  CHECK(none.top.empty());
}

}  // namespace test_plan_measured
