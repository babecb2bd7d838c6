// Float8 training on the CPU (model.converters = ["float8"], [float8] with emulate): the
// config's keys and refusals, which layers the policy takes, and each recipe's short loss
// curve against the same model trained in bf16 (bench-float8-curves runs the long ones).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/linear.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/job_plan.hpp"
#include "tessera/train/trainer.hpp"

namespace test_float8_training {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using Model = DynamicModel<float, Cpu>;

namespace {

train::JobConfig float8_job(const std::vector<std::string>& overrides) {
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    dim = 64
    n_layers = 2
    n_heads = 4
    multiple_of = 64
    [training]
    local_batch_size = 4
    seq_len = 32
    steps = 30
    mixed_precision_param = "bfloat16"
    synthetic_documents = 300
    [optimizer]
    lr = 3e-3
    [lr_scheduler]
    warmup_steps = 5
    [float8]
    emulate = true
  )",
                             "test_float8", overrides);
}

std::vector<double> losses(const train::JobConfig& c) {
  train::check_supported(c);
  Model model(c.model.args, train::make_plan(c, nullptr));
  model.init_weights(5);
  data::DataLoader loader(train::load_training_tokens(c, io::ByteTokenizer{}), c.training.seq_len,
                          c.training.local_batch_size);
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  std::vector<double> l;
  for (std::int64_t s = 0; s < c.training.steps; ++s) l.push_back(trainer.step().loss);
  return l;
}

}  // namespace

TEST_CASE("The float8 policy takes the linear layers its filters leave, by name and torchao's sizes") {
  ops::Float8Policy p;
  CHECK_FALSE(p.applies("layers.0.attention.wq", 4096, 4096));  // not enabled
  p.enabled = true;
  CHECK(p.applies("layers.0.attention.wq", 64, 64));
  CHECK_FALSE(p.applies("output", 4096, 128256));  // "output" is filtered by default
  p.filter_fqns = {"feed_forward"};
  CHECK_FALSE(p.applies("layers.3.feed_forward.w2", 14336, 4096));
  CHECK(p.applies("layers.3.attention.wo", 4096, 4096));
  p.auto_filter = true;  // torchao's: tensorwise skips K <= 4096 with N <= 1024
  CHECK_FALSE(p.applies("layers.0.attention.wk", 4096, 1024));
  CHECK(p.applies("layers.0.attention.wq", 4096, 4096));
  CHECK_FALSE(p.applies("layers.0.attention.wq", 4100, 4096));  // not a multiple of 16
  p.recipe = ops::Float8Recipe::rowwise;  // rowwise skips N <= 2048, K <= 1024, or both N <= 4096 and K <= 2048
  CHECK_FALSE(p.applies("layers.0.attention.wq", 2048, 2048));
  CHECK(p.applies("layers.0.attention.wq", 4096, 4096));
  CHECK_FALSE(p.applies("layers.0.attention.wk", 4096, 1024));
}

