// Tensor parallelism (with sequence and loss parallelism) trains the same model as one
// rank: the parity model in float32 for 10 steps (3 in sanitizer builds) on thread
// ranks, losses within 1e-5 relative at every step (gradient norms within 1e-4).
// TP 2 and 4; TP larger than the key/value head count (kv heads replicated); loss
// parallelism off; sequence parallelism off; TP composed with FSDP and HSDP, each with
// an activation checkpoint mode. Also: the whole gradient of
// one step matches one rank's, pieces and all; saving gathers whole parameters; bad
// degrees are refused by name on every rank: by config key when a config gave them, in
// words (or by the static policy) when a program did. Float8 GEMMs under tensor
// parallelism: a column- and a row-parallel linear layer against the whole one, every
// recipe; the model against one rank's float8 run, FSDP's float8 all-gather included.
// Asynchronous TP: the overlapped gather and reduce-scatter against the collectives, and
// ten layouts with it against one rank (float8 among them).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "harness.hpp"
#include "parity_checks.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/nn/linear.hpp"

namespace test_tensor_parallel {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

const std::vector<std::string> kFull = kAcModes[1].keys;
const std::vector<std::string> kSelectiveOp = kAcModes[2].keys;
const std::vector<std::string> kEvery2nd = kAcModes[3].keys;

/// A rows x cols matrix of normal values whose magnitudes grow along the rows and the
/// columns (by 8 across the columns, 4 down the rows), so that each row's, column's and
/// piece's largest value lies in its last piece: a piece cast by its own amax is cast
/// by another scale than the whole.
std::vector<float> graded_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> m(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      m[static_cast<std::size_t>(r * cols + c)] =
          normal(gen) * std::exp2(3.0f * static_cast<float>(c) / static_cast<float>(cols) +
                                  2.0f * static_cast<float>(r) / static_cast<float>(rows));
  return m;
}

/// Columns [c0, c1) of a row-major matrix with `cols` columns.
std::vector<float> columns_of(const std::vector<float>& m, std::int64_t cols, std::int64_t c0, std::int64_t c1) {
  std::vector<float> out;
  for (std::size_t r = 0; r < m.size() / static_cast<std::size_t>(cols); ++r)
    out.insert(out.end(), m.begin() + static_cast<std::ptrdiff_t>(r * cols + c0),
               m.begin() + static_cast<std::ptrdiff_t>(r * cols + c1));
  return out;
}
/// Rows [r0, r1) of a row-major matrix with `cols` columns.
std::vector<float> rows_of(const std::vector<float>& m, std::int64_t cols, std::int64_t r0, std::int64_t r1) {
  return {m.begin() + r0 * cols, m.begin() + r1 * cols};
}

Tensor<float> tensor_of(const std::vector<float>& v, std::int64_t rows, std::int64_t cols) {
  Tensor<float> t(Shape{rows, cols});
  std::copy(v.begin(), v.end(), t.data());
  return t;
}
std::vector<float> values_of(const Tensor<float>& t) { return {t.data(), t.data() + t.numel()}; }

/// A linear layer's forward and backward: y, dx and dW (its weight's gradient, first written).
struct LinearRun {
  std::vector<float> y, dx, dw;
};
LinearRun run_linear(nn::Linear<float, Cpu>& lin, const std::vector<float>& x, const std::vector<float>& dy,
                     nn::Geometry g) {
  nn::ActivationStore<float> store;
  const std::int64_t in = lin.in_features(), out = lin.out_features();
  const Tensor<float> y = lin.forward(nn::Context<float>(g, &store), tensor_of(x, g.rows(), in));
  const Tensor<float> dx = lin.backward(nn::Context<float>(g, &store), tensor_of(dy, g.rows(), out));
  return {values_of(y), values_of(dx), values_of(lin.weight().grad)};
}

}  // namespace

TEST_CASE("tensor parallel: TP 2 and TP 4 train the same model as one rank") {
  check_layout_parity("TP 2", {1, 1, 1, 2}, {});
  check_layout_parity("TP 4, full checkpointing", {1, 1, 1, 4}, kFull);
}

TEST_CASE("tensor parallel: TP 4 over 2 key/value heads (each kv head on 2 ranks), and TP 2 over 4") {
  const std::vector<std::string> gqa = {"--model.n_kv_heads", "2"};
  check_layout_parity("TP 4 > kv heads 2", {1, 1, 1, 4}, kSelectiveOp, gqa);
  check_layout_parity("TP 2 < kv heads 4", {1, 1, 1, 2}, {}, {"--model.n_kv_heads", "4"});
}

TEST_CASE("tensor parallel: loss parallelism disabled (the output whole on every rank)") {
  check_layout_parity("TP 2, no loss parallel", {1, 1, 1, 2}, {"--parallelism.disable_loss_parallel", "true"});
}

