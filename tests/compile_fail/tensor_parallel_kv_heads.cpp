// expect: tessera::TensorParallel<N, Heads<H, KV>>: N and the key/value head count KV must divide one another (with more ranks than kv heads each kv head is replicated over the ranks that read it)
// expect: TensorParallel<8, tessera::Heads<48, 12> >
// 8 divides the 48 query heads, but neither 8 nor the 12 kv heads divides the other:
// a rank would hold 1.5 kv heads.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<8, Heads<48, 12>>, Checkpoint<Full>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