TEST_CASE("[float8] is read when model.converters names it, and what cannot run is refused by key") {
  const train::JobConfig c = float8_job({"--model.converters", "float8", "--float8.recipe_name", "rowwise",
                                         "--float8.filter_fqns", "output,auto_filter_small_kn"});
  const parallel::Plan plan = train::make_plan(c, nullptr);
  CHECK(plan.float8.enabled);
  CHECK(plan.float8.recipe == ops::Float8Recipe::rowwise);
  CHECK(plan.float8.auto_filter);
  CHECK(plan.float8.filter_fqns == std::vector<std::string>{"output"});
  CHECK_FALSE(train::make_plan(float8_job({}), nullptr).float8.enabled);  // [float8] alone changes nothing

  auto refused = [](const std::vector<std::string>& overrides, const std::string& message) {
    CAPTURE(message);
    CHECK_THROWS_WITH_AS(
        {
          const train::JobConfig bad = float8_job(overrides);
          train::check_supported(bad);
          (void)train::make_plan(bad, nullptr);
        },
        doctest::Contains(message.c_str()), Error);
  };
  refused({"--model.converters", "float4"}, "model.converters: each item must be one of float8");
  refused({"--model.converters", "float8,float8"}, "model.converters: \"float8\" is given twice");
  refused({"--model.converters", "float8", "--float8.recipe_name", "blockwise"},
          "float8.recipe_name must be one of tensorwise, rowwise, rowwise_with_gw_hp");
  refused({"--model.converters", "float8", "--training.mixed_precision_param", "float32"},
          "float8 GEMMs cast a bfloat16 model's values, and training.mixed_precision_param is \"float32\"");
  refused({"--model.converters", "float8", "--float8.emulate", "false", "--training.seq_len", "24"},
          "training.seq_len = 24: float8 GEMMs (float8.emulate = false) reduce over a micro-batch's tokens");
  refused({"--model.converters", "float8", "--float8.precompute_float8_dynamic_scale_for_fsdp", "true"},
          "needs float8.enable_fsdp_float8_all_gather = true");
  refused({"--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather", "true", "--float8.recipe_name",
           "rowwise"},
          "float8.enable_fsdp_float8_all_gather needs float8.recipe_name = \"tensorwise\"");
  // The all-gather itself runs (tests/parallel/test_parity.cpp holds it to gathering then
  // casting), its scales agreed once a step with or without precompute.
  for (const char* precompute : {"false", "true"}) {
    const train::JobConfig gather = float8_job({"--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather",
                                                "true", "--float8.precompute_float8_dynamic_scale_for_fsdp", precompute});
    train::check_supported(gather);
    CHECK(train::make_plan(gather, nullptr).float8.all_gather);
  }
  // Tensor parallelism takes float8 (tests/parallel/test_tensor_parallel.cpp holds it to one
  // rank's run; a degree above n_kv_heads is refused on wk and wv as the model is made).
  CHECK_NOTHROW(train::check_supported(
      float8_job({"--model.converters", "float8", "--parallelism.tensor_parallel_degree", "2"})));
}

namespace {

/// Every parameter's gradient after one forward_backward of the small model's first batch.
std::vector<std::vector<float>> gradients(const train::JobConfig& c) {
  Model model(c.model.args, train::make_plan(c, nullptr));
  model.init_weights(5);
  data::DataLoader loader(train::load_training_tokens(c, io::ByteTokenizer{}), c.training.seq_len,
                          c.training.local_batch_size);
  const data::Batch b = loader.next();
  model.zero_grad();
  model.forward_backward(b.inputs, b.targets, nn::Geometry{b.batch, b.seq_len}, 1.0 / static_cast<double>(b.n_targets));
  std::vector<std::vector<float>> g;
  model.for_each_parameter([&](nn::Parameter<float>& p) { g.emplace_back(p.grad.data(), p.grad.data() + p.numel()); });
  return g;
}

}  // namespace

TEST_CASE("Each float8 recipe's gradients are bf16's to float8's precision, every parameter") {
  const auto bf16 = gradients(float8_job({}));
  for (const std::string recipe : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    CAPTURE(recipe);
    const auto f8 = gradients(float8_job({"--model.converters", "float8", "--float8.recipe_name", recipe}));
    REQUIRE(f8.size() == bf16.size());
    double worst = 0;
    for (std::size_t p = 0; p < f8.size(); ++p) {
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < f8[p].size(); ++i) {
        diff += (f8[p][i] - bf16[p][i]) * static_cast<double>(f8[p][i] - bf16[p][i]);
        norm += bf16[p][i] * static_cast<double>(bf16[p][i]);
      }
      worst = std::max(worst, std::sqrt(diff / norm));
    }
    MESSAGE(recipe, ": largest relative L2 gap of a gradient to bf16's ", worst);
    CHECK(worst > 0);
    CHECK(worst < 0.15);
  }
}

