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

TEST_CASE("kernels are told by the operation they belong to, as llama-plan names it, and set beside its prediction") {
  // The names CUPTI reports (demangled): a row kernel names its body, then the functor; a
  // row body of ops::RowsWithAmaxes names the functor first; the elementwise kernel, the
  // per-index fallback and the float8 casts name it in their arguments too.
  const std::vector<std::pair<std::string, std::string>> names = {
      {"void tessera::cuda::detail::row_kernel<tessera::cuda::detail::RmsNormForwardRows<tessera::bf16>, 8, false, "
       "tessera::ops::RmsNormForward<tessera::bf16> >(tessera::ops::RmsNormForward<tessera::bf16>, long)",
       "RmsNormForward<bf16>"},
      {"void tessera::cuda::detail::row_kernel<tessera::cuda::detail::RowsWithAmaxesBody<tessera::ops::"
       "SwiGluForwardRows<tessera::bf16>, tessera::ops::SwiGluForward<tessera::bf16>, tessera::ops::SwiGluForwardAmax, "
       "tessera::bf16>, 8, false, tessera::ops::SwiGluForwardRows<tessera::bf16> >(...)",
       "SwiGluForwardRows<bf16>"},
      {"void tessera::cuda::detail::elementwise_kernel<tessera::ops::SwiGluForward<tessera::bf16>, 8>(long, "
       "tessera::ops::SwiGluForward<tessera::bf16>)",
       "SwiGluForward<bf16>"},
      {"void tessera::cuda::detail::quantize_rows_kernel<tessera::bf16, tessera::float8<tessera::E4M3>, unsigned "
       "int>(tessera::ops::QuantizeFloat8<tessera::bf16, tessera::float8<tessera::E4M3> >)",
       "QuantizeFloat8<bf16, float8<E4M3> >"},
      {"void tessera::cuda::detail::max_of_kernel<tessera::ops::Float8ScaleFromAmaxes>(tessera::ops::"
       "Float8ScaleFromAmaxes)",
       "Float8ScaleFromAmaxes"},
      {"nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", ""},
      {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1", ""},
  };
  for (const auto& [name, functor] : names) {
    CAPTURE(name);
    CHECK(functor_of_kernel(name) == functor);
  }

  // A step: RMSNorm's forward twice, SwiGLU once, a GEMM whose call the backend labelled
  // (cuBLASLt's main kernel and its split-K reduction), one it did not, a copy, the
  // optimizer's AdamW.
  const std::string norm = names[0].first, swiglu = names[2].first;
  const std::string gemm = "gemm 8192x2048x2048 bfloat16->bfloat16 (nt)";
  std::vector<DeviceActivity> work = {
      kernel(norm, 0, 10'000),
      kernel(names[5].first, 10'000, 40'000),
      kernel("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", 40'000, 50'000),
      kernel(norm, 50'000, 58'000),
      kernel(swiglu, 60'000, 90'000),
      kernel(names[5].first, 90'000, 95'000),
      kernel("void tessera::cuda::detail::adamw_multi_kernel<tessera::bf16, float>(tessera::ops::AdamWMultiStep<"
             "tessera::bf16, float>)",
             100'000, 200'000, region::kOptimizer),
      kernel("memcpy device to device", 200'000, 210'000),
  };
  work[1].operation = work[2].operation = gemm;
  work.back().work = DeviceWork::device_copy;
  const MeasuredStep m = measure_step(work);
  REQUIRE(m.operations.size() == 4);  // the unlabelled GEMM and the copy belong to none
  CHECK(m.operations[0].what == "AdamWMultiStep<bf16, float>");
  CHECK(m.operations[0].cls == kClassOptimizer);
  CHECK(m.operations[1].what == gemm);
  CHECK(m.operations[1].cls == kClassGemm);
  CHECK(m.operations[1].count == 2);
  CHECK(m.operations[1].seconds == doctest::Approx(40e-6));
  CHECK(m.operations[2].what == "SwiGluForward<bf16>");
  CHECK(m.operations[3].what == "RmsNormForward<bf16>");
  CHECK(m.operations[3].count == 2);
  CHECK(m.operations[3].seconds == doctest::Approx(18e-6));

  // Beside llama-plan's kinds of operation (a kernel's "functor (kernel class)", whose
  // template arguments it may space otherwise): matched by name and class, a GEMM by its
  // whole name ("(nt)" and "(nt, +=)" apart); host reads left out; what the prediction
  // has and nothing measured matched listed after, measured 0.
  const std::vector<OpTotal> predicted = {
      {gemm, kClassGemm, 50e-6, 1},
      {"gemm 8192x2048x2048 bfloat16->bfloat16 (nt, +=)", kClassGemm, 7e-6, 1},
      {"AdamWMultiStep<bf16,float> (multi-tensor)", kClassOptimizer, 80e-6, 1},
      {"RmsNormForward<bf16> (row)", kClassKernels, 12e-6, 2},
      {"RmsNormBackwardInput<bf16> (row)", kClassKernels, 5e-6, 1},
      {"synchronize", kClassHost, 1e-6, 1},
  };
  const std::vector<OperationComparison> c = compare_operations(m.operations, predicted);
  REQUIRE(c.size() == 6);
  CHECK(c[0].what == "AdamWMultiStep<bf16, float>");
  CHECK(c[0].predicted_seconds == doctest::Approx(80e-6));
  CHECK(c[1].what == gemm);
  CHECK(c[1].predicted_seconds == doctest::Approx(50e-6));
  CHECK(c[1].measured_count == 2);
  CHECK(c[1].predicted_count == 1);
  CHECK(c[2].what == "SwiGluForward<bf16>");
  CHECK(c[2].predicted_count == 0);
  CHECK(c[3].what == "RmsNormForward<bf16>");
  CHECK(c[3].measured_seconds == doctest::Approx(18e-6));
  CHECK(c[3].predicted_seconds == doctest::Approx(12e-6));
  CHECK(c[3].predicted_count == 2);
  CHECK(c[4].what == "gemm 8192x2048x2048 bfloat16->bfloat16 (nt, +=)");
  CHECK(c[4].measured_count == 0);
  CHECK(c[5].what == "RmsNormBackwardInput<bf16>");
  CHECK(c[5].measured_count == 0);
  CHECK(c[5].predicted_seconds == doctest::Approx(5e-6));
}

}  // namespace test_plan_measured
