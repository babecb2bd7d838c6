// Pipeline schedules as pure logic: what each pipeline rank computes, and in which order.
//
// P ranks hold S = P x V stages, V stages per rank ("virtual stages"); stage s lives on
// rank s % P (the looping placement of torchtitan and PyTorch), or, for ZBVZeroBubble
// and DualPipeV, down the ranks and back up (the V placement: rank r holds stages r and
// 2P-1-r; schedule_kind.hpp). Each of the M
// microbatches passes forward through stages 0 .. S-1 and backward through S-1 .. 0.
// Stage 0's forward takes the input tokens; stage S-1's forward computes the loss, so its
// backward can start as soon as its own forward is done. A schedule is, for each rank, an
// ordered list of actions (op, stage, microbatch). A forward takes its stage's input from
// the previous stage's rank and a backward its output gradient from the next stage's
// rank; pipeline_program.hpp lowers the lists to the transfers that move them (untagged,
// grouped, safe when a send waits for its receiver, as NCCL's do) and
// pipeline_runner.hpp runs them. This header holds no communication and no tensors: it
// decides the order of the computes, checks it and measures it.
//
//   GPipe                  every forward, then every backward (microbatch order).
//   1F1B                   rank r runs P-1-r forwards (warm-up), then one forward and one
//                          backward in turn, then the remaining backwards (cool-down).
//   Interleaved1F1B        1F1B over V >= 2 stages per rank, in the depth-first order of
//                          Narayanan et al. 2021: microbatches in rounds of P, a round
//                          through the rank's first stage, then its second, ...; warm-up
//                          (V-1) P + 2 (P-1-r) forwards.
//   InterleavedZeroBubble  the backward split into I (input gradient, which the previous
//                          stage waits for) and W (weight gradient, which nothing waits
//                          for): rank r runs I where 1F1B runs B and delays each W by r
//                          backwards, so the W's fill the cool-down bubble (ZB-H1 of Qi et
//                          al. 2023 for V = 1; its interleaved form, as PyTorch's
//                          ScheduleInterleavedZeroBubble, for V >= 2, warm-up
//                          (V-1) P + (P-1-r)).
//   LoopedBFS              breadth first over V >= 1 stages per rank (Lamy-Poirier 2022):
//                          every microbatch forward through the rank's first stage, then
//                          its second, ...; then every backward, last stage first and
//                          the last microbatch first. GPipe's order, stage by stage.
//   ZBVZeroBubble          the V-shaped zero-bubble schedule (ZB-V, Qi et al. 2023,
//                          section 6): two stages per rank in the V placement, split
//                          backwards; a microbatch turns round on rank P-1 and its
//                          backward begins at once on rank 0, so warm-up and cool-down
//                          are filled with the other chunk's work and weight gradients.
//                          With F = I = W the bubble is about (P-1) F against 1F1B's
//                          (P-1)(F+B), at 1F1B's peak activations.
//   DualPipeV              DeepSeek's DualPipe folded into the V placement (as PyTorch's
//                          ScheduleDualPipeV), M >= 2P: the steady state pairs a forward
//                          of one chunk with a whole backward of the other (PyTorch
//                          overlaps the pair; here they run one after the other), and
//                          only the warm-up and cool-down split backwards, the weight
//                          gradients filling the tail.
//
// simulate() executes the lists against the data dependencies with given op costs
// (sends buffered, a producer never waiting for its consumer: it judges the order of
// the computes; check_program in pipeline_program.hpp judges the transfers) and reports
// completion or the deadlock, the makespan, each rank's busy time, the bubble fraction
// and each rank's peak number of stage activations held. docs/pipeline.md shows every schedule's timeline.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/schedule_kind.hpp"
#include "tessera/parallel/wording.hpp"

namespace tessera::parallel {

/// What one action computes.
enum class Op : std::uint8_t {
  forward,
  backward,         ///< the whole backward: input and weight gradients
  backward_input,   ///< the input gradient only (sent to the previous stage)
  backward_weight,  ///< the weight gradient only (needs that microbatch's backward_input)
};

/// One step of a rank's list: `op` on `stage` for `microbatch`.
struct Action {
  Op op = Op::forward;
  int stage = 0;
  int microbatch = 0;
  friend bool operator==(const Action&, const Action&) = default;
};

/// The actions of every pipeline rank, in the order each rank runs them.
struct Schedule {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int ranks = 1;            ///< P: the pipeline degree
  int stages_per_rank = 1;  ///< V
  int microbatches = 1;     ///< M
  std::vector<std::vector<Action>> per_rank;  ///< per_rank[r]: rank r's actions in order
  /// Where the stages live: placement_of(kind) (the V placement for ZBVZeroBubble and
  /// DualPipeV, the looping one otherwise), or where a schedule file's rows put them.
  Placement stage_placement = Placement::loop;

