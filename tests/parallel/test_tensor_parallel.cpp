// Tensor parallelism (with sequence and loss parallelism) trains the same model as one
// rank: the parity model in float32 for 10 steps (3 in sanitizer builds) on thread
// ranks, losses within 1e-5 relative at every step (gradient norms within 1e-4).
// TP 2 and 4; TP larger than the key/value head count (kv heads replicated); loss
// parallelism off; sequence parallelism off; TP composed with FSDP and HSDP, each with
// an activation checkpoint mode. Also: the whole gradient of
// one step matches one rank's, pieces and all; saving gathers whole parameters; bad
// degrees are refused by name on every rank: by config key when a config gave them, in
// words (or by the static policy) when a program did.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "harness.hpp"
#include "parity_checks.hpp"
#include "tessera/comm/thread.hpp"

namespace test_tensor_parallel {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

const std::vector<std::string> kFull = kAcModes[1].keys;
const std::vector<std::string> kSelectiveOp = kAcModes[2].keys;
const std::vector<std::string> kEvery2nd = kAcModes[3].keys;

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