TEST_CASE("tensor parallel: sequence parallelism disabled (every row on every rank between the regions)") {
  const std::vector<std::string> no_sp = {"--parallelism.disable_sequence_parallel", "true"};
  check_layout_parity("TP 2, no sequence parallel", {1, 1, 1, 2}, no_sp);
  // Selective op keeps wo's and w2's outputs: the all-reduce must leave them partial.
  check_layout_parity("FSDP 2 x TP 2, no sequence parallel, selective op", {1, 1, 2, 2}, with(no_sp, kSelectiveOp));
  check_layout_parity("TP 4 > kv heads 2, neither sequence nor loss parallel, full", {1, 1, 1, 4},
               with(with(no_sp, {"--parallelism.disable_loss_parallel", "true"}), kFull), {"--model.n_kv_heads", "2"});
}

TEST_CASE("tensor parallel: with tied embeddings (the head reads the vocabulary-split embedding)") {
  check_layout_parity("TP 2, tied", {1, 1, 1, 2}, {}, {"--model.tie_embeddings", "true"});
}

TEST_CASE("tensor parallel: FSDP x TP and HSDP x TP, with checkpointing") {
  check_layout_parity("FSDP 2 x TP 2, selective op", {1, 1, 2, 2}, kSelectiveOp);
  check_layout_parity("FSDP 2 x TP 4, every 2nd layer", {1, 1, 2, 4}, kEvery2nd);
  check_layout_parity("HSDP 2x2 x TP 2, full", {1, 2, 2, 2}, kFull);
}

TEST_CASE("tensor parallel: the overlapped gather and reduce-scatter are the collectives' bits, cut by peer") {
  // Asynchronous TP's two moves on 2, 3 and 4 thread ranks under NCCL's rules: the
  // gathered rows and the summed rows are whole_rows' and summed_rows' bit for bit (bf16
  // sums rounded in the same order), the GEMM's blocks come in the order the transfers
  // bring or want them, and the bytes sent are the collectives', by send/recv instead.
  for (const int n : {2, 3, 4}) {
    CAPTURE(n);
    comm::run_thread_ranks(
        n,
        [&](comm::Communicator& world) {
          parallel::TensorParallelGroup whole(&world), cut(&world, true, true, /*overlapped=*/true);
          REQUIRE(parallel::overlaps(&cut));
          REQUIRE_FALSE(parallel::overlaps(&whole));
          const int r = world.rank();
          const std::int64_t m = 3, cols = 5;
          std::vector<float> mine(static_cast<std::size_t>(m * cols)), partial(static_cast<std::size_t>(n * m * cols));
          for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = 0.37f * static_cast<float>(i) - 1.3f * (r + 1);
          for (std::size_t i = 0; i < partial.size(); ++i)
            partial[i] = std::sin(0.7f * static_cast<float>(i) + 1.9f * r) * (1.0f + 1e3f * static_cast<float>(r));
          const auto check = [&]<class T>(T) {
            const auto as_t = [&](const std::vector<float>& v, std::int64_t rows) {
              Tensor<T> t = Cpu::empty<T>(Shape{rows, cols});
              for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = T(v[static_cast<std::size_t>(i)]);
              return t;
            };
            const auto bits = [](const Tensor<T>& t) {
              std::vector<unsigned char> b(static_cast<std::size_t>(t.numel()) * sizeof(T));
              std::memcpy(b.data(), t.data(), b.size());
              return b;
            };
            const Tensor<T> x = as_t(mine, m), p = as_t(partial, n * m);
            world.reset_traffic();
            const Tensor<T> gathered = parallel::whole_rows<Cpu>(&whole, x);
            const Tensor<T> summed = parallel::summed_rows<Cpu>(&whole, p);
            const comm::Traffic collectives = world.traffic();
            world.reset_traffic();
            std::vector<std::int64_t> read, written;
            const Tensor<T> gathered_cut = parallel::whole_rows_overlapped<Cpu>(
                &cut, x, [&](const Tensor<T>& y, std::int64_t begin, std::int64_t end) {
                  CHECK(y.size(0) == n * m);
                  CHECK(end - begin == m);
                  read.push_back(begin / m);
                });
            const Tensor<T> summed_cut = parallel::summed_rows_overlapped<Cpu, T>(
                &cut, n * m, cols, [&](const Tensor<T>& into, std::int64_t begin, std::int64_t end) {
                  CHECK(end - begin == m);
                  std::memcpy(into.data() + begin * cols, p.data() + begin * cols,
                              static_cast<std::size_t>((end - begin) * cols) * sizeof(T));
                  written.push_back(begin / m);
                });
            CHECK(bits(gathered_cut) == bits(gathered));
            CHECK(bits(summed_cut) == bits(summed));
            std::vector<std::int64_t> arrival, departure;
            for (int s = 0; s < n; ++s) {
              arrival.push_back((r + s) % n);
              departure.push_back((r + s + 1) % n);
            }
            CHECK(read == arrival);
            CHECK(written == departure);
            const comm::Traffic peers = world.traffic();
            CHECK(peers.all_gather + peers.reduce_scatter == 0);
            CHECK(peers.send == collectives.all_gather + collectives.reduce_scatter);
          };
          check(float{});
          check(bf16{});
        },
        nccl_rules());
  }
}

