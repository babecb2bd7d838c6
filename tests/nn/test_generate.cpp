// Decoding through a KV cache (layer/kv_cache.hpp, Transformer::cached_last_logits): the
// logits of the whole sequence, a few new tokens at a time, for fused and separate
// projections, grouped-query heads and bf16; nn::generate writes the same text with the
// cache as without it, across a window that moves on; and the misuses are named.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"

namespace test_generate {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::nn;

namespace {

ModelArgs small_args() {
  ModelArgs a = model_flavor("debugmodel");
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;  // two query heads a key/value head
  a.vocab_size = 96;
  a.max_seq_len = 64;
  return a;
}

std::vector<std::int32_t> some_ids(std::size_t n, std::int64_t vocab) {
  std::vector<std::int32_t> ids(n);
  std::uint64_t x = 88172645463325252ull;
  for (auto& id : ids) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = static_cast<std::int32_t>(x % static_cast<std::uint64_t>(vocab));
  }
  return ids;
}

/// The largest difference between two rows of logits, against the larger magnitude.
template <class A>
double relative_gap(const Tensor<A>& got, const Tensor<A>& want) {
  REQUIRE(got.shape() == want.shape());
  double gap = 0, scale = 1;
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    gap = std::max(gap, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return gap / scale;
}

/// Feeds 40 tokens through a cache in runs of `steps` (a prompt, then single tokens and a
/// few longer runs) and holds the logits after each run against the whole prefix's.
template <class Model>
void check_cached_logits(Model& m, double tolerance) {
  using T = typename Model::scalar_type;
  const std::vector<std::int32_t> ids = some_ids(40, m.args().vocab_size);
  KvCache<T> cache(40);
  const std::vector<std::size_t> steps = {7, 1, 1, 5, 1, 3, 1, 1, 10, 1, 1, 8};
  std::size_t done = 0;
  for (const std::size_t n : steps) {
    const auto got = m.cached_last_logits(std::span<const std::int32_t>(ids).subspan(done, n), cache);
    done += n;
    const auto want = m.last_logits(std::span<const std::int32_t>(ids).first(done),
                                    Geometry{1, static_cast<std::int64_t>(done)});
    CAPTURE(done);
    CHECK(relative_gap(got, want) <= tolerance);
  }
  CHECK(done == ids.size());
  CHECK(cache.length() == 40);
  CHECK(cache.slots() == static_cast<std::size_t>(m.args().n_layers));
}

/// LlamaBlock that does not say it decodes through a cache: its model runs the whole
/// window again for each token.
template <class T, Backend B>
struct WindowBlock : LlamaBlock<T, B> {
  using LlamaBlock<T, B>::LlamaBlock;
  static constexpr bool decodes_with_kv_cache = false;
};

/// LlamaBlock that says it decodes through a cache but runs its attention without it.
template <class T, Backend B>
struct CacheBypassingBlock : LlamaBlock<T, B> {
  using LlamaBlock<T, B>::LlamaBlock;
  static constexpr bool decodes_with_kv_cache = true;
  Tensor<T> forward(const Context<T>& ctx, const Tensor<T>& x) {
    return LlamaBlock<T, B>::forward(Context<T>(ctx.geometry(), nullptr), x);
  }
};

}  // namespace

TEST_CASE("A KV cache gives the logits of the whole sequence, a few tokens at a time") {
  const ModelArgs a = small_args();
  SUBCASE("float, q, k and v in one GEMM") {
    Transformer<float, Cpu> m(a);
    m.init_weights(5);
    REQUIRE(m.decodes_with_kv_cache());
    check_cached_logits(m, 1e-5);
  }
  SUBCASE("float, q, k and v one by one") {
    parallel::Plan p;
    p.fuse_projections = false;
    Transformer<float, Cpu> m(a, p);
    m.init_weights(5);
    check_cached_logits(m, 1e-5);
  }
  SUBCASE("float, one key/value head for every query head") {
    ModelArgs mqa = a;
    mqa.n_kv_heads = 1;
    Transformer<float, Cpu> m(mqa);
    m.init_weights(6);
    check_cached_logits(m, 1e-5);
  }
  SUBCASE("bf16: to bf16's rounding") {
    Transformer<bf16, Cpu> m(a);
    m.init_weights(7);
    check_cached_logits(m, 2e-2);
  }
}

TEST_CASE("generate writes the same text with a KV cache as without, across a window that moves on") {
  const ModelArgs a = small_args();
  Transformer<float, Cpu> cached(a);
  Transformer<float, Cpu, WindowBlock<float, Cpu>> window(a);
  cached.init_weights(11);
  window.init_weights(11);  // the same values: they depend on seed, name and index only
  REQUIRE(cached.decodes_with_kv_cache());
  REQUIRE_FALSE(window.decodes_with_kv_cache());
  SampleOptions o;
  o.max_new_tokens = 40;
  o.context = 24;  // 5 + 40 tokens: the window moves on after 19 new ones
  SUBCASE("greedy") { o.temperature = 0; }
  SUBCASE("sampled from the top 8") {
    o.temperature = 0.8;
    o.top_k = 8;
    o.seed = 3;
  }
  SUBCASE("a prompt longer than the window") {
    o.context = 4;
    o.temperature = 0;
  }
  const std::vector<std::int32_t> prompt = {1, 2, 3, 4, 5};
  const std::vector<std::int32_t> with_cache = generate(cached, prompt, o);
  CHECK(with_cache.size() == 40);
  CHECK(with_cache == generate(window, prompt, o));
}

TEST_CASE("Decoding through a KV cache refuses what it cannot do, naming it") {
  const ModelArgs a = small_args();
  const std::vector<std::int32_t> ids = some_ids(8, a.vocab_size);
  const std::span<const std::int32_t> all(ids);
  Transformer<float, Cpu> m(a);
  m.init_weights(1);
  SUBCASE("more tokens than the cache holds") {
    KvCache<float> cache(6);
    m.cached_last_logits(all.first(4), cache);
    CHECK_THROWS_WITH(m.cached_last_logits(all.subspan(4), cache),
                      doctest::Contains("4 new tokens after the 4 a KV cache holds go past its capacity of 6"));
  }
  SUBCASE("a cache another model filled") {
    Transformer<float, Cpu> other(a);
    other.init_weights(1);
    KvCache<float> cache(8);
    other.cached_last_logits(all.first(3), cache);
    CHECK_THROWS_WITH(m.cached_last_logits(all.subspan(3, 1), cache),
                      doctest::Contains("layers.0.attention: its KV cache holds 0 tokens where the new rows start at "
                                        "position 3"));
  }
  SUBCASE("a block that does not say it reads the cache") {
    Transformer<float, Cpu, WindowBlock<float, Cpu>> window(a);
    window.init_weights(1);
    KvCache<float> cache(8);
    CHECK_THROWS_WITH(window.cached_last_logits(all.first(2), cache),
                      doctest::Contains("needs a block whose attention reads it"));
  }
  SUBCASE("a block that says so but attends without it") {
    Transformer<float, Cpu, CacheBypassingBlock<float, Cpu>> bypass(a);
    bypass.init_weights(1);
    KvCache<float> cache(8);
    CHECK_THROWS_WITH(bypass.cached_last_logits(all.first(2), cache),
                      doctest::Contains("decoding with a KV cache, no attention layer used it"));
  }
  SUBCASE("float8 GEMMs: generate runs the window whole") {
    parallel::Plan p;
    p.float8.enabled = true;
    p.float8.emulate = true;
    Transformer<float, Cpu> f8(a, p);
    CHECK_FALSE(f8.decodes_with_kv_cache());
    KvCache<float> cache(8);
    CHECK_THROWS_WITH(f8.cached_last_logits(all.first(2), cache), doctest::Contains("and no float8 GEMMs"));
  }
}

}  // namespace test_generate
