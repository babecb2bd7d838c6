// expect: tessera::Heads<H, KV>: H query heads and KV key/value heads, KV dividing H
// expect: Heads<32, 5>
// 5 key/value heads cannot be shared evenly by 32 query heads; checked with a dynamic
// degree too, when the head counts are given.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<dynamic, Heads<32, 5>>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
