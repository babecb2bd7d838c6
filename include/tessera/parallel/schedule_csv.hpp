// Pipeline schedules written out and read back in PyTorch's CSV of actions: a custom
// order for PipelineScheduleSingle or PipelineScheduleMulti
// (parallelism.pipeline_parallel_schedule_csv, as torchtitan), and any Schedule written
// so that it can be edited into one.
//
// The format is torch.distributed.pipelining's: one row per pipeline rank, rank 0
// first; each cell one action, [stage][type][microbatch], "2F0" being stage 2's forward
// of microbatch 0. The types tessera runs are F (forward), B (the whole backward), I (the
// input gradient) and W (the weight gradient, after that microbatch's I). An empty cell
// is a step where PyTorch's lock-step runtime idles the rank; here each action runs as
// soon as its input is there, so only the order of a row counts and empty cells are
// skipped. PyTorch's lowered rows ("compute_comms") also hold the transfers and FSDP's
// gathers (UNSHARD, RESHARD, SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD): tessera places
// those itself (pipeline_program.hpp lowers any order to transfers that cannot deadlock
// under NCCL's rules; the data-parallel units gather and reduce as their policy says), so
// they are read, counted and left out. An overlapped pair "(0F3;1B1)OVERLAP_F_B" is its
// actions one after the other, as tessera runs DualPipeV's pairs.
//
// What the rows say fixes the rest: the ranks (one a row), the stages (each on the one
// rank whose row holds it, every stage from 0 up present, a multiple of the ranks), where
// they live (the looping placement or the V one, schedule_kind.hpp: the two the model's
// layout and the planner know; another is refused naming the stage), and the
// microbatches (every one from 0 up). Read, the order is checked as a named schedule's is:
// every (stage, microbatch) forward once and backward once (B, or I then W), on its own
// rank (validate), and free of deadlocks (simulate), each error naming the file and the
// row, the column or the action.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/schedule.hpp"
#include "tessera/parallel/schedule_kind.hpp"
#include "tessera/parallel/wording.hpp"

