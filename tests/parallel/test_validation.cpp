// [validation] under every layout: the held-out loss a layout reads is one rank's.
//
// Each layout trains the parity model with validation every 2 steps (and after the
// last), two global batches of held-out documents each time, and must read the same
// validation losses as one rank (1e-5, as the training losses) on every rank: the
// sharded units gathered, the tensor-parallel loss, the pipeline's forward-only pass and
// the context-parallel ring all give the loss a whole model gives.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "harness.hpp"
#include "parity_checks.hpp"

namespace test_validation {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::test;

namespace {

const std::vector<std::string> kValidation = {"--validation.enable", "true", "--validation.freq", "2",
                                              "--validation.steps", "2"};

struct Layout {
  const char* name;
  comm::MeshShape shape;
  std::vector<std::string> keys;
};

}  // namespace

TEST_CASE("validation: one rank reads the mean loss of the held-out windows") {
  const RunResult& r = one_rank_run(kValidation);
  // Every 2 of kParitySteps steps, and after the last.
  CHECK(r.validation_losses.size() == static_cast<std::size_t>((kParitySteps + 1) / 2));
  for (double l : r.validation_losses) CHECK(l > 0);
  // Training lowers the held-out loss too.
  CHECK(r.validation_losses.back() < r.validation_losses.front());
}

TEST_CASE("validation: every layout reads one rank's validation losses") {
  const std::vector<Layout> layouts = {
      {"FSDP 2", comm::MeshShape{1, 1, 2, 1}, {"--parallelism.data_parallel_shard_degree", "2"}},
      {"HSDP 2 x 2", comm::MeshShape{1, 2, 2, 1},
       {"--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"}},
      {"TP 2", comm::MeshShape{1, 1, 1, 2},
       {"--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"}},
      {"PP 2 (1F1B)", comm::MeshShape{2, 1, 1, 1},
       {"--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"}},
      {"PP 2 (Interleaved1F1B)", comm::MeshShape{2, 1, 1, 1},
       {"--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"}},
      {"PP 2 x TP 2", comm::MeshShape{2, 1, 1, 2},
       {"--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.tensor_parallel_degree", "2"}},
      {"CP 2", comm::MeshShape{1, 1, 1, 1, 2},
       {"--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"}},
      {"TP 2 x FSDP 2", comm::MeshShape{1, 1, 2, 2},
       {"--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"}},
  };
  for (const Layout& l : layouts) check_layout_parity(l.name, l.shape, l.keys, kValidation);
}

TEST_CASE("validation: a missing validation file is refused by name, on every rank") {
  const std::vector<std::string> keys = {"--validation.enable", "true", "--validation.dataset", "shard",
                                         "--validation.dataset_path", "/nonexistent/val.bin"};
  CHECK_ERROR_CONTAINS(debug_job(8, 8, 1, {"--validation.enable", "true", "--validation.dataset", "shard"}),
                       "validation.dataset_path is required when validation.dataset = \"shard\"");
  for (const std::string& e : layout_errors(comm::MeshShape{1, 1, 2, 1},
                                            with(keys, {"--parallelism.data_parallel_shard_degree", "2"})))
    CHECK(e.find("/nonexistent/val.bin") != std::string::npos);
}

}  // namespace test_validation