TEST_CASE("Each float8 recipe trains the debug model as bf16 does: its short curve within 2%, no step diverging") {
  const std::vector<double> bf16 = losses(float8_job({}));
  CHECK(bf16.back() < bf16.front() - 0.5);
  for (const std::string recipe : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    CAPTURE(recipe);
    const std::vector<double> f8 = losses(float8_job({"--model.converters", "float8", "--float8.recipe_name", recipe}));
    REQUIRE(f8.size() == bf16.size());
    CHECK(f8 != bf16);  // the float8 GEMMs ran
    double worst = 0;
    for (std::size_t s = 0; s < f8.size(); ++s) {
      REQUIRE(std::isfinite(f8[s]));
      worst = std::max(worst, std::fabs(f8[s] - bf16[s]) / bf16[s]);
    }
    MESSAGE(recipe, ": loss ", f8.front(), " -> ", f8.back(), " (bf16 ", bf16.front(), " -> ", bf16.back(),
            "), largest relative gap ", worst);
    CHECK(std::fabs(f8.back() - bf16.back()) / bf16.back() < 0.02);
    CHECK(worst < 0.05);
  }
}


// The CPU backend, counting its float8 casts' launches.
template <class F>
struct IsQuantize : std::false_type {};
template <class T, class F>
struct IsQuantize<ops::QuantizeFloat8<T, F>> : std::true_type {};
struct CountingCpu : Cpu {
  static inline int quantizes = 0, amaxes = 0;
  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    if constexpr (IsQuantize<F>::value) ++quantizes;
    if constexpr (std::is_same_v<F, ops::RowAbsMaxScale<float>> || std::is_same_v<F, ops::RowAbsMax<float>>) ++amaxes;
    Cpu::for_each(n, f);
  }
};
static_assert(Backend<CountingCpu>);

TEST_CASE("a tensorwise linear layer casts its output gradient once for both of its GEMMs, its weight gradient "
          "run at once or deferred") {
  // nn::Linear's backward (tensorwise, emulated): dy cast into both layouts in one launch,
  // dy^T handed to the weight gradient, which a zero-bubble schedule defers
  // (Context::deferring_weight_grads) and which then holds dy^T, not dy, and casts
  // nothing. dx and dW are bit for bit those of casting dy twice (nn::float8_gemm).
  const nn::Geometry g{2, 16};
  const std::int64_t M = g.rows(), K = 48, N = 32;
  auto matrix = [](std::int64_t rows, std::int64_t cols, float seed) {
    Tensor<float> t(Shape{rows, cols});
    for (std::int64_t i = 0; i < t.numel(); ++i)
      t[i] = std::sin(seed + 0.61f * static_cast<float>(i)) * std::pow(2.0f, static_cast<float>(i % 7) - 3);
    return t;
  };
  const Tensor<float> x = matrix(M, K, 1), dy = matrix(M, N, 2), w = matrix(N, K, 3);
  ops::Float8Policy policy;
  policy.enabled = true;
  policy.emulate = true;
  policy.recipe = ops::Float8Recipe::tensorwise;
  const ops::Float8LinearCasts c = ops::float8_casts(policy.recipe);
  // The reference: dy cast for each GEMM by itself.
  Tensor<float> dx_ref(Shape{M, K}), dw_ref(Shape{N, K});
  nn::float8_gemm<Cpu>(Trans::no, Trans::no, dy.cview(), c.grad_output, w.cview(), c.weight_for_grad_input, 0.0f,
                       dx_ref.view(), "dx", {true, false});
  nn::float8_gemm<Cpu>(Trans::yes, Trans::no, dy.cview(), c.grad_output_for_grad_weight, x.cview(),
                       c.input_for_grad_weight, 0.0f, dw_ref.view(), "dW", {true, false});
  auto same = [](const Tensor<float>& a, const Tensor<float>& b) {
    return a.numel() == b.numel() &&
           std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.numel())) == 0;
  };
  for (const bool deferred : {false, true}) {
    CAPTURE(deferred);
    nn::Linear<float, CountingCpu> lin("layers.0.feed_forward.w1", K, N, nn::Init{}, nullptr, {}, &policy);
    std::memcpy(lin.weight().value.data(), w.data(), sizeof(float) * static_cast<std::size_t>(w.numel()));
    nn::ActivationStore<float> store;
    (void)lin.forward(nn::Context<float>(g, &store), x);
    nn::WeightGradQueue queue;
    const nn::Context<float> ctx = nn::Context<float>(g, &store).deferring_weight_grads(deferred ? &queue : nullptr);
    CountingCpu::quantizes = CountingCpu::amaxes = 0;
    Tensor<float> dx;
    {
      nn::Float8SharedCasts<CountingCpu> shared;  // as the layers that hold a linear layer open
      dx = lin.backward(ctx, dy);
    }
    CHECK(queue.size() == (deferred ? 1u : 0u));
    for (auto& f : queue) f();
    CHECK(same(dx, dx_ref));
    CHECK(same(lin.weight().grad, dw_ref));
    // dy's amax once, dy in both layouts at once, W^T and x^T by their forward's scales.
    CHECK(CountingCpu::amaxes == 1);
    CHECK(CountingCpu::quantizes == 3);
  }
}

