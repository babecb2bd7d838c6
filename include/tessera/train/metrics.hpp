// Step metrics: throughput, MFU by torchtitan's formula, memory; JSON lines and a live
// progress line.
//
// MFU = achieved FLOP/s / peak FLOP/s, with FLOPs per token from the model's
// flops_per_token (6 N_non-embedding + each block's attention term, 12 H hd T for the
// Llama block, no causal halving; nn::Transformer asks its block);
// mfu_causal_pct uses the causally halved attention term. The peak is
// [metrics] peak_tflops when set; otherwise, on a GPU, the datasheet's dense rate, and
// on the CPU the fastest of the step's own GEMM shapes and a 1024^3 product, each the
// median of runs at start-up (plan/cpu.hpp, measure_gemms: the ceiling this machine's
// GEMMs reach, which the step, doing more than GEMMs, cannot).
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/units.hpp"
#include "tessera/train/tensorboard.hpp"

namespace tessera::train {

struct StepMetrics {
  std::int64_t step = 0;
  double loss = 0;
  double grad_norm = 0;
  double lr = 0;
  std::int64_t tokens = 0;  // tokens this step, all data-parallel ranks
  double step_seconds = 0;
  double tokens_per_sec = 0;
  double mfu_pct = 0;
  double mfu_causal_pct = 0;
  std::size_t peak_memory_bytes = 0;
  // The first step a process runs: the device memory in use after the model's
  // initialisation, before the optimizer's state (Trainer).
  std::optional<std::size_t> memory_after_init_bytes;
  std::size_t activation_bytes = 0;
  std::uint64_t comm_bytes = 0;  // bytes this rank sent in collectives this step
  std::uint64_t peer_bytes = 0;  // of them, sent by point-to-point transfers (comm::Traffic::send)
  double checkpoint_seconds = 0;  // what a checkpoint save after the step held it (async: the copy only)
  // [validation], after the steps it ran at: the held-out loss and its counted targets.
  std::optional<double> validation_loss;
  std::int64_t validation_tokens = 0;

  nlohmann::json to_json() const {
    nlohmann::json j = {{"step", step},
            {"loss", loss},
            {"grad_norm", grad_norm},
            {"lr", lr},
            {"tokens", tokens},
            {"step_seconds", step_seconds},
            {"tokens_per_sec", tokens_per_sec},
            {"mfu_pct", mfu_pct},
            {"mfu_causal_pct", mfu_causal_pct},
            {"peak_memory_bytes", peak_memory_bytes},
            {"activation_bytes", activation_bytes},
            {"comm_bytes", comm_bytes},
            {"checkpoint_seconds", checkpoint_seconds}};
    if (memory_after_init_bytes) j["memory_after_init_bytes"] = *memory_after_init_bytes;
    if (validation_loss) {
      j["validation_loss"] = *validation_loss;
      j["validation_tokens"] = validation_tokens;
    }
    return j;
  }
};

/// The FLOP rate of B's GEMM on an (n, n) x (n, n) product, best of a few runs.
template <Backend B>
double measure_gemm_flops(std::int64_t n = 1024, int repeats = 8) {
  Tensor<float> a(Shape{n, n}), b(Shape{n, n}), c(Shape{n, n});
  for (std::int64_t i = 0; i < a.numel(); ++i) a[i] = b[i] = static_cast<float>(i % 13) * 0.01f;
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    B::gemm(Trans::no, Trans::no, 1.0f, a.cview(), b.cview(), 0.0f, c.view());
    B::synchronize();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * static_cast<double>(n * n * n) / s);  // run 0 warms up
  }
  return best;
}

