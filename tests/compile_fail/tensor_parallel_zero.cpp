// expect: tessera::TensorParallel<N>: the degree N must be at least 1
// expect: TensorParallel<0
// A degree of 0 ranks splits nothing (1 is no tensor parallelism).
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<0>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