  /// S = P x V.
  [[nodiscard]] int stages() const { return ranks * stages_per_rank; }
  [[nodiscard]] Placement placement() const { return stage_placement; }
  /// The rank holding `stage`.
  [[nodiscard]] int rank_of(int stage) const { return rank_of_stage(placement(), ranks, stage); }
  /// The stages `rank` holds, in model order (rank, rank + P, ... with the looping placement).
  [[nodiscard]] std::vector<int> stages_of(int rank) const {
    std::vector<int> s;
    for (int v = 0; v < stages_per_rank; ++v) s.push_back(stage_of_rank(placement(), ranks, rank, v));
    return s;
  }
};

/// The fewest microbatches `kind` runs on `ranks` ranks: P for the 1F1B family (PyTorch's
/// requirement for 1F1B; the interleaved schedules also need a multiple of P), 1 for
/// GPipe, LoopedBFS and ZBVZeroBubble (which needs 2P - 1 to fill its pipeline, and runs
/// fewer as the same order with the missing microbatches left out, as PyTorch does), 2P
/// (one per stage) for DualPipeV, as PyTorch.
constexpr int min_microbatches(ScheduleKind k, int ranks) {
  if (from_file(k)) return 1;  // the file's own count (schedule_csv.hpp)
  if (k == ScheduleKind::gpipe || k == ScheduleKind::looped_bfs || k == ScheduleKind::zbv_zero_bubble) return 1;
  return k == ScheduleKind::dual_pipe_v ? 2 * ranks : ranks;
}

/// Checks that `kind` can run `microbatches` microbatches with `ranks` x `stages_per_rank`
/// stages; throws naming the settings (by config key, unless `wording` says the values
/// were set in code), the schedule and the numbers.
///   GPipe, 1F1B: one stage per rank; 1F1B needs M >= P.
///   Interleaved1F1B: V >= 2 (with V = 1 it is 1F1B), M >= P and M a multiple of P.
///   InterleavedZeroBubble: V >= 1, M >= P; for V >= 2 also M a multiple of P.
///   LoopedBFS: V >= 1, M >= 1.
///   ZBVZeroBubble: V = 2 (its V placement), M >= 1.
///   DualPipeV: V = 2 (the V placement), M >= 2P.
///   PipelineScheduleSingle: V = 1; PipelineScheduleMulti: V >= 1 (with either, what the
///   file's rows hold is schedule_csv.hpp's to check).
/// The multiple-of-P rule is Narayanan et al.'s, stricter than PyTorch, which also accepts
/// M when floor(M / P) divides M (rounds of more than P microbatches).
inline void check_schedule_shape(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches,
                                 Wording wording = config_keys) {
  const char* name = name_of(kind);
  const std::string_view mb = wording(settings::microbatch_size);
  TESSERA_CHECK(ranks >= 1, wording(settings::pipeline_parallel_degree), ": must be at least 1, got ", ranks);
  TESSERA_CHECK(stages_per_rank >= 1, "pipeline schedule ", name, ": stages per rank must be at least 1, got ",
                stages_per_rank);
  TESSERA_CHECK(microbatches >= 1, mb, ": schedule ", name, " needs at least 1 microbatch, got ", microbatches);
  if (kind == ScheduleKind::gpipe || kind == ScheduleKind::one_f_one_b || kind == ScheduleKind::csv_single)
    TESSERA_CHECK(stages_per_rank == 1, wording(settings::schedule), ": ", name, " runs one stage per rank, got ",
                  stages_per_rank, " stages per rank (Interleaved1F1B, InterleavedZeroBubble, LoopedBFS or "
                  "PipelineScheduleMulti run several)");
  if (kind == ScheduleKind::interleaved_1f1b)
    TESSERA_CHECK(stages_per_rank >= 2, wording(settings::schedule),
                  ": Interleaved1F1B needs at least 2 stages per rank, got ", stages_per_rank,
                  " (with one stage per rank use 1F1B)");
  if (placement_of(kind) == Placement::vee)
    TESSERA_CHECK(stages_per_rank == 2, wording(settings::schedule), ": ", name,
                  " runs exactly 2 stages per rank (down the ranks and back up), got ", stages_per_rank);
  const int least = min_microbatches(kind, ranks);
  TESSERA_CHECK(microbatches >= least, mb, ": schedule ", name, " on ", ranks, " ranks needs at least ", least,
                " microbatches, got ", microbatches, " (microbatches = ", wording(settings::local_batch_size), " / ",
                mb, ")");
  if (stages_per_rank >= 2 &&
      (kind == ScheduleKind::interleaved_1f1b || kind == ScheduleKind::interleaved_zero_bubble))
    TESSERA_CHECK(microbatches % ranks == 0, mb, ": schedule ", name, " with ", stages_per_rank,
                  " stages per rank needs a microbatch count that is a multiple of the ", ranks, " ranks, got ",
                  microbatches, " (microbatches = ", wording(settings::local_batch_size), " / ", mb, ")");
}

namespace detail {

/// Rank `rank`'s list for the 1F1B family. The k-th forward (backward) of the rank is
/// microbatch round * P + k % P of its chunk (k / P) % V (counted from the last chunk for
/// backwards), round = k / (P V): rounds of P microbatches, depth first. With V = 1 the
/// k-th forward is microbatch k. `warmup` forwards come first; then one forward and one
/// backward in turn; then the remaining backwards. With `split`, each backward is
/// backward_input, and the weight gradient of the backward `w_delay` backwards earlier
/// follows it; the weight gradients still owed close the list.
inline std::vector<Action> one_f_one_b_family(int P, int V, int M, int rank, int warmup, bool split, int w_delay) {
  const int total = V * M;
  auto item = [&](int k, bool backward) {
    const int chunk = (k / P) % V;
    const int local = backward ? V - 1 - chunk : chunk;
    return std::pair{local * P + rank, (k / (P * V)) * P + k % P};
  };
  std::vector<Action> out;
  out.reserve(static_cast<std::size_t>(total * (split ? 3 : 2)));
  auto forward = [&](int k) {
    const auto [s, m] = item(k, false);
    out.push_back({Op::forward, s, m});
  };
  auto backward = [&](int k) {
    const auto [s, m] = item(k, true);
    out.push_back({split ? Op::backward_input : Op::backward, s, m});
    if (split && k >= w_delay) {
      const auto [ws, wm] = item(k - w_delay, true);
      out.push_back({Op::backward_weight, ws, wm});
    }
  };
  for (int k = 0; k < warmup; ++k) forward(k);
  for (int i = 0; i < total - warmup; ++i) {
    forward(warmup + i);
    backward(i);
  }
  for (int i = total - warmup; i < total; ++i) backward(i);
  if (split)
    for (int k = std::max(0, total - w_delay); k < total; ++k) {
      const auto [ws, wm] = item(k, true);
      out.push_back({Op::backward_weight, ws, wm});
    }
  return out;
}

/// LoopedBFS on rank `rank`: every microbatch forward through each of the rank's stages
/// in model order, then every backward, the last stage and the last microbatch first
/// (PyTorch's ScheduleLoopedBFS).
inline std::vector<Action> looped_bfs(int P, int V, int M, int rank) {
  std::vector<Action> out;
  out.reserve(static_cast<std::size_t>(2 * V * M));
  for (int v = 0; v < V; ++v)
    for (int m = 0; m < M; ++m) out.push_back({Op::forward, stage_of_rank(Placement::loop, P, rank, v), m});
  for (int v = V; v-- > 0;)
    for (int m = M; m-- > 0;) out.push_back({Op::backward, stage_of_rank(Placement::loop, P, rank, v), m});
  return out;
}

/// ZBVZeroBubble on rank `rank` (ZB-V, Qi et al. 2023, section 6, in PyTorch's phases):
/// chunk 0 is stage r (going down the ranks), chunk 1 stage 2P-1-r (coming back up). Laid
/// out for N = max(M, 2P - 1) microbatches, the fewest that fill the V, then the
/// microbatches past M dropped (the order of the rest kept):
///   1. 2(P-r) - 1 forwards of chunk 0;
///   2. r times: a forward of chunk 1, a forward of chunk 0;
///   3. P-r times: a forward, an input gradient and a weight gradient of chunk 1;
///   4. until both chunks have every forward: chunk 0's next forward (while it has one),
///      input and weight gradients, then chunk 1's forward, input and weight gradients;
///   5. r times: an input gradient of chunk 0, then one of chunk 1;
///   6. P-r times: an input gradient of chunk 0 and its oldest weight gradient owed;
///   7. the weight gradients still owed, chunk 1's then chunk 0's.
inline std::vector<Action> zbv_zero_bubble(int P, int M, int rank) {
  const int N = std::max(M, 2 * P - 1);
  const int down = stage_of_rank(Placement::vee, P, rank, 0), up = stage_of_rank(Placement::vee, P, rank, 1);
  struct Chunk {
    int stage, f = 0, i = 0, w = 0;  // the next microbatch of each op
  } c0{down}, c1{up};
  std::vector<Action> all;
  auto f = [&](Chunk& c) { all.push_back({Op::forward, c.stage, c.f++}); };
  auto i = [&](Chunk& c) { all.push_back({Op::backward_input, c.stage, c.i++}); };
  auto w = [&](Chunk& c) { all.push_back({Op::backward_weight, c.stage, c.w++}); };
  for (int k = 0; k < 2 * (P - rank) - 1; ++k) f(c0);
  for (int k = 0; k < rank; ++k) f(c1), f(c0);
  for (int k = 0; k < P - rank; ++k) f(c1), i(c1), w(c1);
  while (c1.f < c0.f || c0.f < N) {
    if (c0.f < N) f(c0);
    i(c0), w(c0), f(c1), i(c1), w(c1);
  }
  for (int k = 0; k < rank; ++k) i(c0), i(c1);
  for (int k = 0; k < P - rank; ++k) i(c0), w(c0);
  while (c1.w < c1.i) w(c1);
  while (c0.w < c0.i) w(c0);
  TESSERA_CHECK(c0.f == N && c0.i == N && c0.w == N && c1.f == N && c1.i == N && c1.w == N,
                "pipeline schedule ZBVZeroBubble: rank ", rank, " of ", P, " laid out an incomplete list (a bug)");
  std::vector<Action> out;
  for (const Action& a : all)
    if (a.microbatch < M) out.push_back(a);
  return out;
}

/// DualPipeV on rank `rank` (the V form of DeepSeek's DualPipe, in PyTorch's phases):
/// chunk 0 is stage r, chunk 1 stage 2P-1-r, M >= 2P microbatches. Where PyTorch runs a
/// forward and a backward overlapped, this runs the forward, then the backward. Input
/// gradients (I) queue their weight gradients, which W takes oldest first; B is a whole
/// backward.
///   1. 2(P-r-1) forwards of chunk 0;
///   2. r+1 times: a forward of chunk 0, then of chunk 1;
///   3. P-r-1 times: I of chunk 1, a W, a forward of chunk 1;
///   4. M-2P+r+1 times: a forward of chunk 0 and B of chunk 1, a forward of chunk 1 and B
///      of chunk 0;
///   5. P-r-1 times: B of chunk 1, then a forward of chunk 1 and B of chunk 0;
///   6. r+1 times: a backward of chunk 1, then of chunk 0, whole until halfway through
///      (from chunk 1 on odd ranks, chunk 0 on even ones), I from there on;
///   7. P-r-1 times: a W, then I of chunk 0;
///   8. r+1 times: a W.
inline std::vector<Action> dual_pipe_v(int P, int M, int rank) {
  const int down = stage_of_rank(Placement::vee, P, rank, 0), up = stage_of_rank(Placement::vee, P, rank, 1);
  struct Chunk {
    int stage, f = 0, b = 0;  // the next microbatch to go forward and back
  } c0{down}, c1{up};
  std::vector<Action> out;
  std::vector<Action> owed;  // weight gradients of the input gradients run, oldest first
  bool split = false;
  auto f = [&](Chunk& c) { out.push_back({Op::forward, c.stage, c.f++}); };
  auto b = [&](Chunk& c, bool input_only) {
    out.push_back({input_only ? Op::backward_input : Op::backward, c.stage, c.b});
    if (input_only) owed.push_back({Op::backward_weight, c.stage, c.b});
    ++c.b;
  };
  auto w = [&] {
    TESSERA_CHECK(!owed.empty(), "pipeline schedule DualPipeV: rank ", rank, " of ", P, " owes no weight gradient (a bug)");
    out.push_back(owed.front());
    owed.erase(owed.begin());
  };
  for (int k = 0; k < 2 * (P - rank - 1); ++k) f(c0);
  for (int k = 0; k < rank + 1; ++k) f(c0), f(c1);
  for (int k = 0; k < P - rank - 1; ++k) b(c1, true), w(), f(c1);
  for (int k = 0; k < M - 2 * P + rank + 1; ++k) f(c0), b(c1, false), f(c1), b(c0, false);
  for (int k = 0; k < P - rank - 1; ++k) b(c1, false), f(c1), b(c0, false);
  const int half = (rank + 1) / 2;
  for (int k = 0; k < rank + 1; ++k) {
    if (k == half && rank % 2 == 1) split = true;
    b(c1, split);
    if (k == half && rank % 2 == 0) split = true;
    b(c0, split);
  }
  for (int k = 0; k < P - rank - 1; ++k) w(), b(c0, split);
  for (int k = 0; k < rank + 1; ++k) w();
  TESSERA_CHECK(owed.empty() && c0.f == M && c0.b == M && c1.f == M && c1.b == M, "pipeline schedule DualPipeV: rank ",
                rank, " of ", P, " laid out an incomplete list (a bug)");
  return out;
}

}  // namespace detail

/// The schedule `kind` for `ranks` pipeline ranks with `stages_per_rank` stages each and
/// `microbatches` microbatches. Throws (check_schedule_shape) when the shape does not fit.
/// A file's schedule (from_file) is read, not made: schedule_from_table (schedule_csv.hpp).
inline Schedule make_schedule(ScheduleKind kind, int ranks, int stages_per_rank, int microbatches) {
  TESSERA_CHECK(!from_file(kind), "pipeline schedule ", name_of(kind), ": its order comes from a file (",
                config_keys(settings::schedule_csv), "), not from the schedule's name");
  check_schedule_shape(kind, ranks, stages_per_rank, microbatches);
  const int P = ranks, V = stages_per_rank, M = microbatches;
  Schedule s{kind, P, V, M, {}, placement_of(kind)};
  for (int r = 0; r < P; ++r) {
    std::vector<Action> list;
    switch (kind) {
      case ScheduleKind::gpipe: list = detail::one_f_one_b_family(P, 1, M, r, M, false, 0); break;
      case ScheduleKind::one_f_one_b: list = detail::one_f_one_b_family(P, 1, M, r, std::min(P - 1 - r, M), false, 0); break;
      case ScheduleKind::interleaved_1f1b:
        list = detail::one_f_one_b_family(P, V, M, r, std::min((V - 1) * P + 2 * (P - 1 - r), V * M), false, 0);
        break;
      case ScheduleKind::interleaved_zero_bubble:
        list = detail::one_f_one_b_family(P, V, M, r, std::min((V - 1) * P + (P - 1 - r), V * M), true, r);
        break;
      case ScheduleKind::looped_bfs: list = detail::looped_bfs(P, V, M, r); break;
      case ScheduleKind::zbv_zero_bubble: list = detail::zbv_zero_bubble(P, M, r); break;
      case ScheduleKind::dual_pipe_v: list = detail::dual_pipe_v(P, M, r); break;
      case ScheduleKind::csv_single:
      case ScheduleKind::csv_multi: break;  // refused above
    }
    s.per_rank.push_back(std::move(list));
  }
  return s;
}

namespace detail {

inline const char* op_name(Op op) {
  switch (op) {
    case Op::forward: return "forward";
    case Op::backward: return "backward";
    case Op::backward_input: return "backward_input";
    case Op::backward_weight: return "backward_weight";
  }
  return "?";
}

/// "backward_input of stage 3, microbatch 1".
inline std::string spell(const Action& a) {
  return ::tessera::detail::concat(op_name(a.op), " of stage ", a.stage, ", microbatch ", a.microbatch);
}

}  // namespace detail

/// Checks that `s` is well formed: every action names a stage of its own rank and a
/// microbatch in range, and every (stage, microbatch) gets exactly one forward and either
/// one backward or one backward_input and one backward_weight. Throws naming the rank, the
/// position in its list and the action. (Order and deadlocks are simulate()'s part.)
inline void validate(const Schedule& s) {
  TESSERA_CHECK(s.ranks >= 1 && s.stages_per_rank >= 1 && s.microbatches >= 1, "pipeline schedule ", name_of(s.kind),
                ": needs positive ranks, stages per rank and microbatches, got ", s.ranks, ", ", s.stages_per_rank,
                ", ", s.microbatches);
  TESSERA_CHECK(static_cast<int>(s.per_rank.size()) == s.ranks, "pipeline schedule ", name_of(s.kind), ": has lists for ",
                s.per_rank.size(), " ranks, expected ", s.ranks);
  const int S = s.stages(), M = s.microbatches;
  std::vector<int> count(static_cast<std::size_t>(S * M * 4), 0);  // [stage][microbatch][op]
  for (int r = 0; r < s.ranks; ++r) {
    const auto& list = s.per_rank[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      TESSERA_CHECK(static_cast<int>(a.op) < 4, "pipeline schedule ", name_of(s.kind), ": rank ", r, ", action ", i,
                    " has no valid op (", static_cast<int>(a.op), ")");
      TESSERA_CHECK(a.stage >= 0 && a.stage < S && a.microbatch >= 0 && a.microbatch < M, "pipeline schedule ",
                    name_of(s.kind), ": rank ", r, ", action ", i, " (", detail::spell(a), ") is out of range: ", S,
                    " stages, ", M, " microbatches");
      TESSERA_CHECK(s.rank_of(a.stage) == r, "pipeline schedule ", name_of(s.kind), ": rank ", r, ", action ", i, " (",
                    detail::spell(a), ") belongs to rank ", s.rank_of(a.stage));
      int& n = count[static_cast<std::size_t>((a.stage * M + a.microbatch) * 4 + static_cast<int>(a.op))];
      TESSERA_CHECK(n == 0, "pipeline schedule ", name_of(s.kind), ": rank ", r, ", action ", i, " (", detail::spell(a),
                    ") repeats an action already in the schedule");
      ++n;
    }
  }
  for (int st = 0; st < S; ++st)
    for (int m = 0; m < M; ++m) {
      const int* c = &count[static_cast<std::size_t>((st * M + m) * 4)];
      const int f = c[0], b = c[1], in = c[2], w = c[3];
      TESSERA_CHECK(f == 1, "pipeline schedule ", name_of(s.kind), ": stage ", st, ", microbatch ", m,
                    " has no forward (on rank ", s.rank_of(st), ")");
      TESSERA_CHECK((b == 1 && in == 0 && w == 0) || (b == 0 && in == 1 && w == 1), "pipeline schedule ",
                    name_of(s.kind), ": stage ", st, ", microbatch ", m, " (rank ", s.rank_of(st),
                    ") needs one backward or one backward_input and one backward_weight, has ", b, " backward, ", in,
                    " backward_input, ", w, " backward_weight");
    }
}

/// The duration of each op; a whole backward costs backward_input + backward_weight.
struct Costs {
  double forward = 1.0;
  double backward_input = 1.0;
  double backward_weight = 1.0;

