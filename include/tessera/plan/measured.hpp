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
#include "tessera/core/type_name.hpp"
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

/// The functor a kernel of tessera's own carries in its name, as a trace names the launch
/// (core/type_name.hpp: "RmsNormForward<bf16>"): the first tessera::ops:: type in the name
/// (a row kernel names its body first, which is not one, then the functor), tessera's
/// namespaces dropped; empty for every other kernel (cuBLASLt's, cuDNN's, a copy).
inline std::string functor_of_kernel(std::string_view name) {
  constexpr std::string_view kOps = "tessera::ops::";
  const std::size_t at = name.find(kOps);
  if (at == std::string_view::npos) return {};
  std::size_t end = at + kOps.size();
  while (end < name.size() && (std::isalnum(static_cast<unsigned char>(name[end])) != 0 || name[end] == '_')) ++end;
  if (end < name.size() && name[end] == '<') {
    int depth = 0;
    for (; end < name.size(); ++end) {
      if (name[end] == '<') ++depth;
      if (name[end] == '>' && --depth == 0) {
        ++end;
        break;
      }
    }
  }
  return without_tessera_namespaces(std::string(name.substr(at, end - at)));
}

/// What the prediction calls the operation an activity belongs to: the GEMM or attention
/// call the backend was launching (DeviceActivity::operation, trace::describe's name), or
/// the functor of a kernel of tessera's own (functor_of_kernel); empty for the rest
/// (copies, fills, a library's kernel launched outside a labelled call).
inline std::string operation_of(const DeviceActivity& a) {
  if (!a.operation.empty()) return a.operation;
  return a.work == DeviceWork::kernel ? functor_of_kernel(a.name) : std::string();
}

/// A profiled step by class: each class's device time (durations summed: work on two
/// streams at once counts twice) and count, the time the device was busy (the union of
/// the activities' spans), the costliest kernels by name, and the kernels by the
/// operation they belong to (operation_of: every one, costliest first, as the prediction
/// lists its kinds of operation).
struct MeasuredStep {
  ClassTimes by_class;              // Prediction::by_class's order
  double device_seconds = 0;        // the activities' durations summed
  double busy_seconds = 0;          // the union of their spans
  std::vector<OpTotal> top;         // by name (what), class (cls), summed time, count; costliest first
  std::vector<OpTotal> operations;  // by operation_of (what), class, summed time, kernels counted
};

inline MeasuredStep measure_step(const std::vector<DeviceActivity>& activities, std::size_t top = 40) {
  MeasuredStep m;
  m.by_class = zero_class_times();
  std::map<std::string, OpTotal> names, operations;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const DeviceActivity& a : activities) {
    const char* cls = measured_class(a);
    add_to_class(m.by_class, cls, a.seconds());
    m.device_seconds += a.seconds();
    OpTotal& o = names[std::string(cls) + '\n' + a.name];  // the same kernel in two classes: two rows
    if (o.what.empty()) o.what = a.name, o.cls = cls;
    o.seconds += a.seconds();
    ++o.count;
    if (std::string operation = operation_of(a); !operation.empty()) {
      OpTotal& f = operations[std::string(cls) + '\n' + operation];
      if (f.what.empty()) f.what = std::move(operation), f.cls = cls;
      f.seconds += a.seconds();
      ++f.count;
    }
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
  m.operations = costliest(operations, operations.size());
  return m;
}

/// One kind of operation, measured beside predicted (either side may be missing: count 0).
/// Counts are kernels on the measured side (a GEMM may launch two: cuBLASLt's split-K
/// reduction), calls on the predicted one.
struct OperationComparison {
  std::string what, cls;
  double measured_seconds = 0, predicted_seconds = 0;
  std::int64_t measured_count = 0, predicted_count = 0;
};

/// The measured operations (MeasuredStep::operations) beside the prediction's kinds of
/// operation (llama-plan's "costliest") of the same name and class: a GEMM or attention
/// call by trace::describe's name, a kernel of tessera's by its functor (the prediction's
/// "RmsNormForward<bf16> (row)" without its kernel class; spaces ignored, as the two
/// demanglers space template arguments differently). Costliest measured first, then the
/// predicted ones nothing measured matched; host synchronisations are left out. A functor
/// the CUDA kernel runs fused with another (RMSNorm's backward) is measured under the
/// launch's functor and predicted under its parts': it shows on both sides, unmatched.
inline std::vector<OperationComparison> compare_operations(const std::vector<OpTotal>& measured,
                                                           const std::vector<OpTotal>& predicted) {
  auto name = [](std::string_view what) {
    if (!what.starts_with("gemm ") && !what.starts_with("attention "))
      if (const std::size_t b = what.rfind(" ("); b != std::string_view::npos && what.back() == ')')
        what = what.substr(0, b);
    return std::string(what);
  };
  auto key = [](std::string_view what, std::string_view cls) {
    std::string k(cls);
    k += '\n';
    for (char c : what)
      if (c != ' ') k += c;
    return k;
  };
  std::vector<OperationComparison> out;
  std::map<std::string, std::size_t> index;
  for (const OpTotal& m : measured) {
    index[key(m.what, m.cls)] = out.size();
    out.push_back({m.what, m.cls, m.seconds, 0, m.count, 0});
  }
  for (const OpTotal& p : predicted) {
    if (p.cls == kClassHost) continue;
    const std::string what = name(p.what), k = key(what, p.cls);
    auto it = index.find(k);
    if (it == index.end()) {
      it = index.emplace(k, out.size()).first;
      out.push_back({what, p.cls, 0, 0, 0, 0});
    }
    out[it->second].predicted_seconds += p.seconds;
    out[it->second].predicted_count += p.count;
  }
  return out;
}

}  // namespace tessera::plan
