// A feature checked on layouts of the parity runs: each layout trained without it and
// with it (doctest's checks: for the test programs, not the harness's other users).
#pragma once

#include <doctest/doctest.h>

#include <span>
#include <string>
#include <vector>

#include "harness.hpp"

namespace tessera::test {

/// A layout a feature is checked on: its name, its shape, the sequences per rank and
/// micro-batch (the global batch is kParityBatch), and keys of its own.
struct NamedLayout {
  const char* name;
  comm::MeshShape shape;
  std::int64_t local;
  std::vector<std::string> keys;
};

/// For each layout, rank 0's run of `steps` steps with its keys and `base`, then the same
/// with `feature` added (every rank of each agreeing): check(without, with) compares them.
template <class Check>
void each_layout_with_and_without(std::span<const NamedLayout> layouts, const std::vector<std::string>& base,
                                  const std::vector<std::string>& feature, int steps, Check&& check) {
  for (const NamedLayout& l : layouts) {
    const std::string layout = l.name;
    CAPTURE(layout);
    const LayoutRun without = layout_run(l.shape, with(base, l.keys), l.local, steps);
    const LayoutRun with_it = layout_run(l.shape, with(with(base, l.keys), feature), l.local, steps);
    CHECK(without.ranks_agree);
    CHECK(with_it.ranks_agree);
    REQUIRE(without.rank0.losses.size() == static_cast<std::size_t>(steps));
    check(without.rank0, with_it.rank0);
  }
}

}  // namespace tessera::test