  [[nodiscard]] double of(Op op) const {
    switch (op) {
      case Op::forward: return forward;
      case Op::backward: return backward_input + backward_weight;
      case Op::backward_input: return backward_input;
      case Op::backward_weight: return backward_weight;
    }
    return 0.0;
  }
};

/// What simulate() measured.
struct Simulation {
  double makespan = 0.0;                   ///< when the last action ends
  double bubble = 0.0;                     ///< 1 - sum(busy) / (P x makespan)
  std::vector<double> busy;                ///< per rank: time spent computing
  std::vector<int> peak_in_flight;         ///< per rank: most stage activations held at once
  std::vector<std::vector<double>> start;  ///< start[r][i]: when rank r's i-th action starts
};

/// Runs every rank's list in order, each action as soon as its rank is free and its
/// inputs exist: forward (s, m) after forward (s-1, m); backward or backward_input (s, m)
/// after forward (s, m) and after backward or backward_input (s+1, m); backward_weight
/// (s, m) after backward_input (s, m). Sends are buffered. Validates `s` first, then throws
/// if some rank's next action can never run (a deadlock), naming each waiting rank, the
/// action and what it waits for. peak_in_flight counts (stage, microbatch) pairs whose
/// forward ran on the rank and whose backward or backward_input has not: with V stages per
/// rank each pair holds the activations of 1/V of the rank's layers.
inline Simulation simulate(const Schedule& s, const Costs& costs = {}) {
  validate(s);
  TESSERA_CHECK(costs.forward >= 0 && costs.backward_input >= 0 && costs.backward_weight >= 0 &&
                    costs.forward + costs.backward_input > 0,
                "pipeline simulation: costs must be non-negative with forward + backward_input > 0, got forward ",
                costs.forward, ", backward_input ", costs.backward_input, ", backward_weight ", costs.backward_weight);
  const int P = s.ranks, S = s.stages(), M = s.microbatches;
  auto at = [M](int stage, int mb) { return static_cast<std::size_t>(stage * M + mb); };
  std::vector<double> forward_done(static_cast<std::size_t>(S * M), -1.0);   // end time, -1 while not run
  std::vector<double> backward_done(static_cast<std::size_t>(S * M), -1.0);  // backward or backward_input
  Simulation out;
  out.busy.assign(static_cast<std::size_t>(P), 0.0);
  out.peak_in_flight.assign(static_cast<std::size_t>(P), 0);
  out.start.resize(static_cast<std::size_t>(P));
  std::vector<std::size_t> next(static_cast<std::size_t>(P), 0);
  std::vector<double> clock(static_cast<std::size_t>(P), 0.0);
  std::vector<int> in_flight(static_cast<std::size_t>(P), 0);
  // The action `a` needs, as (time it ended or -1, what it is), or time 0 when it needs nothing.
  auto needs = [&](const Action& a) -> std::pair<double, Action> {
    switch (a.op) {
      case Op::forward:
        if (a.stage == 0) return {0.0, a};
        return {forward_done[at(a.stage - 1, a.microbatch)], {Op::forward, a.stage - 1, a.microbatch}};
      case Op::backward:
      case Op::backward_input: {
        const double f = forward_done[at(a.stage, a.microbatch)];
        if (f < 0 || a.stage == S - 1) return {f, {Op::forward, a.stage, a.microbatch}};
        const double b = backward_done[at(a.stage + 1, a.microbatch)];
        return {b < 0 ? b : std::max(f, b), {Op::backward_input, a.stage + 1, a.microbatch}};
      }
      case Op::backward_weight:
        return {backward_done[at(a.stage, a.microbatch)], {Op::backward_input, a.stage, a.microbatch}};
    }
    return {0.0, a};
  };
  std::size_t remaining = 0;
  for (const auto& list : s.per_rank) remaining += list.size();
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < P; ++r) {
      const auto& list = s.per_rank[static_cast<std::size_t>(r)];
      auto& i = next[static_cast<std::size_t>(r)];
      for (; i < list.size(); ++i) {
        const Action& a = list[i];
        const auto [ready, dep] = needs(a);
        if (ready < 0) break;
        const double begin = std::max(clock[static_cast<std::size_t>(r)], ready), cost = costs.of(a.op);
        out.start[static_cast<std::size_t>(r)].push_back(begin);
        clock[static_cast<std::size_t>(r)] = begin + cost;
        out.busy[static_cast<std::size_t>(r)] += cost;
        int& held = in_flight[static_cast<std::size_t>(r)];
        if (a.op == Op::forward) {
          forward_done[at(a.stage, a.microbatch)] = begin + cost;
          held += 1;
          out.peak_in_flight[static_cast<std::size_t>(r)] = std::max(out.peak_in_flight[static_cast<std::size_t>(r)], held);
        } else if (a.op != Op::backward_weight) {
          backward_done[at(a.stage, a.microbatch)] = begin + cost;
          held -= 1;
        }
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      std::ostringstream why;
      why << "pipeline schedule " << name_of(s.kind) << " deadlocks:";
      const char* sep = " ";
      for (int r = 0; r < P; ++r) {
        const auto& list = s.per_rank[static_cast<std::size_t>(r)];
        const std::size_t i = next[static_cast<std::size_t>(r)];
        if (i == list.size()) continue;
        Action dep = needs(list[i]).second;
        // A whole backward of the next stage satisfies a backward_input dependency too:
        // name the one the schedule has.
        if (dep.op == Op::backward_input) {
          const auto& theirs = s.per_rank[static_cast<std::size_t>(s.rank_of(dep.stage))];
          if (std::find(theirs.begin(), theirs.end(), dep) == theirs.end()) dep.op = Op::backward;
        }
        why << sep << "rank " << r << " waits at action " << i << " (" << detail::spell(list[i]) << ") for the "
            << detail::spell(dep) << " on rank " << s.rank_of(dep.stage);
        sep = "; ";
      }
      fail(why.str());
    }
  }
  for (double c : clock) out.makespan = std::max(out.makespan, c);
  double total = 0.0;
  for (double b : out.busy) total += b;
  out.bubble = out.makespan > 0 ? 1.0 - total / (P * out.makespan) : 0.0;
  return out;
}

