// expect: tessera::TensorParallel<N>: N must be a degree (an integer) or tessera::dynamic
// expect: TensorParallel<2.5
// A fractional degree: N is a number of ranks, so it must be an integer (or tessera::dynamic).
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<2.5>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
