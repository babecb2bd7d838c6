// expect: tessera::Selective<EveryNthBlock, K>: K (checkpoint every K-th block) must be at least 1
// Selective<EveryNthBlock, K> checkpoints every K-th block: K = 0 means nothing.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<FSDP>, Checkpoint<Selective<EveryNthBlock, 0>>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
