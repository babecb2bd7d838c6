// The dry run of one training step: llama-train's model and trainer, on the Meta backend,
// traced.
//
// dry_run_step<T>(config) builds the model the config describes (T = float, or bf16 for a
// bf16 model) on Traced<Meta>, without initialising it (values are never read), gives
// the Trainer a token stream of the right length, does the one-time work of a first step
// ahead of it (Trainer::prepare: the rotary, gradient-norm and optimizer tables), and
// records the first step, which then does what every later step does: every GEMM,
// attention call, kernel, fill, transfer and synchronisation, and every allocation and
// release of device memory. The memory peak covers the whole run from the model's
// construction: parameters, gradients and optimizer state are live throughout, the
// step's temporaries come and go. Meta's allocations go through tessera's caching
// allocator meanwhile (meta::AllocatorReplay), so the run also says what that allocator,
// the CUDA backend's, reserves for them at its peak: the live bytes, plus what its
// rounding and its free blocks too small to reuse hold. Nothing is computed and nothing
// is stored, so a step of Llama 3 405B is traced in about a second and a step of 8B in
// tens of milliseconds.
//
// One rank of a layout: on a world of N ranks, dry_run_step traces the rank it is given,
// its mesh made of PhantomEngine communicators (plan/phantom.hpp): every collective and
// send/recv it issues is recorded with its bytes and its group, and returns at once,
// since its peers do not run. Data- and tensor-parallel peers run the same program on
// their own shards, so the ranks that differ are the pipeline positions:
// distinct_ranks(shape) names one rank of each, and their traces are the layout's.
#pragma once

#include <chrono>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/backend/meta/meta.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/comm/mesh.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/io/memory_snapshot.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/phantom.hpp"
#include "tessera/plan/traced_step.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/job_config.hpp"
#include "tessera/train/trainer.hpp"
#include "tessera/train/validate.hpp"

