// One traced training step of a config, compiled once for llama-plan and llama-train (and
// llama-plan's traced validation batch).
//
// llama-plan prices it on a machine; llama-train measures the CPU's GEMM peak for MFU on
// its GEMMs (plan/cpu.hpp: measure_gemm_peak). The model types of the dry run are
// instantiated in step_trace.cpp alone, so neither binary compiles them twice.
#pragma once

#include <cstddef>
#include <string>

#include "tessera/plan/traced_step.hpp"
#include "tessera/train/job_config.hpp"

namespace llama_plan {

/// One traced step of the model `c` describes: the bf16 model when `bf16_model`, else
/// float32 (with bf16 parameter values under mixed_precision_param = "bfloat16"), on a
/// device of `device_bytes` (0: the host, whose reservation is its live peak): world
/// rank `rank` of a layout of `world` ranks.
tessera::plan::StepTrace trace_step(const tessera::train::JobConfig& c, bool bf16_model, std::size_t device_bytes = 0,
                                    int world = 1, int rank = 0);

/// The memory snapshot of that step (PyTorch's pickle, io/memory_snapshot.hpp): the
/// replayed CUDA allocator's segments and blocks at the step's end, and every allocation
/// and release from the model's first parameter on, each with the spans open at it.
std::string memory_snapshot(const tessera::train::JobConfig& c, bool bf16_model, std::size_t device_bytes,
                            int world = 1, int rank = 0);

/// One traced global batch of the config's validation ([validation]), after a training
/// step, on the same terms as trace_step (plan::dry_run_validation). llama-plan's alone:
/// defined in validation_trace.cpp, which only it compiles.
tessera::plan::StepTrace trace_validation(const tessera::train::JobConfig& c, bool bf16_model,
                                          std::size_t device_bytes = 0, int world = 1, int rank = 0);

/// `c` on one device: every parallelism degree 1 (the whole model's step on one rank).
tessera::train::JobConfig on_one_device(tessera::train::JobConfig c);

}  // namespace llama_plan
