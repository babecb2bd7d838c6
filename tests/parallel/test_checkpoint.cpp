// Activation checkpointing: every mode gives bitwise the gradients of none (on one
// rank and under FSDP; selective "op", which runs the projections one by one, those of
// none with model.fuse_projections false), and the activation memory it leaves orders
// full < selective < none; the SwiGLU output made again in the backward
// (activation_checkpoint.recompute_swiglu) changes no bit, under any mode, and keeps a
// hidden size a token a block less.
#include <doctest/doctest.h>

#include <vector>

#include "harness.hpp"
#include "tessera/comm/thread.hpp"

namespace test_checkpoint {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

const parallel::CheckpointMode kModes[] = {
    {parallel::CheckpointMode::Kind::none, 0},
    {parallel::CheckpointMode::Kind::full, 0},
    {parallel::CheckpointMode::Kind::selective_op, 0},
    {parallel::CheckpointMode::Kind::selective_layer, 2},
};

struct Pass {
  std::vector<std::vector<float>> grads;  // this rank's local gradients, in order
  double loss = 0;
  std::size_t activation_bytes = 0;
};

/// One forward_backward of the parity model's first batch under `mode`.
Pass one_pass(comm::DeviceMesh* mesh, parallel::CheckpointMode mode, bool recompute_swiglu = false,
              bool fuse_projections = true) {
  const train::JobConfig c = debug_job(8, 8, 1);
  parallel::Plan plan;
  plan.mesh = mesh;
  plan.checkpoint = mode;
  plan.recompute_swiglu = recompute_swiglu;
  plan.fuse_projections = fuse_projections;
  CpuDynamicModel model(c.model.args, plan);
  model.init_weights(0);
  model.shard();
  const int dp = plan.dp_degree();
  data::DataLoader loader(debug_tokens(), c.training.seq_len, 8 / dp, plan.dp_rank(), dp);
  const data::Batch b = loader.next();
  model.zero_grad();
  Pass p;
  p.loss = model.forward_backward(b.inputs, b.targets, nn::Geometry{b.batch, b.seq_len}, 1.0 / 256);
  p.activation_bytes = model.saved_activation_bytes();
  model.for_each_local_parameter([&](nn::Parameter<float>& q) {
    p.grads.emplace_back(q.grad.data(), q.grad.data() + q.numel());
  });
  return p;
}

/// Whether `mode` runs the projections as one where model.fuse_projections lets them:
/// all but selective "op", whose stash keeps every other projection's output.
bool fuses(const parallel::CheckpointMode& mode) { return mode.kind != parallel::CheckpointMode::Kind::selective_op; }

}  // namespace

TEST_CASE("checkpointing: every mode gives bitwise the gradients of none, on one rank") {
  for (const bool fuse : {true, false}) {
    CAPTURE(fuse);
    const Pass none = one_pass(nullptr, kModes[0], false, fuse);
    for (const auto& mode : kModes) {
      CAPTURE(mode.str());
      if (fuse && !fuses(mode)) continue;  // below
      const Pass p = one_pass(nullptr, mode, false, fuse);
      CHECK(p.loss == none.loss);
      REQUIRE(p.grads.size() == none.grads.size());
      for (std::size_t i = 0; i < p.grads.size(); ++i) CHECK(p.grads[i] == none.grads[i]);
    }
  }
  // Selective "op" runs the projections one by one whatever fuse_projections says: the
  // gradients of none with them one by one, and to rounding those with them as one.
  const Pass op = one_pass(nullptr, kModes[2], false, true), unfused = one_pass(nullptr, kModes[0], false, false),
             fused = one_pass(nullptr, kModes[0], false, true);
  REQUIRE(op.grads.size() == unfused.grads.size());
  bool all_same = true;
  for (std::size_t i = 0; i < op.grads.size(); ++i) {
    CHECK(op.grads[i] == unfused.grads[i]);
    all_same = all_same && fused.grads[i] == unfused.grads[i];
    CAPTURE(i);
    CHECK(gap_to_scale(fused.grads[i], unfused.grads[i]) <= 1e-5);
  }
  CHECK(op.loss == doctest::Approx(fused.loss).epsilon(1e-6));
  CHECK_FALSE(all_same);  // the fused GEMMs sum in another order: a test that they ran
}

TEST_CASE("checkpointing: every mode gives bitwise the gradients of none, under FSDP over 2 ranks") {
  comm::run_thread_ranks(2, [&](comm::Communicator& world) {
    omp_set_num_threads(1);
    comm::DeviceMesh mesh(world, comm::MeshShape{1, 1, 2, 1});
    const Pass fused = one_pass(&mesh, kModes[0]), unfused = one_pass(&mesh, kModes[0], false, false);
    for (const auto& mode : kModes) {
      CAPTURE(mode.str());
      const Pass p = one_pass(&mesh, mode);
      const Pass& none = fuses(mode) ? fused : unfused;
      REQUIRE(p.grads.size() == none.grads.size());
      for (std::size_t i = 0; i < p.grads.size(); ++i) CHECK(p.grads[i] == none.grads[i]);
    }
  }, nccl_rules());
}

TEST_CASE("checkpointing: the SwiGLU output made again in the backward changes no bit, under any mode, and keeps a "
          "hidden size a token a block less") {
  const Pass fused = one_pass(nullptr, kModes[0]), unfused = one_pass(nullptr, kModes[0], false, false);
  for (const auto& mode : kModes) {
    CAPTURE(mode.str());
    const Pass& none = fuses(mode) ? fused : unfused;
    const Pass kept = one_pass(nullptr, mode), remade = one_pass(nullptr, mode, true);
    CHECK(remade.loss == none.loss);
    REQUIRE(remade.grads.size() == none.grads.size());
    for (std::size_t i = 0; i < remade.grads.size(); ++i) CHECK(remade.grads[i] == none.grads[i]);
    CHECK(remade.activation_bytes <= kept.activation_bytes);
  }
  const train::JobConfig c = debug_job(8, 8, 1);
  const auto& a = c.model.args;
  const std::size_t swiglu_outputs =
      static_cast<std::size_t>(a.n_layers * 8 * c.training.seq_len * a.ffn_hidden_dim()) * sizeof(float);
  CHECK(fused.activation_bytes - one_pass(nullptr, kModes[0], true).activation_bytes == swiglu_outputs);
  CHECK(unfused.activation_bytes == fused.activation_bytes);  // q, k and v, and W1 x and W3 x, either way
}

TEST_CASE("checkpointing: activation memory orders full < selective < none") {
  std::size_t bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = one_pass(nullptr, kModes[i]).activation_bytes;
  MESSAGE("activation bytes: none ", bytes[0], ", full ", bytes[1], ", selective op ", bytes[2],
          ", selective every 2nd layer ", bytes[3]);
  CHECK(bytes[1] < bytes[2]);
  CHECK(bytes[2] < bytes[0]);
  CHECK(bytes[1] < bytes[3]);
  CHECK(bytes[3] < bytes[0]);
}

}  // namespace test_checkpoint