TEST_CASE("tensor parallel: asynchronous TP trains one rank's model, its collectives cut into the GEMMs") {
  // parallelism.enable_async_tensor_parallel: every region's gathers and reduce-scatters
  // cut by peer. The same bytes as the collectives, sent by send/recv, and one rank's
  // model within the parity bar (a GEMM run a block of rows at a time rounds as OpenBLAS
  // blocks that call: 1e-8 from the collectives' run in float32). Layers the cut does not
  // reach (an op policy's stash) run whole beside those it does.
  struct Case {
    const char* name;
    comm::MeshShape shape;
    std::vector<std::string> keys, model_keys;
    double loss_bar = 1e-5, grad_norm_bar = 1e-4;
    // Where every region is cut, in float32 (the CPU model's activations, bf16 parameter
    // values among them), and nothing else sends point to point: the cut transfers a
    // block and step (4 forward, 4 backward, 4 more where full checkpointing replays the
    // forward).
    std::uint64_t cut_per_block = 0;
  };
  const std::vector<std::string> async = {"--parallelism.enable_async_tensor_parallel", "true"};
  const std::vector<std::string> float8 = {"--training.mixed_precision_param", "bfloat16", "--model.converters",
                                           "float8", "--float8.emulate", "true", "--float8.recipe_name"};
  const std::vector<std::string> kTensorwise = with(float8, {"tensorwise"}), kRowwise = with(float8, {"rowwise"});
  for (const Case& k :
       {Case{"TP 2", {1, 1, 1, 2}, {}, {}, 1e-5, 1e-4, 8},
        Case{"TP 4, full checkpointing", {1, 1, 1, 4}, kFull, {}, 1e-5, 1e-4, 12},
        Case{"FSDP 2 x TP 2, selective op", {1, 1, 2, 2}, kSelectiveOp, {}},
        // wk and wv held by two ranks each: not stacked, each multiplied by blocks.
        Case{"TP 4 > kv heads 2", {1, 1, 1, 4}, {}, {"--model.n_kv_heads", "2"}, 1e-5, 1e-4, 8},
        Case{"TP 2 x PP 2, 1F1B", {2, 1, 1, 2}, {"--parallelism.pipeline_parallel_microbatch_size", "2"}, {}},
        Case{"TP 2, projections one by one", {1, 1, 1, 2}, {}, {"--model.fuse_projections", "false"}, 1e-5, 1e-4, 8},
        // bf16: a row-parallel layer's partial sums rounded before they are summed (the
        // bf16 model's bars, as the float8 case above).
        Case{"TP 2, bf16", {1, 1, 1, 2}, {}, {"--training.mixed_precision_param", "bfloat16"}, 1e-3, 5e-3, 8},
        // Float8 (emulated): the gathers in float8 multiplied a block of rows at a time, the
        // output projections' operands cast once and multiplied by blocks (per-row scales
        // sliced with their rows, rowwise); the float8 model's bars against one rank's.
        Case{"TP 2, float8 tensorwise (gathers in float8), full checkpointing", {1, 1, 1, 2}, kFull, kTensorwise, 1e-3,
             5e-3},
        // Rowwise gathers bf16 rows, each block cast by its rows' scales as it arrives.
        Case{"TP 4, float8 rowwise", {1, 1, 1, 4}, {}, kRowwise, 1e-3, 5e-3, 8},
        Case{"TP 2, float8 tensorwise, weights gathered in float8 by FSDP 2", {1, 1, 2, 2},
             {"--float8.enable_fsdp_float8_all_gather", "true"}, kTensorwise, 1e-3, 5e-3}}) {
    const std::string name = k.name;
    CAPTURE(name);
    const LayoutRun cut = layout_run(k.shape, with(with(k.keys, k.model_keys), async));
    const LayoutRun collectives = layout_run(k.shape, with(k.keys, k.model_keys));
    CHECK(cut.ranks_agree);
    const RunGap gap = run_gap(cut.rank0, one_rank_run(k.model_keys));
    const RunGap beside = run_gap(cut.rank0, collectives.rank0);
    MESSAGE(name, ": loss within ", gap.loss, ", gradient norm within ", gap.grad_norm, " of one rank's (",
            beside.loss, " and ", beside.grad_norm, " of the collectives'); bytes sent by send/recv in a step ",
            cut.rank0.peer_bytes, " (", collectives.rank0.peer_bytes, " without), of ", cut.rank0.comm_bytes);
    CHECK(gap.loss <= k.loss_bar);
    CHECK(gap.grad_norm <= k.grad_norm_bar);
    CHECK(cut.rank0.comm_bytes == collectives.rank0.comm_bytes);
    CHECK(cut.rank0.peer_bytes > collectives.rank0.peer_bytes);
    if (k.cut_per_block > 0) {
      // Each cut transfer: a rank sends (n - 1) blocks of R / n rows (its rows to each
      // peer, or each peer's rows of a partial sum) of `dim` float32 elements.
      const train::JobConfig c = debug_job(kParityBatch, kParityBatch, 1, k.model_keys);
      const auto n = static_cast<std::uint64_t>(k.shape.tp);
      const auto rows = static_cast<std::uint64_t>(kParityBatch / k.shape.dp() * c.training.seq_len);
      CHECK(cut.rank0.peer_bytes == k.cut_per_block * static_cast<std::uint64_t>(c.model.args.n_layers) * (n - 1) *
                                        (rows / n) * static_cast<std::uint64_t>(c.model.args.dim) * sizeof(float));
    }
  }
}

