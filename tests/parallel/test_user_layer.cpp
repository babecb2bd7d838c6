// Composition with a user's layer: a block type written outside the library (the
// GPT-J / PaLM parallel block of examples/custom_layer.cpp, which also changes op
// outputs in place) gets sharding and checkpointing by being wrapped, with the
// policies in either order, and trains the same model as the bare block on one rank.
#include <doctest/doctest.h>

#include "harness.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/nn/feed_forward.hpp"
#include "tessera/nn/rmsnorm.hpp"

namespace test_user_layer {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

/// y = x + attention(norm(x)) + feed_forward(norm(x))
template <class T, Backend B>
class SideBySideBlock {
 public:
  using scalar_type = T;
  using backend_type = B;

  explicit SideBySideBlock(const nn::BlockArgs<T, B>& b)
      : norm_(b.name + ".norm", b.model.dim, b.model.norm_eps),
        attention_(b.name + ".attention", b.model, nn::output_init_std(b.model, b.layer_id), b.rope),
        feed_forward_(b.name + ".feed_forward", b.model, nn::output_init_std(b.model, b.layer_id)) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> n = norm_.forward(ctx.child("norm"), x);
    Tensor<T> y = attention_.forward(ctx.child("attention"), n);
    Tensor<T> f = feed_forward_.forward(ctx.child("feed_forward"), n);
    B::for_each(y.numel(), ops::Axpy<T>{T(1), f.data(), y.data()});  // in place, on wo's output
    B::for_each(y.numel(), ops::Axpy<T>{T(1), x.data(), y.data()});
    return y;
  }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy) {
    Tensor<T> dn = attention_.backward(ctx.child("attention"), dy);
    Tensor<T> df = feed_forward_.backward(ctx.child("feed_forward"), dy);
    B::for_each(dn.numel(), ops::Axpy<T>{T(1), df.data(), dn.data()});
    Tensor<T> dx = norm_.backward(ctx.child("norm"), dn);
    B::for_each(dx.numel(), ops::Axpy<T>{T(1), dy.data(), dx.data()});
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    norm_.for_each_parameter(f);
    attention_.for_each_parameter(f);
    feed_forward_.for_each_parameter(f);
  }

 private:
  nn::RmsNorm<T, B> norm_;
  nn::Attention<T, B> attention_;
  nn::FeedForward<T, B> feed_forward_;
};

using UserBlock = SideBySideBlock<float, Cpu>;
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
