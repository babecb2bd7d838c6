// Context parallelism trains the same model as one rank. The pieces first: the
// chunk-major layout and each row's position; the ring attention against the backends'
// attention over whole sequences, forward and backward, on thread ranks under NCCL's
// rules (degrees 2, 3 and 4, grouped-query heads, a batch of two; one document a
// sequence, and packed documents that cross chunks and ranks). Then the parity
// matrix: the parity model for 10 steps (3 in sanitizer builds) on CP 2, CP 4 and CP
// composed with FSDP, HSDP, TP and PP, each with activation checkpoint modes, losses
// within 1e-5 of one rank's at every step; one run at 4096 tokens a sequence; and the
// refusals: a seq_len the balancer cannot split, a block that does not declare it runs
// on part of each sequence, sharding other than FSDP/HSDP.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "harness.hpp"
#include "parity_checks.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/nn/attention.hpp"
#include "tessera/parallel/context_parallel.hpp"
#include "../support/gradcheck.hpp"

namespace test_context_parallel {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

/// The rows of `whole` (rows x cols) at `rows`, in that order.
std::vector<float> take_rows(const std::vector<float>& whole, std::int64_t cols, const std::vector<std::int64_t>& rows) {
  std::vector<float> out;
  for (std::int64_t r : rows) out.insert(out.end(), whole.begin() + r * cols, whole.begin() + (r + 1) * cols);
  return out;
}

/// The largest |a - b| over the largest |b|.
template <class E>
double relative_gap(const std::vector<E>& a, const std::vector<E>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::abs(a[i] - b[i])));
    largest = std::max(largest, static_cast<double>(std::abs(b[i])));
  }
  return worst / largest;
}

}  // namespace

TEST_CASE("context parallel: each rank holds chunks i and 2 cp - 1 - i of every sequence, chunk-major") {
  // Two sequences of 8 tokens (ids 0..7 and 10..17) over cp 2: chunks of 2 tokens.
  std::vector<int> ids;
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 8; ++t) ids.push_back(10 * b + t);
  const std::span<const int> all(ids);
  CHECK(parallel::context_tokens(all, 2, 8, {0, 2}, 2) == std::vector<int>{0, 1, 10, 11, 6, 7, 16, 17});
  CHECK(parallel::context_tokens(all, 2, 8, {1, 2}, 2) == std::vector<int>{2, 3, 12, 13, 4, 5, 14, 15});
  // In runs of one sequence (a pipeline's microbatches of 1): each sequence's two chunks together.
  CHECK(parallel::context_tokens(all, 2, 8, {1, 2}, 1) == std::vector<int>{2, 3, 4, 5, 12, 13, 14, 15});
  CHECK(parallel::context_tokens(all, 2, 8, {0, 1}, 2) == ids);
  CHECK_THROWS_WITH_AS(parallel::context_tokens(all, 2, 8, {0, 3}, 2),
                       doctest::Contains("do not split into 6 chunks a sequence"), Error);

  // Each row's position: the same chunks, as RoPE reads them.
  const ops::RowPositions p(2, 4, ops::ContextShard{1, 2});
  std::vector<std::int64_t> positions;
  for (std::int64_t r = 0; r < 8; ++r) positions.push_back(p(r));
  CHECK(positions == std::vector<std::int64_t>{2, 3, 2, 3, 4, 5, 4, 5});
  CHECK(p.end() == 6);
  const ops::RowPositions whole(2, 8, ops::ContextShard{});
  CHECK(whole(11) == 3);
  CHECK(whole.end() == 8);
}

