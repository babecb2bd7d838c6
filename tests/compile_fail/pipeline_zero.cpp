// expect: tessera::Pipeline<Stages, Schedule>: Stages must be at least 1
// A pipeline of no stages.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Pipeline<0, OneFOneB>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
