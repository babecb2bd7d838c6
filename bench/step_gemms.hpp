// The GEMMs of one training step of a Llama flavor on one GPU, as llama-plan traces the
// step (examples/llama/step_trace.hpp, plan/step_gemms.hpp): the shapes bench-kernels'
// GEMM, SM-hold and float8 sections time. Compiled by g++ (step_gemms.cpp), so that the
// CUDA benchmark includes this alone, not the model and the trainer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/plan/step_gemms.hpp"

namespace tessera::bench {

/// The distinct GEMMs of one bf16 training step of `flavor` (layer/args.hpp's names) at
/// batch 1 x `tokens`, without activation checkpointing, on one device of `device_bytes`
/// (the loss head's chunks as nn::ChunkedCrossEntropyHead sizes them there), in the order
/// the step first issues them. With `float8`, the blocks' linear layers run cuBLASLt's
/// float8 matmul by the tensorwise recipe (model.converters = ["float8"], the output
/// projection kept in bf16, as torchtitan's default filter_fqns).
std::vector<tessera::plan::StepGemm> step_gemms(const std::string& flavor, std::int64_t tokens,
                                                std::size_t device_bytes, bool float8);

}  // namespace tessera::bench
