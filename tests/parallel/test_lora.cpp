// LoRA (model.converters = ["lora"], [lora]; layer/lora.hpp, nn/lora.hpp). Held here:
// - the model starts as the one the adapters were added to: the first step's loss is
//   the model's without them, bit for bit (B starts at zero);
// - only the adapters train: every other parameter keeps its value to the bit, has no
//   gradient, and the optimizer holds state for the adapters alone;
// - the loss falls, and each layout (DDP, FSDP and HSDP with the frozen weights in shards
//   of their own, TP with and without loss parallelism, PP, CP, and their compositions,
//   FSDP's float8 all-gather of the frozen weights) trains the model one rank trains,
//   within the parity bar, every rank agreeing;
// - CPU offload (the frozen shards in host memory too) and the early step (each unit's
//   adapters updated in the backward, the frozen embedding skipped) train bit for bit
//   what LoRA trains without them;
// - what it cannot run is refused by key: an adapter on a head the model does not have,
//   a rank below 1.
// (The gradients against finite differences: tests/nn/test_gradcheck.cpp; checkpoints:
// test_sharded_checkpoint.cpp.)
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../../examples/custom_layer.hpp"
#include "../support/errors.hpp"
#include "harness.hpp"
#include "with_and_without.hpp"
#include "parity_checks.hpp"
#include "tessera/comm/thread.hpp"

namespace test_lora {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

const std::vector<std::string> kLora = {"--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8",
                                        "--optimizer.lr", "1e-2"};

bool is_adapter(const std::string& name) { return name.find(".lora_") != std::string::npos; }

/// Every parameter's values on the host, by name.
std::map<std::string, std::vector<float>> values_of(CpuDynamicModel& model) {
  std::map<std::string, std::vector<float>> out;
  model.for_each_parameter([&](nn::Parameter<float>& p) {
    out[p.name] = std::vector<float>(p.value.data(), p.value.data() + p.numel());
  });
  return out;
}

}  // namespace

TEST_CASE("LoRA: the model starts as it was, only the adapters train, and the loss falls") {
  const train::JobConfig base = debug_job(4, 4, 6);
  const train::JobConfig lora = debug_job(4, 4, 6, kLora);
  const RunResult plain = train_layout(comm::Communicator(), {}, base);

  comm::DeviceMesh mesh(comm::Communicator(), {});
  CpuDynamicModel model(lora.model.args, train::make_plan(lora, &mesh));
  model.init_weights(static_cast<std::uint64_t>(lora.training.seed));
  const auto before = values_of(model);
  std::size_t adapters = 0, adapter_elements = 0, frozen = 0;
  model.for_each_parameter([&](nn::Parameter<float>& p) {
    CHECK_MESSAGE(p.frozen != is_adapter(p.name), p.name);
    CHECK_MESSAGE(p.grad.empty() == p.frozen, p.name);
    if (p.frozen) ++frozen;
    else {
      ++adapters;
      adapter_elements += static_cast<std::size_t>(p.numel());
    }
  });
  const nn::ModelArgs& a = lora.model.args;
  CHECK(adapters == static_cast<std::size_t>(2 * (7 * a.n_layers + (a.tie_embeddings ? 0 : 1))));
  // The adapters as the plan counts them, and the FLOPs MFU counts: the frozen weights 4
  // a parameter (forward, input gradient), the adapters 6.
  const nn::LoraPolicy& policy = model.plan().lora;
  CHECK(static_cast<std::size_t>(nn::lora_params(a, policy)) == adapter_elements);
  CHECK(model.num_params() == a.num_params() + nn::lora_params(a, policy));
  const std::int64_t seq = lora.training.seq_len;
  CHECK(model.flops_per_token(seq) == doctest::Approx(nn::training_flops_per_token(a, policy, seq)).epsilon(1e-12));
  CHECK(model.flops_per_token(seq, true) ==
        doctest::Approx(nn::training_flops_per_token(a, policy, seq, true)).epsilon(1e-12));
  CHECK(model.flops_per_token(seq) ==
        doctest::Approx(a.flops_per_token(seq) - 2.0 * static_cast<double>(a.num_params() - a.num_embedding_params()) +
                        6.0 * static_cast<double>(adapter_elements))
            .epsilon(1e-12));
  data::DataLoader loader(debug_tokens(), lora.training.seq_len, lora.training.local_batch_size, 0, 1);
  train::Trainer<CpuDynamicModel> trainer(model, train::trainer_options(lora), std::move(loader));
  std::vector<double> losses;
  for (int s = 0; s < 6; ++s) losses.push_back(trainer.step().loss);

  // B = 0: the adapters add exact zeros, so the first forward is the plain model's.
  CHECK(losses.front() == plain.losses.front());
  CHECK(losses.back() < losses.front());
  // AdamW's moments for the adapters alone (float32: two of 4 bytes an element).
  CHECK(trainer.optimizer().state_bytes() == adapter_elements * 2 * sizeof(float));
  const auto after = values_of(model);
  std::size_t moved = 0;
  for (const auto& [name, v] : before) {
    CAPTURE(name);
    if (is_adapter(name)) moved += v != after.at(name);
    else CHECK(v == after.at(name));
  }
  CHECK(moved == adapters);
}

