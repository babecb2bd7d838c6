// Every layer's backward against central finite differences in float64.
#include <doctest/doctest.h>

#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "../support/gradcheck.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/nn/embedding.hpp"
#include "tessera/nn/feed_forward.hpp"
#include "tessera/nn/linear.hpp"
#include "tessera/nn/rmsnorm.hpp"
#include "tessera/nn/transformer.hpp"

namespace test_layers {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;
using tessera::testing::check_gradient;
using tessera::testing::fill_normal;
using tessera::testing::tiny_args;
using tessera::testing::to_vector;

namespace {

// f(x) = sum(c * layer(x)) for fixed random c: df/dy = c.
template <class L>
void check_layer(const std::string& what, L& layer, Geometry g, std::int64_t in_dim, std::uint64_t seed,
                 double tol = 1e-6) {
  Tensor<double> x(Shape{g.rows(), in_dim});
  fill_normal(x, seed, "x");
  ActivationStore<double> store;
  Tensor<double> y = layer.forward(Context<double>(g, &store), x);
  Tensor<double> c(y.shape());
  fill_normal(c, seed, "c");
  layer.for_each_parameter([](Parameter<double>& p) {
    for (std::int64_t i = 0; i < p.numel(); ++i) p.grad[i] = 0;
  });
  Tensor<double> dx = layer.backward(Context<double>(g, &store), c);
  auto f = [&] {
    Tensor<double> out = layer.forward(Context<double>(g, nullptr), x);
    double s = 0;
    for (std::int64_t i = 0; i < out.numel(); ++i) s += c[i] * out[i];
    return s;
  };
  check_gradient(what + " dx", x, to_vector(dx), f, tol);
  layer.for_each_parameter([&](Parameter<double>& p) { check_gradient(what + " d" + p.name, p.value, to_vector(p.grad), f, tol); });
}

template <class L>
void randomize(L& layer, std::uint64_t seed) {
  layer.for_each_parameter([&](Parameter<double>& p) { fill_normal(p.value, seed, p.name, 0.5); });
}

}  // namespace

TEST_CASE("Linear backward matches finite differences") {
  Linear<double, Cpu> lin("lin", 6, 5, Init::truncated_normal(0.5));
  randomize(lin, 1);
  check_layer("linear", lin, Geometry{2, 3}, 6, 11);
}

TEST_CASE("Linear::forward_adding is the forward then the residual's add, bit for bit, with the same saves") {
  // The residual as the GEMM's C (gemm_out_of_place): the product rounded to the output's
  // type, then the residual added, as ops::Add after the forward writes it.
  auto check = [&]<class T>(std::type_identity<T>) {
    Linear<T, Cpu> lin("layers.0.attention.wo", 6, 5, Init::truncated_normal(0.5));
    lin.for_each_parameter([](Parameter<T>& p) {
      for (std::int64_t i = 0; i < p.numel(); ++i) p.value[i] = T(0.13 * static_cast<double>(i % 9) - 0.5);
    });
    const Geometry g{2, 3};
    Tensor<T> x(Shape{g.rows(), 6}), residual(Shape{g.rows(), 5});
    for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = T(0.37 * static_cast<double>(i % 11) - 1.5);
    for (std::int64_t i = 0; i < residual.numel(); ++i) residual[i] = T(0.61 * static_cast<double>(i % 7) - 2.0);
    ActivationStore<T> plain, adding;
    const Tensor<T> y = lin.forward(Context<T>(g, &plain), x);
    const Tensor<T> sum = lin.forward_adding(Context<T>(g, &adding), x, residual);
    const Tensor<T> expected = sum_of<Cpu>(residual, y);
    for (std::int64_t i = 0; i < sum.numel(); ++i) CHECK(std::memcmp(&sum[i], &expected[i], sizeof(T)) == 0);
    CHECK(adding.bytes() == plain.bytes());
    CHECK_THROWS_WITH_AS(lin.forward_adding(Context<T>(g, nullptr), x, y.clone().reshape(Shape{5, g.rows()})),
                         doctest::Contains("layers.0.attention.wo.weight: the residual added to the output is (5, 6), "
                                           "the output (6, 5)"),
                         Error);
  };
  check(std::type_identity<double>{});
  check(std::type_identity<float>{});
  check(std::type_identity<bf16>{});
}

TEST_CASE("RmsNorm backward matches finite differences") {
  RmsNorm<double, Cpu> norm("norm", 7, 1e-5);
  randomize(norm, 2);
  check_layer("rmsnorm", norm, Geometry{3, 2}, 7, 12);
}

TEST_CASE("FeedForward (SwiGLU) backward matches finite differences") {
  ModelArgs a = tiny_args();
  FeedForward<double, Cpu> ffn("ffn", a, 0.1);
  randomize(ffn, 3);
  check_layer("feed_forward", ffn, Geometry{2, 3}, a.dim, 13);
}

TEST_CASE("FeedForward with recompute_swiglu: the same output and gradients bit for bit, a hidden size a row less kept") {
  ModelArgs a = tiny_args();
  const Geometry g{2, 3};
  Tensor<double> x(Shape{g.rows(), a.dim});
  fill_normal(x, 17, "x");
  struct Run {
    std::vector<double> y, dx, grads;
    std::size_t kept = 0;
  };
  auto run = [&](bool recompute) {
    FeedForward<double, Cpu> ffn("ffn", a, 0.1, nullptr, nullptr, recompute);
    randomize(ffn, 3);
    ActivationMeter meter;
    ActivationStore<double> store("", &meter);
    Run r;
    Tensor<double> y = ffn.forward(Context<double>(g, &store), x);
    r.kept = meter.current();
    r.y = to_vector(y);
    Tensor<double> dy(y.shape());
    fill_normal(dy, 17, "dy");
    ffn.for_each_parameter([](Parameter<double>& p) { p.forget_grad(); });
    r.dx = to_vector(ffn.backward(Context<double>(g, &store), dy));
    ffn.for_each_parameter([&](Parameter<double>& p) {
      const auto v = to_vector(p.grad);
      r.grads.insert(r.grads.end(), v.begin(), v.end());
    });
    return r;
  };
  const Run kept = run(false), remade = run(true);
  CHECK(remade.y == kept.y);
  CHECK(remade.dx == kept.dx);
  CHECK(remade.grads == kept.grads);
  // x (w1's and w3's input), W1 x and W3 x kept either way; the SwiGLU output only without.
  const std::size_t hidden_rows = static_cast<std::size_t>(g.rows() * a.ffn_hidden_dim()) * sizeof(double);
  CHECK(kept.kept == remade.kept + hidden_rows);
  CHECK(remade.kept == static_cast<std::size_t>(g.rows() * a.dim) * sizeof(double) + 2 * hidden_rows);
  FeedForward<double, Cpu> ffn("ffn", a, 0.1, nullptr, nullptr, true);
  randomize(ffn, 3);
  check_layer("feed_forward, SwiGLU recomputed", ffn, g, a.dim, 13);
}

TEST_CASE("ParameterStack: its members side by side, whole and in pieces, one round after another") {
  const TensorSplit halves{0, 2, 1, 1, true};  // rows cut in two, this rank's the second
  auto stack = std::make_shared<ParameterStack<double>>(std::vector<Shape>{Shape{4, 3}, Shape{2, 3}},
                                                        std::vector<TensorSplit>{halves, halves});
  Parameter<double> p = Parameter<double>::on<Cpu>("p", Shape{4, 3}, Init::ones(), stack, 0);
  Parameter<double> q = Parameter<double>::on<Cpu>("q", Shape{2, 3}, Init::ones(), stack, 1);
  CHECK(side_by_side(p, q));
  CHECK_FALSE(side_by_side(q, p));  // in the stack's order only
  const double* first = p.value.data();
  // Again, whole (a runtime making storage): a new round, side by side again.
  p.allocate<Cpu>(p.whole);
  q.allocate<Cpu>(q.whole);
  CHECK(side_by_side(p, q));
  CHECK(p.value.data() != first);
  // This rank's pieces (tensor parallelism): side by side, the gradient too.
  p.allocate<Cpu>(Shape{2, 3});
  q.allocate<Cpu>(Shape{1, 3});
  CHECK(side_by_side(p, q));
  CHECK(q.grad.data() == p.grad.data() + 6);
  // A DDP unit's values without gradients: the values side by side, no gradient given.
  p.grad = {};
  q.grad = {};
  p.allocate<Cpu>(Shape{2, 3}, false);
  q.allocate<Cpu>(Shape{1, 3}, false);
  CHECK(q.value.data() == p.value.data() + 6);
  CHECK((p.grad.empty() && q.grad.empty()));
  // A shape that is neither its whole nor its piece is allocated on its own.
  p.allocate<Cpu>(Shape{5, 3});
  q.allocate<Cpu>(q.whole);
  CHECK_FALSE(side_by_side(p, q));
  CHECK(p.value.shape() == Shape{5, 3});
}

TEST_CASE("Attention and FeedForward run their projections as one GEMM: one by one's outputs and gradients, to "
          "rounding, from the same saves") {
  ModelArgs a = tiny_args();
  const Geometry g{2, 5};
  Tensor<double> x(Shape{g.rows(), a.dim}), dy(Shape{g.rows(), a.dim});
  fill_normal(x, 21, "x");
  fill_normal(dy, 22, "dy");
  struct Run {
    std::vector<double> y, dx, grads;
    std::size_t kept = 0;
  };
  auto run = [&](auto& layer) {
    randomize(layer, 6);
    ActivationMeter meter;
    ActivationStore<double> store("", &meter);
    Run r;
    r.y = to_vector(layer.forward(Context<double>(g, &store), x));
    r.kept = meter.current();
    layer.for_each_parameter([](Parameter<double>& p) { p.forget_grad(); });
    r.dx = to_vector(layer.backward(Context<double>(g, &store), dy));
    layer.for_each_parameter([&](Parameter<double>& p) {
      const auto v = to_vector(p.grad);
      r.grads.insert(r.grads.end(), v.begin(), v.end());
    });
    return r;
  };
  auto same = [](const Run& one, const Run& apart) {
    CHECK(one.kept == apart.kept);
    for (auto [u, v] : {std::pair{&one.y, &apart.y}, {&one.dx, &apart.dx}, {&one.grads, &apart.grads}}) {
      REQUIRE(u->size() == v->size());
      for (std::size_t i = 0; i < u->size(); ++i) CHECK((*u)[i] == doctest::Approx((*v)[i]).epsilon(1e-12).scale(1e-12));
    }
  };
  auto weights = [](auto& layer) {
    std::vector<Parameter<double>*> w;
    layer.for_each_parameter([&](Parameter<double>& p) { w.push_back(&p); });
    return w;
  };
  SUBCASE("attention: wq, wk and wv") {
    auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
    Attention<double, Cpu> one("attention", a, 0.1, rope), apart("attention", a, 0.1, rope, nullptr, nullptr, nullptr, false);
    const auto w = weights(one), v = weights(apart);
    CHECK(side_by_side(*w[0], *w[1], *w[2]));
    CHECK_FALSE(side_by_side(*v[0], *v[1], *v[2]));
    const Run apart_run = run(apart);
    same(run(one), apart_run);
    // The values side by side, the gradients not (wk's elsewhere, as a DDP bucket or an
    // FSDP unit may hold them): one GEMM each way but the weight gradients', one a weight.
    Attention<double, Cpu> grads_apart("attention", a, 0.1, rope);
    const auto u = weights(grads_apart);
    u[1]->grad = Tensor<double>(u[1]->grad.shape());
    CHECK(side_by_side(*u[0], *u[1], *u[2]));
    same(run(grads_apart), apart_run);
  }
  SUBCASE("feed-forward: w1 and w3") {
    FeedForward<double, Cpu> one("ffn", a, 0.1), apart("ffn", a, 0.1, nullptr, nullptr, false, false);
    const auto w = weights(one), v = weights(apart);  // w1, w3, w2
    CHECK(w[0]->name == "ffn.w1.weight");
    CHECK(w[1]->name == "ffn.w3.weight");
    CHECK(side_by_side(*w[0], *w[1]));
    CHECK_FALSE(side_by_side(*v[0], *v[1]));
    same(run(one), run(apart));
    FeedForward<double, Cpu> remade("ffn", a, 0.1, nullptr, nullptr, true);
    randomize(remade, 3);
    check_layer("feed_forward as one, SwiGLU recomputed", remade, Geometry{2, 3}, a.dim, 13);
  }
}

TEST_CASE("Attention backward matches finite differences") {
  SUBCASE("grouped-query, no rope scaling") {
    ModelArgs a = tiny_args();
    auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
    Attention<double, Cpu> attn("attention", a, 0.1, rope);
    randomize(attn, 4);
    check_layer("attention gqa", attn, Geometry{2, 5}, a.dim, 14);
  }
  SUBCASE("multi-head with Llama 3.1 rope scaling") {
    ModelArgs a = tiny_args();
    a.n_kv_heads = 4;
    a.rope_scaling = RopeScaling{true, 8.0, 1.0, 4.0, 4};
    auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
    Attention<double, Cpu> attn("attention", a, 0.1, rope);
    randomize(attn, 5);
    check_layer("attention mha scaled", attn, Geometry{1, 6}, a.dim, 15);
  }
}

TEST_CASE("LlamaBlock backward matches finite differences") {
  ModelArgs a = tiny_args();
  auto rope = std::make_shared<RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
  LlamaBlock<double, Cpu> block(BlockArgs<double, Cpu>{a, 0, "layers.0", rope});
  randomize(block, 6);
  check_layer("block", block, Geometry{2, 4}, a.dim, 16);
}

TEST_CASE("Embedding backward accumulates repeated ids") {
  Embedding<double, Cpu> emb("tok", 5, 3, Init::normal(1.0));
  randomize(emb, 7);
  std::vector<std::int32_t> ids = {1, 3, 1, 4};
  Tensor<double> dy(Shape{4, 3});
  fill_normal(dy, 7, "dy");
  emb.backward(ids, dy);
  for (std::int64_t j = 0; j < 3; ++j) {
    CHECK(emb.weight().grad[1 * 3 + j] == doctest::Approx(dy[0 * 3 + j] + dy[2 * 3 + j]));
    CHECK(emb.weight().grad[3 * 3 + j] == doctest::Approx(dy[1 * 3 + j]));
    CHECK(emb.weight().grad[0 * 3 + j] == 0.0);
  }
  std::vector<std::int32_t> bad = {1, 5};
  CHECK_THROWS_WITH_AS(emb.forward(bad), doctest::Contains("token id 5 at position 1"), Error);
}

TEST_CASE("Whole model: loss gradients match finite differences") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    ModelArgs a = tiny_args();
    a.tie_embeddings = tied;
    Transformer<double, Cpu> model(a);
    model.init_weights(3);
    // Larger weights than the init, so every path carries gradient well above noise.
    model.for_each_parameter([](Parameter<double>& p) {
      if (p.name.find("norm") == std::string::npos) fill_normal(p.value, 9, p.name, 0.3);
    });
    Geometry g{2, 5};
    std::vector<std::int32_t> inputs = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    std::vector<std::int32_t> targets = {2, 3, 4, 5, ops::kIgnoreIndex, 7, 8, 9, 10, 0};
    const double scale = 1.0 / 9.0;
    model.zero_grad();
    const double loss = model.forward_backward(inputs, targets, g, scale);
    CHECK(loss == doctest::Approx(model.loss(inputs, targets, g)).epsilon(1e-12));
    auto f = [&] { return scale * model.loss(inputs, targets, g); };
    model.for_each_parameter(
        [&](Parameter<double>& p) { check_gradient("model d" + p.name, p.value, to_vector(p.grad), f); });
  }
}

}  // namespace test_layers