namespace {

/// The ring's attention over cp ranks (or, `rotation` all_gather, the all-gathered keys')
/// against the CPU backend's over whole sequences (relative gaps within 1e-5 on every
/// rank: o, lse, dq, dk, dv). `starts`: packed documents starting at those positions of
/// each sequence (besides its first), masked apart; none: one document a sequence. The
/// all-gathered forward is also the ring's, bit for bit (the same blocks merged in the
/// same order).
void check_ring(int cp, std::vector<std::int64_t> starts = {},
                parallel::ContextRotation rotation = parallel::ContextRotation::ring,
                parallel::ContextBalance balance = parallel::ContextBalance::head_tail) {
  const std::int64_t batch = 2, heads = 4, kv_heads = 2, hd = 8, c = 5;  // chunks of 5: no tile divides them
  const std::int64_t S = 2 * cp * c, rows = batch * S, q_cols = heads * hd, kv_cols = kv_heads * hd;
  const auto q = random_floats(static_cast<std::size_t>(rows * q_cols), 1);
  const auto k = random_floats(static_cast<std::size_t>(rows * kv_cols), 2);
  const auto v = random_floats(static_cast<std::size_t>(rows * kv_cols), 3);
  const auto d_o = random_floats(static_cast<std::size_t>(rows * q_cols), 4);
  std::vector<ops::DocumentSpan> spans;
  if (!starts.empty()) {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows), 3);
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t p : starts) ids[static_cast<std::size_t>(b * S + (p + 3 * b) % S)] = 1;
    spans = ops::document_spans(ids, batch, S, 1);
  }
  // One rank, whole sequences.
  const AttentionShape whole{batch, S, heads, kv_heads, hd, true, spans.empty() ? nullptr : spans.data()};
  std::vector<float> o(q.size()), lse(static_cast<std::size_t>(batch * heads * S)), dq(q.size()), dk(k.size()),
      dv(v.size());
  auto view = [](auto& x, std::int64_t cols) {
    using E = std::remove_reference_t<decltype(x[0])>;
    return TensorView<E>(x.data(), Shape{static_cast<std::int64_t>(x.size()) / cols, cols});
  };
  Cpu::attention_forward<float>(whole, view(q, q_cols), view(k, kv_cols), view(v, kv_cols), view(o, q_cols),
                                lse.data());
  Cpu::attention_backward<float>(whole, view(q, q_cols), view(k, kv_cols), view(v, kv_cols), view(o, q_cols),
                                 lse.data(), view(d_o, q_cols), view(dq, q_cols), view(dk, kv_cols), view(dv, kv_cols));
  std::vector<std::int64_t> all_rows(static_cast<std::size_t>(rows));
  std::iota(all_rows.begin(), all_rows.end(), 0);
  std::vector<double> gaps(static_cast<std::size_t>(cp) * 5, INFINITY);
  std::vector<int> same_as_ring(static_cast<std::size_t>(cp), 0);
  comm::run_thread_ranks(cp, [&](comm::Communicator& world) {
    parallel::ContextParallelGroup group(&world, rotation, balance);
    const auto mine = parallel::context_tokens<std::int64_t>(all_rows, batch, S, group.shard(), batch);
    auto lq = take_rows(q, q_cols, mine), lk = take_rows(k, kv_cols, mine), lv = take_rows(v, kv_cols, mine);
    auto ldo = take_rows(d_o, q_cols, mine);
    std::vector<float> lo(lq.size()), llse(static_cast<std::size_t>(batch * heads * 2 * c)), ldq(lq.size()),
        ldk(lk.size()), ldv(lv.size());
    // Each row's document in whole-sequence positions, in the rows' chunk order.
    const std::vector<ops::DocumentSpan> local_spans =
        spans.empty() ? spans : parallel::context_tokens<ops::DocumentSpan>(spans, batch, S, group.shard(), batch);
    const AttentionShape local{batch, 2 * c, heads, kv_heads, hd, true,
                               local_spans.empty() ? nullptr : local_spans.data()};
    parallel::attention_forward<Cpu, float>(&group, local, view(lq, q_cols), view(lk, kv_cols), view(lv, kv_cols),
                                            view(lo, q_cols), llse.data());
    if (rotation != parallel::ContextRotation::ring) {
      parallel::ContextParallelGroup ring(&world, parallel::ContextRotation::ring, balance);
      std::vector<float> ro(lq.size()), rlse(llse.size());
      parallel::attention_forward<Cpu, float>(&ring, local, view(lq, q_cols), view(lk, kv_cols), view(lv, kv_cols),
                                              view(ro, q_cols), rlse.data());
      same_as_ring[static_cast<std::size_t>(world.rank())] = ro == lo && rlse == llse;
    }
    parallel::attention_backward<Cpu, float>(&group, local, view(lq, q_cols), view(lk, kv_cols), view(lv, kv_cols),
                                             view(lo, q_cols), llse.data(), view(ldo, q_cols), view(ldq, q_cols),
                                             view(ldk, kv_cols), view(ldv, kv_cols));
    // lse, chunk-major (2, batch, heads, c), against the whole's (batch, heads, S).
    std::vector<float> want_lse;
    const ops::ContextShard me = group.shard();
    for (int j = 0; j < 2; ++j)
      for (std::int64_t b = 0; b < batch; ++b)
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t t = 0; t < c; ++t)
            want_lse.push_back(lse[static_cast<std::size_t>((b * heads + h) * S + me.chunk(j) * c + t)]);
    double* g = gaps.data() + world.rank() * 5;
    g[0] = relative_gap(lo, take_rows(o, q_cols, mine));
    g[1] = relative_gap(llse, want_lse);
    g[2] = relative_gap(ldq, take_rows(dq, q_cols, mine));
    g[3] = relative_gap(ldk, take_rows(dk, kv_cols, mine));
    g[4] = relative_gap(ldv, take_rows(dv, kv_cols, mine));
  }, nccl_rules());
  for (double g : gaps) CHECK(g <= 1e-5);
  if (rotation != parallel::ContextRotation::ring)
    for (int same : same_as_ring) CHECK(same == 1);
}

}  // namespace