TEST_CASE("tensor parallel: each rank's gradient is its piece of one rank's, and saving sees whole parameters") {
  const train::JobConfig c = debug_job(2, 2, 1, {"--model.n_kv_heads", "2"});
  data::DataLoader loader(debug_tokens(), c.training.seq_len, 2, 0, 1);
  const data::Batch batch = loader.next();
  const nn::Geometry g{batch.batch, batch.seq_len};
  const double scale = 1.0 / static_cast<double>(batch.n_targets);

  // One rank: every parameter's initial value and gradient, whole.
  std::map<std::string, std::pair<Tensor<float>, Tensor<float>>> reference;
  double reference_norm = 0, reference_loss = 0;
  {
    CpuDynamicModel model(c.model.args, train::make_plan(c, nullptr));
    model.init_weights(0);
    model.shard();
    model.zero_grad();
    reference_loss = model.forward_backward(batch.inputs, batch.targets, g, scale);
    reference_norm = model.grad_norm();
    model.for_each_parameter([&](nn::Parameter<float>& p) { reference[p.name] = {p.value.clone(), p.grad.clone()}; });
  }

  comm::run_thread_ranks(4, [&](comm::Communicator& world) {
    comm::DeviceMesh mesh(world, {1, 1, 1, 4});
    CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
    model.init_weights(0);
    model.shard();
    model.zero_grad();
    const double loss = model.forward_backward(batch.inputs, batch.targets, g, scale);
    const double norm = model.grad_norm();
    CHECK(std::abs(loss - reference_loss) <= 1e-5 * std::abs(reference_loss));
    CHECK(std::abs(norm - reference_norm) <= 1e-5 * reference_norm);
    int split = 0;
    model.for_each_parameter([&](nn::Parameter<float>& p) {
      const auto& [value, grad] = reference.at(p.name);
      // This rank's piece of the whole gradient, cut the way the parameter is.
      nn::Parameter<float> expected(p.name, p.whole, nn::Init{});
      expected.split = p.split;
      expected.value = grad.clone();
      parallel::narrow<Cpu>(expected);
      REQUIRE(expected.value.shape() == p.grad.shape());
      double worst = 0, largest = 0;
      for (std::int64_t i = 0; i < p.grad.numel(); ++i) {
        worst = std::max(worst, static_cast<double>(std::abs(p.grad[i] - expected.value[i])));
        largest = std::max(largest, static_cast<double>(std::abs(expected.value[i])));
      }
      const std::string name = p.name;
      CAPTURE(name);
      CHECK(worst <= 1e-5 * largest);
      split += p.split.split() ? 1 : 0;
    });
    CHECK(split == 6 * 7 + 2);  // wq, wk, wv, wo, w1, w2, w3 of each block; the embedding; the output
    // Saving gathers the pieces: every value whole and exactly the initial one.
    model.with_whole_parameters([&] {
      model.for_each_parameter([&](nn::Parameter<float>& p) {
        const Tensor<float>& whole = reference.at(p.name).first;
        REQUIRE(p.value.shape() == whole.shape());
        CHECK(std::equal(whole.data(), whole.data() + whole.numel(), p.value.data()));
      });
    });
    model.for_each_parameter([&](nn::Parameter<float>& p) {
      if (p.split.split()) CHECK(p.value.shape() != p.whole);  // pieces again afterwards
    });
  }, nccl_rules());
}

