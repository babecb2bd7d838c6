// llama-plan: what one training step of a config will cost on a machine, before running it.
//
//   llama-plan --config examples/configs/llama3_8b.toml --machine h100-sxm
//   llama-plan --config CFG [--machine h100-sxm|h200|a100-80gb-sxm|cpu|FILE.toml]
//              [--section.key value ...] [--json]
//
// Reads the same TOML and command-line keys as llama-train, traces one training step of
// that model on the dry-run backend (plan/dry_run.hpp: nothing computed, nothing stored),
// and prices the trace on the machine (plan/cost.hpp): the step's time by class, tokens/s,
// MFU (torchtitan's formula and causally halved), the memory peak with its breakdown and
// whether it fits. GPU machines are the profiles in examples/machines (built in, each
// figure with its source) or any FILE.toml of that form; `cpu` measures this machine's CPU
// on the step's own GEMMs and kernels (plan/cpu.hpp) and predicts llama-train's CPU step.
// A GPU step is traced for the model llama-train would train there: bf16 with
// mixed_precision_param = "bfloat16", else float32; the CPU's is float32 (bf16 parameter
// values with "bfloat16"). One rank on one device (parallelism degrees of 1).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "builtin_machines.hpp"
#include "step_trace.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/cpu.hpp"
#include "tessera/plan/machine.hpp"
#include "tessera/train/config.hpp"

using namespace tessera;