TEST_CASE("context parallel: the all-gathered keys' attention is attention over whole sequences, the ring's forward") {
  for (int cp : {2, 3, 4}) {
    CAPTURE(cp);
    check_ring(cp, {}, parallel::ContextRotation::all_gather);
    check_ring(cp, {3, 5, 6, 10, 17}, parallel::ContextRotation::all_gather);
  }
  CHECK(parallel::parse_context_rotation("allgather") == parallel::ContextRotation::all_gather);
  CHECK(parallel::parse_context_rotation("alltoall") == parallel::ContextRotation::ring);
  CHECK_THROWS_WITH_AS(parallel::parse_context_rotation("ring"),
                       "parallelism.context_parallel_rotate_method: unknown method \"ring\" (known: alltoall, "
                       "allgather)",
                       Error);
}

TEST_CASE("context parallel: without the head-tail balance each rank holds its part of the sequence in order") {
  // A sequence of 8 cut for CP 2 into 4 chunks of 2: rank 1 holds chunks 2 and 3.
  const ops::ContextShard in_order{1, 2, false};
  CHECK(in_order.chunk(0) == 2);
  CHECK(in_order.chunk(1) == 3);
  std::vector<int> all(16);
  std::iota(all.begin(), all.end(), 0);
  CHECK(parallel::context_tokens<int>(all, 2, 8, in_order, 2) == std::vector<int>{4, 5, 12, 13, 6, 7, 14, 15});
  const ops::RowPositions p(2, 4, in_order);
  std::vector<std::int64_t> positions;
  for (std::int64_t r = 0; r < 8; ++r) positions.push_back(p(r));
  CHECK(positions == std::vector<std::int64_t>{4, 5, 4, 5, 6, 7, 6, 7});
  CHECK(p.end() == 8);
  // The ring: rank i computes 4 i + 3 blocks over a step (every later key chunk skipped).
  for (int rank = 0; rank < 4; ++rank) {
    std::size_t blocks = 0;
    for (int src = 0; src < 4; ++src) blocks += parallel::detail::ring_blocks({rank, 4, false}, src).size();
    CHECK(blocks == static_cast<std::size_t>(4 * rank + 3));
    std::size_t balanced = 0;
    for (int src = 0; src < 4; ++src) balanced += parallel::detail::ring_blocks({rank, 4}, src).size();
    CHECK(balanced == 2 * 4 + 1);
  }
  // Attention over the ring, and over the all-gathered keys, is the whole sequence's.
  for (int cp : {2, 3}) {
    CAPTURE(cp);
    check_ring(cp, {}, parallel::ContextRotation::ring, parallel::ContextBalance::none);
    check_ring(cp, {3, 5, 6, 10, 17}, parallel::ContextRotation::all_gather, parallel::ContextBalance::none);
  }
  CHECK(parallel::parse_context_balance("none") == parallel::ContextBalance::none);
  CHECK(parallel::parse_context_balance("headtail") == parallel::ContextBalance::head_tail);
  CHECK_THROWS_WITH_AS(parallel::parse_context_balance("ptrr"), doctest::Contains("known: headtail, none"), Error);
}

