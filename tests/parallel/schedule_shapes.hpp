// What the schedule tests share: every schedule kind, and whether a shape is one it runs.
#pragma once

#include "tessera/core/error.hpp"
#include "tessera/parallel/schedule.hpp"

namespace tessera::test {

inline constexpr auto kAllScheduleKinds = parallel::kScheduleKinds;

/// Whether check_schedule_shape accepts P ranks x V stages each with M microbatches.
inline bool schedule_fits(parallel::ScheduleKind k, int P, int V, int M) {
  try {
    parallel::check_schedule_shape(k, P, V, M);
    return true;
  } catch (const Error&) {
    return false;
  }
}

}  // namespace tessera::test
