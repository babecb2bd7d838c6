// expect: tessera::Selective<What, K>: What must be tessera::Op or tessera::EveryNthBlock
// expect: Selective<int
// Selective over a type that is neither Op nor EveryNthBlock.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Checkpoint<Selective<int>>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