TEST_CASE("LoRA: each layout trains the model one rank trains") {
  // FSDP and HSDP keep a unit's frozen weights in a flat shard of their own beside the
  // adapters' (ShardedUnit's frozen companion): gathered, never reduced or updated.
  struct Case {
    const char* name;
    comm::MeshShape shape;
    std::vector<std::string> keys;
  };
  const Case cases[] = {
      {"DDP 2", {1, 2, 1, 1}, {}},
      {"TP 2 (the output's adapter split by vocabulary)", {1, 1, 1, 2}, {}},
      {"TP 2 without loss parallelism", {1, 1, 1, 2}, {"--parallelism.disable_loss_parallel", "true"}},
      {"TP 4 (more ranks than key/value heads)", {1, 1, 1, 4}, {}},
      {"PP 2", {2, 1, 1, 1}, {"--parallelism.pipeline_parallel_microbatch_size", "2"}},
      {"TP 2 x DDP 2", {1, 2, 1, 2}, {}},
      {"PP 2 x TP 2, full checkpointing", {2, 1, 1, 2},
       {"--parallelism.pipeline_parallel_microbatch_size", "2", "--activation_checkpoint.mode", "full"}},
      {"TP 2, selective op checkpointing (projections run one by one)", {1, 1, 1, 2},
       {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}},
      {"FSDP 2", {1, 1, 2, 1}, {}},
      {"FSDP 4, full checkpointing", {1, 1, 4, 1}, {"--activation_checkpoint.mode", "full"}},
      {"HSDP 2 x 2", {1, 2, 2, 1}, {}},
      {"TP 2 x FSDP 2", {1, 1, 2, 2}, {}},
      {"PP 2 x FSDP 2", {2, 1, 2, 1}, {"--parallelism.pipeline_parallel_microbatch_size", "2"}},
      {"CP 2 (FSDP over the context-parallel ranks)", {1, 1, 1, 1, 2}, {}},
      {"CP 2 x TP 2 x FSDP 2", {1, 1, 2, 2, 2}, {}},
  };
  for (const Case& c : cases) check_layout_parity(c.name, c.shape, c.keys, kLora);
}

TEST_CASE("LoRA: beside float8 GEMMs, the frozen weights gathered in float8 train the model gathered in bf16 does") {
  // The base GEMMs in float8 (emulated), the adapters in bf16. A float8 cast scales each
  // activation by its own micro-batch's amax, so one rank runs FSDP 2's micro-batches
  // (two of 4), held to the bf16 model's bars as test_parity.cpp's float8 cases; the
  // float8 all-gather of the frozen shards is the same bytes as gathering them in bf16 and
  // casting after: the same run, bit for bit.
  const std::vector<std::string> float8 = with(kLora, {"--training.mixed_precision_param", "bfloat16", "--model.converters",
                                                       "float8,lora", "--float8.emulate", "true"});
  const RunResult one = train_layout(comm::Communicator(), comm::MeshShape{},
                                     debug_job(kParityBatch / 2, kParityBatch, kParitySteps, float8));
  const LayoutRun bf16_gather = layout_run({1, 1, 2, 1}, float8);
  const LayoutRun float8_gather = layout_run({1, 1, 2, 1}, with(float8, {"--float8.enable_fsdp_float8_all_gather", "true"}));
  CHECK(bf16_gather.ranks_agree);
  CHECK(float8_gather.ranks_agree);
  const RunGap gap = run_gap(bf16_gather.rank0, one);
  CHECK(gap.loss <= 1e-3);
  CHECK(gap.grad_norm <= 5e-3);
  CHECK(float8_gather.rank0.losses == bf16_gather.rank0.losses);
  CHECK(float8_gather.rank0.grad_norms == bf16_gather.rank0.grad_norms);
  CHECK(float8_gather.rank0.comm_bytes < bf16_gather.rank0.comm_bytes);
}