TEST_CASE("tensor parallel: a float8 cast of a piece takes the whole tensor's scales, bit for bit") {
  // Every cast (both formats, by tensor, row and column, powers of two or not) of a piece
  // split by rows and by columns over 2 and 4 thread ranks against the cast of the whole
  // tensor: the scales of the rows or columns the piece holds, or the one scale, and the
  // piece's float8 values, bitwise. Power-of-two scales (rowwise) quantise alike at any
  // power of two above the largest value but for underflow, so only the scales show a
  // piece cast by its own amax there.
  const std::int64_t R = 16, C = 32;
  const std::vector<float> x = graded_matrix(R, C, 4);
  const Tensor<float> whole_x = tensor_of(x, R, C);
  for (const DType format : {DType::f8e4m3, DType::f8e5m2})
    for (const ops::Float8Axis axis : {ops::Float8Axis::tensor, ops::Float8Axis::rows, ops::Float8Axis::columns})
      for (const bool pow2 : {false, true}) {
        const ops::Float8Cast cast{format, axis, pow2};
        const nn::Float8Operand<Cpu> whole = nn::cast_to_float8<Cpu>(whole_x.cview(), cast);
        const std::vector<float> whole_values = values_of(nn::float8_values<Cpu>(whole));
        for (const int degree : {2, 4})
          for (const bool by_rows : {true, false}) {
            const std::string what = std::string(name_of(format)) + " by " +
                                     (axis == ops::Float8Axis::tensor ? "tensor" : axis == ops::Float8Axis::rows ? "rows" : "columns") +
                                     (pow2 ? " (powers of two)" : "") + ", split by " + (by_rows ? "rows" : "columns") +
                                     " over " + std::to_string(degree);
            CAPTURE(what);
            std::vector<int> differ(static_cast<std::size_t>(degree), -1);
            comm::run_thread_ranks(degree, [&](comm::Communicator& world) {
              const std::int64_t t = world.rank();
              const std::int64_t r0 = by_rows ? t * R / degree : 0, r1 = by_rows ? (t + 1) * R / degree : R;
              const std::int64_t c0 = by_rows ? 0 : t * C / degree, c1 = by_rows ? C : (t + 1) * C / degree;
              const Tensor<float> piece = tensor_of(columns_of(rows_of(x, C, r0, r1), C, c0, c1), r1 - r0, c1 - c0);
              const nn::Float8Split split = by_rows ? nn::Float8Split::rows(world) : nn::Float8Split::columns(world);
              const nn::Float8Operand<Cpu> q = nn::cast_to_float8<Cpu>(piece.cview(), cast, false, split);
              int bad = 0;
              // Its scales: the whole's one, or those of its rows or columns.
              const std::int64_t s0 = axis == ops::Float8Axis::rows ? r0 : axis == ops::Float8Axis::columns ? c0 : 0;
              for (std::int64_t i = 0; i < q.scale.numel(); ++i)
                bad += q.scale[i] != whole.scale[s0 + i] || q.inverse[i] != whole.inverse[s0 + i];
              const std::vector<float> mine = values_of(nn::float8_values<Cpu>(q));
              const std::vector<float> expected = columns_of(rows_of(whole_values, C, r0, r1), C, c0, c1);
              for (std::size_t i = 0; i < mine.size(); ++i) bad += std::memcmp(&mine[i], &expected[i], sizeof(float)) != 0;
              differ[static_cast<std::size_t>(t)] = bad;
            }, nccl_rules());
            for (const int d : differ) CHECK(d == 0);
          }
      }
}

