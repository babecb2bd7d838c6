// One kernel, copy or fill as a device reported it: what a device profiler
// (backend/cuda/kernel_profile.hpp, through CUPTI) records of a step, and what the
// planner sets against its prediction class by class (plan/measured.hpp).
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

/// What the device ran.
enum class DeviceWork { kernel, device_copy, host_copy, fill };

/// One kernel, copy or fill as the device reported it.
struct DeviceActivity {
  std::string name;         // the kernel's (demangled) name, or what the copy was
  DeviceWork work = DeviceWork::kernel;
  std::string region;       // the Region open on the launching thread, "" outside any
  std::string operation;    // the operation the backend was launching (trace::describe of
                            // trace::Launching's: a GEMM, an attention call), "" for none
  std::uint64_t start_ns = 0, end_ns = 0;
  std::uint64_t bytes = 0;  // copies and fills
  double seconds() const { return end_ns > start_ns ? static_cast<double>(end_ns - start_ns) * 1e-9 : 0.0; }
};

}  // namespace tessera
