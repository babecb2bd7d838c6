// What the parallel tests share: the parity model (the debug model at dim 64, below)
// trained for a few steps on a layout (a mesh over some ranks, a checkpoint mode),
// returning every step's loss, so a layout can be compared with one rank. The same function runs on thread ranks
// (tests/parallel) and on MPI ranks (tests/mpi).
#pragma once

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/tokenizers.hpp"
#include "tessera/instances.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/parallel.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/trainer.hpp"
#include "tessera/train/validate.hpp"

namespace tessera::test {

/// The model the binaries train (train/dynamic_model.hpp), on the CPU: every choice read from the Plan.
using CpuDynamicBlock = DynamicBlock<float, Cpu>;
using CpuDynamicModel = DynamicModel<float, Cpu>;
}  // namespace tessera::test

namespace tessera::test {

/// The parity model in float32: the debug model's 6 layers, 16 heads and vocabulary of
/// 1024 at dim 64 (head dim 4, ffn 256) instead of 256, on a global batch of
/// `global_batch` sequences of 32 tokens, gradients clipped to norm 0.5.
///
/// Why a narrower model proves what the debug model would: every cut a layout makes is
/// the same — heads and kv heads over tensor-parallel ranks, the vocabulary over
/// loss-parallel ranks, layers over pipeline stages, micro-batches over the schedule,
/// rows over sequence parallelism, flat FSDP/HSDP shards that cut through parameters
/// (padded where they do not divide) — because dim only sets how wide each head and
/// hidden row is; and every gradient-norm chunk, AdamW block and loss chunk path is
/// still taken (the embedding alone spans four 16384-element norm chunks). At a quarter
/// of the width the parity matrix runs about 8 times faster (CI's budget:
/// docs/testing.md); the bars (1e-5 on losses, 1e-4 on norms) are unchanged, measured
/// gaps are about 1e-8. The clipping norm is 0.5 because this model's gradient norm
/// stays near 0.7, so clipping (a scale from the global norm over every shard, piece and
/// stage) acts at every step, as it did at dim 256 with a norm of 1.
train::JobConfig debug_job(std::int64_t local_batch, std::int64_t global_batch, int steps,
                                  const std::vector<std::string>& overrides = {});

/// The tokens every rank trains on (the same on each: every rank loads the whole corpus).
const std::vector<std::uint32_t>& debug_tokens();

/// The activation checkpoint modes every parity matrix runs, as llama-train keys.
struct AcMode {
  const char* name;
  std::vector<std::string> keys;
};
inline const AcMode kAcModes[] = {
    {"none", {"--activation_checkpoint.mode", "none"}},
    {"full", {"--activation_checkpoint.mode", "full"}},
    {"selective op", {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}},
    {"selective every 2nd layer",
     {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"}},
};

/// The checkpoint modes a parity matrix runs on its `turn`-th layout: every mode; in the
/// sanitizer build (TESSERA_SHORT_TESTS: every step there is ten times slower) one, in
/// turn, so that the matrix still runs every layout and, over four layouts, every mode.
/// With `with_none`, `none` is always one of them and the other comes in turn (over
/// three layouts, every mode).
inline std::vector<AcMode> ac_modes_for(std::size_t turn, bool with_none = false) {
#if TESSERA_SHORT_TESTS
  constexpr std::size_t n = std::size(kAcModes);
  if (with_none) return {kAcModes[0], kAcModes[1 + turn % (n - 1)]};
  return {kAcModes[turn % n]};
#else
  (void)turn;
  (void)with_none;
  return {std::begin(kAcModes), std::end(kAcModes)};
#endif
}

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::size_t activation_bytes = 0;   // peak saved activations, this rank
  std::size_t peak_memory_bytes = 0;  // every allocation, this rank
  std::uint64_t comm_bytes = 0;       // sent by this rank in the last step
  std::uint64_t peer_bytes = 0;       // of them, by point-to-point transfers
  std::vector<double> validation_losses;  // [validation] enabled: each validation's loss
};

/// The validation stream [validation] names, tokenized by the debug model's tokenizer.
io::TokenStream validation_tokens(const train::JobConfig& c);

/// Trains the debug model on `world` laid out as `shape`, with the config `c`
/// (its [parallelism] and [activation_checkpoint] keys make the Plan); a block with
/// settings of its own is given `options`.
template <class Model = CpuDynamicModel>
RunResult train_layout(comm::Communicator world, comm::MeshShape shape, const train::JobConfig& c,
                       const typename Model::block_options_type& options = {}) {
  if (world.size() > 1) omp_set_num_threads(1);  // ranks share the cores
  comm::DeviceMesh mesh(world, shape);
  const parallel::Plan plan = train::make_plan(c, &mesh);
  Model model(c.model.args, plan, options);
  model.init_weights(static_cast<std::uint64_t>(c.training.seed));
  data::DataLoader loader(debug_tokens(), c.training.seq_len, c.training.local_batch_size, mesh.dp_rank(),
                          mesh.dp_degree());
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  std::optional<train::Validator> validator;
  if (c.validation.enable)
    validator.emplace(data::DataLoader(validation_tokens(c), c.validation.seq_len, c.validation.local_batch_size,
                                       mesh.dp_rank(), mesh.dp_degree()),
                      c.validation.steps, c.training.document_mask ? train::document_start_id(c) : -1, "validation");
  RunResult r;
  for (std::int64_t s = 0; s < c.training.steps; ++s) {
    const train::StepMetrics m = trainer.step();
    if (validator && ((s + 1) % c.validation.freq == 0 || s + 1 == c.training.steps))
      r.validation_losses.push_back(validator->run(model).loss);
    r.losses.push_back(m.loss);
    r.grad_norms.push_back(m.grad_norm);
    r.activation_bytes = std::max(r.activation_bytes, m.activation_bytes);
    r.peak_memory_bytes = std::max(r.peak_memory_bytes, m.peak_memory_bytes);
    r.comm_bytes = m.comm_bytes;
    r.peer_bytes = m.peer_bytes;
  }
  return r;
}

// Compiled once, in harness.cpp.
extern template RunResult train_layout<CpuDynamicModel>(comm::Communicator, comm::MeshShape, const train::JobConfig&,
                                                        const nn::NoBlockOptions&);

/// The tensor- and pipeline-parallel parity runs: 10 steps (3 in sanitizer builds) of a
/// global batch of 8 sequences.
#if TESSERA_SHORT_TESTS
inline constexpr int kParitySteps = 3;
#else
inline constexpr int kParitySteps = 10;
#endif
inline constexpr std::int64_t kParityBatch = 8;

/// Two lists of config keys, one after the other.
inline std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// One rank's parity run with `keys` (trained once per distinct keys).
inline const RunResult& one_rank_run(const std::vector<std::string>& keys = {}) {
  static std::map<std::vector<std::string>, RunResult> cache;
  auto it = cache.find(keys);
  if (it == cache.end())
    it = cache
             .emplace(keys, train_layout(comm::Communicator(), comm::MeshShape{},
                                         debug_job(kParityBatch, kParityBatch, kParitySteps, keys)))
             .first;
  return it->second;
}

/// A parity run on thread ranks laid out as `shape`: rank 0's result, and whether every
/// rank reported the very same losses and gradient norms.
struct LayoutRun {
  RunResult rank0;
  bool ranks_agree = true;
};
/// Thread ranks held to NCCL's rules (comm/nccl_rules.hpp), as every parity run is: what
/// the layouts do across ranks is what NCCL will be asked to do on GPUs.
inline comm::ThreadOptions nccl_rules() {
  comm::ThreadOptions o;
  o.memory = Cpu::memory_access();
  o.nccl_rules = true;
  o.timeout = std::chrono::seconds(120);
  return o;
}

/// `local` sequences per rank and micro-batch (the global batch of kParityBatch in
/// several micro-batches where local x dp is less), for `steps` steps.
inline LayoutRun layout_run(comm::MeshShape shape, const std::vector<std::string>& keys, std::int64_t local, int steps) {
  std::vector<RunResult> per_rank(static_cast<std::size_t>(shape.world()));
  comm::run_thread_ranks(
      shape.world(),
      [&](comm::Communicator& world) {
        per_rank[static_cast<std::size_t>(world.rank())] =
            train_layout(world, shape, debug_job(local, kParityBatch, steps, keys));
      },
      nccl_rules());
  LayoutRun r{per_rank.front()};
  for (const auto& p : per_rank)
    r.ranks_agree = r.ranks_agree && p.losses == r.rank0.losses && p.grad_norms == r.rank0.grad_norms &&
                    p.validation_losses == r.rank0.validation_losses;
  return r;
}
inline LayoutRun layout_run(comm::MeshShape shape, const std::vector<std::string>& keys) {
  return layout_run(shape, keys, kParityBatch / shape.dp(), kParitySteps);
}

/// Each rank's error from training `shape` with `keys` for one step (empty where a rank
/// ran through): what a refusal test checks, every rank having to refuse, none to hang.
inline std::vector<std::string> layout_errors(comm::MeshShape shape, const std::vector<std::string>& keys) {
  std::vector<std::string> errors(static_cast<std::size_t>(shape.world()));
  comm::run_thread_ranks(shape.world(), [&](comm::Communicator& world) {
    try {
      train_layout(world, shape, debug_job(kParityBatch / shape.dp(), kParityBatch, 1, keys));
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(world.rank())] = e.what();
    }
  }, nccl_rules());
  return errors;
}

inline double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - b[i]) / std::abs(b[i]);
    if (!std::isfinite(d)) return INFINITY;
    worst = std::max(worst, d);
  }
  return worst;
}

/// How far tensor `a` is from `b` at its worst, against b's scale: max |a - b| / max |b|.
/// Two sums of the same products in another order (a GEMM of three projections as one,
/// another BLAS kernel's blocking) differ by rounding of the summands, which can be
/// larger than an element left small by cancellation: a gap of 1e-7 of the tensor's
/// scale is rounding (OpenBLAS's Haswell kernels give 3e-7 where its SkylakeX ones give
/// 9e-8), where a wrong value is off by about the values themselves.
inline double gap_to_scale(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double scale = 0, worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  if (!std::isfinite(worst)) return INFINITY;
  return scale > 0 ? worst / scale : worst;
}

/// How far a layout's run is from one rank's: the largest relative difference of the
/// losses (the parity bar is 1e-5) and of the gradient norms, which clipping uses (held
/// to 1e-4: a norm sums squares over every shard, piece and stage, so summation order
/// shows more in it, most at a loss spike).
struct RunGap {
  double loss = 0, grad_norm = 0;
};
inline RunGap run_gap(const RunResult& run, const RunResult& reference) {
  return {max_relative_difference(run.losses, reference.losses),
          max_relative_difference(run.grad_norms, reference.grad_norms)};
}

}  // namespace tessera::test