TEST_CASE("tensor parallel: float8 linear layers cast each piece by the whole tensor's scales, every recipe") {
  // One rank's linear layer (float32, emulated float8 GEMMs) against the same layer split
  // over 2 and 4 thread ranks, column-parallel (W by output rows: x whole, dy split by
  // columns) and row-parallel (W by input columns: x split by columns, dy whole): each
  // rank's y, dx and dW, or the sum of the ranks' partial sums, against the whole layer's.
  // The float8 operands are the whole cast's pieces, so only the float sums' order
  // differs (about 1e-7 of the scale); a piece cast by its own amax is a float8 step off
  // (about 1e-2), on every rank but the last.
  const nn::Geometry g{2, 12};
  const std::int64_t M = g.rows(), K = 64, N = 32;  // rows, input and output features
  const std::vector<float> w = graded_matrix(N, K, 1), x = graded_matrix(M, K, 2), dy = graded_matrix(M, N, 3);
  for (const ops::Float8Recipe recipe :
       {ops::Float8Recipe::tensorwise, ops::Float8Recipe::rowwise, ops::Float8Recipe::rowwise_with_gw_hp}) {
    ops::Float8Policy policy;
    policy.enabled = true;
    policy.emulate = true;
    policy.recipe = recipe;
    nn::Linear<float, Cpu> whole("layers.0.feed_forward.w1", K, N, nn::Init{}, nullptr, {}, &policy);
    std::copy(w.begin(), w.end(), whole.weight().value.data());
    const LinearRun one = run_linear(whole, x, dy, g);
    for (const int degree : {2, 4})
      for (const int dim : {0, 1}) {
        const std::string layout = std::string(ops::name_of(recipe)) + (dim == 0 ? ", column" : ", row") +
                                   "-parallel over " + std::to_string(degree);
        CAPTURE(layout);
        std::vector<LinearRun> runs(static_cast<std::size_t>(degree));
        comm::run_thread_ranks(degree, [&](comm::Communicator& world) {
          parallel::TensorParallelGroup tp(&world);
          nn::Linear<float, Cpu> lin("layers.0.feed_forward.w1", K, N, nn::Init{}, &tp, tp.split(dim), &policy);
          std::copy(w.begin(), w.end(), lin.weight().value.data());
          parallel::narrow<Cpu>(lin.weight());
          const std::int64_t t = world.rank();
          const std::int64_t n0 = t * N / degree, n1 = (t + 1) * N / degree, k0 = t * K / degree,
                             k1 = (t + 1) * K / degree;
          runs[static_cast<std::size_t>(t)] =
              run_linear(lin, dim == 0 ? x : columns_of(x, K, k0, k1), dim == 0 ? columns_of(dy, N, n0, n1) : dy, g);
        }, nccl_rules());
        // The partial sums over the ranks, in rank order.
        auto summed = [&](std::vector<float> LinearRun::*part) {
          std::vector<float> sum(runs[0].*part);
          for (std::size_t r = 1; r < runs.size(); ++r)
            for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += (runs[r].*part)[i];
          return sum;
        };
        double worst = 0;
        if (dim == 0) {
          worst = std::max(worst, gap_to_scale(summed(&LinearRun::dx), one.dx));
          for (int t = 0; t < degree; ++t) {
            const std::int64_t n0 = t * N / degree, n1 = (t + 1) * N / degree;
            const LinearRun& r = runs[static_cast<std::size_t>(t)];
            worst = std::max(worst, gap_to_scale(r.y, columns_of(one.y, N, n0, n1)));
            worst = std::max(worst, gap_to_scale(r.dw, rows_of(one.dw, K, n0, n1)));
          }
        } else {
          worst = std::max(worst, gap_to_scale(summed(&LinearRun::y), one.y));
          for (int t = 0; t < degree; ++t) {
            const std::int64_t k0 = t * K / degree, k1 = (t + 1) * K / degree;
            const LinearRun& r = runs[static_cast<std::size_t>(t)];
            worst = std::max(worst, gap_to_scale(r.dx, columns_of(one.dx, K, k0, k1)));
            worst = std::max(worst, gap_to_scale(r.dw, columns_of(one.dw, K, k0, k1)));
          }
        }
        CAPTURE(worst);
        CHECK(worst <= 1e-6);
      }
  }
  // A piece several ranks hold (more ranks than key/value heads) is refused, by name: its
  // output gradient is each rank's part of a sum one rank casts whole.
  ops::Float8Policy policy;
  policy.enabled = true;
  policy.emulate = true;
  using CpuLinear = nn::Linear<float, Cpu>;
  CHECK_THROWS_WITH_AS(CpuLinear("layers.0.attention.wk", K, N, nn::Init{}, nullptr, nn::TensorSplit{0, 2, 0, 2, true},
                                 &policy),
                       doctest::Contains("layers.0.attention.wk: float8 with 2 tensor-parallel ranks holding each "
                                         "piece of it"),
                       Error);
}

