// The parity check the thread-rank parity matrices share (doctest assertions, so in a
// header of its own: harness.hpp is also built into programs without doctest).
#pragma once

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "harness.hpp"

namespace tessera::test {

/// Trains `shape` on thread ranks with `keys` (and `model_keys`, the one-rank reference's
/// too) and holds it to one rank: every rank the same, losses within 1e-5 relative at
/// every step, gradient norms within `grad_norm_bar`. `layout` names it in a failure.
inline void check_layout_parity(const std::string& layout, comm::MeshShape shape, const std::vector<std::string>& keys,
                                const std::vector<std::string>& model_keys = {}, double grad_norm_bar = 1e-4) {
  CAPTURE(layout);
  const LayoutRun run = layout_run(shape, with(keys, model_keys));
  CHECK(run.ranks_agree);
  const RunGap gap = run_gap(run.rank0, one_rank_run(model_keys));
  CHECK(gap.loss <= 1e-5);
  CHECK(gap.grad_norm <= grad_norm_bar);
  // Validation (when the keys enable it) reads the same held-out loss on every layout.
  const RunResult& reference = one_rank_run(model_keys);
  CHECK(run.rank0.validation_losses.size() == reference.validation_losses.size());
  if (!reference.validation_losses.empty())
    CHECK(max_relative_difference(run.rank0.validation_losses, reference.validation_losses) <= 1e-5);
}

}  // namespace tessera::test
