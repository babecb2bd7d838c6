// Graphs of the backend's work (backend/graph.hpp): the CPU backend records a capture and
// runs it only on replay, under a GPU's rules; a training step replayed from a captured
// graph (training.cuda_graph) trains bit for bit the model the eager steps train, which
// holds only if nothing the host chooses per step travels in a launch's arguments.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/graph.hpp"
#include "tessera/instances.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/job_plan.hpp"
#include "tessera/train/trainer.hpp"

namespace test_step_graph {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using Model = DynamicModel<float, Cpu>;

namespace {

struct AddOne {
  float* p;
  void operator()(std::int64_t i) const { p[i] += 1.0f; }
};

std::vector<float> host(const Tensor<float>& t) {
  const Tensor<float> h = download<Cpu>(t);
  return {h.data(), h.data() + h.numel()};
}

}  // namespace

static_assert(CapturesGraphs<Cpu>);

TEST_CASE("The CPU backend's graph runs what was captured only when replayed, as a CUDA graph does") {
  const std::vector<float> ones(16, 1.0f);
  Tensor<float> x = upload<Cpu>(std::span<const float>(ones));
  Tensor<float> z;
  Tensor<float> a = Cpu::empty<float>(Shape{4, 4}), c = Cpu::empty<float>(Shape{4, 4});
  Cpu::copy_from_host(ones.data(), a.data(), 16);
  Cpu::Graph g;
  {
    cpu::FillNewAllocations nan;  // what the capture allocates holds NaN until a replay writes it
    g = Cpu::capture([&] {
      Cpu::for_each(16, AddOne{x.data()});
      z = Cpu::zeros<float>(Shape{16});
      Cpu::for_each(16, AddOne{z.data()});
      Cpu::gemm(Trans::no, Trans::no, 1.0f, a.cview(), a.cview(), 0.0f, c.view());
    });
  }
  CHECK(g.size() == 4);
  CHECK(host(x) == ones);  // nothing ran
  CHECK(std::isnan(host(z)[0]));
  g.replay();
  CHECK(host(x) == std::vector<float>(16, 2.0f));
  CHECK(host(z) == std::vector<float>(16, 1.0f));
  CHECK(host(c) == std::vector<float>(16, 4.0f));
  g.replay();  // the same work again, with the arguments it was captured with
  CHECK(host(x) == std::vector<float>(16, 3.0f));
  CHECK(host(z) == std::vector<float>(16, 1.0f));  // zeroed, then one added
}

TEST_CASE("A graph capture refuses host transfers and synchronisations, and an error abandons it") {
  const std::vector<float> v(8, 1.0f);
  Tensor<float> t = upload<Cpu>(std::span<const float>(v));
  auto refused = [](auto body, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(Cpu::capture(body), doctest::Contains(what), Error);
  };
  refused([&] { upload<Cpu>(std::span<const float>(v)); }, "CPU backend: a copy from the host inside a graph capture");
  std::vector<float> back(8);
  refused([&] { Cpu::copy_to_host(t.data(), back.data(), 8); }, "CPU backend: a copy to the host inside a graph capture");
  refused([] { Cpu::synchronize(); }, "CPU backend: a synchronisation inside a graph capture");
  refused([] { (void)Cpu::capture([] {}); }, "CPU backend: a graph capture inside a graph capture");
  // The thread captures nothing after an abandoned capture: work runs again at once.
  CHECK(cpu::capturing() == nullptr);
  Cpu::for_each(8, AddOne{t.data()});
  CHECK(host(t) == std::vector<float>(8, 2.0f));
}

TEST_CASE("Memory a capture allocated is the graph's until the graph is gone") {
  Cpu::Graph g = Cpu::capture([] {
    Tensor<float> scratch = Cpu::empty<float>(Shape{1024});  // released inside the capture
    Cpu::for_each(1024, AddOne{scratch.data()});
  });
  // The scratch block is released but held: a replay writes it.
  CHECK(g.held_blocks() == 1);
  g.replay();
  g = Cpu::Graph{};
  CHECK(g.held_blocks() == 0);
}

namespace {

train::JobConfig graph_job(const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"--training.steps", "6"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    dim = 64
    n_layers = 2
    n_heads = 4
    n_kv_heads = 2
    multiple_of = 64
    [training]
    local_batch_size = 4
    seq_len = 32
    mixed_precision_param = "float32"
    synthetic_documents = 200
    [optimizer]
    lr = 4e-3
    [lr_scheduler]
    warmup_steps = 2
    decay_type = "cosine"
  )",
                             "test_step_graph", all);
}

struct Run {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> parameters;
};

/// `steps` steps of the small model, eager or replayed from a graph, on windows whose
/// first targets are ignored, more of them each step: the loss scale (1 / target count)
/// changes every step, as the learning rate and the bias corrections do.
Run train(const train::JobConfig& c, bool graph) {
  const parallel::Plan plan = train::make_plan(c, nullptr);
  Model model(c.model.args, plan);
  model.init_weights(3);
  train::TrainerOptions o = train::trainer_options(c);
  o.graph = graph;
  const std::vector<std::uint32_t> tokens = train::load_training_tokens(c, io::ByteTokenizer{}).ids;
  auto windows = [&](const data::BatchRequest& r) {
    data::DataLoader l(tokens, r.seq_len, r.batch);
    l.seek(r.index * r.batch);
    data::Batch b = l.next();
    for (std::int64_t k = 0; k < 5 * (r.index % 4); ++k) b.targets[static_cast<std::size_t>(k)] = data::Batch::ignore_index;
    b.n_targets = data::count_targets(b);
    return b;
  };
  train::Trainer<Model> trainer(model, std::move(o),
                                data::BatchSource::callback(windows, c.training.seq_len, c.training.local_batch_size));
  Run r;
  for (std::int64_t s = 0; s < c.training.steps; ++s) {
    const train::StepMetrics m = trainer.step();
    r.losses.push_back(m.loss);
    r.norms.push_back(m.grad_norm);
  }
  model.for_each_parameter(
      [&](nn::Parameter<float>& p) { r.parameters.emplace_back(p.value.data(), p.value.data() + p.numel()); });
  return r;
}

}  // namespace

TEST_CASE("Steps replayed from a captured graph train bit for bit the model eager steps train") {
  const std::vector<std::pair<const char*, std::vector<std::string>>> cases = {
      {"float32", {}},
      {"two micro-batches a step", {"--training.global_batch_size", "8"}},
      {"bf16 parameters, bf16 moments, full checkpointing",
       {"--training.mixed_precision_param", "bfloat16", "--optimizer.state_dtype", "bfloat16",
        "--activation_checkpoint.mode", "full"}},
      {"selective op checkpointing, no clipping",
       {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
        "--training.max_norm", "0"}},
  };
  for (const auto& [label, overrides] : cases) {
    const std::string name = label;
    CAPTURE(name);
    const train::JobConfig c = graph_job(overrides);
    const Run eager = train(c, false), replayed = train(c, true);
    CHECK(replayed.losses == eager.losses);
    CHECK(replayed.norms == eager.norms);
    CHECK(replayed.parameters == eager.parameters);
    CHECK(eager.losses.back() < eager.losses.front());
  }
}

TEST_CASE("training.cuda_graph reaches the trainer's options") {
  const train::JobConfig c = graph_job({"--training.cuda_graph", "true"});
  CHECK(c.training.cuda_graph);
  CHECK(train::trainer_options(c).graph);
}

}  // namespace test_step_graph
