// bench-plan-calibration: llama-plan's CPU prediction against llama-train's CPU step.
//
// For each shape, in one run: the prediction (the step traced on the dry-run backend,
// this machine's CPU measured on the trace's own GEMMs, attention calls and kernels, the
// trace priced: plan/dry_run.hpp, plan/cpu.hpp, plan/cost.hpp), then the measurement (the
// same model type and Trainer llama-train runs, DynamicModel<float, Cpu>, on token
// windows; the tracked peak of the CPU backend's memory from the model's construction on).
// The speed of a shared 2-core machine drifts by tens of percent over a minute, so the two
// alternate: --rounds times, the CPU is measured and the trace priced, then --steps steps
// are timed; predicted and measured tokens/s are each the median over the rounds (the
// measured one over every timed step). It prints predicted / measured for tokens/s and for
// the memory peak, against the targets (tokens/s within 15%, peak within 5%), and the
// machine, the date and --commit.
//
//   debug-8x128    the debug model (dim 256, 6 layers, 16 heads, vocab 1024), batch 8 x seq 128
//   debug-4x1024   the same model, batch 4 x seq 1024 (attention a larger share)
//   80m-4x512      dim 768, 11 layers, 12 heads, vocab 1024 (79.4M parameters), batch 4 x seq 512
//
// Targets are reported as PASS/MISS; the exit status is non-zero only on an error.
// --markdown adds the table bench/RESULTS.md holds.
// --shapes picks some (comma-separated); the suite's smoke test runs debug-8x128 for one
// round of one step, which proves the benchmark runs, not that the targets hold.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "machine.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/units.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/instances.hpp"
#include "tessera/plan/cost.hpp"
#include "tessera/plan/cpu.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/dynamic_model.hpp"
#include "tessera/train/trainer.hpp"

using namespace tessera;