TEST_CASE("tensor parallel: float8 GEMMs (emulated) under TP train one rank's float8 model, every recipe") {
  // The parameters are bf16 (float8 takes a bf16 model), so a row-parallel layer's partial
  // sums are rounded to bf16 before they are summed, where one rank rounds the whole sum:
  // the bf16 model's bars (test_parity.cpp's float8 case). The layer test above holds the
  // casts to the whole's; here the layouts run end to end under NCCL's rules.
  // A cast's amax is its micro-batch's, so one rank runs the layout's micro-batches: a
  // data-parallel rank's share, or a pipeline's microbatches.
  struct Case {
    const char* name;
    comm::MeshShape shape;
    const char* recipe;
    std::vector<std::string> keys;
    std::int64_t micro_batch;  // sequences
  };
  const std::vector<std::string> no_sp = {"--parallelism.disable_sequence_parallel", "true"};
  // A zero-bubble schedule runs the weight gradients later, their casts' agreements then.
  const std::vector<std::string> zero_bubble = {"--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
                                                "--parallelism.pipeline_parallel_microbatch_size", "2"};
  for (const Case& k :
       {Case{"TP 2, tensorwise, full checkpointing", {1, 1, 1, 2}, "tensorwise", kFull, kParityBatch},
        Case{"TP 4, rowwise, full checkpointing", {1, 1, 1, 4}, "rowwise", kFull, kParityBatch},
        Case{"TP 2, rowwise_with_gw_hp, no sequence parallel", {1, 1, 1, 2}, "rowwise_with_gw_hp", no_sp, kParityBatch},
        Case{"FSDP 2 x TP 2, tensorwise, selective op", {1, 1, 2, 2}, "tensorwise", kSelectiveOp, kParityBatch / 2},
        Case{"TP 2 x PP 2, InterleavedZeroBubble, tensorwise", {2, 1, 1, 2}, "tensorwise", zero_bubble, 2}}) {
    const std::string name = k.name;
    CAPTURE(name);
    const std::vector<std::string> keys = {"--training.mixed_precision_param", "bfloat16", "--model.converters",
                                           "float8", "--float8.emulate", "true", "--float8.recipe_name", k.recipe};
    const RunResult one = train_layout(comm::Communicator(), comm::MeshShape{},
                                       debug_job(k.micro_batch, kParityBatch, kParitySteps, keys));
    const LayoutRun run = layout_run(k.shape, with(keys, k.keys));
    CHECK(run.ranks_agree);
    const RunGap gap = run_gap(run.rank0, one);
    const RunGap bf16 = run_gap(one, one_rank_run({"--training.mixed_precision_param", "bfloat16"}));
    MESSAGE(name, ": loss within ", gap.loss, ", gradient norm within ", gap.grad_norm, " of one rank's float8 run ",
            "(which is ", bf16.loss, " and ", bf16.grad_norm, " from its bf16 run)");
    CHECK(gap.loss <= 1e-3);
    CHECK(gap.grad_norm <= 5e-3);
    CHECK(bf16.loss > 0);  // float8 ran
    if (std::string_view(k.recipe) == "tensorwise") {
      // The sequence-parallel gathers in float8 (the default, tensorwise): each rank's
      // rows cast by the agreed scale and gathered as float8, the same bytes as gathering
      // bf16 and casting, so the same losses and norms, bit for bit, in fewer bytes sent.
      const LayoutRun bf16_gathers = layout_run(k.shape, with(with(keys, k.keys), {"--float8.enable_tp_float8_all_gather", "false"}));
      CHECK(bf16_gathers.ranks_agree);
      CHECK(run.rank0.losses == bf16_gathers.rank0.losses);
      CHECK(run.rank0.grad_norms == bf16_gathers.rank0.grad_norms);
      MESSAGE(name, ": bytes a rank sent in a step ", run.rank0.comm_bytes, " gathering float8 over the tensor-parallel "
              "ranks, ", bf16_gathers.rank0.comm_bytes, " gathering bf16");
      CHECK(run.rank0.comm_bytes < bf16_gathers.rank0.comm_bytes);
    }
    if (k.shape.dp_shard == 1) continue;
    // FSDP's float8 all-gather under TP: each piece's scale agreed over the shards, then
    // over the tensor-parallel ranks (the whole weight's), so the same bytes as gathering
    // bf16 and casting: the same losses and norms, bit for bit, in fewer bytes.
    const LayoutRun float8 = layout_run(k.shape, with(with(keys, k.keys), {"--float8.enable_fsdp_float8_all_gather", "true"}));
    CHECK(float8.ranks_agree);
    CHECK(float8.rank0.losses == run.rank0.losses);
    CHECK(float8.rank0.grad_norms == run.rank0.grad_norms);
    CHECK(float8.rank0.comm_bytes < run.rank0.comm_bytes);
  }
}

TEST_CASE("tensor parallel: degrees that do not divide the model are refused by name on every rank") {
  auto refused = [](comm::MeshShape shape, const std::vector<std::string>& keys, const char* text) {
    const std::string expected = text;
    CAPTURE(expected);
    for (const auto& e : layout_errors(shape, keys)) CHECK(e.find(expected) != std::string::npos);
  };
  refused({1, 1, 1, 3}, {}, "tensor_parallel_degree = 3 does not divide n_heads = 16");
  refused({1, 1, 1, 4}, {"--model.ffn_hidden", "514"}, "does not divide the feed-forward hidden size 514");
  refused({1, 1, 1, 4}, {"--model.vocab_size", "1026"}, "does not divide vocab_size = 1026");
  refused({1, 1, 1, 3}, {"--model.dim", "240", "--model.n_heads", "12", "--model.n_kv_heads", "4"},
          "tensor_parallel_degree = 3 and n_kv_heads = 4: one must divide the other");
  refused({1, 1, 1, 2}, {"--parallelism.disable_loss_parallel", "true", "--model.tie_embeddings", "true"},
          "disable_loss_parallel = true with tied embeddings");
}

