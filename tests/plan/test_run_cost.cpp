// A whole run's cost (plan/run_cost.hpp): training.steps steps, the validation passes
// llama-train makes (every validation.freq steps and after the last), each pass's global
// batches counted as train::Validator counts them, and the GPU-hours they add up to.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/data/loader.hpp"
#include "tessera/plan/run_cost.hpp"
#include "tessera/train/config.hpp"
#include "tessera/train/validate.hpp"

namespace test_run_cost {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

train::JobConfig job(const std::vector<std::string>& keys) {
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    [training]
    steps = 1000
    seq_len = 64
    [validation]
    enable = true
    freq = 100
    local_batch_size = 4
    seq_len = 63
  )",
                             "test_run_cost", keys);
}

}  // namespace

TEST_CASE("run cost: a validation every validation.freq steps and one after the last, as llama-train runs them") {
  CHECK(plan::validation_passes(250, 10) == 25);
  CHECK(plan::validation_passes(251, 10) == 26);  // the last step's
  CHECK(plan::validation_passes(5, 10) == 1);
  CHECK(plan::validation_passes(0, 10) == 0);
  // The loop of llama-train's run, counted.
  for (const std::int64_t steps : {1, 99, 100, 101, 1000}) {
    std::int64_t n = 0;
    for (std::int64_t s = 1; s <= steps; ++s) n += (s % 100 == 0 || s == steps) ? 1 : 0;
    CAPTURE(steps);
    CHECK(plan::validation_passes(steps, 100) == n);
  }
}

TEST_CASE("run cost: validation.steps = -1 reads the whole set in whole global batches, as the Validator does") {
  const train::JobConfig c = job({});
  for (const std::uint64_t tokens : {64ull, 5000ull, 50000ull, 50111ull}) {
    for (const int dp : {1, 2, 3}) {
      CAPTURE(tokens);
      CAPTURE(dp);
      const train::Validator v(data::DataLoader(std::vector<std::uint32_t>(tokens, 1), 63, 4, 0, dp), -1, -1, "test");
      CHECK(plan::validation_batches(c, tokens, dp) == v.steps());
    }
  }
  CHECK(plan::validation_batches(c, 50000, 2) == 50000 / 64 / 8);
  CHECK(plan::validation_batches(job({"--validation.steps", "7"}), 50000, 2) == 7);
}

TEST_CASE("run cost: the steps and validations priced add up to the run, in GPU-hours over every GPU") {
  plan::RunCost r = plan::run_cost(job({"--validation.steps", "7"}), 0.5, 8192, 8);
  CHECK(r.steps == 1000);
  CHECK(r.tokens == 8192000);
  CHECK(r.validation);
  CHECK(r.validations == 10);
  CHECK(r.validation_batches == 0);  // the caller prices the batches
  r.validation_batches = 7;
  r.validation_batch_seconds = 0.1;
  CHECK(r.training_seconds() == doctest::Approx(500));
  CHECK(r.validation_seconds() == doctest::Approx(7));
  CHECK(r.seconds() == doctest::Approx(507));
  CHECK(r.gpu_hours() == doctest::Approx(8 * 507 / 3600.0));
  const plan::RunCost off = plan::run_cost(job({"--validation.enable", "false"}), 0.5, 8192, 1);
  CHECK_FALSE(off.validation);
  CHECK(off.validations == 0);
  CHECK(off.seconds() == doctest::Approx(500));
}

}  // namespace test_run_cost
