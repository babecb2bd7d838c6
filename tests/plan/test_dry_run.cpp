// The dry run is the real run: a training step of the model on Traced<Meta> issues the
// very GEMMs, attention calls, kernels, fills, uploads and synchronisations that the same
// step on the CPU backend (Traced<Cpu>) issues, in the same order, and its memory peak and
// the peak's breakdown are the CPU backend's tracked ones, byte for byte, in every
// activation checkpoint mode. A bf16 model's dry run issues the CPU bf16 model's
// operations. At Llama 3 8B the peak's parameters, gradients and optimizer state are what
// the arithmetic says, with fp32 AdamW moments and with bf16 ones.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/meta/meta.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/backend/traced.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/machine.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/trainer.hpp"

namespace test_dry_run {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

/// The debug model's layers and heads at dim 64, a batch of 2 x 32 tokens, clipping on.
train::JobConfig small_job(const std::vector<std::string>& keys) {
  std::vector<std::string> o = {"--model.dim", "64", "--training.seq_len", "32", "--training.local_batch_size", "2"};
  o.insert(o.end(), keys.begin(), keys.end());
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    [training]
    max_norm = 0.5
    mixed_precision_param = "float32"
  )",
                             "test_dry_run", o);
}

struct Run {
  trace::Trace trace;
  std::size_t peak = 0;
  MemoryBreakdown at_peak{};
};

/// Trains T's model on backend B for two steps (the first untraced) and traces the
/// second, with B's memory (and the host's) counted apart from the rest of the process.
template <class T, class B>
Run traced_step(const train::JobConfig& c) {
  using Model = DynamicModel<T, B>;
  Run r;
  MemoryStats stats[kDeviceKinds];
  ScopedMemoryStats scope(stats);
  const parallel::Plan plan = train::make_plan(c, nullptr);
  Model model(c.model.args, plan);
  if constexpr (B::device == Device::cpu) model.init_weights(0);  // the dry run needs no values
  std::vector<std::uint32_t> tokens(4 * 2 * 33);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7919) % 250);
  data::DataLoader loader(std::move(tokens), c.training.seq_len, c.training.local_batch_size, 0, 1);
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  trainer.step();
  MemoryStats& device = stats[static_cast<int>(B::device)];
  device.reset_peak();
  {
    trace::Recording recording(r.trace, {B::device});
    trainer.step();
  }
  r.peak = device.peak();
  r.at_peak = device.at_peak();
  return r;
}

/// A validation batch of T's model on backend B (train::Validator, one global batch of
/// validation.local_batch_size x validation.seq_len) after an untraced training step, traced.
template <class T, class B>
trace::Trace traced_validation(const train::JobConfig& c) {
  using Model = DynamicModel<T, B>;
  const parallel::Plan plan = train::make_plan(c, nullptr);
  Model model(c.model.args, plan);
  if constexpr (B::device == Device::cpu) model.init_weights(0);
  auto stream = [](std::size_t n) {
    std::vector<std::uint32_t> tokens(n);
    for (std::size_t i = 0; i < n; ++i) tokens[i] = static_cast<std::uint32_t>((i * 7919) % 250);
    return tokens;
  };
  const std::int64_t local = c.validation.local_batch_size, seq = c.validation.seq_len;
  data::DataLoader loader(stream(4 * 2 * 33), c.training.seq_len, c.training.local_batch_size, 0, 1);
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  trainer.step();
  train::Validator validator(data::DataLoader(stream(static_cast<std::size_t>(local * (seq + 1))), seq, local, 0, 1), 1,
                             -1, "test_dry_run");
  trace::Trace t;
  {
    trace::Recording recording(t, {B::device});
    validator.run(model);
  }
  return t;
}

/// The operations the device is asked for, without memory events and reads back to the
/// host: on the CPU backend download() hands back the tensor itself, so only the dry run
/// (whose memory is not the host's) copies.
std::vector<trace::Op> device_ops(const trace::Trace& t) {
  std::vector<trace::Op> ops;
  for (const auto& e : t.events()) {
    if (std::holds_alternative<trace::Memory>(e.op)) continue;
    if (const auto* x = std::get_if<trace::Transfer>(&e.op); x && x->to_host) continue;
    ops.push_back(e.op);
  }
  return ops;
}

/// Where the first difference is, for the failure message.
std::string first_difference(const std::vector<trace::Op>& a, const std::vector<trace::Op>& b) {
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (!(a[i] == b[i])) return "operation " + std::to_string(i) + " differs";
  return a.size() == b.size() ? "none" : "lengths " + std::to_string(a.size()) + " and " + std::to_string(b.size());
}

struct Mode {
  const char* mode;
  const char* option;
  std::size_t attention_calls;  // 6 layers forward and backward, plus the recomputed forwards
  bool recompute_swiglu = false;  // activation_checkpoint.recompute_swiglu
};
const Mode kModes[] = {{"none", "", 12},      {"full", "", 18},         {"selective", "op", 12},
                       {"selective", "2", 15}, {"none", "", 12, true}, {"full", "", 18, true}};

}  // namespace

