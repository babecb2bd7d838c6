// The GEMMs a traced step issues, one entry per distinct GEMM: what bench-kernels times
// and checks cuBLASLt's algorithm choice on, so that it measures the shapes the step runs
// (the projections that read one input fused into one GEMM, the gradients written first
// with beta 0, the residual read as the output projection's C, the loss head's chunks)
// rather than a list kept by hand beside the model.
//
// A GEMM is told by trace::Gemm as a whole: its sizes, transposes, operand and result
// types and whether it reads C (beta != 0: a gradient summed into, or a residual read
// apart from the output, which costs the same bytes). Entries keep the order of their
// first issue (the forward's GEMMs, then the backward's), each with how many times the
// step issues it and the region it was first issued in (core/region.hpp: the loss head's
// GEMMs are told apart from the blocks').
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "tessera/backend/trace.hpp"

namespace tessera::plan {

/// One distinct GEMM of a step.
struct StepGemm {
  trace::Gemm gemm;
  std::int64_t count = 0;   // issues in the step
  std::string region;       // where it was first issued ("" outside any region)

  /// What the GEMM computes for a linear layer y = x W^T, from its transposes: nn::Linear
  /// issues nt forward, nn for the input gradient and tn for the weight gradient. A float8
  /// GEMM is always nt (the casts transpose), so there the first operand tells: a
  /// tensorwise backward's is the gradient in e5m2, for dx and dW alike.
  std::string pass() const {
    const bool beta = gemm.accumulate;
    if (gemm.operands == DType::f8e5m2) return beta ? "dx or dW += (e5m2 dy)" : "dx or dW (e5m2 dy)";
    if (gemm.ta == Trans::no && gemm.tb == Trans::yes) return beta ? "y = x W^T + C" : "y = x W^T";
    if (gemm.ta == Trans::no && gemm.tb == Trans::no) return beta ? "dx += dy W" : "dx = dy W";
    if (gemm.ta == Trans::yes && gemm.tb == Trans::no) return beta ? "dW += dy^T x" : "dW = dy^T x";
    return trace::trans_name(gemm.ta, gemm.tb) + (beta ? " +=" : "");
  }
};

/// The distinct GEMMs of `t` in the order they were first issued, each counted.
inline std::vector<StepGemm> step_gemms(const trace::Trace& t) {
  std::vector<StepGemm> out;
  for (const trace::Event& e : t.events()) {
    const auto* g = std::get_if<trace::Gemm>(&e.op);
    if (g == nullptr) continue;
    bool seen = false;
    for (StepGemm& s : out)
      if (s.gemm == *g) {
        ++s.count;
        seen = true;
        break;
      }
    if (!seen) out.push_back(StepGemm{*g, 1, e.region});
  }
  return out;
}

}  // namespace tessera::plan
