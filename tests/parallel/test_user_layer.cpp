// Composition with a user's layer: a block type written outside the library (the
// GPT-J / PaLM parallel block of examples/custom_layer.hpp, which also changes op
// outputs in place) gets sharding, checkpointing and tensor parallelism by being
// wrapped, with the policies in either order, and trains the same model as the bare
// block on one rank. A block with settings of its own (the ReLU^2 block there: its own
// MLP width and residual scale) gets them on every rank of every layout, trains under
// tensor parallelism whatever SwiGLU's width would be, is refused by name where its own
// width does not split; and every rank of a layout, also a pipeline rank holding no
// block, counts the model's parameters and FLOPs as one rank does.
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
std::vector<double> losses_on(int ranks, comm::MeshShape shape, const std::vector<std::string>& keys = {},
                              const typename Model::block_options_type& options = {}) {
  std::vector<double> out;
  comm::run_thread_ranks(ranks, [&](comm::Communicator& world) {
    auto r = train_layout<Model>(world, shape, debug_job(8 / shape.dp(), 8, kSteps, keys), options);
    if (world.rank() == 0) out = r.losses;
  }, nccl_rules());
  return out;
}

using ReluBlock = examples::ReluSquaredBlock<float, Cpu>;
/// The ReLU^2 block with every choice left to the Plan (one model type for every layout
/// below: each trained model type costs the build seconds).
using ReluModel = nn::Transformer<float, Cpu, Parallel<ReluBlock, Sharding<Dynamic>, TensorParallel<dynamic>,
                                                       Pipeline<dynamic>>>;
// A width of its own that is SwiGLU's (the model's ffn_hidden, 256 here) under no
// reading, divides 2 but not 4; and a scale that is not 1, so that a block made
// without its options would train another model.
const examples::ReluSquaredOptions kRelu{90, 0.5};

/// Each rank's message when `ranks` thread ranks make a model of type Model laid out as
/// `shape` by the config `c` (empty: it was made).
template <class Model>
std::vector<std::string> errors_making(comm::MeshShape shape, const train::JobConfig& c,
                                       const typename Model::block_options_type& options = {}) {
  std::vector<std::string> errors(static_cast<std::size_t>(shape.world()));
  comm::run_thread_ranks(shape.world(), [&](comm::Communicator& world) {
    try {
      comm::DeviceMesh mesh(world, shape);
      Model model(c.model.args, train::make_plan(c, &mesh), options);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
  }, nccl_rules());
  return errors;
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

TEST_CASE("a user's block with its own options trains under tensor parallelism whatever SwiGLU's width would be") {
  // 255: a SwiGLU width TP 2 does not divide. The ReLU^2 block has no SwiGLU, so only
  // its own width (90) must split; the model once refused this layout by SwiGLU's.
  const std::vector<std::string> odd_swiglu = {"--model.ffn_hidden", "255"};
  const auto alone = losses_on<nn::Transformer<float, Cpu, ReluBlock>>(1, {}, odd_swiglu, kRelu);
  const auto tp = losses_on<ReluModel>(2, {1, 1, 1, 2}, odd_swiglu, kRelu);
  CHECK(max_relative_difference(tp, alone) <= 1e-5);
  // The options reached every block: without the scale the run is another one, ten times
  // the parity bar away (over the sanitizer build's 2 steps: 4.9e-4).
  const auto unscaled = losses_on<nn::Transformer<float, Cpu, ReluBlock>>(1, {}, odd_swiglu, {90, 1.0});
  CHECK(max_relative_difference(unscaled, alone) > 1e-4);
}

TEST_CASE("a user's block: a tensor-parallel degree its own width does not divide is refused by name on every rank") {
  const auto errors = errors_making<ReluModel>({1, 1, 1, 4}, debug_job(8, 8, 1), kRelu);
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("layers.0.mlp.w1.weight: shape (90, 64) does not split into 4 pieces along dimension 0") !=
          std::string::npos);
  }
  // Its options left out: the width is the default's 0, refused as such.
  for (const auto& e : errors_making<ReluModel>({1, 1, 1, 2}, debug_job(8, 8, 1))) {
    CAPTURE(e);
    CHECK(e.find(": ReluSquaredOptions::hidden must be positive, got 0") != std::string::npos);
  }
}

TEST_CASE("every rank of a layout counts the model's parameters and FLOPs as one rank does") {
  // Two pipeline stages, the first the embedding alone (split point layers.0): pipeline
  // rank 0 holds no block; each stage over two FSDP shards.
  const train::JobConfig c = debug_job(8, 8, 1, {"--parallelism.pipeline_parallel_split_points", "layers.0"});
  const nn::ModelArgs& a = c.model.args;
  const comm::MeshShape shape{2, 1, 2, 1};
  constexpr std::int64_t kSeq = 32;
  const nn::Transformer<float, Cpu, ReluBlock> relu_alone(a, {}, kRelu);
  std::vector<std::size_t> blocks(4);
  std::vector<int> llama_agrees(4), relu_agrees(4);
  comm::run_thread_ranks(4, [&](comm::Communicator& world) {
    comm::DeviceMesh mesh(world, shape);
    const parallel::Plan plan = train::make_plan(c, &mesh);
    const auto r = static_cast<std::size_t>(world.rank());
    const CpuDynamicModel llama(a, plan);
    blocks[r] = llama.n_layers();
    llama_agrees[r] = llama.num_params() == a.num_params() && llama.flops_per_token(kSeq) == a.flops_per_token(kSeq) &&
                      llama.flops_per_token(kSeq, true) == a.flops_per_token(kSeq, true);
    const ReluModel relu(a, plan, kRelu);
    relu_agrees[r] = relu.num_params() == relu_alone.num_params() &&
                     relu.flops_per_token(kSeq) == relu_alone.flops_per_token(kSeq);
  }, nccl_rules());
  CHECK(blocks == std::vector<std::size_t>{0, 0, 6, 6});  // pipeline rank 0: the embedding only
  CHECK(llama_agrees == std::vector<int>{1, 1, 1, 1});
  CHECK(relu_agrees == std::vector<int>{1, 1, 1, 1});
}

TEST_CASE("a user's block: checkpointing gives the gradients of none (bitwise where it runs the projections alike), despite in-place changes") {
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
    std::vector<std::vector<float>> all;  // per parameter
    model.for_each_parameter(
        [&](nn::Parameter<float>& p) { all.emplace_back(p.grad.data(), p.grad.data() + p.numel()); });
    return all;
  };
  using K = parallel::CheckpointMode::Kind;
  const auto none = grads({K::none, 0});
  CHECK(grads({K::full, 0}) == none);
  // Selective "op" runs the projections one by one (the block's Attention and FeedForward
  // run them as one elsewhere): the gradients of none to rounding. A stash the in-place
  // changes had reached would be off by the values themselves.
  const auto op = grads({K::selective_op, 0});
  REQUIRE(op.size() == none.size());
  for (std::size_t i = 0; i < op.size(); ++i) {
    CAPTURE(i);
    CHECK(gap_to_scale(op[i], none[i]) <= 1e-5);
  }
}

}  // namespace test_user_layer
