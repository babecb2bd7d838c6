// Saving and loading a sharded model: the whole parameters are gathered for the save
// (every rank takes part, one writes) and equal the model's; saving or loading a
// shard alone is refused by name.
#include <doctest/doctest.h>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "harness.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/comm/thread.hpp"

namespace test_save {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

TEST_CASE("a sharded model saves its whole parameters, and refuses to save or load a shard") {
  tessera::test::TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const train::JobConfig c = debug_job(1, 1, 1);
  comm::run_thread_ranks(2, [&](comm::Communicator& world) {
    comm::DeviceMesh mesh(world, comm::MeshShape{1, 1, 2, 1});
    CpuDynamicModel model(c.model.args, parallel::Plan{.mesh = &mesh});
    model.init_weights(3);
    model.shard();
    CHECK_ERROR_CONTAINS(train::save_model(model, path, DType::f32),
                         "tok_embeddings.weight cannot be saved: only this rank's shard is here");
    model.with_whole_parameters([&] {
      if (world.rank() == 0) train::save_model(model, path, DType::f32);
    });
    world.barrier();     // orders the stream after every rank's save (NCCL's rule) ...
    Cpu::synchronize();  // ... and this holds the host until then: the file is there
    CHECK_ERROR_CONTAINS(train::load_model(model, path), "cannot be loaded: only this rank's shard is here");
  }, nccl_rules());
  CpuDynamicModel saved(c.model.args), fresh(c.model.args);
  train::load_model(saved, path);
  fresh.init_weights(3);
  std::vector<std::vector<float>> a, b;
  saved.for_each_parameter([&](nn::Parameter<float>& p) { a.emplace_back(p.value.data(), p.value.data() + p.numel()); });
  fresh.for_each_parameter([&](nn::Parameter<float>& p) { b.emplace_back(p.value.data(), p.value.data() + p.numel()); });
  CHECK(a == b);
}

}  // namespace test_save
