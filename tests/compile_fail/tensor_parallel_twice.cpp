// expect: tessera::Parallel: tessera::TensorParallel<...> is given more than once; give each policy family once
// Two TensorParallel policies on one block, a static and a dynamic degree: the family may be given once.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<2>, Sharding<FSDP>, TensorParallel<dynamic>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
