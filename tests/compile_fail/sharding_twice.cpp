// expect: tessera::Parallel: tessera::Sharding<...> is given more than once; give each policy family once
// Two Sharding policies on one block: the family may be given once.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<FSDP>, Sharding<DDP>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
