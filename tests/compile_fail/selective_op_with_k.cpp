// expect: tessera::Selective<Op>: takes no K
// Selective<Op> keeps matmul and attention outputs in every block: it has no K.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Checkpoint<Selective<Op, 3>>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