/// Writes one JSON object per step to <dump_folder>/metrics.jsonl and prints progress.
/// A run resumed after step `resumed_step` keeps the file's lines of steps up to it
/// (and drops any later ones, which the resumed run writes again) and appends: across
/// any number of resumes the file holds each step once, in order. With `tensorboard_dir`
/// the same numbers go to TensorBoard event files there too, one tag per key
/// (train/tensorboard.hpp: a resumed run's file makes TensorBoard drop the steps it
/// writes again).
class MetricsLogger {
 public:
  MetricsLogger(const std::string& path, std::int64_t total_steps, std::int64_t log_freq, bool live,
                std::int64_t resumed_step = 0, const std::string& tensorboard_dir = "")
      : path_(path),
        total_steps_(total_steps),
        log_freq_(log_freq),
        live_(live),
        first_step_(resumed_step),
        start_(clock::now()) {
    namespace fs = std::filesystem;
    fs::create_directories(fs::path(path).parent_path());
    if (resumed_step > 0) keep_steps_up_to(resumed_step);
    out_.open(path, std::ios::out | (resumed_step > 0 ? std::ios::app : std::ios::trunc));
    TESSERA_CHECK(out_.good(), path, ": cannot open for writing");
    if (!tensorboard_dir.empty()) tensorboard_.emplace(tensorboard_dir, resumed_step > 0 ? resumed_step : -1);
  }

  void log(const StepMetrics& m) {
    const nlohmann::json j = m.to_json();
    out_ << j.dump() << '\n';
    out_.flush();
    TESSERA_CHECK(out_.good(), path_, ": write failed");
    if (tensorboard_) {
      std::vector<std::pair<std::string, double>> scalars;
      for (const auto& [key, value] : j.items())
        if (key != "step") scalars.emplace_back(key, value.get<double>());
      const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
      tensorboard_->add_scalars(m.step, scalars, now);
    }
    const double elapsed = std::chrono::duration<double>(clock::now() - start_).count();
    // From this run's own steps: a resumed run's ETA does not count the steps it skipped.
    const double done = static_cast<double>(std::max<std::int64_t>(1, m.step - first_step_));
    const double left = elapsed / done * static_cast<double>(total_steps_ - m.step);
    char line[320];
    std::snprintf(line, sizeof line, "step %5lld/%lld | loss %7.4f | grad_norm %6.3f | lr %.2e | %9.0f tok/s | mfu %5.2f%% | mem %s | left %s",
                  static_cast<long long>(m.step), static_cast<long long>(total_steps_), m.loss, m.grad_norm, m.lr,
                  m.tokens_per_sec, m.mfu_pct, memory_bytes(static_cast<double>(m.peak_memory_bytes)).c_str(),
                  duration_text(left).c_str());
    if (m.validation_loss) {
      const std::size_t used = std::strlen(line);
      std::snprintf(line + used, sizeof line - used, " | validation loss %7.4f", *m.validation_loss);
    }
    const bool milestone =
        m.step % log_freq_ == 0 || m.step == 1 || m.step == total_steps_ || m.validation_loss.has_value();
    if (live_) {
      std::fprintf(stderr, "\r\033[2K%s", line);
      if (milestone) std::fprintf(stderr, "\n");
    } else if (milestone) {
      std::fprintf(stderr, "%s\n", line);
    }
    std::fflush(stderr);
  }

 private:
  using clock = std::chrono::steady_clock;

  /// Rewrites the file with its lines of steps 1..`last` only (a line cut short by a
  /// kill is dropped), to a temporary name renamed over it.
  void keep_steps_up_to(std::int64_t last) {
    std::ifstream in(path_);
    if (!in) return;  // a resume without metrics: they start at the next step
    std::string kept, line;
    std::int64_t expected = 1;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
      const auto step = j["step"].get<std::int64_t>();
      if (step > last || step != expected) continue;  // beyond the resume, or a step written twice
      kept += line + '\n';
      ++expected;
    }
    in.close();
    const std::string tmp = path_ + ".tmp";
    {
      std::ofstream out(tmp, std::ios::out | std::ios::trunc);
      out << kept;
      out.flush();
      TESSERA_CHECK(out.good(), tmp, ": cannot write");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path_, ec);
    TESSERA_CHECK(!ec, path_, ": cannot replace: ", ec.message());
  }

  std::string path_;
  std::ofstream out_;
  std::int64_t total_steps_, log_freq_;
  bool live_;
  std::int64_t first_step_;
  std::optional<TensorBoardWriter> tensorboard_;
  clock::time_point start_;
};

}  // namespace tessera::train
