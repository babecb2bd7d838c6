// cuda::KernelProfile (backend/cuda/kernel_profile.hpp) on the device: every kernel and
// copy of a small step recorded with its span, each filed under the class the
// prediction would file it under (plan/measured.hpp), regions included, and a GEMM's
// kernels under the GEMM's name; one profile at a time, and a second after the first has
// stopped.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "profile_launchers.hpp"
#include "tessera/core/region.hpp"
#include "tessera/plan/classes.hpp"
#include "tessera/plan/measured.hpp"

namespace test_gpu_profile {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {
std::int64_t count_of(const plan::MeasuredStep& m, const char* cls) {
  for (const auto& [name, ct] : m.by_class)
    if (name == cls) return ct.count;
  return -1;
}
}  // namespace

TEST_CASE("a kernel profile records each kernel and copy of a step, filed by class and region") {
  const std::vector<DeviceActivity> work = gpu_test::profiled_work_of_each_class();
  REQUIRE(!work.empty());
  for (const DeviceActivity& a : work) {
    CAPTURE(a.name);
    CHECK(!a.name.empty());
    CHECK(a.end_ns > a.start_ns);
  }
  for (std::size_t i = 1; i < work.size(); ++i) CHECK(work[i - 1].start_ns <= work[i].start_ns);
  const plan::MeasuredStep m = plan::measure_step(work);
  std::string seen;
  for (const DeviceActivity& a : work)
    seen += std::string(plan::measured_class(a)) + " [" + a.region + "]: " + a.name + "\n";
  CAPTURE(seen);
  // In launch order: the first GEMM's kernels (cuBLASLt may add a split-K reduction),
  // the same kernels again inside the loss head, Scale in the optimizer, Axpy, the copy.
  std::size_t head = 0;
  while (head < work.size() && work[head].region.empty()) ++head;
  REQUIRE(head > 0);
  REQUIRE(head < work.size());
  std::size_t end = head;
  while (end < work.size() && work[end].region == region::kLossHead) ++end;
  REQUIRE(end - head == head);
  for (std::size_t i = 0; i < head; ++i) {
    CHECK(work[head + i].name == work[i].name);
    CHECK(std::string(plan::measured_class(work[head + i])) == plan::kClassLossHead);
  }
  CHECK(plan::is_gemm_kernel(work[0].name));
  CHECK(std::string(plan::measured_class(work[0])) == plan::kClassGemm);
  // Each GEMM's kernels carry the GEMM as llama-plan names it (trace::Launching), and the
  // row of the step by operation is that name; Scale and Axpy go by their functors.
  for (std::size_t i = 0; i < end; ++i) CHECK(work[i].operation == "gemm 256x384x512 bfloat16->bfloat16 (nn)");
  CHECK(work[end].operation.empty());
  CHECK(plan::operation_of(work[end]) == "Scale<float>");
  CHECK(plan::operation_of(work[end + 1]) == "Axpy<float>");
  REQUIRE(m.operations.size() >= 3);
  bool gemm_row = false;
  for (const plan::OpTotal& o : m.operations)
    gemm_row |= o.what == "gemm 256x384x512 bfloat16->bfloat16 (nn)" && o.cls == plan::kClassGemm &&
                o.count == static_cast<std::int64_t>(head);
  REQUIRE(end + 3 <= work.size());
  CHECK(work[end].region == region::kOptimizer);
  CHECK(work[end].name.find("Scale") != std::string::npos);
  CHECK(std::string(plan::measured_class(work[end])) == plan::kClassOptimizer);
  CHECK(work[end + 1].name.find("Axpy") != std::string::npos);
  CHECK(std::string(plan::measured_class(work[end + 1])) == plan::kClassKernels);
  for (std::size_t i = end + 2; i < work.size(); ++i)  // the download: one copy, or a staged pair
    CHECK(std::string(plan::measured_class(work[i])) == plan::kClassHost);
  CHECK(gemm_row);
  CHECK(count_of(m, plan::kClassLossHead) == static_cast<std::int64_t>(head));
  CHECK(count_of(m, plan::kClassAttention) == 0);
  CHECK(m.busy_seconds > 0);
  CHECK(m.busy_seconds <= m.device_seconds * (1 + 1e-9));
}

TEST_CASE("one kernel profile records at a time; another can follow it") {
  std::string why;
  CHECK(gpu_test::second_profile_refused(why));
  CHECK(why.find("already recording") != std::string::npos);
  CHECK(!gpu_test::profiled_work_of_each_class().empty());
}

}  // namespace test_gpu_profile