TEST_CASE("dry run: a step on Meta asks for what the CPU backend's step does, with its memory peak, in every checkpoint mode") {
  for (const Mode& mode : kModes) {
    std::vector<std::string> keys = {"--activation_checkpoint.mode", mode.mode};
    if (*mode.option) keys.insert(keys.end(), {"--activation_checkpoint.selective_ac_option", mode.option});
    if (mode.recompute_swiglu) keys.insert(keys.end(), {"--activation_checkpoint.recompute_swiglu", "true"});
    const std::string name = std::string(mode.mode) + " " + mode.option + (mode.recompute_swiglu ? " swiglu" : "");
    CAPTURE(name);
    const train::JobConfig c = small_job(keys);
    const Run cpu = traced_step<float, Traced<Cpu>>(c);
    const Run dry = traced_step<float, DryRun>(c);
    const auto a = device_ops(cpu.trace), b = device_ops(dry.trace);
    const std::string difference = first_difference(a, b);
    CAPTURE(difference);
    CHECK(a == b);
    CHECK(cpu.trace.all<trace::Gemm>().size() > 20);
    // Full checkpointing recomputes every layer's attention, every 2nd layer's half of them;
    // selective op keeps attention's output and replays it.
    CHECK(cpu.trace.all<trace::Attention>().size() == mode.attention_calls);
    // The peak and what it held, to the byte.
    CHECK(dry.peak == cpu.peak);
    for (int u = 0; u < kMemoryUses; ++u) CHECK(dry.at_peak.by_use[u] == cpu.at_peak.by_use[u]);
    CHECK(dry.at_peak.saved_activations == cpu.at_peak.saved_activations);
    CHECK(dry.at_peak.saved_activations > 0);
    CHECK(dry.at_peak[MemoryUse::parameters] > 0);
    // Every launch says what it does.
    for (const auto& k : dry.trace.all<trace::Kernel>()) {
      CAPTURE(std::string(k.functor));
      CHECK(k.priced);
    }
    // The host reads device values once a step, at its end: the loss sum and the
    // gradient norm, in one copy (tests/plan/test_layout_trace.cpp: after AdamW's launch).
    std::vector<std::string> reads;
    for (const auto& t : dry.trace.all<trace::Transfer>())
      if (t.to_host) reads.push_back(std::string(t.file) + ":" + std::to_string(t.line));
    REQUIRE(reads.size() == 1);
    CHECK(reads[0].find("train/step_scalars.hpp") != std::string::npos);
  }
}

TEST_CASE("dry run: a validation batch asks for what the CPU backend's Validator does: the forward and the loss") {
  const train::JobConfig c = small_job({"--validation.enable", "true", "--validation.local_batch_size", "3",
                                        "--validation.seq_len", "16", "--activation_checkpoint.mode", "full"});
  const trace::Trace cpu = traced_validation<float, Traced<Cpu>>(c);
  const plan::StepTrace dry = plan::dry_run_validation<float>(c);
  const auto a = device_ops(cpu), b = device_ops(dry.trace);
  const std::string difference = first_difference(a, b);
  CAPTURE(difference);
  CHECK(a == b);
  CHECK(dry.shape.tokens == 3 * 16);
  CHECK(dry.shape.seq_len == 16);
  // Forward only, once (full checkpointing recomputes nothing without a backward): a GEMM
  // per projection and the head against the step's three (forward, input and weight
  // gradients) and its recomputed forward; one attention call a layer; no optimizer.
  const plan::StepTrace step = plan::dry_run_step<float>(c);
  CHECK(dry.trace.all<trace::Attention>().size() == 6);
  for (const auto& at : dry.trace.all<trace::Attention>()) CHECK_FALSE(at.backward);
  CHECK(3 * dry.trace.all<trace::Gemm>().size() < step.trace.all<trace::Gemm>().size());
  for (const auto& k : dry.trace.all<trace::Kernel>()) {
    CAPTURE(std::string(k.functor));
    CHECK(std::string_view(k.functor).find("AdamW") == std::string_view::npos);
    CHECK(k.priced);
  }
}

TEST_CASE("dry run: a validation batch under FSDP gathers the parameters and sums the losses, and reduces no gradient") {
  const train::JobConfig c = small_job({"--validation.enable", "true", "--validation.local_batch_size", "2",
                                        "--validation.seq_len", "16", "--parallelism.data_parallel_shard_degree", "2"});
  const plan::StepTrace v = plan::dry_run_validation<float>(c, 0, 2, 1);
  std::map<std::string, int> kinds;
  for (const auto& x : v.trace.all<trace::Collective>()) ++kinds[x.kind];
  CHECK(kinds["all_gather"] > 0);
  CHECK(kinds["all_reduce"] == 1);  // the loss and target sums (train/validate.hpp)
  CHECK(kinds.count("reduce_scatter") == 0);
  CHECK(v.shape.tokens == 2 * 2 * 16);  // the global batch: 2 sequences on each of 2 ranks
  CHECK(v.rank == 1);
}

