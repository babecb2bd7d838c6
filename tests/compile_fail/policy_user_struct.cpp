// expect: tessera::Parallel<Block, Policies...>: every policy must be a tessera::Sharding<...>, a tessera::TensorParallel<...>, a tessera::Pipeline<...> or a tessera::Checkpoint<...> (this one is none of them)
// expect: check_policy<MyPolicy>
// A user's own tag type among the policies; the diagnostic names it.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

struct MyPolicy {};

using Block = Parallel<nn::LlamaBlock<float, Cpu>, MyPolicy, Checkpoint<Full>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
