// expect: tessera::Parallel: tessera::Checkpoint<...> is given more than once; give each policy family once
// Two Checkpoint policies, with a Sharding between them: counted per family, in any order.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Checkpoint<Full>, Sharding<FSDP>, Checkpoint<Selective<Op>>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