namespace {

struct Shape {
  const char* name;
  const char* description;
  std::vector<std::string> keys;  // llama-train's command-line keys
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> all = {
      {"debug-8x128", "debug model, batch 8 x seq 128", {"--training.local_batch_size", "8", "--training.seq_len", "128"}},
      {"debug-4x1024", "debug model, batch 4 x seq 1024",
       {"--training.local_batch_size", "4", "--training.seq_len", "1024"}},
      {"80m-4x512", "dim 768, 11 layers, 12 heads, batch 4 x seq 512",
       {"--model.dim", "768", "--model.n_layers", "11", "--model.n_heads", "12", "--training.local_batch_size", "4",
        "--training.seq_len", "512"}},
  };
  return all;
}

/// The config of a shape: the debug model in float32, no clipping changes, metrics off.
train::JobConfig config_of(const Shape& s) {
  std::vector<std::string> keys = s.keys;
  for (const char* k : {"--model.flavor", "debugmodel", "--model.vocab_size", "1024", "--training.mixed_precision_param",
                        "float32", "--training.max_norm", "1.0"})
    keys.emplace_back(k);
  return train::parse_config("", "bench-plan-calibration", keys);
}

struct Calibration {
  double predicted_tokens_per_sec = 0, measured_tokens_per_sec = 0;
  std::size_t predicted_peak = 0, measured_peak = 0;
  plan::Prediction last;  // the last round's prediction (its breakdown)
  double measuring_seconds = 0;  // the last round's measure_cpu
};

/// Predicts and measures llama-train's CPU step on config `c`: `warmup` untimed steps,
/// then `rounds` of (the CPU measured on the trace and the trace priced; `steps` steps
/// timed).
Calibration calibrate(const train::JobConfig& c, std::int64_t warmup, std::int64_t rounds, std::int64_t steps) {
  Calibration out;
  const plan::StepTrace st = plan::dry_run_step<float>(c);
  out.predicted_peak = st.peak_bytes;

  using Model = DynamicModel<float, Cpu>;
  MemoryStats stats[kDeviceKinds];
  ScopedMemoryStats scope(stats);
  Model model(c.model.args, train::make_plan(c, nullptr));
  model.init_weights(c.training.seed);
  const std::int64_t local = c.training.local_batch_size, seq = c.training.seq_len;
  // Enough windows for every step; ids spread over the vocabulary (the values do not
  // change the step's work).
  std::vector<std::uint32_t> tokens(static_cast<std::size_t>((warmup + rounds * steps + 1) * local * (seq + 1)));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<std::uint32_t>((i * 2654435761u) % static_cast<std::uint64_t>(c.model.args.vocab_size));
  data::DataLoader loader(std::move(tokens), seq, local, 0, 1);
  train::Trainer<Model> trainer(model, train::trainer_options(c), std::move(loader));
  for (std::int64_t i = 0; i < warmup; ++i) trainer.step();
  std::vector<double> predicted, seconds;
  for (std::int64_t r = 0; r < rounds; ++r) {
    {
      MemoryStats own[kDeviceKinds];  // the measurement's operands stay out of the run's peak
      ScopedMemoryStats measuring(own);
      const plan::CpuPricer pricer(plan::measure_cpu(st.trace));
      out.last = plan::predict(st.trace, pricer, st.shape, st.peak_bytes, st.at_peak);
      out.measuring_seconds = pricer.profile().seconds;
    }
    predicted.push_back(out.last.tokens_per_sec);
    for (std::int64_t i = 0; i < steps; ++i) seconds.push_back(trainer.step().step_seconds);
  }
  out.predicted_tokens_per_sec = bench::median(predicted);
  out.measured_tokens_per_sec = static_cast<double>(local * seq) / bench::median(seconds);
  out.measured_peak = stats[static_cast<int>(Device::cpu)].peak();
  return out;
}

const char* verdict(double ratio, double tolerance) { return std::fabs(ratio - 1) <= tolerance ? "PASS" : "MISS"; }

int run(const std::vector<std::string_view>& args) {
  std::int64_t warmup = 1, rounds = 3, steps = 3;
  bool markdown = false;
  std::string commit = "unknown";
  std::vector<const Shape*> chosen;
  for (bench::Flags f(args); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--warmup") warmup = bench::parse_count(flag, f.value(), 0);
    else if (flag == "--steps") steps = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--rounds") rounds = bench::parse_count(flag, f.value(), 1);
    else if (flag == "--commit") commit = std::string(f.value());
    else if (flag == "--markdown") markdown = true;
    else if (flag == "--shapes") {
      for (const std::string_view name : bench::split_commas(f.value())) {
        const Shape* found = nullptr;
        for (const Shape& s : shapes())
          if (s.name == name) found = &s;
        TESSERA_CHECK(found != nullptr, "--shapes: unknown shape '", name,
                      "' (known: debug-8x128, debug-4x1024, 80m-4x512)");
        chosen.push_back(found);
      }
    } else {
      f.unknown("options: --shapes debug-8x128,debug-4x1024,80m-4x512 --warmup N --rounds N --steps N --commit SHA --markdown");
    }
  }
  if (chosen.empty())
    for (const Shape& s : shapes()) chosen.push_back(&s);

  std::printf("bench-plan-calibration: llama-plan's CPU prediction against llama-train's CPU step\n");
  std::printf("machine: %s, %ld cores, %d OpenMP threads, OpenBLAS %s kernels | %s | commit %s\n",
              bench::cpuinfo_field("model name").c_str(), sysconf(_SC_NPROCESSORS_ONLN), Cpu::threads(),
              Cpu::blas_kernels(), bench::utc_date().c_str(), commit.c_str());
  std::printf("%lld rounds of (the CPU measured and the trace priced; %lld steps timed) after %lld untimed steps: "
              "the medians\n\n",
              static_cast<long long>(rounds), static_cast<long long>(steps), static_cast<long long>(warmup));
  std::printf("%-13s %7s | %10s %10s %6s %4s | %11s %11s %6s %4s | %s\n", "shape", "params", "pred tok/s",
              "meas tok/s", "ratio", "", "pred peak", "meas peak", "ratio", "", "measuring the CPU");
  std::vector<std::string> rows;  // the --markdown table's
  for (const Shape* s : chosen) {
    const train::JobConfig c = config_of(*s);
    const Calibration k = calibrate(c, warmup, rounds, steps);
    const double speed = k.predicted_tokens_per_sec / k.measured_tokens_per_sec;
    const double memory = static_cast<double>(k.predicted_peak) / static_cast<double>(k.measured_peak);
    std::printf("%-13s %6.1fM | %10.0f %10.0f %6.3f %4s | %11s %11s %6.4f %4s | %.2f s\n", s->name,
                static_cast<double>(c.model.args.num_params()) / 1e6, k.predicted_tokens_per_sec,
                k.measured_tokens_per_sec, speed, verdict(speed, 0.15),
                mebibytes(static_cast<double>(k.predicted_peak)).c_str(),
                mebibytes(static_cast<double>(k.measured_peak)).c_str(), memory, verdict(memory, 0.05),
                k.measuring_seconds);
    const plan::Prediction& p = k.last;
    char row[512];
    std::snprintf(row, sizeof row, "| %s | %.1fM | %.0f | %.0f | %.3f (%s) | %s | %s | %.4f (%s) |", s->name,
                  static_cast<double>(c.model.args.num_params()) / 1e6, k.predicted_tokens_per_sec,
                  k.measured_tokens_per_sec, speed, verdict(speed, 0.15),
                  mebibytes(static_cast<double>(k.predicted_peak)).c_str(),
                  mebibytes(static_cast<double>(k.measured_peak)).c_str(), memory, verdict(memory, 0.05));
    rows.emplace_back(row);
    std::printf("  %s; predicted step %.4f s:", s->description, p.step_seconds);
    for (const auto& [name, t] : p.by_class)
      if (t.seconds > 0) std::printf(" %s %.1f%%", name.c_str(), 100 * t.seconds / p.step_seconds);
    std::printf("\n");
    std::fflush(stdout);
  }
  std::printf("\ntargets: tokens/s within 15%%, peak memory within 5%%\n");
  if (markdown) {
    std::printf("\n%s, %s, %d OpenMP threads, OpenBLAS %s kernels, commit `%s`:\n\n", bench::utc_date().c_str(),
                bench::cpuinfo_field("model name").c_str(), Cpu::threads(), Cpu::blas_kernels(), commit.c_str());
    std::printf("| shape | parameters | predicted tokens/s | measured tokens/s | predicted / measured | predicted peak "
                "| measured peak | predicted / measured |\n|---|---|---|---|---|---|---|---|\n");
    for (const std::string& r : rows) std::printf("%s\n", r.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string_view>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-plan-calibration: error: %s\n", e.what());
    return 1;
  }
}
