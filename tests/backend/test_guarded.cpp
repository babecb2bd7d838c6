// The model keeps the backend rule -- host code never touches backend memory -- on
// GuardedCpu, whose memory faults outside backend calls (tests/support/guarded_cpu.hpp),
// and computes the same losses and gradients there as on the CPU backend.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "../parallel/harness.hpp"
#include "../support/guarded_cpu.hpp"
#include "../support/temp_dir.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/nn/generate.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;
using testing::GuardedCpu;


namespace {

/// Runs `f` in a child process; returns the signal that ended it (0 if it exited).
template <class F>
int signal_in_child(F f) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    f();
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

train::JobConfig small_job(const std::string& extra = {}) {
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    dim = 64
    n_layers = 2
    n_heads = 4
    n_kv_heads = 2
    multiple_of = 32
    [training]
    local_batch_size = 2
    seq_len = 32
    steps = 3
    mixed_precision_param = "float32"
    synthetic_documents = 200
    [optimizer]
    lr = 3e-3
  )" + extra,
                             "test_guarded");
}

template <class B>
std::map<std::string, std::vector<float>> parameters(nn::Transformer<float, B>& model) {
  std::map<std::string, std::vector<float>> out;
  model.for_each_parameter([&](nn::Parameter<float>& p) {
    Tensor<float> host = download<B>(p.value);
    out[p.name].assign(host.data(), host.data() + host.numel());
  });
  return out;
}

template <class B>
std::vector<train::StepMetrics> train_steps(const train::JobConfig& c, std::map<std::string, std::vector<float>>* after) {
  nn::Transformer<float, B> model(c.model.args);
  model.init_weights(3);
  data::DataLoader loader(train::load_training_tokens(c, io::ByteTokenizer{}), c.training.seq_len,
                          c.training.local_batch_size);
  train::Trainer<nn::Transformer<float, B>> trainer(model, train::trainer_options(c), std::move(loader));
  std::vector<train::StepMetrics> steps;
  for (int s = 0; s < c.training.steps; ++s) steps.push_back(trainer.step());
  *after = parameters(model);
  return steps;
}

}  // namespace

TEST_CASE("GuardedCpu memory faults when host code touches it outside a backend call") {
  Tensor<float> t = GuardedCpu::zeros<float>(Shape{16});
  CHECK(t.device() == Device::cuda);
  CHECK(read_one<GuardedCpu>(t.data() + 3) == 0.0f);
  CHECK(signal_in_child([&] {
          volatile float x = t.data()[3];
          (void)x;
        }) == SIGSEGV);
  CHECK(signal_in_child([&] { GuardedCpu::for_each(16, ops::Fill<float>{1.0f, t.data()}); }) == 0);
}

TEST_CASE("Training steps on GuardedCpu: no host access, the CPU backend's losses and parameters") {
  const train::JobConfig c = small_job();
  std::map<std::string, std::vector<float>> cpu_params, guarded_params;
  const auto cpu = train_steps<Cpu>(c, &cpu_params);
  const auto guarded = train_steps<GuardedCpu>(c, &guarded_params);
  REQUIRE(cpu.size() == guarded.size());
  for (std::size_t s = 0; s < cpu.size(); ++s) {
    CHECK(guarded[s].loss == doctest::Approx(cpu[s].loss).epsilon(1e-6));
    CHECK(guarded[s].grad_norm == doctest::Approx(cpu[s].grad_norm).epsilon(1e-6));
  }
  REQUIRE(cpu_params.size() == guarded_params.size());
  for (const auto& [name, v] : cpu_params) {
    INFO(name);
    CHECK(guarded_params.at(name) == v);
  }
}

