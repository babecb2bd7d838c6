// Composition with a user's layer: a block type written outside the library (the
// GPT-J / PaLM parallel block of examples/custom_layer.hpp, which also changes op
// outputs in place) gets sharding, checkpointing and tensor parallelism by being
// wrapped, with the policies in either order, and trains the same model as the bare
// block on one rank.
#include <doctest/doctest.h>

#include "../../examples/custom_layer.hpp"
#include "harness.hpp"
#include "tessera/comm/thread.hpp"

namespace test_user_layer {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

using UserBlock = examples::ParallelBlock<float, Cpu>;
using BareModel = nn::Transformer<float, Cpu, UserBlock>;
template <class... Policies>
using WrappedModel = nn::Transformer<float, Cpu, Parallel<UserBlock, Policies...>>;

#if TESSERA_SHORT_TESTS
constexpr int kSteps = 2;
#else
constexpr int kSteps = 5;
#endif

template <class Model>
std::vector<double> losses_on(int ranks, comm::MeshShape shape) {
  std::vector<double> out;
  comm::run_thread_ranks(ranks, [&](comm::Communicator& world) {
    auto r = train_layout<Model>(world, shape, debug_job(8 / shape.dp(), 8, kSteps));
    if (world.rank() == 0) out = r.losses;
  }, nccl_rules());
  return out;
}

}  // namespace

TEST_CASE("a user's block under FSDP with selective checkpointing trains the model it trains alone") {
  const auto alone = losses_on<BareModel>(1, {});
  const auto fsdp = losses_on<WrappedModel<Sharding<FSDP>, Checkpoint<Selective<Op>>>>(2, {1, 1, 2, 1});
  const auto reversed = losses_on<WrappedModel<Checkpoint<Full>, Sharding<DDP>>>(2, {1, 2, 1, 1});
  CHECK(max_relative_difference(fsdp, alone) <= 1e-5);
  CHECK(max_relative_difference(reversed, alone) <= 1e-5);
}

TEST_CASE("a user's block under TensorParallel<2> trains the model it trains alone") {
  // The block splits because its layers take BlockArgs::tp: heads and hidden units over
  // the two ranks, the rows between blocks split by sequence parallelism.
  const auto alone = losses_on<BareModel>(1, {});
  const auto tp = losses_on<WrappedModel<TensorParallel<2>>>(2, {1, 1, 1, 2});
  CHECK(max_relative_difference(tp, alone) <= 1e-5);
}

TEST_CASE("a user's block: selective checkpointing gives bitwise the gradients of none, despite in-place changes") {
  const train::JobConfig c = debug_job(8, 8, 1);
  auto grads = [&](parallel::CheckpointMode mode) {
    parallel::Plan plan;
    plan.checkpoint = mode;
    WrappedModel<Checkpoint<Dynamic>> model(c.model.args, plan);
    model.init_weights(0);
    data::DataLoader loader(debug_tokens(), c.training.seq_len, 8);
    const data::Batch b = loader.next();
    model.zero_grad();
    model.forward_backward(b.inputs, b.targets, nn::Geometry{b.batch, b.seq_len}, 1.0 / 256);
    std::vector<float> all;
    model.for_each_parameter(
        [&](nn::Parameter<float>& p) { all.insert(all.end(), p.grad.data(), p.grad.data() + p.numel()); });
    return all;
  };
  using K = parallel::CheckpointMode::Kind;
  const auto none = grads({K::none, 0});
  CHECK(grads({K::selective_op, 0}) == none);
  CHECK(grads({K::full, 0}) == none);
}

}  // namespace test_user_layer
