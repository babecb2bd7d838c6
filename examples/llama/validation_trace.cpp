// llama-plan's traced validation batch (step_trace.hpp: trace_validation), apart from the
// step's trace: only llama-plan prices a validation, so only it compiles the validation's
// dry runs (the sanitizer build, which leaves llama-plan out, never does).
#include "step_trace.hpp"

#include "tessera/plan/dry_run.hpp"

namespace llama_plan {

tessera::plan::StepTrace trace_validation(const tessera::train::JobConfig& c, bool bf16_model, std::size_t device_bytes,
                                          int world, int rank) {
  tessera::plan::StepTrace st = bf16_model
                                    ? tessera::plan::dry_run_validation<tessera::bf16>(c, device_bytes, world, rank)
                                    : tessera::plan::dry_run_validation<float>(c, device_bytes, world, rank);
  if (device_bytes == 0) st.reserved_peak_bytes = st.peak_bytes;  // as trace_step's
  return st;
}

}  // namespace llama_plan
