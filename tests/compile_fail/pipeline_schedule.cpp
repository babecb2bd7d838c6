// expect: tessera::Pipeline<Stages, Schedule>: Schedule must be tessera::GPipe, tessera::OneFOneB, tessera::Interleaved1F1B, tessera::InterleavedZeroBubble, tessera::LoopedBFS, tessera::ZBVZeroBubble, tessera::DualPipeV or tessera::Dynamic
// A schedule that is not one of the pipeline schedules (here a checkpoint choice).
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

using Block = Parallel<nn::LlamaBlock<float, Cpu>, Pipeline<4, Full>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
