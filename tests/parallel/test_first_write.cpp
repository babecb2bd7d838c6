// The first write (layer/layer.hpp): zero_grad() zeroes nothing, the step's first writer
// of each gradient overwrites it (a GEMM with beta 0, a copy of the first reduction) and
// what nothing wrote is zeroed as the backward ends. Held here with every allocation of
// the CPU backend NaN-filled (cpu::FillNewAllocations) and every forgotten gradient
// NaN-filled too, so that any write that still adds to stale memory shows as NaN:
// - one rank, tied and untied embeddings, two micro-batches: the gradients are bit for
//   bit those of gradients zeroed before the step;
// - FSDP, HSDP and DDP with gradient accumulation, tensor parallelism with key and value
//   heads held by several ranks and sequence parallelism, a zero-bubble pipeline (weight
//   gradients deferred): the same losses as one rank;
// - a user's block that only adds into its gradients (no writes_gradients_first) is
//   handed zeros, alone and under FSDP.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "harness.hpp"
#include "tessera/backend/cpu/device_memory.hpp"
#include "tessera/comm/thread.hpp"

namespace test_first_write {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

#if TESSERA_SHORT_TESTS
constexpr int kSteps = 2;
#else
constexpr int kSteps = 3;
#endif

using OneRankModel = nn::Transformer<float, Cpu, nn::LlamaBlock<float, Cpu>>;

/// Every local gradient after two micro-batches of forward_backward, flattened. With
/// `poison`, each gradient is NaN-filled after zero_grad() (what a first writer must
/// not read); without, each is zeroed and marked written (what adding writers expect).
std::vector<float> gradients_after_two_micro_batches(bool tied, bool poison) {
  train::JobConfig c = debug_job(2, 4, 1, {"--model.tie_embeddings", tied ? "true" : "false"});
  OneRankModel model(c.model.args);
  model.init_weights(0);
  model.zero_grad();
  model.for_each_local_parameter([&](nn::Parameter<float>& p) {
    if (poison)
      Cpu::for_each(p.grad.numel(), ops::Fill<float>{std::numeric_limits<float>::quiet_NaN(), p.grad.data()});
    else
      p.zero_grad_if_unwritten<Cpu>();
  });
  const auto& tokens = debug_tokens();
  const std::int64_t seq = c.training.seq_len;
  for (int m = 0; m < 2; ++m) {
    std::vector<std::int32_t> in, out;
    for (std::int64_t i = 0; i < 2 * seq; ++i) {
      in.push_back(static_cast<std::int32_t>(tokens[static_cast<std::size_t>(m * 2 * seq + i)]));
      out.push_back(static_cast<std::int32_t>(tokens[static_cast<std::size_t>(m * 2 * seq + i + 1)]));
    }
    model.forward_backward(in, out, nn::Geometry{2, seq}, 1.0 / 128, m == 1);
  }
  std::vector<float> all;
  model.for_each_local_parameter([&](nn::Parameter<float>& p) {
    CHECK(p.grad_written);
    all.insert(all.end(), p.grad.data(), p.grad.data() + p.grad.numel());
  });
  return all;
}

/// Rank 0's losses of `shape` with `keys`, `local` sequences per rank and micro-batch,
/// a global batch of 8; every rank must agree.
template <class Model = CpuDynamicModel>
std::vector<double> losses(comm::MeshShape shape, std::int64_t local, const std::vector<std::string>& keys = {}) {
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(shape.world()));
  comm::run_thread_ranks(
      shape.world(),
      [&](comm::Communicator& world) {
        per_rank[static_cast<std::size_t>(world.rank())] =
            train_layout<Model>(world, shape, debug_job(local, 8, kSteps, keys)).losses;
      },
      nccl_rules());
  for (const auto& r : per_rank) CHECK(r == per_rank.front());
  return per_rank.front();
}

bool all_finite(const std::vector<double>& v) {
  for (double x : v)
    if (!std::isfinite(x)) return false;
  return !v.empty();
}

/// y = x * s, column by column, with a per-column scale s: a block whose backward only
/// adds into its gradient (ds += sum over rows of dy * x), as a user's first block would,
/// and that does not declare writes_gradients_first.
template <class T>
struct ScaleColumns {
  const T* x;
  const T* s;
  T* y;
  std::int64_t cols;
  TESSERA_HD void operator()(std::int64_t i) const { y[i] = x[i] * s[i % cols]; }
};
template <class T>
struct AddScaleGradient {
  const T* x;
  const T* dy;
  T* ds;
  std::int64_t rows, cols;
  TESSERA_HD void operator()(std::int64_t j) const {
    T sum = 0;
    for (std::int64_t r = 0; r < rows; ++r) sum += dy[r * cols + j] * x[r * cols + j];
    ds[j] += sum;
  }
};

