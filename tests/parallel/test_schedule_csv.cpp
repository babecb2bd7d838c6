// Pipeline schedules read from PyTorch's CSV of actions (parallel/schedule_csv.hpp): every
// named schedule written and read back to the same order and placement over a grid of
// shapes; PyTorch's lowered rows (transfers and FSDP's gathers) read for their computes;
// empty cells, quoting, line endings and overlapped pairs; the V placement recognised;
// and every malformed file refused naming the file and the row, column or action.
// Run alone with --test-case='schedule csv:*'.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "schedule_shapes.hpp"
#include "tessera/parallel/pipeline_program.hpp"
#include "tessera/parallel/schedule_csv.hpp"

namespace test_schedule_csv {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::parallel;
using tessera::parallel::Op;

namespace {

constexpr Op F = Op::forward, B = Op::backward, I = Op::backward_input, W = Op::backward_weight;

ScheduleTable parse(const std::string& text) { return parse_schedule_csv(text, "order.csv"); }

/// Two ranks in the V placement (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2),
/// two microbatches, whole and split backwards mixed: an order no named schedule lays out.
const char* const kVeeOrder =
    "0F0,0F1,3F0,3I0,3W0,3F1,3B1,0I0,0B1,0W0\n"
    "1F0,2F0,1F1,2F1,2I0,1B0,2B1,1I1,1W1,2W0\n";

}  // namespace

TEST_CASE("schedule csv: every named schedule is written and read back to the same order") {
  int checked = 0;
  for (ScheduleKind k : test::kAllScheduleKinds)
    for (int P = 1; P <= 4; ++P)
      for (int V = 1; V <= 3; ++V)
        for (int M = 1; M <= 8; ++M) {
          if (!test::schedule_fits(k, P, V, M)) continue;
          const Schedule s = make_schedule(k, P, V, M);
          CAPTURE(name_of(k));
          CAPTURE(P);
          CAPTURE(V);
          CAPTURE(M);
          const ScheduleTable t = parse(format_csv(s));
          CHECK(t.order.per_rank == s.per_rank);
          CHECK(t.order.ranks == P);
          CHECK(t.order.stages_per_rank == V);
          CHECK(t.order.microbatches == M);
          // Where the two placements agree (one rank, or one stage a rank) the file says loop.
          CHECK(t.order.placement() == (P > 1 && V > 1 ? s.placement() : Placement::loop));
          CHECK(t.transfers_dropped == 0);
          ++checked;
        }
  CHECK(checked >= 250);  // 292 shapes fit today
}

TEST_CASE("schedule csv: a custom order in the V placement is read, checked and lowered") {
  const ScheduleTable t = parse(kVeeOrder);
  const Schedule& s = t.order;
  CHECK(s.kind == ScheduleKind::csv_multi);
  CHECK(s.ranks == 2);
  CHECK(s.stages_per_rank == 2);
  CHECK(s.microbatches == 2);
  CHECK(s.placement() == Placement::vee);
  CHECK(s.stages_of(0) == std::vector<int>{0, 3});
  CHECK(s.per_rank[0][3] == Action{I, 3, 0});
  CHECK(s.per_rank[1][5] == Action{B, 1, 0});
  // What the model runs: the order for its own kind and shape, lowered under NCCL's rules.
  const Schedule run = schedule_from_table(t, ScheduleKind::csv_multi, 2, 2, 2);
  CHECK(run.per_rank == s.per_rank);
  check_program(lower(run));
}

TEST_CASE("schedule csv: PyTorch's lowered rows are read for their computes") {
  // PyTorch's compute_comms rows for 1F1B on two ranks, two microbatches: FSDP's
  // gathers and frees and the sends and receives around each compute.
  const std::string lowered =
      "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0RESHARD,0REDUCE_GRAD\n"
      "1UNSHARD,1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1RESHARD,1REDUCE_GRAD\n";
  const ScheduleTable t = parse(lowered);
  CHECK(t.transfers_dropped == 14);
  CHECK(t.order.per_rank == make_schedule(ScheduleKind::one_f_one_b, 2, 1, 2).per_rank);
  CHECK(t.order.per_rank[1] == std::vector<Action>{{F, 1, 0}, {B, 1, 0}, {F, 1, 1}, {B, 1, 1}});
}

TEST_CASE("schedule csv: empty cells, spaces, quotes, CRLF, a byte-order mark and overlapped pairs") {
  const std::string text =
      "\xEF\xBB\xBF" "0F0, ,0F1,,\"0B0\" ,0B1\r\n"
      ",1F0,(1B0;1F1)OVERLAP_F_B,,1B1\r\n";
  const ScheduleTable t = parse(text);
  CHECK(t.order.per_rank[0] == std::vector<Action>{{F, 0, 0}, {F, 0, 1}, {B, 0, 0}, {B, 0, 1}});
  CHECK(t.order.per_rank[1] == std::vector<Action>{{F, 1, 0}, {B, 1, 0}, {F, 1, 1}, {B, 1, 1}});
  // Blank lines after the last row are no ranks; one between rows is a rank with nothing.
  CHECK(parse(text + "\r\n  \n\n").order.ranks == 2);
  CHECK_ERROR_CONTAINS(parse("0F0,0B0\n\n1F0,1B0\n"), "order.csv: row 2 (rank 1) has no forward");
}

TEST_CASE("schedule csv: malformed cells are refused naming the file, the row and the column") {
  CHECK_ERROR_CONTAINS(parse("0F0,0X1\n"), "order.csv: row 1, column 2: \"0X1\" is not an action (unknown type \"X\"");
  CHECK_ERROR_CONTAINS(parse("0F0\nF0\n"), "order.csv: row 2, column 1: \"F0\" is not an action (no stage number first");
  CHECK_ERROR_CONTAINS(parse("0F0,0B\n"), "row 1, column 2: \"0B\" is not an action (a compute action needs its "
                                          "microbatch number last");
  CHECK_ERROR_CONTAINS(parse("0F0x\n"), "\"0F0x\" is not an action (text after the microbatch");
  CHECK_ERROR_CONTAINS(parse("0F0,(0B0)\n"), "a bracketed pair must be followed by OVERLAP_F_B");
  CHECK_ERROR_CONTAINS(parse("0F0,0SEND_F1x\n"), "\"0SEND_F1x\" is not an action (text after the microbatch");
}

TEST_CASE("schedule csv: orders that cannot run are refused naming the file and what is wrong") {
  CHECK_ERROR_CONTAINS(parse(""), "order.csv: no rows");
  CHECK_ERROR_CONTAINS(parse("0F0,0B0\n,,\n"), "order.csv: row 2 (rank 1) has no forward, backward or weight-gradient "
                                              "action");
  CHECK_ERROR_CONTAINS(parse("0F0,1F0,1B0,0B0\n1F1\n"),
                       "order.csv: row 2, column 1: forward of stage 1, microbatch 1 is on rank 1, but row 1 puts "
                       "stage 1 on rank 0");
  CHECK_ERROR_CONTAINS(parse("0F0,0I0,0W0,2F0,2I0,2W0\n"), "order.csv: no row runs stage 1");
  // Too few actions for the stages and microbatches named: refused before anything is
  // sized by them (a stray 9999999 allocates nothing).
  CHECK_ERROR_CONTAINS(parse("0F0,0B0,0F9999999\n"), "order.csv: the rows run stages up to 0 and microbatches up to "
                                                     "9999999, which take at least 20000000 actions (a forward and a "
                                                     "backward of each stage for each microbatch), and hold 3");
  CHECK_ERROR_CONTAINS(parse("0F0,2F0,2B0,0B0\n1F0,1B0\n"),
                       "order.csv: 3 stages on 2 ranks (one a row): every rank holds the same number of stages");
  // Stage 1 on rank 0 and stage 2 on rank 1: neither placement.
  CHECK_ERROR_CONTAINS(parse("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n"),
                       "order.csv: stage 1 is on rank 0, where the looping placement puts it on rank 1 and the V "
                       "placement on rank 1");
  // Three ranks: stage 3 is where the loop puts it, not the V; stage 5 neither.
  CHECK_ERROR_CONTAINS(parse("0F0,3F0,3B0,0B0\n1F0,5F0,5B0,1B0\n2F0,4F0,4B0,2B0\n"),
                       "order.csv: stage 4 is on rank 2, where the looping placement puts it on rank 1, and stage 3 "
                       "is on rank 0, where the V placement puts it on rank 2");
  CHECK_ERROR_CONTAINS(parse("0F0,0B0,0B1\n1F0,1B0,1F1,1B1\n"),
                       "order.csv: pipeline schedule PipelineScheduleMulti: stage 0, microbatch 1 has no forward");
  CHECK_ERROR_CONTAINS(parse("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n"),
                       "stage 1, microbatch 1 (rank 1) needs one backward or one backward_input and one "
                       "backward_weight, has 0 backward");
  CHECK_ERROR_CONTAINS(parse("0F0,0B0,0F0\n1F0,1B0\n"), "repeats an action already in the schedule");
  // The weight gradient before its input gradient: the rank waits on itself.
  CHECK_ERROR_CONTAINS(parse("0F0,0W0,0I0\n1F0,1B0\n"),
                       "order.csv: pipeline schedule PipelineScheduleMulti deadlocks: rank 0 waits at action 1 "
                       "(backward_weight of stage 0, microbatch 0) for the backward_input of stage 0, microbatch 0");
  // Rank 0's backward before the forward rank 1 needs first: a cycle between the ranks,
  // the dependency named as the file has it (a whole backward).
  CHECK_ERROR_CONTAINS(parse("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"),
                       "rank 0 waits at action 1 (backward of stage 0, microbatch 0) for the backward of stage 1, "
                       "microbatch 0 on rank 1");
}

TEST_CASE("schedule csv: the pipeline's shape is checked against the file's") {
  const ScheduleTable t = parse(kVeeOrder);
  CHECK_ERROR_CONTAINS(check_table_shape(t, ScheduleKind::csv_multi, 4, 2, std::nullopt),
                       "parallelism.pipeline_parallel_schedule_csv: order.csv: has 2 rows (one a pipeline rank), and "
                       "parallelism.pipeline_parallel_degree = 4");
  CHECK_ERROR_CONTAINS(check_table_shape(t, ScheduleKind::csv_multi, 2, 3, std::nullopt),
                       "order.csv: runs 4 stages (2 per rank), and the model is cut into 6");
  CHECK_ERROR_CONTAINS(check_table_shape(t, ScheduleKind::csv_multi, 2, 2, 8),
                       "order.csv: runs 2 microbatches a pass, and each pass has 8 (training.local_batch_size / "
                       "parallelism.pipeline_parallel_microbatch_size)");
  CHECK_ERROR_CONTAINS(check_table_shape(t, ScheduleKind::csv_single, 2, 2, 2),
                       "parallelism.pipeline_parallel_schedule = PipelineScheduleSingle runs one stage per rank");
  CHECK_ERROR_CONTAINS(check_table_shape(t, ScheduleKind::zbv_zero_bubble, 2, 2, 2),
                       "parallelism.pipeline_parallel_schedule_csv is set, and parallelism.pipeline_parallel_schedule "
                       "= ZBVZeroBubble lays out its own order");
  // Set in code, the settings are named in words.
  CHECK_ERROR_CONTAINS(check_table_shape(t, ScheduleKind::csv_multi, 4, 2, std::nullopt, code_words),
                       "the pipeline schedule's table: order.csv: has 2 rows (one a pipeline rank), and the mesh's "
                       "pipeline degree 4");
  check_table_shape(t, ScheduleKind::csv_multi, 2, 2, 2);
  // The file kinds are read, never laid out.
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::csv_multi, 2, 2, 2),
                       "pipeline schedule PipelineScheduleMulti: its order comes from a file "
                       "(parallelism.pipeline_parallel_schedule_csv)");
  CHECK(parse_schedule_kind("PipelineScheduleSingle") == ScheduleKind::csv_single);
  CHECK(parse_schedule_kind("PipelineScheduleMulti") == ScheduleKind::csv_multi);
  CHECK(from_file(ScheduleKind::csv_single));
  CHECK_FALSE(from_file(ScheduleKind::looped_bfs));
  CHECK(schedule_names().find("DualPipeV, PipelineScheduleSingle, PipelineScheduleMulti") != std::string::npos);
}

TEST_CASE("schedule csv: a file that is missing, a folder or readable") {
  const test::TempDir dir;
  CHECK_ERROR_CONTAINS(read_schedule_csv(dir.file("none.csv")), "none.csv: schedule file not found");
  CHECK_ERROR_CONTAINS(read_schedule_csv(dir.path.string()), ": is a folder, not a schedule file");
  const std::string path = dir.write("order.csv", kVeeOrder);
  const ScheduleTable t = read_schedule_csv(path);
  CHECK(t.source == path);
  CHECK(t.order.per_rank == parse(kVeeOrder).order.per_rank);
  CHECK_ERROR_CONTAINS(read_schedule_csv(dir.write("bad.csv", "0F0,0Q0\n")), "bad.csv: row 1, column 2");
}

}  // namespace test_schedule_csv