namespace tessera::parallel {

/// A schedule as a file gave it: the order of every rank, and what the rows implied.
struct ScheduleTable {
  std::string source;  ///< where it came from (the path), as errors name it
  /// The order: kind csv_multi, ranks the rows, stages_per_rank and microbatches what the
  /// rows hold, the placement the rows imply. Validated and simulated.
  Schedule order;
  /// Transfer and FSDP actions read and left out (PyTorch's "compute_comms" rows).
  int transfers_dropped = 0;
};

namespace detail {

/// The action types PyTorch writes that are not computes: tessera places them itself.
inline bool is_transfer_type(std::string_view t) {
  for (std::string_view k : {"UNSHARD", "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD"})
    if (t == k) return true;
  return false;
}

inline std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

/// The digits at the start of `s`, consumed, or nullopt where there are none (or too many).
inline std::optional<int> leading_number(std::string_view& s) {
  std::size_t n = 0;
  while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
  if (n == 0 || n > 7) return std::nullopt;
  int v = 0;
  for (std::size_t i = 0; i < n; ++i) v = v * 10 + (s[i] - '0');
  s.remove_prefix(n);
  return v;
}

/// One cell's actions appended to `out` ("2F0"; a transfer counted in `dropped`; an
/// overlapped pair's two). Throws naming `where` and the cell.
inline void parse_cell(std::string_view cell, const std::string& where, std::vector<Action>& out, int& dropped) {
  cell = trim(cell);
  if (cell.size() >= 2 && cell.front() == '"' && cell.back() == '"') cell = trim(cell.substr(1, cell.size() - 2));
  if (cell.empty()) return;
  const auto bad = [&](std::string_view why) {
    fail(where, ": \"", cell, "\" is not an action (", why,
         "; expected [stage][type][microbatch] with type F, B, I or W, as 2F0)");
  };
  if (cell.front() == '(') {  // "(0F3;1B1)OVERLAP_F_B": the pair, one after the other
    const std::size_t close = cell.find(')');
    if (close == std::string_view::npos || cell.substr(close + 1) != "OVERLAP_F_B")
      bad("a bracketed pair must be followed by OVERLAP_F_B");
    std::string_view inner = cell.substr(1, close - 1);
    const std::size_t before = out.size();
    while (!inner.empty()) {
      const std::size_t semi = inner.find(';');
      parse_cell(inner.substr(0, semi), where, out, dropped);
      inner = semi == std::string_view::npos ? std::string_view{} : inner.substr(semi + 1);
    }
    if (out.size() == before) bad("an overlapped pair with no actions");
    return;
  }
  std::string_view rest = cell;
  const std::optional<int> stage = leading_number(rest);
  if (!stage) bad("no stage number first");
  std::size_t type_end = 0;
  while (type_end < rest.size() && !(rest[type_end] >= '0' && rest[type_end] <= '9')) ++type_end;
  const std::string_view type = rest.substr(0, type_end);
  rest.remove_prefix(type_end);
  if (is_transfer_type(type)) {  // its microbatch, where it has one, is digits (type took the rest)
    if (!rest.empty()) (void)leading_number(rest);
    if (!rest.empty()) bad("text after the microbatch");
    ++dropped;
    return;
  }
  Op op{};
  if (type == "F")
    op = Op::forward;
  else if (type == "B")
    op = Op::backward;
  else if (type == "I")
    op = Op::backward_input;
  else if (type == "W")
    op = Op::backward_weight;
  else
    bad(::tessera::detail::concat("unknown type \"", type, "\""));
  const std::optional<int> microbatch = leading_number(rest);
  if (!microbatch) bad("a compute action needs its microbatch number last");
  if (!rest.empty()) bad("text after the microbatch");
  out.push_back({op, *stage, *microbatch});
}

}  // namespace detail

/// Reads a schedule from `text`, PyTorch's CSV (see the header comment); `source` names
/// it in errors (the path). Throws naming the source and the row, column or action.
inline ScheduleTable parse_schedule_csv(std::string_view text, std::string source) {
  ScheduleTable t;
  t.source = std::move(source);
  Schedule& s = t.order;
  s.kind = ScheduleKind::csv_multi;
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);  // a byte-order mark
  std::vector<std::vector<Action>> rows;
  std::vector<std::vector<int>> columns;  // each action's cell, for errors
  std::vector<bool> blank;                // whether each row's line is blank
  std::size_t line_start = 0;
  while (line_start < text.size()) {
    std::size_t end = text.find('\n', line_start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(line_start, end - line_start);
    line_start = end + 1;
    const int row = static_cast<int>(rows.size());
    rows.emplace_back();
    columns.emplace_back();
    std::size_t cell_start = 0;
    for (int column = 1;; ++column) {
      std::size_t comma = line.find(',', cell_start);
      const std::string_view cell = line.substr(cell_start, comma == std::string_view::npos ? comma : comma - cell_start);
      const std::size_t before = rows.back().size();
      detail::parse_cell(cell, ::tessera::detail::concat(t.source, ": row ", row + 1, ", column ", column),
                         rows.back(), t.transfers_dropped);
      columns.back().insert(columns.back().end(), rows.back().size() - before, column);
      if (comma == std::string_view::npos) break;
      cell_start = comma + 1;
    }
    blank.push_back(detail::trim(line).empty());
  }
  // Blank lines after the last row (an editor's) are no ranks; one between rows is a rank
  // with nothing to do, refused below.
  while (!rows.empty() && blank.back()) {
    rows.pop_back();
    columns.pop_back();
    blank.pop_back();
  }
  const auto where = [&](int row, std::size_t i) {
    return ::tessera::detail::concat(t.source, ": row ", row + 1, ", column ",
                                     columns[static_cast<std::size_t>(row)][i]);
  };
  TESSERA_CHECK(!rows.empty(), t.source, ": no rows (one row of actions per pipeline rank)");
  const int P = static_cast<int>(rows.size());
  int S = 0, M = 0;
  for (int r = 0; r < P; ++r) {
    TESSERA_CHECK(!rows[static_cast<std::size_t>(r)].empty(), t.source, ": row ", r + 1, " (rank ", r,
                  ") has no forward, backward or weight-gradient action (every rank holds a stage)");
    for (const Action& a : rows[static_cast<std::size_t>(r)]) {
      S = std::max(S, a.stage + 1);
      M = std::max(M, a.microbatch + 1);
    }
  }
  // Every (stage, microbatch) needs a forward and a backward. The checks below allocate
  // by stages x microbatches, so a file naming far more than it holds (a stray 9999999)
  // is refused first; one a few actions short gets the check that names them.
  std::int64_t computes = 0;
  for (const auto& list : rows) computes += static_cast<std::int64_t>(list.size());
  TESSERA_CHECK(static_cast<std::int64_t>(S) * M <= computes, t.source, ": the rows run stages up to ", S - 1,
                " and microbatches up to ", M - 1, ", which take at least ", 2 * static_cast<std::int64_t>(S) * M,
                " actions (a forward and a backward of each stage for each microbatch), and hold ", computes);
  // Each stage on one rank: the row of its first action.
  std::vector<int> home(static_cast<std::size_t>(S), -1);
  for (int r = 0; r < P; ++r) {
    const auto& list = rows[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      int& h = home[static_cast<std::size_t>(list[i].stage)];
      TESSERA_CHECK(h < 0 || h == r, where(r, i), ": ", detail::spell(list[i]), " is on rank ", r,
                    ", but row ", h + 1, " puts stage ", list[i].stage, " on rank ", h,
                    " (each stage lives on one rank)");
      h = r;
    }
  }
  for (int st = 0; st < S; ++st)
    TESSERA_CHECK(home[static_cast<std::size_t>(st)] >= 0, t.source, ": no row runs stage ", st, " (the rows run stages ",
                  "up to ", S - 1, ", and every stage from 0 must be there)");
  TESSERA_CHECK(S % P == 0, t.source, ": ", S, " stages on ", P, P == 1 ? " rank" : " ranks",
                " (one a row): every rank holds the same number of stages, so the stages must be a multiple of the ranks");
  // The placement: the looping one where it fits (it does wherever the two agree), else the V one.
  auto fits = [&](Placement p) {
    for (int st = 0; st < S; ++st)
      if (rank_of_stage(p, P, st) != home[static_cast<std::size_t>(st)]) return st;
    return -1;
  };
  const int off_loop = fits(Placement::loop);
  Placement placement = Placement::loop;
  if (off_loop >= 0) {
    const int off_vee = fits(Placement::vee);
    if (off_vee >= 0) {
      auto on = [&](int st) { return ::tessera::detail::concat("stage ", st, " is on rank ", home[static_cast<std::size_t>(st)]); };
      const int loop_rank = rank_of_stage(Placement::loop, P, off_loop), vee_rank = rank_of_stage(Placement::vee, P, off_vee);
      fail(t.source, ": ",
           off_loop == off_vee
               ? ::tessera::detail::concat(on(off_loop), ", where the looping placement puts it on rank ", loop_rank,
                                           " and the V placement on rank ", vee_rank)
               : ::tessera::detail::concat(on(off_loop), ", where the looping placement puts it on rank ", loop_rank,
                                           ", and ", on(off_vee), ", where the V placement puts it on rank ", vee_rank),
           " (stages live in one of those two: stage s on rank s % P, or down the ranks and back up)");
    }
    placement = Placement::vee;
  }
  s.ranks = P;
  s.stages_per_rank = S / P;
  s.microbatches = M;
  s.per_rank = std::move(rows);
  s.stage_placement = placement;
  try {
    simulate(s);  // validate(), then the order run against its data dependencies
  } catch (const Error& e) {
    fail(t.source, ": ", e.what());
  }
  return t;
}

/// Reads the schedule file at `path` (parse_schedule_csv). Throws naming the path when it
/// is missing, a folder, or unreadable.
inline ScheduleTable read_schedule_csv(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  TESSERA_CHECK(std::filesystem::exists(status), path, ": schedule file not found");
  TESSERA_CHECK(!std::filesystem::is_directory(status), path, ": is a folder, not a schedule file");
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), path, ": cannot open the schedule file");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TESSERA_CHECK(!in.bad(), path, ": cannot read the schedule file");
  return parse_schedule_csv(text, path);
}

