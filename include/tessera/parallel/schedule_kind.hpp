// The pipeline schedules tessera runs, by name: the choice a Plan carries
// (parallelism.pipeline_parallel_schedule), and where each puts its stages. What each
// schedule does is schedule.hpp's; the two whose order a file gives (PyTorch's
// PipelineScheduleSingle and PipelineScheduleMulti, with
// parallelism.pipeline_parallel_schedule_csv) are read by schedule_csv.hpp.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "tessera/core/error.hpp"

namespace tessera::parallel {

/// torchtitan's `parallelism.pipeline_parallel_schedule` values that tessera runs.
enum class ScheduleKind : std::uint8_t {
  gpipe,
  one_f_one_b,
  interleaved_1f1b,
  interleaved_zero_bubble,
  looped_bfs,
  zbv_zero_bubble,
  dual_pipe_v,
  csv_single,  ///< one stage per rank, the order read from a CSV file
  csv_multi,   ///< one or more stages per rank, the order read from a CSV file
};

/// Every schedule tessera lays out itself, in the order the help and the errors list them.
inline constexpr std::array kScheduleKinds{ScheduleKind::one_f_one_b,     ScheduleKind::interleaved_1f1b,
                                           ScheduleKind::gpipe,           ScheduleKind::interleaved_zero_bubble,
                                           ScheduleKind::looped_bfs,      ScheduleKind::zbv_zero_bubble,
                                           ScheduleKind::dual_pipe_v};

/// The schedules whose order a file gives (parallelism.pipeline_parallel_schedule_csv).
inline constexpr std::array kFileScheduleKinds{ScheduleKind::csv_single, ScheduleKind::csv_multi};

/// Whether `k` runs the order of a schedule file rather than laying out its own.
constexpr bool from_file(ScheduleKind k) { return k == ScheduleKind::csv_single || k == ScheduleKind::csv_multi; }

/// The schedule's name as torchtitan's config spells it.
constexpr const char* name_of(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::gpipe: return "GPipe";
    case ScheduleKind::one_f_one_b: return "1F1B";
    case ScheduleKind::interleaved_1f1b: return "Interleaved1F1B";
    case ScheduleKind::interleaved_zero_bubble: return "InterleavedZeroBubble";
    case ScheduleKind::looped_bfs: return "LoopedBFS";
    case ScheduleKind::zbv_zero_bubble: return "ZBVZeroBubble";
    case ScheduleKind::dual_pipe_v: return "DualPipeV";
    case ScheduleKind::csv_single: return "PipelineScheduleSingle";
    case ScheduleKind::csv_multi: return "PipelineScheduleMulti";
  }
  return "?";
}

/// "1F1B, Interleaved1F1B, GPipe, ...": the known names, for errors and help.
inline std::string schedule_names() {
  std::string out;
  auto add = [&](ScheduleKind k) {
    if (!out.empty()) out += ", ";
    out += name_of(k);
  };
  for (ScheduleKind k : kScheduleKinds) add(k);
  for (ScheduleKind k : kFileScheduleKinds) add(k);
  return out;
}

/// Parses `parallelism.pipeline_parallel_schedule` (exact spelling); throws listing the known names.
inline ScheduleKind parse_schedule_kind(std::string_view name) {
  for (ScheduleKind k : kScheduleKinds)
    if (name == name_of(k)) return k;
  for (ScheduleKind k : kFileScheduleKinds)
    if (name == name_of(k)) return k;
  fail("parallelism.pipeline_parallel_schedule: unknown schedule \"", name, "\" (known: ", schedule_names(), ")");
}

/// Whether the schedule splits backwards into backward_input and backward_weight: every
/// one (InterleavedZeroBubble, ZBVZeroBubble) or those of its warm-up and cool-down
/// (DualPipeV). A file's schedule may split some: its actions say.
constexpr bool splits_backward(ScheduleKind k) {
  return k == ScheduleKind::interleaved_zero_bubble || k == ScheduleKind::zbv_zero_bubble ||
         k == ScheduleKind::dual_pipe_v;
}

/// Stages per rank when neither the split points nor the code say: 1 for the schedules of
/// one stage per rank (GPipe, 1F1B, PipelineScheduleSingle), 2 for the others, as
/// torchtitan (a schedule file's own stage count comes first: plan.hpp).
constexpr int default_stages_per_rank(ScheduleKind k) {
  return k == ScheduleKind::gpipe || k == ScheduleKind::one_f_one_b || k == ScheduleKind::csv_single ? 1 : 2;
}

/// Where stage s of S = P x V lives (PyTorch's stage-to-rank "styles").
///   loop  rank s % P: rank r holds stages r, r + P, r + 2P, ... (every schedule but the two V ones)
///   vee   down the ranks and back up: stage s % P of an even round of P stages on rank
///         s % P, of an odd round on rank P - 1 - s % P. With V = 2 rank r holds stages r
///         and 2P - 1 - r: rank 0 the first and the last, rank P - 1 the two middle ones,
///         whose hand-over stays on the rank (ZBVZeroBubble, DualPipeV).
enum class Placement : std::uint8_t { loop, vee };

/// Where `k` puts its stages. A file's schedule (from_file) puts them where its rows say,
/// in one of the two placements (schedule_csv.hpp); loop is only its default.
constexpr Placement placement_of(ScheduleKind k) {
  return k == ScheduleKind::zbv_zero_bubble || k == ScheduleKind::dual_pipe_v ? Placement::vee : Placement::loop;
}

/// The rank holding stage `stage` of a pipeline of `ranks` ranks.
constexpr int rank_of_stage(Placement placement, int ranks, int stage) {
  const int round = stage / ranks, i = stage % ranks;
  return placement == Placement::vee && round % 2 == 1 ? ranks - 1 - i : i;
}

/// The `local`-th stage (in model order) that rank `rank` holds: its stage of round
/// `local`. A stage's local index is stage / ranks under either placement.
constexpr int stage_of_rank(Placement placement, int ranks, int rank, int local) {
  return local * ranks + (placement == Placement::vee && local % 2 == 1 ? ranks - 1 - rank : rank);
}

}  // namespace tessera::parallel
