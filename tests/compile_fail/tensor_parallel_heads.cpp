// expect: tessera::TensorParallel<N, Heads<H, KV>>: N does not divide the query head count H (each rank computes H / N heads)
// expect: TensorParallel<16, tessera::Heads<24, 8> >
// 24 query heads (Llama 3.2 3B's) do not split over 16 ranks, though its 8 kv heads
// would (each on 2 ranks): caught at compile time, before any run.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<FSDP>, TensorParallel<16, Heads<24, 8>>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