TEST_CASE("context parallel: without the head-tail balance, CP 2, CP 4 and CP 2 x FSDP 2 train the same model as one rank") {
  const std::vector<std::string> in_order = {"--parallelism.context_parallel_load_balancer", "none"};
  check_layout_parity("CP 2, in order, none", {1, 1, 1, 1, 2}, with(kAcModes[0].keys, in_order));
  check_layout_parity("CP 4, in order, selective op", {1, 1, 1, 1, 4}, with(kAcModes[2].keys, in_order));
  check_layout_parity("CP 2 x FSDP 2, in order, allgather, packed documents", {1, 1, 2, 1, 2},
                      with(in_order, {"--parallelism.context_parallel_rotate_method", "allgather"}),
                      {"--training.document_mask", "true"});
}

TEST_CASE("context parallel: the ring's attention is attention over whole sequences, forward and backward") {
  for (int cp : {2, 3, 4}) {
    CAPTURE(cp);
    check_ring(cp);
  }
}

TEST_CASE("context parallel: the ring masks packed documents apart as attention over whole sequences does") {
  // Documents that start mid-chunk, on a chunk's first position (5, 10), one token long
  // (5), and that span several chunks and ranks (the second sequence's starts are
  // shifted by 3).
  for (int cp : {2, 3, 4}) {
    CAPTURE(cp);
    check_ring(cp, {3, 5, 6, 10, 17});
  }
}