namespace {

void usage() {
  std::printf(
      "usage: llama-plan [--config FILE.toml] [--machine NAME|FILE.toml] [--json] [--section.key value ...]\n\n"
      "Predicts one training step of the config on a machine, from a trace of the very code llama-train runs:\n"
      "time by class, tokens/s, MFU, peak memory and its breakdown, and whether it fits.\n\n"
      "  --machine NAME   %s, or cpu (this machine, measured), or a machine profile FILE.toml\n"
      "                   (default h100-sxm)\n"
      "  --json           one JSON object instead of the table\n\n"
      "Config keys are llama-train's (llama-train --help lists them).\n",
      builtin_machine_names().c_str());
}

std::string gib(double bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", bytes / double(1ull << 30));
  return s;
}

std::string seconds_text(double s) {
  char t[32];
  if (s >= 1) std::snprintf(t, sizeof t, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(t, sizeof t, "%.2f ms", s * 1e3);
  else std::snprintf(t, sizeof t, "%.1f us", s * 1e6);
  return t;
}

struct Target {
  std::unique_ptr<plan::Pricer> pricer;
  std::string origin;          // "built in", a file, or "measured"
  double reserved_bytes = 0;   // taken before the first tensor (GPUs)
  std::size_t device_bytes = 0;  // the GPU's memory in all (0: the CPU, host memory)
  plan::AttentionChoice attention;  // the GPU's attention kernels (training.attention)
  bool cpu = false;
  std::string description;
};

/// The machine --machine names; for `cpu`, measured on the step's own work. On a GPU the
/// attention kernels are those `attention` (training.attention) picks for a model of `dtype`.
Target resolve_machine(const std::string& name, const trace::Trace& step_trace, const std::string& attention,
                       DType dtype, std::int64_t head_dim) {
  Target t;
  if (name == "cpu") {
    t.cpu = true;
    t.origin = "measured";
    auto pricer = std::make_unique<plan::CpuPricer>(plan::measure_cpu(step_trace));
    t.description = "this machine's CPU";
    t.pricer = std::move(pricer);
    return t;
  }
  plan::Machine m;
  const bool file = name.find('/') != std::string::npos || (name.size() > 5 && name.substr(name.size() - 5) == ".toml");
  if (file) {
    m = plan::load_machine(name);
  } else {
    const char* text = builtin_machine(name);
    TESSERA_CHECK(text != nullptr, "--machine ", name, ": unknown machine (known: ", builtin_machine_names(),
                  ", cpu; or a profile FILE.toml)");
    m = plan::parse_machine(text, name + ".toml (built in)");
  }
  t.origin = m.origin;
  t.reserved_bytes = m.reserved_bytes.value;
  t.device_bytes = static_cast<std::size_t>(m.capacity_bytes.value);
  t.description = m.description;
  t.attention = plan::choose_attention(attention, dtype, head_dim, m);
  t.pricer = std::make_unique<plan::GpuPricer>(std::move(m), t.attention.kernel);
  return t;
}

nlohmann::json to_json(const plan::Prediction& p, const plan::StepTrace& st, const train::JobConfig& c, const Target& t) {
  nlohmann::json j;
  j["machine"] = p.machine;
  j["machine_origin"] = t.origin;
  j["flavor"] = c.model.flavor;
  j["dtype"] = std::string(name_of(st.shape.dtype));
  j["tokens_per_step"] = st.shape.tokens;
  j["step_seconds"] = p.step_seconds;
  j["tokens_per_sec"] = p.tokens_per_sec;
  j["mfu_pct"] = p.mfu_pct;
  j["mfu_causal_pct"] = p.mfu_causal_pct;
  j["peak_flops"] = p.peak_flops;
  j["peak_memory_bytes"] = p.peak_memory_bytes;
  j["usable_memory_bytes"] = p.usable_bytes;
  j["fits"] = p.fits;
  if (!t.cpu) j["attention"] = {{"kernel", plan::attention_name(t.attention.kernel)}, {"why", t.attention.why}};
  nlohmann::json time = nlohmann::json::object();
  for (const auto& [name, ct] : p.by_class) time[name] = {{"seconds", ct.seconds}, {"count", ct.count}};
  const MemoryBreakdown& b = p.memory;
  const std::size_t temporaries = b[MemoryUse::temporary] - std::min(b.saved_activations, b[MemoryUse::temporary]);
  nlohmann::json memory = {{"parameters", b[MemoryUse::parameters]},
                           {"gradients", b[MemoryUse::gradients]},
                           {"optimizer", b[MemoryUse::optimizer]},
                           {"saved_activations", b.saved_activations},
                           {"temporaries", temporaries},
                           {"workspace", b[MemoryUse::workspace]},
                           {"reserved", t.reserved_bytes}};
  j["breakdown"] = {{"time", time}, {"memory", memory}};
  nlohmann::json top = nlohmann::json::array();
  for (const auto& o : p.top) top.push_back({{"what", o.what}, {"class", o.cls}, {"seconds", o.seconds}, {"count", o.count}});
  j["costliest"] = top;
  j["host_reads"] = p.host_reads;
  j["unpriced_kernels"] = p.unpriced_kernels;
  j["trace_seconds"] = st.seconds;
  j["operations"] = st.trace.events().size();
  return j;
}

void print(const plan::Prediction& p, const plan::StepTrace& st, const train::JobConfig& c, const Target& t) {
  const auto& a = c.model.args;
  std::printf("tessera llama-plan: %s | %lld layers, dim %lld, %lld heads (%lld kv), vocab %lld | %.2fB parameters\n",
              c.model.flavor.c_str(), static_cast<long long>(a.n_layers), static_cast<long long>(a.dim),
              static_cast<long long>(a.n_heads), static_cast<long long>(a.kv_heads()),
              static_cast<long long>(a.vocab_size), static_cast<double>(a.num_params()) / 1e9);
  std::printf("  %s, batch %lld x seq %lld = %lld tokens/step, activation checkpointing: %s | one rank on %s (%s)\n",
              std::string(name_of(st.shape.dtype)).c_str(),
              static_cast<long long>(st.shape.tokens / st.shape.seq_len), static_cast<long long>(st.shape.seq_len),
              static_cast<long long>(st.shape.tokens), c.activation_checkpoint.mode.c_str(), p.machine.c_str(),
              t.origin.c_str());
  std::size_t ops = 0;
  for (const auto& e : st.trace.events()) ops += !std::holds_alternative<trace::Memory>(e.op);
  if (!t.cpu)
    std::printf("  attention: %s\n", t.attention.why.c_str());
  std::printf("  traced in %.3f s: %zu operations, %lld host reads (each a device synchronisation)\n\n", st.seconds, ops,
              static_cast<long long>(p.host_reads));
  std::printf("step %s | %.0f tokens/s | MFU %.1f%% (causal %.1f%%) against %.1f TFLOP/s | peak %s of %s usable: %s\n\n",
              seconds_text(p.step_seconds).c_str(), p.tokens_per_sec, p.mfu_pct, p.mfu_causal_pct, p.peak_flops / 1e12,
              gib(static_cast<double>(p.peak_memory_bytes)).c_str(), gib(p.usable_bytes).c_str(),
              p.fits ? "fits" : "does NOT fit");
  std::printf("time by class\n");
  for (const auto& [name, ct] : p.by_class)
    std::printf("  %-24s %10s  %5.1f%%  (%lld)\n", name.c_str(), seconds_text(ct.seconds).c_str(),
                p.step_seconds > 0 ? 100 * ct.seconds / p.step_seconds : 0.0, static_cast<long long>(ct.count));
  const MemoryBreakdown& b = p.memory;
  const std::size_t temporaries = b[MemoryUse::temporary] - std::min(b.saved_activations, b[MemoryUse::temporary]);
  std::printf("\nmemory at the peak\n");
  std::printf("  %-24s %12s\n", "parameters", gib(static_cast<double>(b[MemoryUse::parameters])).c_str());
  std::printf("  %-24s %12s\n", "gradients", gib(static_cast<double>(b[MemoryUse::gradients])).c_str());
  std::printf("  %-24s %12s  (%s moments, fp32 masters)\n", "optimizer",
              gib(static_cast<double>(b[MemoryUse::optimizer])).c_str(), c.optimizer.state_dtype.c_str());
  std::printf("  %-24s %12s\n", "saved activations", gib(static_cast<double>(b.saved_activations)).c_str());
  std::printf("  %-24s %12s\n", "temporaries", gib(static_cast<double>(temporaries)).c_str());
  std::printf("  %-24s %12s\n", "workspace", gib(static_cast<double>(b[MemoryUse::workspace])).c_str());
  if (!t.cpu)
    std::printf("  %-24s %12s  (CUDA context, library workspaces: machine file)\n", "reserved",
                gib(t.reserved_bytes).c_str());
  std::printf("\ncostliest operations\n");
  for (const auto& o : p.top)
    std::printf("  %10s  %5.1f%%  x%-6lld %s\n", seconds_text(o.seconds).c_str(),
                p.step_seconds > 0 ? 100 * o.seconds / p.step_seconds : 0.0, static_cast<long long>(o.count),
                o.what.c_str());
  if (p.unpriced_kernels > 0)
    std::printf("\nnote: %lld launches of functors without traffic() are priced as nothing\n",
                static_cast<long long>(p.unpriced_kernels));
}

/// Until the cluster model prices a layout's communication, llama-plan plans one rank.
void check_one_device(const train::JobConfig& c) {
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
  plan::check_dry_run(c);
}

int run(std::vector<std::string> args) {
  std::string machine = "h100-sxm";
  bool json = false;
  for (std::size_t i = 0; i < args.size();) {
    if (args[i] == "--help" || args[i] == "-h") {
      usage();
      return 0;
    }
    if (args[i] == "--json") {
      json = true;
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (args[i] == "--machine") {
      TESSERA_CHECK(i + 1 < args.size() && !args[i + 1].empty() && args[i + 1].rfind("--", 0) != 0,
                    "--machine: expected a machine name or a profile FILE.toml");
      machine = args[i + 1];
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i + 2));
    } else {
      ++i;
    }
  }
  const train::JobConfig c = train::load_config("", args);
  check_one_device(c);
  // A GPU trains the bf16 model when the parameters are bf16 (llama-train's choice there).
  const bool cpu = machine == "cpu";
  const bool bf16_model = !cpu && c.training.mixed_precision_param == "bfloat16";
  // A bad machine file is refused before anything is traced; the CPU is measured on the trace.
  const DType dtype = bf16_model ? DType::bf16 : DType::f32;
  Target target;
  const std::int64_t hd = c.model.args.head_dim();
  if (!cpu) target = resolve_machine(machine, trace::Trace{}, c.training.attention, dtype, hd);
  plan::StepTrace st = llama_plan::trace_step(c, bf16_model, target.device_bytes);
  if (cpu) target = resolve_machine(machine, st.trace, c.training.attention, dtype, hd);
  const plan::Prediction p = plan::predict(st.trace, *target.pricer, st.shape, st.peak_bytes, st.at_peak);
  if (json)
    std::printf("%s\n", to_json(p, st, c, target).dump(2).c_str());
  else
    print(p, st, c, target);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama-plan: error: %s\n", e.what());
    return 1;
  }
}
