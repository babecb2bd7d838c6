// expect: tessera::nn::Transformer<T, B, Block>: Block must be constructible from tessera::nn::BlockArgs<T, B>
// expect: Transformer<float, tessera::Cpu, SizedBlock>
// A Layer whose constructor takes something else than BlockArgs: the model cannot build it.
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"

using namespace tessera;

struct SizedBlock {
  using scalar_type = float;
  using backend_type = Cpu;
  explicit SizedBlock(std::int64_t dim) : dim_(dim) {}
  Tensor<float> forward(const nn::Context<float>&, const Tensor<float>& x) { return x; }
  Tensor<float> backward(const nn::Context<float>&, const Tensor<float>& dy) { return dy; }
  template <class F>
  void for_each_parameter(F&&) {}
  std::int64_t dim_;
};
static_assert(nn::Layer<SizedBlock>, "the block is a Layer: only its constructor is wrong");

void build(const nn::ModelArgs& args) { nn::Transformer<float, Cpu, SizedBlock> model(args); }
