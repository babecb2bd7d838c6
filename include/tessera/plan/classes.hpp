// The classes a step's time is told by, predicted (plan/cost.hpp) or measured
// (plan/measured.hpp), and the two sums made of them. Apart from cost.hpp so that code
// which measures a step (CUDA translation units among it) needs nothing of the pricing.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera::plan {

struct ClassTime {
  double seconds = 0;
  std::int64_t count = 0;
};

/// One kind of operation, summed: "gemm 8192x14336x4096 bf16 (tn)", "RmsNormForward<bf16>".
struct OpTotal {
  std::string what;
  std::string cls;
  double seconds = 0;
  std::int64_t count = 0;
};

inline const char* kClassGemm = "GEMMs";
inline const char* kClassAttention = "attention";
inline const char* kClassKernels = "memory-bound kernels";
inline const char* kClassLossHead = "loss head";
inline const char* kClassOptimizer = "optimizer";
inline const char* kClassHost = "host synchronisations";

/// A step's time by class, every class listed, in this order.
using ClassTimes = std::vector<std::pair<std::string, ClassTime>>;

inline ClassTimes zero_class_times() {
  ClassTimes t;
  for (const char* c : {kClassGemm, kClassAttention, kClassKernels, kClassLossHead, kClassOptimizer, kClassHost})
    t.push_back({c, {}});
  return t;
}

/// One operation of `seconds` counted in its class.
inline void add_to_class(ClassTimes& t, std::string_view cls, double seconds) {
  for (auto& [name, c] : t)
    if (name == cls) {
      c.seconds += seconds;
      ++c.count;
    }
}

/// The `top` costliest of the summed kinds, costliest first.
inline std::vector<OpTotal> costliest(const std::map<std::string, OpTotal>& kinds, std::size_t top) {
  std::vector<OpTotal> out;
  for (const auto& [key, k] : kinds) out.push_back(k);
  std::sort(out.begin(), out.end(), [](const OpTotal& a, const OpTotal& b) { return a.seconds > b.seconds; });
  if (out.size() > top) out.resize(top);
  return out;
}

}  // namespace tessera::plan
