// What a whole training run costs, from its priced step: training.steps steps, and the
// validations [validation] asks for (one every validation.freq steps and one after the
// last, each reading validation.steps global batches, or the whole set once), as the
// run's wall time, its GPU-hours, and, given a price per GPU-hour, its price. llama-plan
// prices a validation batch from its own trace (plan::dry_run_validation).
//
// Not in it: checkpoint saves (a save's cost is the storage's write rate, which no machine
// profile holds), the start-up (loading, the first step's one-time work), and a resumed
// run's steps already done (the count is training.steps, from the first).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/train/job_config.hpp"

namespace tessera::plan {

struct RunCost {
  std::int64_t steps = 0;                // training.steps
  double step_seconds = 0;               // the priced step
  std::int64_t tokens = 0;               // trained: steps x tokens a step
  int gpus = 1;
  bool validation = false;               // validation.enable
  std::int64_t validations = 0;          // passes over the run
  std::int64_t validation_batches = 0;   // global batches a pass: 0 where not priced
  double validation_batch_seconds = 0;   // one global batch, priced
  std::string validation_unpriced;       // why a validation that runs is not priced; empty where it is

  double training_seconds() const { return static_cast<double>(steps) * step_seconds; }
  double validation_seconds() const {
    return static_cast<double>(validations) * static_cast<double>(validation_batches) * validation_batch_seconds;
  }
  double seconds() const { return training_seconds() + validation_seconds(); }
  double gpu_hours() const { return gpus * seconds() / 3600; }
};

/// The validation passes of a run of `steps` steps: after every step that is a multiple of
/// `freq`, and after the last (llama-train's rule).
inline std::int64_t validation_passes(std::int64_t steps, std::int64_t freq) {
  TESSERA_CHECK(steps >= 0 && freq > 0, "validation passes: ", steps, " steps every ", freq);
  return steps / freq + (steps % freq != 0 ? 1 : 0);
}

/// The global batches one validation pass reads: validation.steps, or for -1 the whole set
/// once, its `set_tokens` cut into windows of validation.seq_len + 1 tokens, in whole
/// global batches of validation.local_batch_size x `dp` windows, at least one (as
/// train::Validator reads it).
inline std::int64_t validation_batches(const train::JobConfig& c, std::uint64_t set_tokens, int dp) {
  const auto& v = c.validation;
  if (v.steps > 0) return v.steps;
  const auto window = static_cast<std::uint64_t>(v.seq_len) + 1;
  const auto global = static_cast<std::uint64_t>(v.local_batch_size) * static_cast<std::uint64_t>(std::max(dp, 1));
  return std::max<std::int64_t>(1, static_cast<std::int64_t>(set_tokens / window / global));
}

/// The run of `c` at `step_seconds` a step of `tokens_per_step` tokens on `gpus` GPUs:
/// training alone (its validation, where enabled, is the caller's to price).
inline RunCost run_cost(const train::JobConfig& c, double step_seconds, std::int64_t tokens_per_step, int gpus) {
  TESSERA_CHECK(step_seconds >= 0 && std::isfinite(step_seconds), "run cost: a step of ", step_seconds, " s");
  RunCost r;
  r.steps = c.training.steps;
  r.step_seconds = step_seconds;
  r.tokens = c.training.steps * tokens_per_step;
  r.gpus = gpus;
  r.validation = c.validation.enable;
  if (r.validation) r.validations = validation_passes(c.training.steps, c.validation.freq);
  return r;
}

}  // namespace tessera::plan
