// expect: tessera::Sharding<Mode>: Mode must be tessera::FSDP, tessera::HSDP, tessera::DDP, tessera::None or tessera::Dynamic
// expect: Sharding<int>
// Sharding over a type that is not a sharding choice.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<int>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