TEST_CASE("tensor parallel: a degree given in code is refused in words, one from a config by its key") {
  // The same refusals through both doors: a Plan a program fills (its mesh a
  // comm::MeshShape) and the Plan a config makes (train::make_plan).
  auto refusals = [](comm::MeshShape shape, const std::vector<std::string>& keys, bool from_config, auto make) {
    const train::JobConfig c = debug_job(kParityBatch, kParityBatch, 1, keys);
    std::vector<std::string> errors(static_cast<std::size_t>(shape.world()));
    comm::run_thread_ranks(shape.world(), [&](comm::Communicator& world) {
      comm::DeviceMesh mesh(world, shape);
      parallel::Plan plan;
      plan.mesh = &mesh;
      try {
        make(c.model.args, from_config ? train::make_plan(c, &mesh) : plan);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(world.rank())] = e.what();
      }
    }, nccl_rules());
    return errors;
  };
  auto all_say = [](const std::vector<std::string>& errors, const std::string& text) {
    CAPTURE(text);
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(e.find(text) != std::string::npos);
      CHECK(e.find('\n') == std::string::npos);  // one line
    }
  };
  auto none_says = [](const std::vector<std::string>& errors, const std::string& text) {
    for (const auto& e : errors) CHECK(e.find(text) == std::string::npos);
  };
  const auto dynamic_model = [](const nn::ModelArgs& a, const parallel::Plan& p) { CpuDynamicModel model(a, p); };

  const comm::MeshShape tp3{1, 1, 1, 3};
  all_say(refusals(tp3, {}, true, dynamic_model), "parallelism.tensor_parallel_degree = 3 does not divide n_heads = 16");
  const auto in_code = refusals(tp3, {}, false, dynamic_model);
  all_say(in_code, "the mesh's tensor-parallel degree 3 does not divide n_heads = 16");
  none_says(in_code, "parallelism.");
  // A static degree is named by its policy, where the number is written.
  using Tp3 = nn::Transformer<float, Cpu, Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<3>>>;
  all_say(refusals(tp3, {}, false, [](const nn::ModelArgs& a, const parallel::Plan& p) { Tp3 model(a, p); }),
          "tessera::TensorParallel<3> does not divide n_heads = 16");
  // The block's own check (the Llama block's feed-forward), through both doors.
  const comm::MeshShape tp4{1, 1, 1, 4};
  const std::vector<std::string> ffn = {"--model.ffn_hidden", "514"};
  all_say(refusals(tp4, ffn, true, dynamic_model),
          "parallelism.tensor_parallel_degree = 4 does not divide the feed-forward hidden size 514");
  all_say(refusals(tp4, ffn, false, dynamic_model),
          "the mesh's tensor-parallel degree 4 does not divide the feed-forward hidden size 514");
  // A batch whose tokens do not split into rows (the model's check_batch).
  const auto rows = [](const nn::ModelArgs& a, const parallel::Plan& p) {
    CpuDynamicModel model(a, p);
    model.check_batch(1, 33);
  };
  const comm::MeshShape tp2{1, 1, 1, 2};
  all_say(refusals(tp2, {}, true, rows), "training.local_batch_size x training.seq_len (1 x 33 = 33 tokens) does not "
                                         "split into equal rows over parallelism.tensor_parallel_degree = 2 ranks");
  const auto rows_in_code = refusals(tp2, {}, false, rows);
  all_say(rows_in_code, "the batch size x the sequence length (1 x 33 = 33 tokens) does not split into equal rows "
                        "over the 2 tensor-parallel ranks");
  none_says(rows_in_code, "training.");
  // And a pipeline's: a microbatch size that does not divide the batch.
  const auto microbatches = [](const nn::ModelArgs& a, parallel::Plan p) {
    p.pipeline.microbatch_size = 2;
    CpuDynamicModel model(a, p);
    model.check_batch(3, 32);
  };
  const comm::MeshShape pp2{2, 1, 1, 1};
  all_say(refusals(pp2, {}, true, microbatches),
          "parallelism.pipeline_parallel_microbatch_size = 2 does not divide training.local_batch_size = 3");
  all_say(refusals(pp2, {}, false, microbatches), "the pipeline microbatch size 2 does not divide the batch size 3");
}

TEST_CASE("tensor parallel: a block type without a TensorParallel policy is refused at degree > 1") {
  using NoTp = Parallel<nn::LlamaBlock<float, Cpu>, Sharding<Dynamic>>;
  std::vector<std::string> errors(2);
  comm::run_thread_ranks(2, [&](comm::Communicator& world) {
    try {
      train_layout<nn::Transformer<float, Cpu, NoTp>>(world, {1, 1, 1, 2}, debug_job(kParityBatch, kParityBatch, 1));
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
  }, nccl_rules());
  for (const auto& e : errors) CHECK(e.find("has no tessera::TensorParallel policy") != std::string::npos);
  std::vector<std::string> static_errors(2);
  using Tp4 = Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<4, Heads<16>>>;
  comm::run_thread_ranks(2, [&](comm::Communicator& world) {
    try {
      train_layout<nn::Transformer<float, Cpu, Tp4>>(world, {1, 1, 1, 2}, debug_job(kParityBatch, kParityBatch, 1));
    } catch (const std::exception& e) {
      static_errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
  }, nccl_rules());
  for (const auto& e : static_errors) CHECK(e.find("TensorParallel<4> on a mesh whose tensor_parallel_degree is 2") != std::string::npos);
}

TEST_CASE("tensor parallel: a static TensorParallel<2, Heads<16>> trains like the dynamic one") {
  using Tp2 = nn::Transformer<float, Cpu, Parallel<nn::LlamaBlock<float, Cpu>, TensorParallel<2, Heads<16>>>>;
  RunResult run;
  comm::run_thread_ranks(2, [&](comm::Communicator& world) {
    auto r = train_layout<Tp2>(world, {1, 1, 1, 2}, debug_job(kParityBatch, kParityBatch, kParitySteps));
    if (world.rank() == 0) run = r;
  }, nccl_rules());
  const RunGap gap = run_gap(run, one_rank_run());
  CHECK(gap.loss <= 1e-5);
  CHECK(gap.grad_norm <= 1e-4);
}

}  // namespace test_tensor_parallel