TEST_CASE("Float8 GEMMs not emulated: refused on the CPU and for sizes cuBLASLt cannot take, float8 GEMMs in a dry run") {
  const std::vector<std::string> real = {"--model.converters", "float8", "--float8.emulate", "false"};
  const train::JobConfig cpu = float8_job(real);
  CHECK_THROWS_WITH_AS(Model(cpu.model.args, train::make_plan(cpu, nullptr)),
                       doctest::Contains("float8.emulate = false: layers.0.attention.wq would run float8 GEMMs on the "
                                         "cpu backend, which has none"),
                       Error);

  // The dry run stands for a GPU with cuBLASLt's float8 matmul: each linear layer of the
  // blocks (7 a block, 2 blocks) runs its three GEMMs in float8 (or two, the weight
  // gradient in bf16), the output projection in bf16.
  struct Count {
    int e4m3 = 0, e5m2 = 0, other = 0;
  };
  auto gemms = [](const plan::StepTrace& st) {
    Count n;
    for (const trace::Event& e : st.trace.events())
      if (const auto* g = std::get_if<trace::Gemm>(&e.op)) {
        if (g->operands == DType::f8e4m3 || g->operands == DType::f8e5m2) {
          CHECK((g->ta == Trans::no && g->tb == Trans::yes));  // cuBLASLt's layout
          (g->operands == DType::f8e4m3 ? n.e4m3 : n.e5m2) += 1;
        } else {
          ++n.other;
        }
      }
    return n;
  };
  // In bf16 with the projections one by one, as the float8 layers run them; as one, 2 + 1
  // GEMMs fewer a block each way (wq, wk and wv; w1 and w3): 18 in the 2 blocks.
  const Count off = gemms(plan::dry_run_step<bf16>(float8_job({"--model.fuse_projections", "false"})));
  REQUIRE(off.e4m3 + off.e5m2 == 0);
  const int linear = 3 * 14;
  REQUIRE(off.other > linear);
  CHECK(gemms(plan::dry_run_step<bf16>(float8_job({}))).other == off.other - 2 * 3 * (2 + 1));
  struct Case {
    const char* recipe;
    int e4m3, e5m2, high;  // GEMMs with each operand type, and the linear layers' in bf16
  };
  for (const Case k : {Case{"tensorwise", 14, 28, 0}, Case{"rowwise", 42, 0, 0}, Case{"rowwise_with_gw_hp", 28, 0, 14}}) {
    const std::string recipe(k.recipe);
    CAPTURE(recipe);
    std::vector<std::string> o = real;
    o.insert(o.end(), {"--float8.recipe_name", k.recipe});
    const plan::StepTrace st = plan::dry_run_step<bf16>(float8_job(o));
    const Count n = gemms(st);
    CHECK(n.e4m3 == k.e4m3);
    // The casts: attention's x cast once for wq, wk and wv, the feed-forward's once for
    // w1 and w3 (nn::Float8SharedCasts), and their transposes once for the weight
    // gradients: a block's forward casts 4 inputs and 7 weights, its backward 7
    // gradients and 7 weights (the input gradients), and, for the weight gradients, 7
    // gradients and 4 inputs (none where they stay in bf16).
    // A cast by rows is one launch (ops::CastRowsFloat8) that takes its rows' amaxes
    // itself or reads the ones kept for it (4 bytes a row more: its traffic()), and any
    // other cast an amax pass (RowAbsMax, ColumnAbsMax) before QuantizeFloat8. Tensorwise
    // casts each output gradient into both of its layouts in one launch
    // (nn::cast_to_float8_both_layouts): the weight gradients' 7 casts of them are the
    // input gradients' (the values of both written once), and a QuantizeFloat8 writing
    // both layouts writes 2 bytes an element.
    int casts = 0, amaxes = 0, both_layouts = 0;
    for (const trace::Event& e : st.trace.events())
      if (const auto* kernel = std::get_if<trace::Kernel>(&e.op)) {
        const std::string_view f(kernel->functor);
        casts += f.starts_with("QuantizeFloat8") || f.starts_with("CastRowsFloat8") ? 1 : 0;
        both_layouts += f.starts_with("QuantizeFloat8") &&
                        kernel->traffic.bytes_written == 2.0 * static_cast<double>(kernel->n);
        amaxes += f.find("AbsMax") != std::string_view::npos ? 1 : 0;
        if (f.starts_with("CastRowsFloat8")) {
          const double values = kernel->traffic.bytes_written - 8.0 * static_cast<double>(kernel->n);  // one byte each
          amaxes += kernel->traffic.bytes_read == values * sizeof(bf16) ? 1 : 0;  // none kept: taken in the pass
        }
      }
    const bool tensorwise = recipe == "tensorwise";
    CHECK(casts == 2 * (11 + 14 + (k.high > 0 ? 0 : 11) - (tensorwise ? 7 : 0)));
    CHECK(both_layouts == (tensorwise ? 2 * 7 : 0));
    // The amaxes: tensorwise takes the forward's 4 inputs' and 7 weights', then the 7
    // output gradients' (each once for both of its GEMMs); the backward's casts of the
    // inputs and weights take the forward's scales (nn::Linear saves them). Rowwise
    // scales each operand along its own reduction: an amax a cast. Either way, 5 a
    // block come from the kernels that wrote the tensors (nn::Float8RowAmaxes): the
    // two norms' outputs and SwiGLU's (the inputs of wq, wk, wv; w1, w3; w2), and
    // SwiGLU's backward's da and db (the output gradients of w1 and w3).
    if (tensorwise) CHECK(amaxes == 2 * (11 + 7 - 5));
    else CHECK(amaxes == casts - 2 * 5);
    int fused = 0;  // the kernels that write them
    for (const trace::Event& e : st.trace.events())
      if (const auto* kernel = std::get_if<trace::Kernel>(&e.op))
        fused += std::string_view(kernel->functor).starts_with("SwiGluForwardRows<") ||
                 std::string_view(kernel->functor).starts_with("SwiGluBackwardRows<");
    CHECK(fused == 2 * 2);
    CHECK(n.e5m2 == k.e5m2);
    CHECK(n.other == off.other - linear + k.high);
  }

  // Sizes a float8 GEMM cannot take: 72 features (not a multiple of 16), or 24 tokens a sequence.
  std::vector<std::string> odd = real;
  odd.insert(odd.end(), {"--model.dim", "72", "--model.n_heads", "4"});
  CHECK_THROWS_WITH_AS(plan::dry_run_step<bf16>(float8_job(odd)),
                       doctest::Contains("layers.0.attention.wq (72 -> 72 features) cannot run float8 GEMMs, which "
                                         "need both sizes in multiples of 16"),
                       Error);
}

}  // namespace test_float8_training