TEST_CASE("LoRA: the whole model every layout gathers (saves, exports, samples) holds the adapters") {
  // with_whole_parameters gathers shards, pieces and (in a pipeline) the other ranks'
  // stages: the adapters among them, so that a save merges every one.
  const train::JobConfig one = debug_job(8, 8, 1, kLora);
  std::set<std::string> names;
  {
    comm::DeviceMesh mesh(comm::Communicator(), {});
    CpuDynamicModel model(one.model.args, train::make_plan(one, &mesh));
    model.for_each_parameter([&](nn::Parameter<float>& p) { names.insert(p.name); });
  }
  for (const comm::MeshShape shape : {comm::MeshShape{2, 1, 1, 1}, comm::MeshShape{2, 1, 2, 2}}) {
    CAPTURE(shape.world());
    const train::JobConfig c =
        debug_job(8 / shape.dp(), 8, 1, with(kLora, {"--parallelism.pipeline_parallel_microbatch_size", "2"}));
    std::vector<std::set<std::string>> seen(static_cast<std::size_t>(shape.world()));
    comm::run_thread_ranks(shape.world(), [&](comm::Communicator& world) {
      comm::DeviceMesh mesh(world, shape);
      CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
      model.init_weights(static_cast<std::uint64_t>(c.training.seed));
      model.with_whole_parameters([&] {
        model.for_each_parameter([&](nn::Parameter<float>& p) {
          CHECK(p.numel() == p.whole.numel());
          seen[static_cast<std::size_t>(world.rank())].insert(p.name);
        });
      });
    });
    for (const auto& s : seen) CHECK(s == names);
  }
}

TEST_CASE("LoRA: a model none of whose layers takes an adapter is refused, naming the targets") {
  // The ReLU^2 block makes its attention and MLP without the plan's policy: under LoRA all
  // of it is frozen, and with only wq targeted nothing would train.
  parallel::Plan plan;
  plan.lora = nn::LoraPolicy{true, 4, 8.0, {"wq"}};
  const nn::ModelArgs a = debug_job(8, 8, 1).model.args;
  using Relu = nn::Transformer<float, Cpu, examples::ReluSquaredBlock<float, Cpu>>;
  CHECK_ERROR_CONTAINS(Relu(a, plan, examples::ReluSquaredOptions{64, 0.5}),
                       "the LoRA policy's target_modules: no linear layer of this model takes an adapter");
  plan.lora.target_modules = {"wq", "output"};  // the head's adapter trains
  Relu with_head(a, plan, examples::ReluSquaredOptions{64, 0.5});
  std::size_t trainable = 0;
  with_head.for_each_parameter([&](nn::Parameter<float>& p) { trainable += !p.frozen; });
  CHECK(trainable == 2);
}

TEST_CASE("LoRA: CPU offload and the early step train bit for bit the model LoRA trains without them") {
  // Offloaded, a unit's frozen shard lives in host memory as its adapters' does, gathered
  // and never reduced; under the early step each unit's adapters are updated as their
  // gradient is reduced, the frozen companion skipped.
  const NamedLayout layouts[] = {
      {"one rank (FSDP over itself)", {}, 8, {}},
      {"FSDP 2", {1, 1, 2, 1}, 4, {}},
      {"HSDP 2 x 2", {1, 2, 2, 1}, 2, {}},
      {"TP 2 x FSDP 2", {1, 1, 2, 2}, 4, {}},
  };
  const std::vector<std::string> no_clip = with(kLora, {"--training.max_norm", "0"});
  for (const auto& feature : {std::vector<std::string>{"--training.enable_cpu_offload", "true"},
                              std::vector<std::string>{"--optimizer.early_step_in_backward", "true"},
                              std::vector<std::string>{"--training.enable_cpu_offload", "true",
                                                       "--optimizer.early_step_in_backward", "true"}}) {
    CAPTURE(feature.front());
    CAPTURE(feature.size());
    each_layout_with_and_without(layouts, no_clip, feature, 3, [](const RunResult& plain, const RunResult& other) {
      CHECK(other.losses == plain.losses);
      CHECK(other.losses.back() < other.losses.front());
    });
  }
}

TEST_CASE("LoRA: what it cannot run is refused by key") {
  CHECK_ERROR_CONTAINS(train_layout(comm::Communicator(), {}, debug_job(8, 8, 1, with(kLora, {"--lora.rank", "0"}))),
                       "lora.rank");
  CHECK_ERROR_CONTAINS(train_layout(comm::Communicator(), {},
                                    debug_job(8, 8, 1, with(kLora, {"--model.tie_embeddings", "true",
                                                                    "--lora.target_modules", "wq,output"}))),
                       "lora.target_modules");
  CHECK_ERROR_CONTAINS(debug_job(8, 8, 1, with(kLora, {"--lora.target_modules", "wq,q_proj"})), "q_proj");
}

}  // namespace test_lora
