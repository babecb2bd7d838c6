// expect: tessera::Parallel<Block, TensorParallel<...>>: Block does not split over tensor-parallel ranks: it must declare `static constexpr bool tensor_parallel = true` and split its heads and hidden units over nn::BlockArgs::tp, as nn::LlamaBlock does
// expect: Parallel<WholeBlock
// A user's own Layer without `tensor_parallel = true`: it would compute whole on every
// rank while its input is split by rows, so TensorParallel refuses it. Sharding alone
// wraps it fine (the control).
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

struct WholeBlock {
  using scalar_type = float;
  using backend_type = Cpu;

  explicit WholeBlock(const nn::BlockArgs<float, Cpu>& b)
      : scale_(b.name + ".scale", Shape{b.model.dim}, nn::Init::ones()) {}
  Tensor<float> forward(const nn::Context<float>&, const Tensor<float>& x) { return x; }
  Tensor<float> backward(const nn::Context<float>&, const Tensor<float>& dy) { return dy; }
  template <class F>
  void for_each_parameter(F&& f) {
    f(scale_);
  }

 private:
  nn::Parameter<float> scale_;
};
static_assert(nn::Layer<WholeBlock>, "the block is a Layer: it only lacks tensor_parallel");

using Block = Parallel<WholeBlock, Sharding<FSDP>, TensorParallel<2>>;

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, Block> model(args); }
