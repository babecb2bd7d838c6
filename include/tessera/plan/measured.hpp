// A measured step told by llama-plan's classes: which class of the prediction
// (plan/cost.hpp: GEMMs, attention, memory-bound kernels, loss head, optimizer, host
// synchronisations) a kernel or copy that ran on the device belongs to, and the device's
// time summed so, for a step profiled on a GPU (bench-train --profile, through CUPTI:
// backend/cuda/kernel_profile.hpp, which records backend/device_activity.hpp's
// DeviceActivity) to be set against the prediction of the same step
// class by class.
//
// The rules are plan::detail::class_of's, applied to what the device reports: a copy to
// or from the host is a host synchronisation wherever it runs; then the region open when
// the work was launched (core/region.hpp: the loss head and the optimizer take their
// GEMMs and kernels); then the kernel's name: cuBLASLt's GEMM kernels are GEMMs, cuDNN's
// and tessera's attention kernels attention, every other kernel, copy and fill on the
// device a memory-bound kernel.
#pragma once

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/backend/device_activity.hpp"
#include "tessera/core/region.hpp"
#include "tessera/plan/classes.hpp"

namespace tessera::plan {

namespace detail {
inline bool contains_nocase(std::string_view hay, std::string_view needle) {
  return std::search(hay.begin(), hay.end(), needle.begin(), needle.end(), [](char a, char b) {
           return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
         }) != hay.end();
}
}  // namespace detail

/// Whether a kernel's name is cuDNN's or tessera's attention (tessera's flash kernels,
/// cuDNN's generated SDPA kernels and their helpers: cuDNN runs nothing else here).
inline bool is_attention_kernel(std::string_view name) {
  for (std::string_view s : {"flash", "fmha", "sdpa", "attention", "cudnn"})
    if (detail::contains_nocase(name, s)) return true;
  return false;
}

/// Whether a kernel's name is one of cuBLASLt's GEMM kernels or its split-K reduction.
inline bool is_gemm_kernel(std::string_view name) {
  for (std::string_view s : {"gemm", "nvjet", "cutlass", "xmma", "splitkreduce", "cublas"})
    if (detail::contains_nocase(name, s)) return true;
  return false;
}

/// The prediction's class of one measured activity (kClassGemm, ... in plan/classes.hpp).
inline const char* measured_class(const DeviceActivity& a) {
  if (a.work == DeviceWork::host_copy) return kClassHost;
  if (a.region == region::kLossHead) return kClassLossHead;
  if (a.region == region::kOptimizer) return kClassOptimizer;
  if (a.work != DeviceWork::kernel) return kClassKernels;
  if (is_attention_kernel(a.name)) return kClassAttention;
  if (is_gemm_kernel(a.name)) return kClassGemm;
  return kClassKernels;
}

/// A profiled step by class: each class's device time (durations summed: work on two
/// streams at once counts twice) and count, the time the device was busy (the union of
/// the activities' spans), and the costliest kernels by name.
struct MeasuredStep {
  ClassTimes by_class;        // Prediction::by_class's order
  double device_seconds = 0;  // the activities' durations summed
  double busy_seconds = 0;    // the union of their spans
  std::vector<OpTotal> top;   // by name (what), class (cls), summed time, count; costliest first
};

inline MeasuredStep measure_step(const std::vector<DeviceActivity>& activities, std::size_t top = 40) {
  MeasuredStep m;
  m.by_class = zero_class_times();
  std::map<std::string, OpTotal> names;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const DeviceActivity& a : activities) {
    const char* cls = measured_class(a);
    add_to_class(m.by_class, cls, a.seconds());
    m.device_seconds += a.seconds();
    OpTotal& o = names[std::string(cls) + '\n' + a.name];  // the same kernel in two classes: two rows
    if (o.what.empty()) o.what = a.name, o.cls = cls;
    o.seconds += a.seconds();
    ++o.count;
    if (a.end_ns > a.start_ns) spans.emplace_back(a.start_ns, a.end_ns);
  }
  std::sort(spans.begin(), spans.end());
  std::uint64_t covered = 0, open_start = 0, open_end = 0;
  bool open = false;
  for (const auto& [s, e] : spans) {
    if (open && s <= open_end) {
      open_end = std::max(open_end, e);
      continue;
    }
    if (open) covered += open_end - open_start;
    open = true, open_start = s, open_end = e;
  }
  if (open) covered += open_end - open_start;
  m.busy_seconds = static_cast<double>(covered) * 1e-9;
  m.top = costliest(names, top);
  return m;
}

}  // namespace tessera::plan