TEST_CASE("context parallel: a rank's attention layer gives its rows of the whole's, RoPE at global positions") {
  // In double, at a head dim of 8 with Llama's RoPE: a row rotated by its local index
  // instead of its position, or a key block left out, is far outside 1e-10.
  nn::ModelArgs a;
  a.dim = 32;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.rope_theta = 10000;
  a.max_seq_len = 64;
  const std::int64_t batch = 2, S = 24, rows = batch * S;
  using Layer = nn::Attention<double, Cpu>;
  auto make = [&](parallel::ContextParallelGroup* cp) {
    auto rope = std::make_shared<nn::RopeTable<double, Cpu>>(a.head_dim(), a.rope_theta, a.rope_scaling);
    auto layer = std::make_unique<Layer>("attention", a, 0.1, rope, nullptr, nullptr, cp);
    layer->for_each_parameter([](nn::Parameter<double>& p) { testing::fill_normal(p.value, 3, p.name, 0.5); });
    return layer;
  };
  auto values = [](std::int64_t n, std::int64_t cols, const char* name) {
    Tensor<double> t(Shape{n, cols});
    testing::fill_normal(t, 4, name);
    return t;
  };
  const Tensor<double> x = values(rows, a.dim, "x"), dy = values(rows, a.dim, "dy");
  auto run = [](Layer& layer, nn::Geometry g, const Tensor<double>& in, const Tensor<double>& grad_out) {
    nn::ActivationStore<double> store;
    Tensor<double> y = layer.forward(nn::Context<double>(g, &store), in);
    layer.for_each_parameter([](nn::Parameter<double>& p) { std::fill_n(p.grad.data(), p.numel(), 0.0); });
    Tensor<double> dx = layer.backward(nn::Context<double>(g, &store), grad_out);
    std::vector<double> grads;
    layer.for_each_parameter([&](nn::Parameter<double>& p) { grads.insert(grads.end(), p.grad.data(), p.grad.data() + p.numel()); });
    return std::tuple{testing::to_vector(y), testing::to_vector(dx), grads};
  };
  auto whole_layer = make(nullptr);
  const auto [y, dx, grads] = run(*whole_layer, nn::Geometry{batch, S}, x, dy);
  for (int cp : {2, 3}) {
    CAPTURE(cp);
    std::vector<double> gaps(static_cast<std::size_t>(cp) * 3, INFINITY);
    comm::run_thread_ranks(cp, [&](comm::Communicator& world) {
      parallel::ContextParallelGroup group(&world);
      std::vector<std::int64_t> all(static_cast<std::size_t>(rows));
      std::iota(all.begin(), all.end(), 0);
      const auto mine = parallel::context_tokens<std::int64_t>(all, batch, S, group.shard(), batch);
      auto rows_of = [&](const std::vector<double>& m, std::int64_t cols) {
        std::vector<double> out;
        for (std::int64_t r : mine) out.insert(out.end(), m.begin() + r * cols, m.begin() + (r + 1) * cols);
        return out;
      };
      auto tensor_of = [&](const std::vector<double>& v) {
        Tensor<double> t(Shape{static_cast<std::int64_t>(v.size()) / a.dim, a.dim});
        std::copy(v.begin(), v.end(), t.data());
        return t;
      };
      auto layer = make(&group);
      const nn::Geometry g{batch, S / cp, group.shard()};
      auto [ly, ldx, lgrads] =
          run(*layer, g, tensor_of(rows_of(testing::to_vector(x), a.dim)), tensor_of(rows_of(testing::to_vector(dy), a.dim)));
      // Each rank's part of the weights' gradients, summed (through the backend's memory, as NCCL would).
      Tensor<double> summed = Cpu::empty<double>(Shape{static_cast<std::int64_t>(lgrads.size())});
      std::copy(lgrads.begin(), lgrads.end(), summed.data());
      world.all_reduce(std::span<double>(summed.data(), lgrads.size()));
      lgrads.assign(summed.data(), summed.data() + summed.numel());
      double* out = gaps.data() + world.rank() * 3;
      out[0] = relative_gap(ly, rows_of(y, a.dim));
      out[1] = relative_gap(ldx, rows_of(dx, a.dim));
      out[2] = relative_gap(lgrads, grads);
    }, nccl_rules());
    for (double g : gaps) CHECK(g <= 1e-10);
  }
}

TEST_CASE("context parallel: CP 2 and CP 4 train the same model as one rank, in every checkpoint mode") {
  std::size_t turn = 0;
  for (const AcMode& ac : ac_modes_for(turn++)) check_layout_parity(std::string("CP 2, ") + ac.name, {1, 1, 1, 1, 2}, ac.keys);
  for (const AcMode& ac : ac_modes_for(turn++, true))
    check_layout_parity(std::string("CP 4, ") + ac.name, {1, 1, 1, 1, 4}, ac.keys);
}