TEST_CASE("dry run: the checkpoint modes order the saved activations full < selective op < none") {
  auto saved = [](const char* mode, const char* option) {
    std::vector<std::string> keys = {"--activation_checkpoint.mode", mode};
    if (*option) keys.insert(keys.end(), {"--activation_checkpoint.selective_ac_option", option});
    return traced_step<float, DryRun>(small_job(keys)).at_peak.saved_activations;
  };
  const std::size_t none = saved("none", ""), full = saved("full", ""), op = saved("selective", "op");
  CHECK(full < op);
  CHECK(op < none);
}

TEST_CASE("dry run: a bf16 model's step asks for the CPU bf16 model's operations") {
  const train::JobConfig c = small_job({"--training.mixed_precision_param", "bfloat16"});
  const Run cpu = traced_step<bf16, Traced<Cpu>>(c);
  const Run dry = traced_step<bf16, DryRun>(c);
  CHECK(device_ops(cpu.trace) == device_ops(dry.trace));
  for (const auto& g : dry.trace.all<trace::Gemm>()) CHECK(g.operands == DType::bf16);
  // The CPU backend widens bf16 GEMM operands to float on the host (Cpu::gemm): its peak
  // holds those copies, the dry run's (a GPU's) does not.
  CHECK(dry.peak <= cpu.peak);
  CHECK(dry.at_peak[MemoryUse::parameters] == cpu.at_peak[MemoryUse::parameters]);
  CHECK(dry.at_peak[MemoryUse::optimizer] == cpu.at_peak[MemoryUse::optimizer]);
}

TEST_CASE("dry run: bf16 AdamW moments: the CPU backend's operations and memory, half the moments' bytes") {
  const train::JobConfig f32 = small_job({}), b16 = small_job({"--optimizer.state_dtype", "bfloat16"});
  const Run cpu = traced_step<float, Traced<Cpu>>(b16);
  const Run dry = traced_step<float, DryRun>(b16);
  CHECK(device_ops(cpu.trace) == device_ops(dry.trace));
  CHECK(dry.peak == cpu.peak);
  for (int u = 0; u < kMemoryUses; ++u) CHECK(dry.at_peak.by_use[u] == cpu.at_peak.by_use[u]);
  // An fp32 model without masters: the optimizer holds the two moments only, 4 bytes
  // per parameter in bf16 instead of 8.
  const auto n = static_cast<std::size_t>(b16.model.args.num_params());
  CHECK(dry.at_peak[MemoryUse::optimizer] == 4 * n);
  CHECK(traced_step<float, DryRun>(f32).at_peak[MemoryUse::optimizer] == 8 * n);
  // The update launch is the bf16-moment functor.
  bool found = false;
  for (const auto& k : dry.trace.all<trace::Kernel>())
    found = found || std::string(k.functor).find("AdamWMultiStep<float, bf16>") != std::string::npos;
  CHECK(found);
}

namespace {
/// `t`'s events with each collective's id (and its waits') numbered from 0 in the order
/// of issue: a communicator numbers its collectives from its creation, so a step's ids
/// depend on how many steps came before.
std::vector<trace::Event> renumbered(const trace::Trace& t) {
  std::vector<trace::Event> events = t.events();
  std::map<std::uint64_t, std::uint64_t> ids;
  auto id = [&](std::uint64_t x) { return ids.emplace(x, ids.size()).first->second; };
  for (auto& e : events) {
    if (auto* c = std::get_if<trace::Collective>(&e.op)) c->id = id(c->id);
    if (auto* w = std::get_if<trace::CommWait>(&e.op)) w->id = id(w->id);
  }
  return events;
}

/// Where two traces first differ ("none"), for the failure message.
std::string first_event_difference(const trace::Trace& a, const trace::Trace& b) {
  const auto x = renumbered(a), y = renumbered(b);
  for (std::size_t i = 0; i < std::min(x.size(), y.size()); ++i)
    if (!(x[i].op == y[i].op) || std::string_view(x[i].region) != y[i].region)
      return "event " + std::to_string(i) + ": " + plan::detail::describe(x[i].op) + " | " + plan::detail::describe(y[i].op);
  return x.size() == y.size() ? "none" : "lengths " + std::to_string(x.size()) + " and " + std::to_string(y.size());
}
}  // namespace

