// expect: compiles
// The control: valid policies compile with the same flags, so each failing case fails
// for its own reason. Policies in either order, Dynamic, Selective<EveryNthBlock, 2>, a
// user's own layer wrapped in Parallel with both families, and TensorParallel: static
// and dynamic degrees, head counts checked (more ranks than kv heads included), composed
// with Sharding and Checkpoint, over the Llama block and over a user's block that
// declares it splits. With both namespaces in use, Layer is the concept, unambiguously.
#include <type_traits>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"

using namespace tessera;

/// y = x * scale: one parameter, enough to be a Layer and to be sharded.
struct ScaleBlock {
  using scalar_type = float;
  using backend_type = Cpu;

  explicit ScaleBlock(const nn::BlockArgs<float, Cpu>& b)
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
static_assert(nn::Layer<ScaleBlock>);

/// ScaleBlock that says it splits over tensor-parallel ranks (a per-row scale needs
/// nothing from the other ranks: each computes on its own rows).
struct SplitScaleBlock : ScaleBlock {
  using ScaleBlock::ScaleBlock;
  static constexpr bool tensor_parallel = true;
};
static_assert(nn::TensorParallelLayer<SplitScaleBlock> && !nn::TensorParallelLayer<ScaleBlock>);

using ShardingFirst = Parallel<ScaleBlock, Sharding<Dynamic>, Checkpoint<Selective<EveryNthBlock, 2>>>;
using CheckpointFirst = Parallel<ScaleBlock, Checkpoint<Selective<EveryNthBlock, 2>>, Sharding<Dynamic>>;
using Llama = Parallel<nn::LlamaBlock<float, Cpu>, Checkpoint<Dynamic>, Sharding<HSDP>>;
using ShardingOnly = Parallel<ScaleBlock, Sharding<DDP>>;
using CheckpointOnly = Parallel<ScaleBlock, Checkpoint<Selective<Op>>>;
using LlamaTp4 = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<4, Heads<32, 8>>, Sharding<FSDP>>;
using LlamaTpDynamic = Parallel<nn::LlamaBlock<float, Cpu>, Checkpoint<Full>, TensorParallel<tessera::dynamic>>;
using LlamaTp16 = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<16, Heads<32, 8>>>;  // 2 ranks per kv head
using UserTp = Parallel<SplitScaleBlock, Sharding<Dynamic>, TensorParallel<2>, Checkpoint<Selective<Op>>>;

static_assert(std::is_same_v<ShardingFirst::sharding_policy, CheckpointFirst::sharding_policy>);
static_assert(std::is_same_v<ShardingFirst::checkpoint_policy, CheckpointFirst::checkpoint_policy>);
static_assert(std::is_same_v<CheckpointFirst::sharding_policy, Sharding<Dynamic>>);
static_assert(std::is_same_v<CheckpointFirst::checkpoint_policy, Checkpoint<Selective<EveryNthBlock, 2>>>);
static_assert(std::is_same_v<ShardingOnly::checkpoint_policy, Checkpoint<None>>);
static_assert(std::is_same_v<CheckpointOnly::sharding_policy, Sharding<None>>);
static_assert(nn::Layer<ShardingFirst> && nn::Layer<CheckpointFirst> && nn::Layer<Llama>);
static_assert(std::is_same_v<LlamaTp4::tensor_parallel_policy, TensorParallel<4, Heads<32, 8>>>);
static_assert(std::is_same_v<LlamaTp4::sharding_policy, Sharding<FSDP>>);
static_assert(std::is_same_v<LlamaTpDynamic::checkpoint_policy, Checkpoint<Full>>);
static_assert(LlamaTpDynamic::tensor_parallel_policy::dynamic_degree);
static_assert(LlamaTp16::tensor_parallel_policy::degree == 16 &&
              LlamaTp16::tensor_parallel_policy::heads::n_kv_heads == 8);
static_assert(std::is_same_v<UserTp::tensor_parallel_policy, TensorParallel<2>>);
static_assert(nn::Layer<LlamaTp4> && nn::Layer<LlamaTpDynamic> && nn::Layer<LlamaTp16> && nn::Layer<UserTp>);

namespace both_namespaces {
using namespace tessera;
using namespace tessera::nn;
static_assert(Layer<ScaleBlock> && Layer<ShardingFirst>);
}  // namespace both_namespaces

template <class Block>
void build(const nn::ModelArgs& args, const parallel::Plan& plan) {
  nn::Transformer<float, Cpu, Block> model(args, plan);
  model.init_weights(0);
}

void build_all(const nn::ModelArgs& args, const parallel::Plan& plan) {
  build<ShardingFirst>(args, plan);
  build<CheckpointFirst>(args, plan);
  build<Llama>(args, plan);
  build<ShardingOnly>(args, plan);
  build<CheckpointOnly>(args, plan);
  build<LlamaTp4>(args, plan);
  build<LlamaTpDynamic>(args, plan);
  build<LlamaTp16>(args, plan);
  build<UserTp>(args, plan);
}