/// The textbook bubble fraction of GPipe and 1F1B with P ranks and M microbatches,
/// (P-1) / (M+P-1): the fraction of P x makespan spent idle when every stage takes the
/// same time.
inline double bubble_1f1b(int ranks, int microbatches) {
  return static_cast<double>(ranks - 1) / static_cast<double>(microbatches + ranks - 1);
}

/// The textbook bubble fraction of interleaved 1F1B with V stages per rank,
/// (P-1) / (V M + P-1): the warm-up and cool-down shrink V-fold.
inline double bubble_interleaved(int ranks, int stages_per_rank, int microbatches) {
  return static_cast<double>(ranks - 1) / static_cast<double>(stages_per_rank * microbatches + ranks - 1);
}

/// The bubble fraction of InterleavedZeroBubble when forward, backward_input and
/// backward_weight cost the same, (P-1) / (3 V M + P-1): each rank idles P-1 forwards'
/// time (the warm-up) against 1F1B's P-1 forwards and backwards, the rest of the cool-down
/// being filled with weight gradients (Qi et al. 2023, ZB-H1: (P-1)(F + I - W)).
inline double bubble_zero_bubble(int ranks, int stages_per_rank, int microbatches) {
  return static_cast<double>(ranks - 1) / static_cast<double>(3 * stages_per_rank * microbatches + ranks - 1);
}

