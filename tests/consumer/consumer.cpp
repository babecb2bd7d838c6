// A project outside tessera that finds it with dependency('tessera') through pkg-config,
// and links what the headers call into: OpenBLAS, OpenMP, PCRE2 and SentencePiece.
#include <cstdio>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/data/synthetic_bpe.hpp"
#include "tessera/io/load_tokenizer.hpp"
#include "tessera/nn/transformer.hpp"

int main() {
  tessera::nn::ModelArgs a = tessera::nn::model_flavor("debugmodel");
  a.n_layers = 1;
  tessera::nn::Transformer<float, tessera::Cpu> model(a);
  const auto bpe = tessera::data::synthetic_bpe_tokenizer();  // PCRE2
  const bool round_trip = bpe.decode(bpe.encode("The fox was small.", true, true)) == "The fox was small.";
  const bool byte_ok = tessera::io::load_tokenizer("byte")->vocab_size() == 258;  // links SentencePiece too
  return model.num_params() == a.num_params() && round_trip && byte_ok ? 0 : 1;
}
