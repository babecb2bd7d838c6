// The structured log: the spans the library opens, under torchtitan's event names, a line
// as each starts and ends, an exception's unwinding as _error, and nothing for the spans
// it does not take.
#include <doctest/doctest.h>

#include "../support/temp_dir.hpp"

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/profile.hpp"
#include "tessera/core/region.hpp"
#include "tessera/train/rank_log.hpp"

namespace test_rank_log {  // unity build: this file's names stay in here (tests/meson.build)

TEST_CASE("the structured log: the coarse spans under torchtitan's names, an unwound one as _error") {
  tessera::test::TempDir dir("tessera-rank-log");
  {
    tessera::train::RankLog log(dir.path / "structured_logs", 3);
    const tessera::profile::PhaseLogging on(&log);
    log.set_step(7);
    log.instant("training_start");
    {
      const tessera::profile::Span step("step", [] { return std::string("step 7"); });
      { const tessera::profile::Span data("step", "data"); }
      {
        const tessera::profile::Span micro("step", [] { return std::string("micro-batch 0"); });
        const tessera::profile::Span layer("layer", [] { return std::string("layers.0 forward"); });  // not taken
        const tessera::Region recompute(tessera::region::kRecompute);                                 // not taken
      }
      const tessera::Region optimizer(tessera::region::kOptimizer);
    }
    try {
      const tessera::profile::Span save("step", "checkpoint");
      throw std::runtime_error("disk full");
    } catch (const std::runtime_error&) {
    }
  }
  // Off this thread's sink, spans log nothing.
  { const tessera::profile::Span step("step", "step 8"); }

  std::ifstream in(dir.path / "structured_logs" / "rank_3.jsonl");
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    CHECK(j["rank"] == 3);
    CHECK(j["source"] == "training");
    CHECK(j.contains("host_name"));
    CHECK(j.contains("time_us"));
    std::string name = j["log_type_name"];
    if (name.ends_with("_end") || name.ends_with("_error")) {
      CHECK(j["value"].get<double>() >= 0);
    } else {
      CHECK_FALSE(j.contains("value"));
    }
    if (name != "structured_logger_started") CHECK(j["step"] == 7);
    names.push_back(name);
  }
  CHECK(names == std::vector<std::string>{"structured_logger_started", "training_start", "step_start",
                                          "fetching_batch_start", "fetching_batch_end", "fwd_bwd_start", "fwd_bwd_end",
                                          "optim_start", "optim_end", "step_end", "checkpoint_save_start",
                                          "checkpoint_save_error"});
}

}  // namespace test_rank_log
