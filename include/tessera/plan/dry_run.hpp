// The dry run of one training step: llama-train's model and trainer, on the Meta backend,
// traced.
//
// dry_run_step<T>(config) builds the model the config describes (T = float, or bf16 for a
// bf16 model) on Traced<Meta>, without initialising it (values are never read), gives
// the Trainer a token stream of the right length, runs one step to do the one-time work
// (the optimizer's and gradient norm's tables), and records the second: every GEMM,
// attention call, kernel, fill, transfer and synchronisation, and every allocation and
// release of device memory. The memory peak covers the whole run from the model's
// construction: parameters, gradients and optimizer state are live throughout, the
// step's temporaries come and go. Nothing is computed and nothing is stored, so a step of
// Llama 3 405B is traced in about a second and a step of 8B in tens of milliseconds.
//
// One rank, one device: a config whose parallelism degrees exceed 1 is refused by name
// (the traces of a layout's ranks are the next step).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/backend/meta/meta.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/parallel/dynamic.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/train/job_config.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera::plan {

/// One traced step.
struct StepTrace {
  trace::Trace trace;                 // the second step's operations and memory events
  std::size_t peak_bytes = 0;         // the device's memory peak, from the model's construction on
  MemoryBreakdown at_peak{};          // what it held then
  std::size_t host_peak_bytes = 0;    // host tensors the step made (read-backs, uploads' sources)
  std::size_t saved_activation_bytes = 0;  // the activation store's peak in the step
  StepShape shape;
  double seconds = 0;                 // how long the dry run took
};

/// Refuses what a one-device dry run cannot plan, naming the key.
inline void check_dry_run(const train::JobConfig& c) {
  const auto& p = c.parallelism;
  auto one = [](const char* key, std::int64_t v) {
    TESSERA_CHECK(v == 1 || v == -1 || v == 0, "parallelism.", key, " = ", v,
                  ": llama-plan predicts one rank on one device for now; set it to 1");
  };
  one("data_parallel_replicate_degree", p.data_parallel_replicate_degree);
  one("data_parallel_shard_degree", p.data_parallel_shard_degree);
  one("tensor_parallel_degree", p.tensor_parallel_degree);
  one("pipeline_parallel_degree", p.pipeline_parallel_degree);
  one("context_parallel_degree", p.context_parallel_degree);
  // What the step runs (metrics.* only change what a real run writes).
  parallel::parse_schedule_kind(p.pipeline_parallel_schedule);
  parallel::parse_checkpoint(c.activation_checkpoint.mode, c.activation_checkpoint.selective_ac_option);
  parallel::parse_reshard(p.fsdp_reshard_after_forward);
}

/// Traces one training step of the model `c` describes, its parameters in T, on a device
/// of `device_bytes` (a GPU profile's capacity; 0: the host), which layers that size their
/// working sets from the device's memory see (meta::DeviceMemory).
template <class T>
StepTrace dry_run_step(const train::JobConfig& c, std::size_t device_bytes = 0) {
  check_dry_run(c);
  const auto t0 = std::chrono::steady_clock::now();
  using Model = tessera::DynamicModel<T, DryRun>;
  StepTrace out;
  MemoryStats stats[kDeviceKinds];  // this run's own counters
  {
    ScopedMemoryStats scope(stats);
    meta::DeviceMemory device(device_bytes);
    const parallel::Plan plan = train::make_plan(c, nullptr);
    Model model(c.model.args, plan);
    const std::int64_t local = c.training.local_batch_size, seq = c.training.seq_len;
    const std::int64_t global = c.training.global_batch_size > 0 ? c.training.global_batch_size : local;
    TESSERA_CHECK(local > 0 && global % local == 0, "training.global_batch_size (", global,
                  ") must be a multiple of training.local_batch_size (", local, ")");
    const std::int64_t micro = global / local;
    // Two steps of windows of seq + 1 tokens; the ids are 0 (never read as values).
    std::vector<std::uint32_t> tokens(static_cast<std::size_t>(2 * micro * local * (seq + 1)), 0);
    data::DataLoader loader(std::move(tokens), seq, local, 0, 1);
    train::Trainer<Model> trainer(model, c, std::move(loader), 0);
    trainer.step();
    stats[static_cast<int>(Device::cpu)].reset_peak();
    {
      trace::Recording recording(out.trace, {Device::meta});
      const train::StepMetrics m = trainer.step();
      out.saved_activation_bytes = m.activation_bytes;
    }
    out.peak_bytes = stats[static_cast<int>(Device::meta)].peak();
    out.at_peak = stats[static_cast<int>(Device::meta)].at_peak();
    out.host_peak_bytes = stats[static_cast<int>(Device::cpu)].peak();
    out.shape.args = c.model.args;
    out.shape.tokens = global * seq;
    out.shape.seq_len = seq;
    out.shape.dtype = std::is_same_v<T, bf16> ? DType::bf16 : plan.param_dtype;
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace tessera::plan