/// Checks that `table` fits a pipeline run by `kind` (a file kind) on `ranks` ranks with
/// `stages_per_rank` stages each and, where given, `microbatches` microbatches a pass;
/// throws naming the settings (`wording`) and the file.
inline void check_table_shape(const ScheduleTable& table, ScheduleKind kind, int ranks, int stages_per_rank,
                              std::optional<int> microbatches, Wording wording = config_keys) {
  const Schedule& s = table.order;
  const std::string what = ::tessera::detail::concat(wording(settings::schedule_csv), ": ", table.source);
  TESSERA_CHECK(from_file(kind), wording(settings::schedule_csv), " is set, and ", wording(settings::schedule), " = ",
                name_of(kind), " lays out its own order (PipelineScheduleSingle or PipelineScheduleMulti run the "
                "file's)");
  TESSERA_CHECK(s.ranks == ranks, what, ": has ", s.ranks, s.ranks == 1 ? " row" : " rows", " (one a pipeline rank), and ",
                wording(settings::pipeline_parallel_degree, ranks));
  TESSERA_CHECK(kind != ScheduleKind::csv_single || s.stages_per_rank == 1, what, ": runs ", s.stages(),
                " stages on ", s.ranks, " ranks, and ", wording(settings::schedule),
                " = PipelineScheduleSingle runs one stage per rank (PipelineScheduleMulti runs several)");
  TESSERA_CHECK(s.stages_per_rank == stages_per_rank, what, ": runs ", s.stages(), " stages (", s.stages_per_rank,
                " per rank), and the model is cut into ", ranks * stages_per_rank, " (",
                wording.pick("parallelism.pipeline_parallel_split_points or layers_per_stage", "the pipeline's split"),
                ")");
  if (microbatches)
    TESSERA_CHECK(s.microbatches == *microbatches, what, ": runs ", s.microbatches,
                  s.microbatches == 1 ? " microbatch" : " microbatches", " a pass, and each pass has ", *microbatches,
                  " (", wording(settings::local_batch_size), " / ", wording(settings::microbatch_size), ")");
}

/// The schedule `table` gives a pipeline run by `kind` on `ranks` x `stages_per_rank`
/// stages with `microbatches` microbatches (check_table_shape first).
inline Schedule schedule_from_table(const ScheduleTable& table, ScheduleKind kind, int ranks, int stages_per_rank,
                                    int microbatches, Wording wording = config_keys) {
  check_table_shape(table, kind, ranks, stages_per_rank, microbatches, wording);
  Schedule s = table.order;
  s.kind = kind;
  return s;
}

/// `s` as PyTorch's CSV: a row per rank, its actions as "2F0" cells (PyTorch's
/// _dump_csv with stage numbers always written), which parse_schedule_csv reads back to
/// the same order.
inline std::string format_csv(const Schedule& s) {
  std::string out;
  for (const auto& list : s.per_rank) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (i > 0) out += ',';
      out += ::tessera::detail::concat(list[i].stage, "FBIW"[static_cast<int>(list[i].op)], list[i].microbatch);
    }
    out += '\n';
  }
  return out;
}

}  // namespace tessera::parallel
