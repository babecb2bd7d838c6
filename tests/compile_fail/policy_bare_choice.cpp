// expect: tessera::Parallel<Block, Policies...>: every policy must be a tessera::Sharding<...>, a tessera::TensorParallel<...>, a tessera::Pipeline<...> or a tessera::Checkpoint<...> (this one is none of them)
// expect: check_policy<tessera::FSDP>
// A choice given without its family (FSDP for Sharding<FSDP>); the diagnostic names it.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, FSDP>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
