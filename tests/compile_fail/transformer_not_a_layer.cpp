// expect: tessera::nn::Transformer<T, B, Block>: Block must satisfy tessera::nn::Layer (forward, backward over a Context, for_each_parameter)
// expect: Transformer<float, tessera::Cpu, NoBackward>
// A block without backward is not a Layer.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"

using namespace tessera;

struct NoBackward {
  using scalar_type = float;
  using backend_type = Cpu;
  explicit NoBackward(const nn::BlockArgs<float, Cpu>&) {}
  Tensor<float> forward(const nn::Context<float>&, const Tensor<float>& x) { return x; }
  template <class F>
  void for_each_parameter(F&&) {}
};

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, NoBackward> model(args); }
