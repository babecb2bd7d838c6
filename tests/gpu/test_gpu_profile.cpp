// cuda::KernelProfile (backend/cuda/kernel_profile.hpp) on the device: every kernel and
// copy of a small step recorded with its span, each filed under the class the
// prediction would file it under (plan/measured.hpp), regions included; one profile at a
// time, and a second after the first has stopped.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "profile_launchers.hpp"
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
  const std::vector<plan::DeviceActivity> work = gpu_test::profiled_work_of_each_class();
  REQUIRE(!work.empty());
  for (const plan::DeviceActivity& a : work) {
    CAPTURE(a.name);
    CHECK(!a.name.empty());
    CHECK(a.end_ns > a.start_ns);
  }
  for (std::size_t i = 1; i < work.size(); ++i) CHECK(work[i - 1].start_ns <= work[i].start_ns);
  const plan::MeasuredStep m = plan::measure_step(work);
  std::string seen;
  for (const auto& o : m.top) seen += o.cls + ": " + o.what + "\n";
  CAPTURE(seen);
  // cuBLASLt may split a GEMM into more than one kernel (a split-K reduction after it).
  CHECK(count_of(m, plan::kClassGemm) >= 1);
  CHECK(count_of(m, plan::kClassLossHead) >= 1);
  CHECK(count_of(m, plan::kClassLossHead) == count_of(m, plan::kClassGemm));
  CHECK(count_of(m, plan::kClassOptimizer) == 1);
  CHECK(count_of(m, plan::kClassKernels) == 1);
  CHECK(count_of(m, plan::kClassHost) >= 1);  // the download (one copy, or a staged pair)
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
