// llama-generate on one GPU (--device cuda): defined in generate_cuda.cpp, built where
// CUDA is found.
#pragma once

#include <string>

#include "generate_run.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/layer/args.hpp"

namespace tessera::llama_generate {

/// Loads the saved model at `checkpoint` (of arguments `a`) onto the current GPU, its
/// weights in bf16 or float32, and samples r from it (sample_text).
std::string sample_on_cuda(const nn::ModelArgs& a, const std::string& checkpoint, bool bf16_weights,
                           const io::Tokenizer& tok, const Request& r);

}  // namespace tessera::llama_generate