/// An action as the timelines print it: "F3" (op letter, microbatch) with one stage per
/// rank, "5F3" (stage, op letter, microbatch) with several, as PyTorch prints actions.
inline std::string action_label(const Schedule& s, const Action& a) {
  const char letter = "FBIW"[static_cast<int>(a.op)];
  return s.stages_per_rank == 1 ? ::tessera::detail::concat(letter, a.microbatch)
                                : ::tessera::detail::concat(a.stage, letter, a.microbatch);
}

namespace detail {
inline std::string rank_prefix(const Schedule& s, int r) {
  const std::string last = std::to_string(s.ranks - 1), mine = std::to_string(r);
  return "rank " + std::string(last.size() - mine.size(), ' ') + mine + ": ";
}
}  // namespace detail

/// Each rank's list in order, one line per rank: "rank 0: F0 F1 B0 F2 B1 B2".
inline std::string format_order(const Schedule& s) {
  std::string out;
  for (int r = 0; r < s.ranks; ++r) {
    out += detail::rank_prefix(s, r);
    const auto& list = s.per_rank[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (i > 0) out += ' ';
      out += action_label(s, list[i]);
    }
    out += '\n';
  }
  return out;
}

/// The simulated timeline, one line per rank and one column per unit of time: an action
/// shows its label in its first column and dashes in the others, idle time a dot. Needs
/// whole-number costs of at least 1 (the default: forward 1, backward_input 1,
/// backward_weight 1, so a whole backward takes two columns).
inline std::string format_timeline(const Schedule& s, const Costs& costs = {}) {
  auto whole = [](double c) { return c >= 1 && c == std::floor(c) && c < 1e6; };
  TESSERA_CHECK(whole(costs.forward) && whole(costs.backward_input) && whole(costs.backward_weight),
                "pipeline timeline: needs whole-number costs of at least 1, got forward ", costs.forward,
                ", backward_input ", costs.backward_input, ", backward_weight ", costs.backward_weight);
  const Simulation sim = simulate(s, costs);
  std::size_t width = 1;
  for (const auto& list : s.per_rank)
    for (const Action& a : list) width = std::max(width, action_label(s, a).size());
  const auto columns = static_cast<std::size_t>(sim.makespan);
  std::string out;
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<std::string> cell(columns, ".");
    const auto& list = s.per_rank[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      const auto t = static_cast<std::size_t>(sim.start[static_cast<std::size_t>(r)][i]);
      const auto n = static_cast<std::size_t>(costs.of(list[i].op));
      cell[t] = action_label(s, list[i]);
      for (std::size_t k = 1; k < n; ++k) cell[t + k] = std::string(width, '-');
    }
    std::string line = detail::rank_prefix(s, r);
    for (std::size_t t = 0; t < columns; ++t) {
      line += cell[t];
      if (t + 1 < columns) line += std::string(width + 1 - cell[t].size(), ' ');
    }
    out += line + '\n';
  }
  return out;
}

/// One line for logs: "1F1B, 4 ranks x 1 stage, 8 microbatches, bubble 27.3%", the
/// bubble simulated with the default costs (forward 1, backward_input 1, backward_weight 1).
inline std::string describe(const Schedule& s) {
  const Simulation sim = simulate(s);
  char bubble[32];
  std::snprintf(bubble, sizeof bubble, "%.1f%%", 100.0 * sim.bubble);
  return ::tessera::detail::concat(name_of(s.kind), ", ", s.ranks, s.ranks == 1 ? " rank x " : " ranks x ", s.stages_per_rank,
                        s.stages_per_rank == 1 ? " stage, " : " stages, ", s.microbatches,
                        s.microbatches == 1 ? " microbatch, bubble " : " microbatches, bubble ", bubble);
}

}  // namespace tessera::parallel
