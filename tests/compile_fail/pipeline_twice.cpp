// expect: tessera::Parallel: tessera::Pipeline<...> is given more than once; give each policy family once
// Two Pipeline policies on one block: the family may be given once.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Pipeline<2, GPipe>, Sharding<FSDP>, Pipeline<dynamic>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
