// llama-generate over the CUDA backend: the saved model on one GPU, decoded there through
// the KV cache (docs/layers.md). Host C++: the kernels come from the build's kernel
// library (examples/instances/cuda_kernels.cu).
#include "generate_cuda.hpp"

#include <string>

#include "tessera/backend/cuda/cuda.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/nn/transformer.hpp"

namespace tessera::llama_generate {

namespace {

template <class T>
std::string sample_with(const nn::ModelArgs& a, const std::string& checkpoint, const io::Tokenizer& tok,
                        const Request& r) {
  nn::Transformer<T, Cuda> model(a);
  train::load_saved_model(model, checkpoint);
  return sample_text(model, tok, r);
}

}  // namespace

std::string sample_on_cuda(const nn::ModelArgs& a, const std::string& checkpoint, bool bf16_weights,
                           const io::Tokenizer& tok, const Request& r) {
  cuda::require_device();
  return bf16_weights ? sample_with<bf16>(a, checkpoint, tok, r) : sample_with<float>(a, checkpoint, tok, r);
}

}  // namespace tessera::llama_generate
