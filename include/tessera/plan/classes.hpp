// The classes a step's time is told by, predicted (plan/cost.hpp) or measured
// (plan/measured.hpp), and the two sums made of them. Apart from cost.hpp so that code
// which measures a step (CUDA translation units among it) needs nothing of the pricing.
#pragma once

#include <cstdint>
#include <string>

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

}  // namespace tessera::plan
