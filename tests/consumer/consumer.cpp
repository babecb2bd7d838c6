// A project outside tessera that finds it with dependency('tessera') through pkg-config.
#include <cstdio>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"

int main() {
  tessera::nn::ModelArgs a = tessera::nn::model_flavor("debugmodel");
  a.n_layers = 1;
  tessera::nn::Transformer<float, tessera::Cpu> model(a);
  return model.num_params() == a.num_params() ? 0 : 1;
}