namespace tessera::plan {

namespace detail {

/// The dry run's frame: the model and the trainer `c` describes on Traced<Meta>, as rank
/// `rank` of `world` sees them (memory, allocator replay, phantom mesh, a token stream of
/// the right length, Trainer::prepare or `steps_before` untraced steps), then
/// `record(trainer, model, mesh, out)` under a trace recording into `out`. The shape it
/// fills is the training step's; the record may change it.
template <class T, class Record>
StepTrace dry_run(const train::JobConfig& c, std::size_t device_bytes, int world, int rank, int steps_before,
                  std::string* memory_snapshot, Record&& record) {
  const comm::MeshShape shape = check_dry_run(c, world);
  TESSERA_CHECK(rank >= 0 && rank < world, "dry run: rank ", rank, " is outside the world of ", world, " ranks");
  const auto t0 = std::chrono::steady_clock::now();
  using Model = tessera::DynamicModel<T, DryRun>;
  StepTrace out;
  MemoryStats stats[kDeviceKinds];  // this run's own counters
  {
    ScopedMemoryStats scope(stats);
    meta::DeviceMemory device(device_bytes);
    meta::AllocatorReplay replay(c.training.expandable_segments);  // opened before the model, closed after it
    // A memory snapshot's history starts before the model's first parameter; the spans
    // open at each allocation are its context.
    profile::Recorder where;
    const profile::Recording spans(memory_snapshot != nullptr ? &where : nullptr);
    if (memory_snapshot != nullptr) replay.record_history(std::size_t{1} << 30);
    // One rank alone has no mesh (as llama-train on one rank); a layout's rank has one of
    // phantom communicators.
    std::optional<comm::DeviceMesh> mesh;
    if (world > 1) mesh.emplace(comm::Communicator(PhantomEngine(rank, world)), shape);
    const parallel::Plan plan = train::make_plan(c, mesh ? &*mesh : nullptr);
    Model model(c.model.args, plan);
    const std::int64_t local = c.training.local_batch_size, seq = c.training.seq_len;
    const std::int64_t dp = shape.dp();
    const std::int64_t global = c.training.global_batch_size > 0 ? c.training.global_batch_size : local * dp;
    TESSERA_CHECK(local > 0 && global % (local * dp) == 0, "training.global_batch_size (", global,
                  ") must be a multiple of training.local_batch_size x the data-parallel degree (", local, " x ", dp,
                  " = ", local * dp, ")");
    // One window of seq + 1 tokens, id 0 (never read as values): the loader wraps around
    // it, so every rank's batches have their real shape without a stream the size of the
    // global batch (a 405B layout on 16,384 GPUs would build and check 1 GiB of ids).
    std::vector<std::uint32_t> tokens(static_cast<std::size_t>(seq + 1), 0);
    data::DataLoader loader(std::move(tokens), seq, local, mesh ? mesh->dp_rank() : 0, dp);
    // The eager step: a replayed graph launches the same work (training.cuda_graph).
    train::TrainerOptions options = train::trainer_options(c);
    options.graph = false;
    train::Trainer<Model> trainer(model, std::move(options), std::move(loader));
    if (steps_before == 0) trainer.prepare();
    for (int i = 0; i < steps_before; ++i) trainer.step();
    stats[static_cast<int>(Device::cpu)].reset_peak();
    out.shape.args = c.model.args;
    out.shape.tokens = global * seq;
    out.shape.seq_len = seq;
    out.shape.dtype = std::is_same_v<T, bf16> ? DType::bf16 : plan.param_dtype;
    out.shape.devices = world;
    out.shape.lora = plan.lora;
    {
      // Room for as many events as this thread's last dry run recorded: a search traces
      // thousands of steps of about one size, and growing each trace's events by
      // doubling moved every event several times over (a twentieth of the search).
      static thread_local std::size_t last_events = 0;
      out.trace.reserve(last_events);
      trace::Recording recording(out.trace, {Device::meta});
      record(trainer, model, mesh ? &*mesh : nullptr, out);
      last_events = out.trace.events().size();
    }
    out.peak_bytes = stats[static_cast<int>(Device::meta)].peak();
    out.reserved_peak_bytes = replay.stats().peak_reserved;
    out.at_peak = stats[static_cast<int>(Device::meta)].at_peak();
    out.host_peak_bytes = stats[static_cast<int>(Device::cpu)].peak();
    out.offloaded_bytes = stats[static_cast<int>(Device::host)].peak();
    out.mesh = shape;
    out.rank = rank;
    if (memory_snapshot != nullptr)
      *memory_snapshot = io::torch_memory_snapshot(replay.state(), replay.history(), 0, c.training.expandable_segments);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace detail

/// Traces one training step of the model `c` describes, its parameters in T, on a device
/// of `device_bytes` (a GPU profile's capacity; 0: the host), which layers that size their
/// working sets from the device's memory see (meta::DeviceMemory): that of world rank
/// `rank` when the layout spans `world` ranks (the degrees of [parallelism] make its mesh).
/// `steps_before`: 0 traces the first step after Trainer::prepare; n > 0 runs n steps
/// without prepare() and traces the next, which does the same (tests/plan/test_dry_run.cpp
/// holds the two equal, event for event and byte for byte) at n + 1 times the cost.
/// `memory_snapshot`, where given, receives the replayed allocator's memory snapshot at
/// the step's end (io/memory_snapshot.hpp: PyTorch's pickle), its events from before the
/// model's first parameter, each allocation's context the spans open at it.
template <class T>
StepTrace dry_run_step(const train::JobConfig& c, std::size_t device_bytes = 0, int world = 1, int rank = 0,
                       int steps_before = 0, std::string* memory_snapshot = nullptr) {
  return detail::dry_run<T>(c, device_bytes, world, rank, steps_before, memory_snapshot,
                            [](auto& trainer, auto&, comm::DeviceMesh*, StepTrace& out) {
                              const train::StepMetrics m = trainer.step();
                              out.saved_activation_bytes = m.activation_bytes;
                            });
}

/// Traces one global batch of validation ([validation]: validation.local_batch_size
/// sequences of validation.seq_len tokens on each data-parallel rank) as llama-train's
/// Validator reads it, after the model's first training step: the forward and the loss
/// under the training's layout, no gradients (train/validate.hpp), and the sum over the
/// data-parallel ranks. Its shape is the validation batch's: tokens of the global batch,
/// validation.seq_len. The memory peak is the run's up to then, the step's included.
template <class T>
StepTrace dry_run_validation(const train::JobConfig& c, std::size_t device_bytes = 0, int world = 1, int rank = 0) {
  const std::int64_t local = c.validation.local_batch_size, seq = c.validation.seq_len;
  return detail::dry_run<T>(c, device_bytes, world, rank, 1, nullptr,
                            [&](auto& trainer, auto& model, comm::DeviceMesh* mesh, StepTrace& out) {
                              model.check_batch(local, seq);
                              const std::int64_t dp = mesh ? mesh->dp_degree() : 1;
                              std::vector<std::uint32_t> tokens(static_cast<std::size_t>(seq + 1), 0);
                              train::Validator validator(
                                  data::DataLoader(std::move(tokens), seq, local, mesh ? mesh->dp_rank() : 0, dp), 1,
                                  trainer.options().document_start_id, "validation (dry run)");
                              validator.run(model);
                              out.shape.tokens = local * dp * seq;
                              out.shape.seq_len = seq;
                            });
}

/// The two step dry runs llama-plan and llama-train trace: of the fp32 model and of the
/// bf16 model. Under TESSERA_EXTERN_INSTANCES (tessera/instances.hpp) they are declared
/// `extern template` here, and a build compiles them once:
/// `namespace tessera::plan { TESSERA_DRY_RUN_INSTANCES(template) }` in one file. The
/// validation's are instantiated where they are used (llama-plan alone, which the
/// sanitizer build leaves out: examples/llama/validation_trace.cpp).
#define TESSERA_DRY_RUN_INSTANCES(X)                                                                                   \
  X StepTrace dry_run_step<float>(const train::JobConfig&, std::size_t, int, int, int, std::string*);                  \
  X StepTrace dry_run_step<bf16>(const train::JobConfig&, std::size_t, int, int, int, std::string*);

#if defined(TESSERA_EXTERN_INSTANCES)
TESSERA_DRY_RUN_INSTANCES(extern template)
#endif

}  // namespace tessera::plan
