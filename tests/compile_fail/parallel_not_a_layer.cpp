// expect: tessera::Parallel<Block, Policies...>: Block must satisfy tessera::nn::Layer (forward, backward over a Context, for_each_parameter)
// expect: Parallel<NoParameters
// A block without for_each_parameter is not a Layer: the policies could not reach its parameters.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

struct NoParameters {
  using scalar_type = float;
  using backend_type = Cpu;
  explicit NoParameters(const nn::BlockArgs<float, Cpu>&) {}
  Tensor<float> forward(const nn::Context<float>&, const Tensor<float>& x) { return x; }
  Tensor<float> backward(const nn::Context<float>&, const Tensor<float>& dy) { return dy; }
};

using Block = Parallel<NoParameters, Sharding<FSDP>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
