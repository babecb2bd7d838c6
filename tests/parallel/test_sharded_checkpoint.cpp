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

}  // namespace test_sharded_checkpoint