TEST_CASE("context parallel: composed with FSDP, HSDP, TP and PP") {
  std::size_t turn = 0;
  const auto modes = [&] { return ac_modes_for(turn++); };
  for (const AcMode& ac : modes()) check_layout_parity(std::string("CP 2 x FSDP 2, ") + ac.name, {1, 1, 2, 1, 2}, ac.keys);
  check_layout_parity("CP 2 x HSDP 2x1, selective op", {1, 2, 1, 1, 2}, kAcModes[2].keys);
  check_layout_parity("CP 2 x TP 2, full", {1, 1, 1, 2, 2}, kAcModes[1].keys, {"--model.n_kv_heads", "4"});
  check_layout_parity("CP 2 x PP 2 (1F1B), none", {2, 1, 1, 1, 2}, kAcModes[0].keys);
  check_layout_parity("CP 2 x PP 2 (interleaved 1F1B), every 2nd layer", {2, 1, 1, 1, 2},
               with(kAcModes[3].keys, {"--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"}));
  check_layout_parity("CP 2 x TP 2 x FSDP 2, selective op", {1, 1, 2, 2, 2}, kAcModes[2].keys);
}

TEST_CASE("context parallel: with the keys all-gathered, CP 2, CP 4 and CP 2 x FSDP 2 train the same model as one rank") {
  const std::vector<std::string> gathered = {"--parallelism.context_parallel_rotate_method", "allgather"};
  check_layout_parity("CP 2, allgather, none", {1, 1, 1, 1, 2}, with(kAcModes[0].keys, gathered));
  check_layout_parity("CP 4, allgather, full", {1, 1, 1, 1, 4}, with(kAcModes[1].keys, gathered));
  check_layout_parity("CP 2 x FSDP 2, allgather, selective op", {1, 1, 2, 1, 2}, with(kAcModes[2].keys, gathered));
  check_layout_parity("CP 2 x PP 2 (1F1B), allgather, packed documents", {2, 1, 1, 1, 2}, gathered,
                      {"--training.document_mask", "true"});
}

TEST_CASE("context parallel: 4096 tokens a sequence on CP 2, as one rank") {
  // Two of the parity model's layers: the length is what this case is about. The
  // sanitizer build, where a step is ten times slower, runs 512 tokens.
#if TESSERA_SHORT_TESTS
  const char* seq = "512";
#else
  const char* seq = "4096";
#endif
  const std::vector<std::string> long_seq = {"--training.seq_len", seq, "--model.max_seq_len", seq,
                                             "--model.n_layers", "2"};
  const train::JobConfig c = debug_job(1, 1, 2, long_seq);
  const RunResult one = train_layout(comm::Communicator(), comm::MeshShape{}, c);
  std::vector<RunResult> per_rank(2);
  comm::run_thread_ranks(2, [&](comm::Communicator& world) {
    per_rank[static_cast<std::size_t>(world.rank())] = train_layout(world, {1, 1, 1, 1, 2}, c);
  }, nccl_rules());
  CHECK(per_rank[0].losses == per_rank[1].losses);
  const RunGap gap = run_gap(per_rank[0], one);
  CHECK(gap.loss <= 1e-5);
  CHECK(gap.grad_norm <= 1e-4);
}

TEST_CASE("context parallel: what it cannot run is refused by name on every rank") {
  auto refused = [](comm::MeshShape shape, const std::vector<std::string>& keys, const char* text) {
    const std::string expected = text;
    CAPTURE(expected);
    for (const auto& e : layout_errors(shape, keys)) CHECK(e.find(expected) != std::string::npos);
  };
  refused({1, 1, 1, 1, 2}, {"--training.seq_len", "30"},
          "training.seq_len = 30 does not split into 2 x parallelism.context_parallel_degree = 2 = 4 equal chunks");
  refused({1, 1, 1, 1, 4}, {"--training.seq_len", "36", "--model.max_seq_len", "36"},
          "training.seq_len = 36 does not split into 2 x parallelism.context_parallel_degree = 4 = 8 equal chunks");
  // The config's check, before any rank is started.
  CHECK_THROWS_WITH_AS(train::check_supported(debug_job(8, 8, 1, {"--parallelism.context_parallel_degree", "4",
                                                                    "--training.seq_len", "36"})),
                       doctest::Contains("training.seq_len = 36 does not split into 2 x "
                                         "parallelism.context_parallel_degree = 8 equal chunks"),
                       Error);
}

}  // namespace test_context_parallel
