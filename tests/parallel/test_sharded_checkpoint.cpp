// Sharded checkpoints (train/sharded_checkpoint.hpp): saved under one layout, each rank
// writing what it holds, and loaded under another, each rank reading what it holds;
// every parameter comes back bitwise. Interrupted and broken folders are refused by name.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "harness.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/train/sharded_checkpoint.hpp"

namespace test_sharded_checkpoint {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;
namespace fs = std::filesystem;

using Values = std::map<std::string, std::vector<float>>;
constexpr std::uint64_t kSeed = 5;

struct Layout {
  const char* name;
  comm::MeshShape shape;
};

/// Runs f(model, world) on every rank of `l`, the model made on its plan.
template <class F>
void on_layout(const Layout& l, const train::JobConfig& c, F&& f) {
  comm::run_thread_ranks(l.shape.world(), [&](comm::Communicator& world) {
    comm::DeviceMesh mesh(world, l.shape);
    CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
    f(model, world);
  }, nccl_rules());
}

/// Every parameter of `model`, whole, by name (a collective on a parallel plan).
Values whole_values(CpuDynamicModel& model) {
  Values v;
  model.with_whole_parameters([&] {
    model.for_each_parameter(
        [&](nn::Parameter<float>& p) { v[p.name] = std::vector<float>(p.value.data(), p.value.data() + p.numel()); });
  });
  return v;
}

bool same_bits(const Values& a, const Values& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, v] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.size() != v.size() ||
        std::memcmp(v.data(), it->second.data(), v.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

TEST_CASE("sharded checkpoints: saved under each layout, loaded under others, every parameter bitwise") {
  const train::JobConfig c = debug_job(1, 1, 1);
  Values reference;
  {
    CpuDynamicModel one(c.model.args);
    one.init_weights(kSeed);
    reference = whole_values(one);
  }
  const Layout saves[] = {{"one rank", {}},
                          {"FSDP 4", {1, 1, 4, 1}},
                          {"HSDP 2x2", {1, 2, 2, 1}},
                          {"FSDP 2 x TP 2", {1, 1, 2, 2}},
                          {"PP 2 x TP 2", {2, 1, 1, 2}}};
  const Layout loads[] = {{"one rank", {}},
                          {"TP 2 x FSDP 2", {1, 1, 2, 2}},
                          {"PP 2 x FSDP 2", {2, 1, 2, 1}},
                          {"DDP 2", {1, 2, 1, 1}},
                          {"TP 4", {1, 1, 1, 4}}};
  for (const Layout& save : saves) {
    tessera::test::TempDir dir;
    const std::string folder = dir.file("step-1");
    on_layout(save, c, [&](CpuDynamicModel& model, comm::Communicator&) {
      model.init_weights(kSeed);
      train::save_sharded_model(model, folder);
    });
    // One file per rank, and the marker.
    CHECK(fs::exists(fs::path(folder) / "COMPLETE"));
    CHECK(fs::exists(fs::path(folder) / train::sharded::file_name(save.shape.world() - 1, save.shape.world())));
    for (const Layout& load : loads) {
      const std::string from = save.name, into = load.name;  // doctest prints a const char* as an address
      CAPTURE(from);
      CAPTURE(into);
      std::vector<Values> got(static_cast<std::size_t>(load.shape.world()));
      on_layout(load, c, [&](CpuDynamicModel& model, comm::Communicator& world) {
        train::load_sharded_model(model, folder);  // into a model without storage: its share only
        got[static_cast<std::size_t>(world.rank())] = whole_values(model);
      });
      for (const Values& v : got) CHECK(same_bits(v, reference));
    }
  }
}

TEST_CASE("sharded checkpoints: an interrupted save, a missing or truncated file and another model are refused") {
  const train::JobConfig c = debug_job(1, 1, 1);
  tessera::test::TempDir dir;
  const fs::path folder = fs::path(dir.file("step-3"));
  const Layout fsdp2{"FSDP 2", {1, 1, 2, 1}};
  auto save = [&] {
    on_layout(fsdp2, c, [&](CpuDynamicModel& model, comm::Communicator&) {
      model.init_weights(kSeed);
      train::save_sharded_model(model, folder.string());
    });
  };
  auto load_error = [&](const std::string& expected, const train::JobConfig& job) {
    CpuDynamicModel model(job.model.args);
    CHECK_ERROR_CONTAINS(train::load_sharded_model(model, folder.string()), expected);
  };
  save();
  fs::remove(folder / "COMPLETE");
  load_error("no COMPLETE marker: the save that wrote this folder did not finish", c);

  save();
  fs::remove(folder / train::sharded::file_name(1, 2));
  load_error(train::sharded::file_name(1, 2) + ": missing (the checkpoint was saved by 2 ranks", c);

  save();
  fs::resize_file(folder / train::sharded::file_name(0, 2), 1000);
  load_error(train::sharded::file_name(0, 2), c);

  save();
  const train::JobConfig wider = debug_job(1, 1, 1, {"--model.dim", "128"});
  load_error("is not this model", wider);

  // Saved again over the same folder: complete again, and it loads.
  save();
  CpuDynamicModel model(c.model.args);
  train::load_sharded_model(model, folder.string());
}

/// Rank 0's losses of `steps` steps on layout `shape`: resumed from `resume` first when
/// given, and saving the training state to `save` after `save_after` steps when given.
std::vector<double> train_steps(const comm::MeshShape& shape, const train::JobConfig& c, int steps,
                                const std::string& resume = "", const std::string& save = "", int save_after = 0) {
  std::vector<std::vector<double>> per_rank(static_cast<std::size_t>(shape.world()));
  comm::run_thread_ranks(shape.world(), [&](comm::Communicator& world) {
    if (world.size() > 1) omp_set_num_threads(1);  // ranks share the cores
    comm::DeviceMesh mesh(world, shape);
    CpuDynamicModel model(c.model.args, train::make_plan(c, &mesh));
    if (resume.empty()) model.init_weights(static_cast<std::uint64_t>(c.training.seed));
    data::DataLoader loader(debug_tokens(), c.training.seq_len, c.training.local_batch_size, mesh.dp_rank(),
                            mesh.dp_degree());
    train::Trainer<CpuDynamicModel> trainer(model, c, std::move(loader), 0);
    if (!resume.empty()) trainer.load_checkpoint(resume);
    for (int s = 0; s < steps; ++s) {
      per_rank[static_cast<std::size_t>(world.rank())].push_back(trainer.step().loss);
      if (!save.empty() && s + 1 == save_after) trainer.save_checkpoint(save);
    }
  }, nccl_rules());
  return per_rank.front();
}

std::vector<double> tail(const std::vector<double>& v, std::size_t from) { return {v.begin() + static_cast<long>(from), v.end()}; }

TEST_CASE("training checkpoints: a run resumed on one rank is the uninterrupted run, bitwise (fp32, bf16 params, bf16 moments)") {
  const std::vector<std::vector<std::string>> variants = {
      {}, {"--training.mixed_precision_param", "bfloat16"}, {"--optimizer.state_dtype", "bfloat16"}};
  for (const auto& keys : variants) {
    const std::string variant = keys.empty() ? "fp32" : keys[0] + " " + keys[1];
    CAPTURE(variant);
    const train::JobConfig c = debug_job(4, 4, 6, keys);
    tessera::test::TempDir dir;
    const std::string folder = dir.file("step-3");
    const std::vector<double> whole = train_steps({}, c, 6);
    const std::vector<double> first = train_steps({}, c, 3, "", folder, 3);
    CHECK(first == std::vector<double>(whole.begin(), whole.begin() + 3));
    CHECK(train_steps({}, c, 3, folder) == tail(whole, 3));
  }
}

TEST_CASE("training checkpoints: saved under one layout, resumed under others, the same run within the parity bar") {
  const train::JobConfig c = debug_job(4, 4, 6);
  const std::vector<double> whole = train_steps({}, c, 6);
  struct Case {
    const char* saved;
    comm::MeshShape save;
    const char* resumed;
    comm::MeshShape resume;
  };
  const Case cases[] = {
      {"FSDP 4", {1, 1, 4, 1}, "TP 2 x FSDP 2", {1, 1, 2, 2}},
      {"PP 2 x TP 2", {2, 1, 1, 2}, "one rank", {}},
      {"HSDP 2x2", {1, 2, 2, 1}, "DDP 2", {1, 2, 1, 1}},
      {"one rank", {}, "PP 2 x FSDP 2", {2, 1, 2, 1}},
  };
  for (const Case& k : cases) {
    const std::string from = k.saved, into = k.resumed;
    CAPTURE(from);
    CAPTURE(into);
    tessera::test::TempDir dir;
    const std::string folder = dir.file("step-3");
    const train::JobConfig saving = debug_job(4 / k.save.dp(), 4, 6), resuming = debug_job(4 / k.resume.dp(), 4, 6);
    train_steps(k.save, saving, 3, "", folder, 3);
    const std::vector<double> resumed = train_steps(k.resume, resuming, 3, folder);
    CHECK(max_relative_difference(resumed, tail(whole, 3)) <= 1e-5);
  }
}

TEST_CASE("training checkpoints: a model-only folder cannot resume training") {
  const train::JobConfig c = debug_job(4, 4, 1);
  tessera::test::TempDir dir;
  const std::string folder = dir.file("model");
  {
    CpuDynamicModel model(c.model.args);
    model.init_weights(1);
    train::save_sharded_model(model, folder);
  }
  CHECK_ERROR_CONTAINS(train_steps({}, c, 1, folder), "no optimizer state 'exp_avg'");
}

}  // namespace test_sharded_checkpoint
