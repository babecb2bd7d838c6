// expect: tessera::Checkpoint<Mode>: Mode must be tessera::None, tessera::Full, tessera::Selective<tessera::Op>, tessera::Selective<tessera::EveryNthBlock, K> or tessera::Dynamic
// expect: Checkpoint<tessera::Op>
// Op is a choice of Selective, not of Checkpoint: Checkpoint<Selective<Op>> is meant.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Checkpoint<Op>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
