// The pipeline schedules tessera runs, by name: the choice a Plan carries
// (parallelism.pipeline_parallel_schedule). What each schedule does is schedule.hpp's.
#pragma once

#include <cstdint>
#include <string_view>

#include "tessera/core/error.hpp"

namespace tessera::parallel {

/// torchtitan's `parallelism.pipeline_parallel_schedule` values that tessera runs.
enum class ScheduleKind : std::uint8_t { gpipe, one_f_one_b, interleaved_1f1b, interleaved_zero_bubble };

/// The schedule's name as torchtitan's config spells it.
constexpr const char* name_of(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::gpipe: return "GPipe";
    case ScheduleKind::one_f_one_b: return "1F1B";
    case ScheduleKind::interleaved_1f1b: return "Interleaved1F1B";
    case ScheduleKind::interleaved_zero_bubble: return "InterleavedZeroBubble";
  }
  return "?";
}

/// Parses `parallelism.pipeline_parallel_schedule` (exact spelling); throws listing the known names.
inline ScheduleKind parse_schedule_kind(std::string_view name) {
  for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved_1f1b,
                         ScheduleKind::interleaved_zero_bubble})
    if (name == name_of(k)) return k;
  fail("parallelism.pipeline_parallel_schedule: unknown schedule \"", name,
       "\" (known: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble)");
}

/// Whether the schedule splits each backward into backward_input and backward_weight.
constexpr bool splits_backward(ScheduleKind k) { return k == ScheduleKind::interleaved_zero_bubble; }

}  // namespace tessera::parallel