namespace {
using GuardedBlock = Parallel<nn::LlamaBlock<float, GuardedCpu>, Sharding<Dynamic>, TensorParallel<dynamic>,
                              Pipeline<dynamic>, Checkpoint<Dynamic>>;
using GuardedModel = nn::Transformer<float, GuardedCpu, GuardedBlock>;

constexpr int kSteps = 2;
const std::vector<std::string> kTwoLayers = {"--model.n_layers", "2"};

/// The parity run of `shape` with `keys` on GuardedCpu thread ranks (every collective
/// moving backend memory through GuardedCpu::memory_access, held to NCCL's rules: the
/// arena is the only memory a collective may touch), against one CPU rank.
void check_guarded_layout(const std::string& layout, comm::MeshShape shape, const std::vector<std::string>& keys) {
  CAPTURE(layout);
  const std::vector<std::string> all_keys = test::with(kTwoLayers, keys);
  std::vector<test::RunResult> per_rank(static_cast<std::size_t>(shape.world()));
  comm::ThreadOptions options;
  options.memory = GuardedCpu::memory_access();
  options.nccl_rules = true;
  comm::run_thread_ranks(
      shape.world(),
      [&](comm::Communicator& world) {
        per_rank[static_cast<std::size_t>(world.rank())] = test::train_layout<GuardedModel>(
            world, shape, test::debug_job(test::kParityBatch / shape.dp(), test::kParityBatch, kSteps, all_keys));
      },
      options);
  const test::RunResult reference = test::train_layout(
      comm::Communicator(), comm::MeshShape{}, test::debug_job(test::kParityBatch, test::kParityBatch, kSteps, all_keys));
  for (const auto& r : per_rank) CHECK(r.losses == per_rank.front().losses);
  const test::RunGap gap = test::run_gap(per_rank.front(), reference);
  CHECK(gap.loss <= 1e-5);
  CHECK(gap.grad_norm <= 1e-4);
}
}  // namespace

TEST_CASE("Parallel layouts on GuardedCpu thread ranks: no host access, one CPU rank's losses") {
  check_guarded_layout("one rank, FSDP mesh of 1, bf16 parameters, selective checkpointing", {1, 1, 1, 1},
                       test::with({"--training.mixed_precision_param", "bfloat16"}, test::kAcModes[2].keys));
  check_guarded_layout("FSDP 2, full checkpointing", {1, 1, 2, 1}, test::kAcModes[1].keys);
  check_guarded_layout("HSDP 2 x 2", {1, 2, 2, 1}, {});
  check_guarded_layout("FSDP 2 offloaded: the shards in host memory, AdamW and the norm on the host", {1, 1, 2, 1},
                       {"--training.enable_cpu_offload", "true", "--training.mixed_precision_param", "bfloat16"});
  check_guarded_layout("FSDP 2 offloaded with LoRA: the frozen shards in host memory too", {1, 1, 2, 1},
                       {"--training.enable_cpu_offload", "true", "--training.mixed_precision_param", "bfloat16",
                        "--model.converters", "lora", "--lora.rank", "4"});
  check_guarded_layout("TP 2 with loss parallelism", {1, 1, 1, 2}, {});
  check_guarded_layout("PP 2, Interleaved1F1B", {2, 1, 1, 1},
                       {"--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                        "--parallelism.pipeline_parallel_microbatch_size", "1"});
}

TEST_CASE("Saving and loading a model on GuardedCpu goes through host copies") {
  test::TempDir dir;
  const train::JobConfig c = small_job();
  nn::Transformer<float, GuardedCpu> model(c.model.args);
  model.init_weights(5);
  const std::string path = (dir.path / "model.safetensors").string();
  train::save_model(model, path, DType::f32);
  nn::Transformer<float, GuardedCpu> loaded(c.model.args);
  train::load_model(loaded, path);
  CHECK(parameters(loaded) == parameters(model));
  nn::Transformer<float, Cpu> on_cpu(c.model.args);
  train::load_model(on_cpu, path);
  const std::vector<std::int32_t> prompt = {1, 2, 3, 4};
  nn::SampleOptions o;
  o.max_new_tokens = 4;
  CHECK(nn::generate(loaded, prompt, o) == nn::generate(on_cpu, prompt, o));
}