// The dry run traces the first step after Trainer::prepare (one step's cost, which is
// what lets llama-plan --search price thousands of layouts); a run's steady step is its
// second, the one-time tables built by the first. The two are the same: every event
// (operations, collectives, memory with its live bytes, regions), the device peak from
// the model's construction on and what it held, the host peak, the saved activations.
TEST_CASE("dry run: the first step after prepare() is the second step of a run, event for event and byte for byte") {
  struct Case {
    const char* name;
    std::vector<std::string> keys;
    int world;
    std::vector<int> ranks;
    bool bf16_model = false;
  };
  const std::vector<std::string> full = {"--activation_checkpoint.mode", "full"};
  auto degrees = [](int replicate, int shard, int tp, int pp, std::vector<std::string> more = {}) {
    std::vector<std::string> k = {"--parallelism.data_parallel_replicate_degree", std::to_string(replicate),
                                  "--parallelism.data_parallel_shard_degree", std::to_string(shard),
                                  "--parallelism.tensor_parallel_degree", std::to_string(tp),
                                  "--parallelism.pipeline_parallel_degree", std::to_string(pp)};
    if (pp > 1) k.insert(k.end(), {"--parallelism.pipeline_parallel_microbatch_size", "1"});
    k.insert(k.end(), more.begin(), more.end());
    return k;
  };
  const Case cases[] = {
      {"one rank", {}, 1, {0}},
      {"one rank, full AC", full, 1, {0}},
      {"one rank, selective op", {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}, 1, {0}},
      {"one rank, selective every 2nd", {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"}, 1, {0}},
      {"bf16 model, bf16 moments", {"--training.mixed_precision_param", "bfloat16", "--optimizer.state_dtype", "bfloat16"}, 1, {0}, true},
      {"FSDP 4, full AC, reshard always", degrees(1, 4, 1, 1, {"--activation_checkpoint.mode", "full", "--parallelism.fsdp_reshard_after_forward", "always"}), 4, {0, 3}},
      {"HSDP 2x2 (the second replica owns no norm pieces)", degrees(2, 2, 1, 1), 4, {0, 3}},
      {"DDP 2", degrees(2, 1, 1, 1), 2, {1}},
      {"TP 2 x FSDP 2", degrees(1, 2, 2, 1), 4, {0, 1}},
      {"PP 2 x FSDP 2, 1F1B", degrees(1, 2, 1, 2, {"--parallelism.pipeline_parallel_schedule", "1F1B"}), 4, {0, 2}},
      {"PP 2, GPipe, bf16", degrees(1, 1, 1, 2, {"--parallelism.pipeline_parallel_schedule", "GPipe", "--training.mixed_precision_param", "bfloat16"}), 2, {0, 1}, true},
      // Eight stages of six blocks, the embedding and the head: the first and last ranks hold no block.
      {"PP 8, 1F1B", degrees(1, 1, 1, 8, {"--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "8"}), 8, {0, 1, 7}},
  };
  for (const Case& k : cases) {
    const train::JobConfig c = small_job(k.keys);
    for (int rank : k.ranks) {
      const std::string name = std::string(k.name) + ", rank " + std::to_string(rank);
      CAPTURE(name);
      auto trace = [&](int steps_before) {
        return k.bf16_model ? plan::dry_run_step<bf16>(c, 0, k.world, rank, steps_before)
                            : plan::dry_run_step<float>(c, 0, k.world, rank, steps_before);
      };
      const plan::StepTrace prepared = trace(0), second = trace(1);
      const std::string difference = first_event_difference(prepared.trace, second.trace);
      CAPTURE(difference);
      CHECK(difference == "none");
      CHECK(prepared.trace.events().size() > 20);
      CHECK(prepared.peak_bytes == second.peak_bytes);
      // The caching allocator's segments (2 MiB multiples) hold the live peak and more.
      CHECK(prepared.reserved_peak_bytes >= prepared.peak_bytes);
      CHECK(prepared.reserved_peak_bytes % (std::size_t{2} << 20) == 0);
      for (int u = 0; u < kMemoryUses; ++u) CHECK(prepared.at_peak.by_use[u] == second.at_peak.by_use[u]);
      CHECK(prepared.at_peak.saved_activations == second.at_peak.saved_activations);
      CHECK(prepared.host_peak_bytes == second.host_peak_bytes);
      CHECK(prepared.saved_activation_bytes == second.saved_activation_bytes);
    }
  }
}

namespace {
/// The blocks the caching allocator hands out in each of `steps` steps after the first
/// (T's model on one device, under the GPU allocator's replay over Meta's addresses).
template <class T>
std::vector<std::vector<meta::AllocatorReplay::Block>> blocks_per_step(const train::JobConfig& c, int steps) {
  using Model = DynamicModel<T, DryRun>;
  meta::DeviceMemory device(std::size_t{80} << 30);
  meta::AllocatorReplay replay(c.training.expandable_segments);
  Model model(c.model.args, train::make_plan(c, nullptr));
  std::vector<std::uint32_t> tokens(static_cast<std::size_t>(c.training.seq_len + 1), 0);
  data::DataLoader loader(std::move(tokens), c.training.seq_len, c.training.local_batch_size, 0, 1);
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  trainer.prepare();
  trainer.step();
  std::vector<std::vector<meta::AllocatorReplay::Block>> logs(static_cast<std::size_t>(steps));
  for (auto& log : logs) {
    replay.log_blocks(&log);
    trainer.step();
    replay.log_blocks(nullptr);
  }
  return logs;
}
}  // namespace

TEST_CASE("dry run: after the first step, every step allocates the same blocks at the same addresses") {
  // What a CUDA graph captured over one step needs of the next: its kernels keep the
  // addresses they were captured with, so every later step must find the same blocks
  // where the captured one found them (and no block the step frees may move).
  struct Case {
    const char* name;
    std::vector<std::string> keys;
    bool bf16_model = false;
  };
  const Case cases[] = {
      {"none", {}},
      {"full AC", {"--activation_checkpoint.mode", "full"}},
      {"selective op", {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}},
      {"2 micro-batches", {"--training.global_batch_size", "4"}},
      {"bf16 model, bf16 moments", {"--training.mixed_precision_param", "bfloat16", "--optimizer.state_dtype", "bfloat16"}, true},
      {"segments of their own", {"--training.expandable_segments", "false"}},
  };
  for (const Case& k : cases) {
    CAPTURE(std::string(k.name));
    const train::JobConfig c = small_job(k.keys);
    const auto logs = k.bf16_model ? blocks_per_step<bf16>(c, 3) : blocks_per_step<float>(c, 3);
    CHECK(logs[0].size() > 50);
    CHECK(logs[1] == logs[0]);
    CHECK(logs[2] == logs[0]);
  }
}

namespace {
/// Llama 3 8B in bf16 on one device: a sequence of 8192 tokens, full checkpointing.
train::JobConfig llama3_8b_job(const std::vector<std::string>& keys) {
  return train::parse_config(R"(
    [model]
    flavor = "llama3_8b"
    [training]
    local_batch_size = 1
    seq_len = 8192
    mixed_precision_param = "bfloat16"
    [activation_checkpoint]
    mode = "full"
  )",
                             "test_dry_run", keys);
}
}  // namespace

TEST_CASE("dry run: Llama 3 8B in bf16 holds 2 + 4 + 12 bytes per parameter, plus its activations") {
  const train::JobConfig c = llama3_8b_job({});
  const plan::StepTrace st = plan::dry_run_step<bf16>(c);
  const auto n = static_cast<std::size_t>(c.model.args.num_params());
  CHECK(st.at_peak[MemoryUse::parameters] == 2 * n);  // bf16 values
  CHECK(st.at_peak[MemoryUse::gradients] == 4 * n);   // fp32 gradients
  CHECK(st.at_peak[MemoryUse::optimizer] == 12 * n);  // fp32 moments and master
  CHECK(st.peak_bytes > 18 * n);
  CHECK(st.at_peak.saved_activations > 0);
  CHECK(st.shape.tokens == 8192);
  CHECK(st.shape.dtype == DType::bf16);
  // Every GEMM of the step is bf16; each layer's attention runs forward, again in the
  // recomputation full checkpointing makes, and backward.
  const auto gemms = st.trace.all<trace::Gemm>();
  CHECK(gemms.size() > 32 * 7 * 3);
  for (const auto& g : gemms) CHECK(g.operands == DType::bf16);
  CHECK(st.trace.all<trace::Attention>().size() == 3 * 32);
}

TEST_CASE("dry run: Llama 3 8B offloaded (training.enable_cpu_offload) keeps 18 bytes a parameter in host memory, "
          "runs AdamW and the norm as host loops and copies its shards over the host link") {
  const train::JobConfig plain = llama3_8b_job({});
  const train::JobConfig c = llama3_8b_job({"--training.enable_cpu_offload", "true"});
  const plan::StepTrace st = plan::dry_run_step<bf16>(c);
  const plan::StepTrace on_device = plan::dry_run_step<bf16>(plain);
  const auto n = static_cast<std::size_t>(c.model.args.num_params());
  CHECK(st.at_peak[MemoryUse::optimizer] == 0);
  CHECK(st.offloaded_bytes >= 18 * n);  // bf16 values, fp32 gradients, moments and masters
  CHECK(on_device.offloaded_bytes == 0);
  CHECK(st.peak_bytes + 15 * n < on_device.peak_bytes);
  bool adamw_on_host = false, norm_on_host = false, adamw_on_device = false;
  for (const auto& k : st.trace.all<trace::Kernel>()) {
    const std::string_view f = k.functor;
    adamw_on_host = adamw_on_host || (k.on_host && f.starts_with("AdamWMultiStep"));
    adamw_on_device = adamw_on_device || (!k.on_host && f.starts_with("AdamWMultiStep"));
    norm_on_host = norm_on_host || (k.on_host && f.starts_with("SquaredNormChunks"));
  }
  CHECK(adamw_on_host);
  CHECK(norm_on_host);
  CHECK_FALSE(adamw_on_device);
  // The bf16 values go down for each gather (a unit's forward, and its backward), the
  // fp32 gradients up once.
  std::int64_t down = 0, up = 0;
  for (const auto& t : st.trace.all<trace::Transfer>()) (t.to_host ? up : down) += t.bytes;
  CHECK(up >= static_cast<std::int64_t>(4 * n));
  CHECK(down > static_cast<std::int64_t>(3 * n));
}

TEST_CASE("dry run: Llama 3 8B under the early step (optimizer.early_step_in_backward) holds a unit's gradient, "
          "not the model's, and updates each unit in the backward") {
  const std::vector<std::string> none = {"--activation_checkpoint.mode", "none", "--training.max_norm", "0",
                                         "--optimizer.state_dtype", "bfloat16"};
  const train::JobConfig plain = llama3_8b_job(none);
  std::vector<std::string> early = none;
  early.insert(early.end(), {"--optimizer.early_step_in_backward", "true"});
  const train::JobConfig c = llama3_8b_job(early);
  const plan::StepTrace st = plan::dry_run_step<bf16>(c);
  const plan::StepTrace whole = plan::dry_run_step<bf16>(plain);
  const auto n = static_cast<std::size_t>(c.model.args.num_params());
  // The largest units: the embedding and the head (untied), then a block. The head's
  // gradient is reduced, and its unit updated, once the last block's backward is done:
  // at most the head's and a block's gradients are held at once.
  const auto& a = c.model.args;
  const auto head = static_cast<std::size_t>(a.vocab_size * a.dim + a.dim);
  const auto block = (n - 2 * head) / static_cast<std::size_t>(a.n_layers) + 1;
  CHECK(whole.at_peak[MemoryUse::gradients] == 4 * n);
  CHECK(st.at_peak[MemoryUse::gradients] <= 4 * (head + block) + 1024);  // each rounded to the allocator's 512 bytes
  CHECK(st.at_peak[MemoryUse::optimizer] == whole.at_peak[MemoryUse::optimizer]);
  CHECK(st.at_peak[MemoryUse::parameters] == whole.at_peak[MemoryUse::parameters]);  // gathers are views of the shards
  CHECK(st.peak_bytes + 4 * (n - head - block) <= whole.peak_bytes);
  // One AdamW launch a unit (the embedding, 32 blocks, the head), in the optimizer's
  // region, the first before the last block's attention backward; the whole step's one.
  std::size_t adamw = 0, whole_adamw = 0, attention_after_first = 0;
  for (const auto& e : st.trace.events()) {
    if (const auto* k = std::get_if<trace::Kernel>(&e.op); k && std::string_view(k->functor).starts_with("AdamWMultiStep")) {
      CHECK(std::string_view(e.region) == region::kOptimizer);
      ++adamw;
    }
    if (adamw > 0 && std::holds_alternative<trace::Attention>(e.op)) ++attention_after_first;
  }
  for (const auto& k : whole.trace.all<trace::Kernel>()) whole_adamw += std::string_view(k.functor).starts_with("AdamWMultiStep");
  CHECK(adamw == 34);
  CHECK(whole_adamw == 1);
  CHECK(attention_after_first == 31);  // every block's attention backward but the last block's
}

TEST_CASE("dry run: Llama 3 8B offloaded under the early step updates each unit on the host beside the backward the "
          "device was given meanwhile") {
  const std::vector<std::string> offload = {"--training.enable_cpu_offload", "true", "--training.max_norm", "0"};
  std::vector<std::string> early = offload;
  early.insert(early.end(), {"--optimizer.early_step_in_backward", "true"});
  const plan::StepTrace after = plan::dry_run_step<bf16>(llama3_8b_job(offload));
  const plan::StepTrace beside = plan::dry_run_step<bf16>(llama3_8b_job(early));
  // Each offloaded gradient's copy up is followed by a fence, and the host waits for that
  // alone: once a unit (34 of them) before its update, and at the walk's end without the
  // early step. Nothing waits for the whole device between the blocks.
  CHECK(beside.trace.all<trace::Fence>().size() == 34);
  CHECK(beside.trace.all<trace::FenceWait>().size() == 34);
  CHECK(after.trace.all<trace::FenceWait>().size() == 34);
  const plan::GpuPricer h100(plan::load_machine(std::string(TESSERA_MACHINES) + "/h100-sxm.toml"),
                             plan::AttentionKernel::cudnn);
  const plan::Prediction p_after = plan::predict(after, h100), p_beside = plan::predict(beside, h100);
  MESSAGE("offloaded, full checkpointing, on an H100: ", p_after.step_seconds, " s a step; under the early step ",
          p_beside.step_seconds, " s, of the host's ", p_beside.host_seconds, " s of loops ", p_beside.hidden_host_seconds,
          " s beside the device");
  // The same work (the host's loops the same bytes, unit by unit), the device's backward
  // under the host's updates.
  CHECK(p_beside.host_seconds == doctest::Approx(p_after.host_seconds).epsilon(0.01));
  CHECK(p_after.hidden_host_seconds < 0.01 * p_after.host_seconds);
  CHECK(p_beside.hidden_host_seconds > 0.1 * p_beside.host_seconds);
  CHECK(p_beside.step_seconds < p_after.step_seconds - 0.9 * p_beside.hidden_host_seconds);
}

TEST_CASE("loss head: a chunk takes 16 MiB on a host and 1/64 of a device's memory, at most 4 GiB") {
  CHECK(nn::loss_chunk_budget(0) == std::size_t{16} << 20);
  CHECK(nn::loss_chunk_budget(std::size_t{80} << 30) == (std::size_t{80} << 30) / 64);
  CHECK(nn::loss_chunk_budget(std::size_t{1} << 30) == std::size_t{16} << 20);   // a small GPU: the host's floor
  CHECK(nn::loss_chunk_budget(std::size_t{1} << 40) == std::size_t{4} << 30);    // a huge one: the ceiling
  // Llama 3's vocabulary: fp32 logits alone (4 bytes) on a host: the 32 rows of before.
  CHECK(nn::loss_chunk_rows(128256, 8192) == 32);
  // A bf16 model keeps the logit (4) and its bf16 gradient (2): 6 bytes a logit.
  CHECK(nn::loss_chunk_bytes_per_logit(DType::bf16) == 6);
  CHECK(nn::loss_chunk_rows(128256, 8192, 6, nn::loss_chunk_budget(std::size_t{80} << 30)) ==
        static_cast<std::int64_t>((std::size_t{80} << 30) / 64 / (128256 * 6)));
  // Never more rows than there are, never fewer than one.
  CHECK(nn::loss_chunk_rows(100, 7) == 7);
  CHECK(nn::loss_chunk_rows(std::int64_t{1} << 40, 7) == 1);
}

TEST_CASE("dry run: the loss head's chunks follow the device's memory: hundreds on a host, a few on an H200") {
  const train::JobConfig c = llama3_8b_job({});
  auto chunks = [](const plan::StepTrace& st) {
    std::int64_t n = 0;
    for (const auto& k : st.trace.all<trace::Kernel>()) n += std::string_view(k.functor) == "CrossEntropyRow<float, bf16>";
    return n;
  };
  const std::int64_t rows = 8192, vocab = c.model.args.vocab_size;
  const std::size_t h200 = 150109945856;  // examples/machines/h200.toml: memory.capacity_bytes
  const std::int64_t host_rows = nn::loss_chunk_rows(vocab, rows, 6), device_rows =
                                     nn::loss_chunk_rows(vocab, rows, 6, nn::loss_chunk_budget(h200));
  CHECK(host_rows == 21);
  CHECK(device_rows == 3047);
  const plan::StepTrace host = plan::dry_run_step<bf16>(c);
  const plan::StepTrace device = plan::dry_run_step<bf16>(c, h200);
  CHECK(chunks(host) == (rows + host_rows - 1) / host_rows);
  CHECK(chunks(device) == 3);
  // The output GEMMs of a chunk are as tall as the chunk.
  bool tall = false;
  for (const auto& g : device.trace.all<trace::Gemm>()) tall = tall || (g.m == device_rows && g.n == vocab);
  CHECK(tall);
  // The bigger chunk's logits (fp32) and gradient (bf16) are in the device's peak, nothing else changes.
  CHECK(device.peak_bytes > host.peak_bytes);
  CHECK(device.peak_bytes - host.peak_bytes <= static_cast<std::size_t>(device_rows * vocab * 6));
  CHECK(device.at_peak[MemoryUse::optimizer] == host.at_peak[MemoryUse::optimizer]);
}

TEST_CASE("dry run: Llama 3 8B with bf16 AdamW moments holds 2 + 4 + 8 bytes per parameter") {
  const train::JobConfig c = llama3_8b_job({"--optimizer.state_dtype", "bfloat16"});
  const plan::StepTrace st = plan::dry_run_step<bf16>(c);
  const auto n = static_cast<std::size_t>(c.model.args.num_params());
  CHECK(st.at_peak[MemoryUse::parameters] == 2 * n);  // bf16 values
  CHECK(st.at_peak[MemoryUse::gradients] == 4 * n);   // fp32 gradients
  CHECK(st.at_peak[MemoryUse::optimizer] == 8 * n);   // bf16 moments (2 + 2), fp32 master (4): 4 fewer
  CHECK(st.peak_bytes > 14 * n);
  // The same step otherwise: the activations at the peak are the fp32-moment run's.
  const plan::StepTrace f32 = plan::dry_run_step<bf16>(llama3_8b_job({}));
  CHECK(f32.at_peak[MemoryUse::optimizer] - st.at_peak[MemoryUse::optimizer] == 4 * n);
  CHECK(st.at_peak.saved_activations == f32.at_peak.saved_activations);
  CHECK(f32.peak_bytes - st.peak_bytes == 4 * n);
}

TEST_CASE("Meta: under an AllocatorReplay, tensors are blocks of tessera's caching allocator over Meta's addresses") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  meta::AllocatorReplay replay;
  REQUIRE(meta::AllocatorReplay::current() == &replay);
  void* first = nullptr;
  {
    // 3 MiB: a large-pool segment of 4 MiB, handed out whole (the 1 MiB left is not
    // worth a block of its own).
    auto a = Meta::empty<float>(Shape{3 * (1 << 18)});
    first = a.data();
    CHECK(replay.stats().reserved_bytes == 4 * MiB);
    CHECK(replay.stats().allocated_bytes == 4 * MiB);
    CHECK(replay.stats().requested_bytes == 3 * MiB);
    // A value the host uploaded reads back while the block is this tensor's.
    const float x = 2.5f;
    Meta::copy_from_host(&x, a.data(), 1);
  }
  // Released, the segment stays reserved (cached), and the next large request that fits
  // takes it: the same address, no new segment, the upload forgotten.
  CHECK(replay.stats().allocated_bytes == 0);
  CHECK(replay.stats().reserved_bytes == 4 * MiB);
  auto b = Meta::empty<float>(Shape{1 << 19});  // 2 MiB
  CHECK(static_cast<void*>(b.data()) == first);
  CHECK(replay.stats().upstream_allocations == 1);
  float y = -1;
  Meta::copy_to_host(b.data(), &y, 1);
  CHECK(y == 0.0f);
  // A small tensor gets a 2 MiB segment of the small pool; live ones never share an address.
  auto c = Meta::empty<bf16>(Shape{100});
  CHECK(replay.stats().reserved_bytes == 6 * MiB);
  CHECK(static_cast<void*>(c.data()) != static_cast<void*>(b.data()));
  // A tensor of an outer replay released while an inner one is open goes back to the
  // outer; one that outlives every replay is released harmlessly.
  std::optional<Tensor<float>> outlives;
  {
    meta::AllocatorReplay inner;
    auto d = Meta::empty<float>(Shape{1 << 10});
    outlives.emplace(Meta::empty<float>(Shape{1 << 10}));
    CHECK(inner.stats().allocated_bytes == 2 * 4096);
    b = Meta::empty<float>(Shape{1});  // the outer replay's 2 MiB block released here
    CHECK(replay.stats().allocated_bytes < 2 * MiB);
  }
  CHECK(meta::AllocatorReplay::current() == &replay);
  outlives.reset();
  CHECK(replay.stats().peak_reserved >= replay.stats().reserved_bytes);
}

TEST_CASE("Meta: a replay of expandable segments grows one segment at its end; its range serves the next replay") {
  constexpr std::int64_t MiB_floats = std::int64_t{1} << 18;  // floats in 1 MiB
  constexpr std::size_t MiB = std::size_t{1} << 20;
  // A tensor freed at the end and a larger one after it: the segment grows by the
  // difference (training.expandable_segments, the default), where a segment per block
  // takes the whole larger one anew.
  const auto reserved = [&](bool expandable) {
    meta::AllocatorReplay replay(expandable);
    auto x = Meta::empty<float>(Shape{4 * MiB_floats});
    std::optional<Tensor<float>> y(Meta::empty<float>(Shape{6 * MiB_floats}));
    void* y_at = y->data();
    y.reset();
    auto z = Meta::empty<float>(Shape{12 * MiB_floats});
    if (expandable) CHECK(static_cast<void*>(z.data()) == y_at);
    return replay.stats().peak_reserved;
  };
  CHECK(reserved(true) == 16 * MiB);
  CHECK(reserved(false) == 22 * MiB);

  // The next replay takes the same range when nothing of the last outlived it.
  void* base = nullptr;
  {
    meta::AllocatorReplay replay;
    base = Meta::empty<float>(Shape{4 * MiB_floats}).data();
  }
  void* kept_at = nullptr;
  std::optional<Tensor<float>> kept;
  {
    meta::AllocatorReplay replay;
    kept.emplace(Meta::empty<float>(Shape{4 * MiB_floats}));
    kept_at = kept->data();
  }
  CHECK(kept_at == base);
  {
    // The last one's tensor outlives it: its range is not reused while that lives.
    meta::AllocatorReplay replay;
    auto t = Meta::empty<float>(Shape{4 * MiB_floats});
    CHECK(static_cast<void*>(t.data()) != kept_at);
  }
  kept.reset();
}

TEST_CASE("trace: a rewrite builds the new events in the spare buffer and hands the old one back, emptied") {
  trace::Trace t;
  for (std::int64_t i = 1; i <= 1000; ++i) t.add(trace::Fill{i});
  std::vector<trace::Event> spare;
  // A Synchronize after every tenth Fill, and the Synchronizes dropped again.
  const auto add = [&] {
    t.rewrite(spare, [](std::vector<trace::Event>& in, std::vector<trace::Event>& out) {
      for (trace::Event& e : in) {
        const bool tenth = std::get<trace::Fill>(e.op).bytes % 10 == 0;
        out.push_back(std::move(e));
        if (tenth) out.push_back(trace::Event{trace::Synchronize{}, "inserted"});
      }
    });
  };
  const auto drop = [&] {
    t.rewrite(spare, [](std::vector<trace::Event>& in, std::vector<trace::Event>& out) {
      for (trace::Event& e : in)
        if (std::holds_alternative<trace::Fill>(e.op)) out.push_back(std::move(e));
    });
  };
  const trace::Event* recorded = t.events().data();
  add();
  const auto& ev = t.events();
  REQUIRE(ev.size() == 1100);
  CHECK(std::get<trace::Fill>(ev[0].op).bytes == 1);
  CHECK(std::get<trace::Fill>(ev[9].op).bytes == 10);
  CHECK(std::holds_alternative<trace::Synchronize>(ev[10].op));
  CHECK(std::string_view(ev[10].region) == "inserted");
  CHECK(std::get<trace::Fill>(ev[1098].op).bytes == 1000);
  CHECK(spare.empty());
  CHECK(spare.data() == recorded);  // the recorded buffer, for the next rewrite
  drop();
  REQUIRE(ev.size() == 1000);
  for (std::size_t i = 0; i < ev.size(); ++i) CHECK(std::get<trace::Fill>(ev[i].op).bytes == static_cast<std::int64_t>(i) + 1);
  // Once both buffers have held the trace, the rewrites trade them and allocate nothing.
  const trace::Event* a = ev.data();
  const trace::Event* b = spare.data();
  add();
  CHECK(ev.size() == 1100);
  CHECK(ev.data() == b);
  CHECK(spare.data() == a);
  drop();
  CHECK(ev.size() == 1000);
  CHECK(ev.data() == a);
  CHECK(spare.data() == b);
}

}  // namespace test_dry_run