template <class T, Backend B>
class AddingBlock : public nn::LayerTypes<T, B> {
 public:
  explicit AddingBlock(const nn::BlockArgs<T, B>& b)
      : inner_(b), scale_(nn::Parameter<T>::template on<B>(b.name + ".scale", Shape{b.model.dim}, nn::Init::ones())) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) {
    Tensor<T> y = inner_.forward(ctx.child("inner"), x);
    Tensor<T> z = B::template empty<T>(y.shape());
    B::for_each(y.numel(), ScaleColumns<T>{y.data(), scale_.value.data(), z.data(), y.size(1)});
    ctx.save("y", nn::SaveKind::input, y);
    return z;
  }
  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dz) {
    const Tensor<T> y = ctx.saved("y");
    B::for_each(y.size(1), AddScaleGradient<T>{y.data(), dz.data(), scale_.grad.data(), y.size(0), y.size(1)});
    Tensor<T> dy = B::template empty<T>(dz.shape());
    B::for_each(dz.numel(), ScaleColumns<T>{dz.data(), scale_.value.data(), dy.data(), dz.size(1)});
    return inner_.backward(ctx.child("inner"), dy);
  }
  template <class F>
  void for_each_parameter(F&& f) {
    inner_.for_each_parameter(f);
    f(scale_);
  }

 private:
  nn::LlamaBlock<T, B> inner_;
  nn::Parameter<T> scale_;
};


static_assert(!nn::writes_gradients_first<AddingBlock<float, Cpu>>);
static_assert(nn::writes_gradients_first<nn::LlamaBlock<float, Cpu>>);

}  // namespace

TEST_CASE("first write: one rank's gradients are bit for bit those of zeroed gradients, whatever the memory held") {
  for (bool tied : {true, false}) {
    CAPTURE(tied);
    const std::vector<float> zeroed = gradients_after_two_micro_batches(tied, false);
    const std::vector<float> stale = gradients_after_two_micro_batches(tied, true);
    REQUIRE(zeroed.size() == stale.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < zeroed.size(); ++i) differ += zeroed[i] != stale[i];  // a NaN differs
    CHECK(differ == 0);
  }
}

TEST_CASE("first write: with every allocation NaN-filled, each layout trains one rank's model") {
  cpu::FillNewAllocations nan_filled;
  const std::vector<double> one = losses({}, 4);  // two micro-batches of 4
  REQUIRE(all_finite(one));
  struct Layout {
    const char* name;
    comm::MeshShape shape;
    std::int64_t local;
    std::vector<std::string> keys;
  };
  const Layout layouts[] = {
      {"FSDP 2, two micro-batches", {1, 1, 2, 1}, 2, {}},
      {"HSDP 2 x 2", {1, 2, 2, 1}, 2, {}},
      {"DDP 2, two micro-batches", {1, 2, 1, 1}, 2, {}},
      {"TP 2, kv heads on both ranks, sequence parallel, two micro-batches", {1, 1, 1, 2}, 4,
       {"--model.n_kv_heads", "1"}},
      {"PP 2, InterleavedZeroBubble (weight gradients deferred)", {2, 1, 1, 1}, 8,
       {"--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
        "--parallelism.pipeline_parallel_microbatch_size", "2"}},
  };
  for (const auto& l : layouts) {
    const std::string layout = l.name;
    CAPTURE(layout);
    const bool kv_changed = !l.keys.empty() && l.keys.front() == "--model.n_kv_heads";
    const std::vector<double> reference = kv_changed ? losses({}, 4, l.keys) : one;
    CHECK(max_relative_difference(losses(l.shape, l.local, l.keys), reference) <= 1e-5);
  }
}

TEST_CASE("first write: a user's block that only adds into its gradients is handed zeros, alone and under FSDP") {
  cpu::FillNewAllocations nan_filled;
  using Bare = nn::Transformer<float, Cpu, AddingBlock<float, Cpu>>;
  using Sharded = nn::Transformer<float, Cpu, Parallel<AddingBlock<float, Cpu>, Sharding<Dynamic>>>;
  const std::vector<double> one = losses<Bare>({}, 4);
  REQUIRE(all_finite(one));
  CHECK(max_relative_difference(losses<Sharded>({1, 1, 2, 1}, 2), one) <= 1e-5);
}

}  // namespace test_first_write
