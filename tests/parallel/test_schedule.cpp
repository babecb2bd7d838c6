// Pipeline stage splitting and schedules as pure logic (parallel/stages.hpp,
// parallel/schedule.hpp): the split rule and its override, each schedule's order on small
// cases derived by hand, the stages' placements, the simulated bubble against the textbook
// figures, activation memory, and every schedule over a grid of shapes complete and free
// of deadlocks.
// Run alone with --test-case='pipeline:*'.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/schedule.hpp"
#include "schedule_shapes.hpp"
#include "tessera/parallel/stages.hpp"

namespace test_schedule {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::parallel;
using tessera::parallel::Op;  // the schedule's action kind, not the checkpoint policy's tessera::Op

namespace {

/// A schedule written by hand, for the error paths.
Schedule custom(int P, int M, std::vector<std::vector<Action>> lists) {
  return Schedule{ScheduleKind::one_f_one_b, P, 1, M, std::move(lists)};
}

constexpr Op F = Op::forward, B = Op::backward, I = Op::backward_input, W = Op::backward_weight;

}  // namespace

TEST_CASE("pipeline: stages split by unit count, embedding and output counting as one layer each") {
  // 8 blocks + 2 = 10 units on 4 stages: 3, 3, 2, 2.
  const std::vector<StageRange> four = split_stages(8, 4);
  const std::vector<StageRange> expect = {{0, 2, true, false}, {2, 5, false, false}, {5, 7, false, false},
                                          {7, 8, false, true}};
  CHECK(four == expect);
  CHECK(split_stages(8, 1) == std::vector<StageRange>{{0, 8, true, true}});
  // As many stages as units: the embedding and the output alone on the end stages.
  const std::vector<StageRange> five = split_stages(3, 5);
  CHECK(five == std::vector<StageRange>{{0, 0, true, false}, {0, 1, false, false}, {1, 2, false, false},
                                        {2, 3, false, false}, {3, 3, false, true}});
  for (int layers = 1; layers <= 12; ++layers)
    for (int n = 1; n <= layers + 2; ++n) {
      CAPTURE(layers);
      CAPTURE(n);
      const std::vector<StageRange> st = split_stages(layers, n);
      REQUIRE(static_cast<int>(st.size()) == n);
      int block = 0, previous_units = st[0].units();
      for (int s = 0; s < n; ++s) {
        const StageRange& r = st[static_cast<std::size_t>(s)];
        CHECK(r.first_block == block);  // contiguous, in order
        CHECK(r.end_block >= r.first_block);
        CHECK(r.embedding == (s == 0));
        CHECK(r.output == (s == n - 1));
        CHECK(r.units() >= 1);
        CHECK(r.units() <= previous_units);  // the remainder goes to the early stages
        CHECK(previous_units - r.units() <= 1);
        previous_units = r.units();
        block = r.end_block;
      }
      CHECK(block == layers);
    }
}

TEST_CASE("pipeline: stages split at torchtitan's split points") {
  const std::vector<int> points = parse_split_points(std::vector<std::string>{"layers.3", "layers.6"});
  CHECK(points == std::vector<int>{3, 6});
  CHECK(split_stages(8, 3, points) ==
        std::vector<StageRange>{{0, 3, true, false}, {3, 6, false, false}, {6, 8, false, true}});
  // layers.0: stage 0 holds the embedding alone; layers.8 (= n_layers): the last holds the output alone.
  const int ends[] = {0, 8};
  CHECK(split_stages(8, 3, ends) ==
        std::vector<StageRange>{{0, 0, true, false}, {0, 8, false, false}, {8, 8, false, true}});
  CHECK(parse_split_points(std::vector<std::string>{"layers.0", "layers.15"}) == std::vector<int>{0, 15});
  CHECK(parse_split_points(std::vector<std::string>{}).empty());
}

TEST_CASE("pipeline: stages split with the embedding and the output counting as other layer counts") {
  // torchtitan's pipeline_parallel_first_stage_less_layers = 2, _last_stage_less_layers =
  // 0: 8 blocks + 2 + 0 = 10 units on 4 stages, shares 3, 3, 2, 2; the first stage holds
  // 3 - 2 = 1 block, the last 2 - 0 = 2.
  CHECK(split_stages(8, 4, {}, config_keys, {2, 0}) ==
        std::vector<StageRange>{{0, 1, true, false}, {1, 4, false, false}, {4, 6, false, false}, {6, 8, false, true}});
  // One stage holds everything whatever the weights.
  CHECK(split_stages(8, 1, {}, config_keys, {3, 3}) == std::vector<StageRange>{{0, 8, true, true}});
  // The default weights are the default split.
  for (int layers = 1; layers <= 12; ++layers)
    for (int n = 1; n <= layers + 2; ++n) CHECK(split_stages(layers, n, {}, config_keys, {1, 1}) == split_stages(layers, n));
  // Every split: contiguous blocks, all of them, each stage its share less the weights on the ends.
  for (int layers = 1; layers <= 10; ++layers)
    for (int we = 0; we <= 3; ++we)
      for (int wo = 0; wo <= 3; ++wo)
        for (int n = 1; n <= layers + we + wo; ++n) {
          const int units = layers + we + wo, base = units / n;
          if (n > 1 && (we > base || wo > base)) continue;
          CAPTURE(layers);
          CAPTURE(we);
          CAPTURE(wo);
          CAPTURE(n);
          const std::vector<StageRange> st = split_stages(layers, n, {}, config_keys, {we, wo});
          REQUIRE(static_cast<int>(st.size()) == n);
          int block = 0;
          for (int i = 0; i < n; ++i) {
            const StageRange& r = st[static_cast<std::size_t>(i)];
            CHECK(r.first_block == block);
            const int share = base + (i < units % n ? 1 : 0);
            CHECK(r.blocks() == share - (i == 0 ? we : 0) - (i == n - 1 ? wo : 0));
            block = r.end_block;
          }
          CHECK(block == layers);
        }
  CHECK_ERROR_CONTAINS(split_stages(8, 4, {}, config_keys, {4, 1}),
                       "parallelism.pipeline_parallel_first_stage_less_layers = 4: more than the 3 layers of a stage "
                       "(8 layers + 4 for the embedding + 1 for the output = 13 units over 4 stages)");
  CHECK_ERROR_CONTAINS(split_stages(8, 4, {}, config_keys, {1, 5}),
                       "parallelism.pipeline_parallel_last_stage_less_layers = 5: more than the 3 layers of a stage");
  CHECK_ERROR_CONTAINS(split_stages(2, 6, {}, config_keys, {1, 2}),
                       "pipeline degree larger than the layer count: 6 stages for 2 layers + 1 for the embedding + 2 "
                       "for the output = 5 units");
}

TEST_CASE("pipeline: layers per stage set the stage count; it and the weights are the even split's") {
  PipelineOptions o;
  o.schedule = ScheduleKind::interleaved_1f1b;
  // 6 blocks + 1 + 1 = 8 units: 2 a stage make 4 stages, 2 on each of 2 ranks.
  o.layers_per_stage = 2;
  CHECK(stages_per_rank(o.schedule, o, 6, 2) == 2);
  CHECK(stages_per_rank(o.schedule, o, 6, 4) == 1);
  // 3 a stage: 3 stages (rounded up), not a multiple of 2 ranks.
  o.layers_per_stage = 3;
  CHECK_ERROR_CONTAINS(stages_per_rank(o.schedule, o, 6, 2),
                       "parallelism.pipeline_parallel_layers_per_stage = 3: 6 layers + embedding + output = 8 units "
                       "make 3 stages of at most 3, not a multiple of parallelism.pipeline_parallel_degree = 2");
  // The weights count: 6 + 0 + 0 = 6 units at 3 a stage, 2 stages.
  o.weights = {0, 0};
  CHECK(stages_per_rank(o.schedule, o, 6, 2) == 1);
  const StageSplit split = pipeline_stages(ScheduleKind::one_f_one_b, o, 6, 2);
  CHECK(split.stages == std::vector<StageRange>{{0, 3, true, false}, {3, 6, false, true}});
  // Split points place every block: with layers per stage, or weights other than 1, refused.
  o.split_points = {3};
  CHECK_ERROR_CONTAINS(stages_per_rank(o.schedule, o, 6, 2),
                       "parallelism.pipeline_parallel_split_points and parallelism.pipeline_parallel_layers_per_stage "
                       "both say where the stages begin: give one");
  o.layers_per_stage = 0;
  CHECK_ERROR_CONTAINS(stages_per_rank(o.schedule, o, 6, 2),
                       "parallelism.pipeline_parallel_split_points place every block: "
                       "parallelism.pipeline_parallel_first_stage_less_layers and "
                       "parallelism.pipeline_parallel_last_stage_less_layers weigh the even split only (leave them 1)");
  o.weights = {};
  CHECK(stages_per_rank(o.schedule, o, 6, 2) == 1);
  // In code the settings are named in words.
  o.split_points.clear();
  o.layers_per_stage = 3;
  CHECK_ERROR_CONTAINS(stages_per_rank(o.schedule, o, 6, 2, code_words),
                       "the pipeline's layers per stage 3: 6 layers + embedding + output = 8 units make 3 stages");
}

TEST_CASE("pipeline: stage splitting errors name the key and the numbers") {
  CHECK_ERROR_CONTAINS(split_stages(8, 11), "parallelism.pipeline_parallel_degree: pipeline degree larger than the "
                                            "layer count: 11 stages for 8 layers + embedding + output = 10 units");
  CHECK_ERROR_CONTAINS(split_stages(8, 0), "parallelism.pipeline_parallel_degree: the pipeline needs at least one stage");
  CHECK_ERROR_CONTAINS(split_stages(0, 1), "n_layers = 0");
  const int one[] = {3};
  CHECK_ERROR_CONTAINS(split_stages(8, 3, one), "parallelism.pipeline_parallel_split_points: 1 split points make 2 "
                                                "stages, but the pipeline has 3");
  const int far[] = {3, 9};
  CHECK_ERROR_CONTAINS(split_stages(8, 3, far),
                       "parallelism.pipeline_parallel_split_points: layers.9 is out of range: the model has blocks "
                       "layers.0 .. layers.7");
  const int negative[] = {-1, 3};
  CHECK_ERROR_CONTAINS(split_stages(8, 3, negative), "layers.-1 is out of range");
  const int twice[] = {3, 3};
  CHECK_ERROR_CONTAINS(split_stages(8, 3, twice), "parallelism.pipeline_parallel_split_points: stage 1 would hold "
                                                  "nothing: split point layers.3 is given twice");
  const int down[] = {5, 3};
  CHECK_ERROR_CONTAINS(split_stages(8, 3, down), "parallelism.pipeline_parallel_split_points: split points must be "
                                                 "strictly increasing, got layers.5 before layers.3");
  for (const char* bad : {"layer.3", "layers.", "layers.x", "layers.-1", "layers.+1", "layers.03", "layers.3a",
                          "tok_embeddings", "layers.12345678901"}) {
    const std::string name = bad;
    CAPTURE(name);
    CHECK_ERROR_CONTAINS(parse_split_points(std::vector<std::string>{name}),
                         "parallelism.pipeline_parallel_split_points: \"" + name + "\" is not a block name");
  }
}

TEST_CASE("pipeline: schedule names parse as torchtitan spells them") {
  for (ScheduleKind k : test::kAllScheduleKinds) CHECK(parse_schedule_kind(name_of(k)) == k);
  CHECK(parse_schedule_kind("1F1B") == ScheduleKind::one_f_one_b);
  CHECK(parse_schedule_kind("InterleavedZeroBubble") == ScheduleKind::interleaved_zero_bubble);
  CHECK(parse_schedule_kind("LoopedBFS") == ScheduleKind::looped_bfs);
  CHECK(parse_schedule_kind("ZBVZeroBubble") == ScheduleKind::zbv_zero_bubble);
  CHECK(parse_schedule_kind("DualPipeV") == ScheduleKind::dual_pipe_v);
  CHECK(test::kAllScheduleKinds.size() == 7);
  CHECK_ERROR_CONTAINS(parse_schedule_kind("interleaved1f1b"),
                       "parallelism.pipeline_parallel_schedule: unknown schedule \"interleaved1f1b\" (known: 1F1B, "
                       "Interleaved1F1B, GPipe, InterleavedZeroBubble, LoopedBFS, ZBVZeroBubble, DualPipeV, "
                       "PipelineScheduleSingle, PipelineScheduleMulti)");
  CHECK(splits_backward(ScheduleKind::interleaved_zero_bubble));
  CHECK(splits_backward(ScheduleKind::zbv_zero_bubble));
  CHECK(splits_backward(ScheduleKind::dual_pipe_v));
  CHECK_FALSE(splits_backward(ScheduleKind::interleaved_1f1b));
  CHECK_FALSE(splits_backward(ScheduleKind::looped_bfs));
  CHECK(default_stages_per_rank(ScheduleKind::one_f_one_b) == 1);
  CHECK(default_stages_per_rank(ScheduleKind::gpipe) == 1);
  CHECK(default_stages_per_rank(ScheduleKind::looped_bfs) == 2);
  CHECK(default_stages_per_rank(ScheduleKind::zbv_zero_bubble) == 2);
  CHECK(default_stages_per_rank(ScheduleKind::dual_pipe_v) == 2);
}

TEST_CASE("pipeline: schedule shapes a schedule cannot run are errors naming keys, schedule and minimum") {
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::one_f_one_b, 4, 1, 3),
                       "parallelism.pipeline_parallel_microbatch_size: schedule 1F1B on 4 ranks needs at least 4 "
                       "microbatches, got 3 (microbatches = training.local_batch_size / "
                       "parallelism.pipeline_parallel_microbatch_size)");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::interleaved_1f1b, 4, 2, 2),
                       "schedule Interleaved1F1B on 4 ranks needs at least 4 microbatches, got 2");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::interleaved_zero_bubble, 4, 1, 3),
                       "schedule InterleavedZeroBubble on 4 ranks needs at least 4 microbatches, got 3");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::interleaved_1f1b, 4, 2, 6),
                       "parallelism.pipeline_parallel_microbatch_size: schedule Interleaved1F1B with 2 stages per rank "
                       "needs a microbatch count that is a multiple of the 4 ranks, got 6");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::interleaved_zero_bubble, 2, 3, 5),
                       "schedule InterleavedZeroBubble with 3 stages per rank needs a microbatch count that is a "
                       "multiple of the 2 ranks, got 5");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::gpipe, 2, 2, 4),
                       "parallelism.pipeline_parallel_schedule: GPipe runs one stage per rank, got 2 stages per rank");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::one_f_one_b, 2, 3, 4), "1F1B runs one stage per rank, got 3");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::interleaved_1f1b, 2, 1, 4),
                       "parallelism.pipeline_parallel_schedule: Interleaved1F1B needs at least 2 stages per rank, "
                       "got 1 (with one stage per rank use 1F1B)");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::zbv_zero_bubble, 2, 3, 4),
                       "parallelism.pipeline_parallel_schedule: ZBVZeroBubble runs exactly 2 stages per rank (down the "
                       "ranks and back up), got 3");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::zbv_zero_bubble, 2, 1, 4), "ZBVZeroBubble runs exactly 2 stages");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::dual_pipe_v, 2, 4, 4), "DualPipeV runs exactly 2 stages per rank");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::dual_pipe_v, 4, 2, 7),
                       "parallelism.pipeline_parallel_microbatch_size: schedule DualPipeV on 4 ranks needs at least 8 "
                       "microbatches, got 7");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::looped_bfs, 2, 2, 0),
                       "schedule LoopedBFS needs at least 1 microbatch, got 0");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::gpipe, 0, 1, 4),
                       "parallelism.pipeline_parallel_degree: must be at least 1, got 0");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::gpipe, 2, 0, 4), "stages per rank must be at least 1, got 0");
  CHECK_ERROR_CONTAINS(make_schedule(ScheduleKind::gpipe, 2, 1, 0),
                       "parallelism.pipeline_parallel_microbatch_size: schedule GPipe needs at least 1 microbatch, got 0");
  // What the schedules accept: GPipe any M; the others M >= P; interleaved a multiple of P.
  CHECK(min_microbatches(ScheduleKind::gpipe, 4) == 1);
  CHECK(min_microbatches(ScheduleKind::one_f_one_b, 4) == 4);
  CHECK(test::schedule_fits(ScheduleKind::gpipe, 4, 1, 1));
  CHECK(test::schedule_fits(ScheduleKind::one_f_one_b, 4, 1, 5));
  CHECK(test::schedule_fits(ScheduleKind::interleaved_zero_bubble, 4, 1, 5));
  CHECK(test::schedule_fits(ScheduleKind::interleaved_1f1b, 4, 2, 8));
  CHECK_FALSE(test::schedule_fits(ScheduleKind::interleaved_zero_bubble, 4, 2, 5));
  // LoopedBFS any V and any M; ZBVZeroBubble V = 2 and any M (fewer than 2P - 1 leave gaps).
  CHECK(min_microbatches(ScheduleKind::looped_bfs, 4) == 1);
  CHECK(min_microbatches(ScheduleKind::zbv_zero_bubble, 4) == 1);
  CHECK(test::schedule_fits(ScheduleKind::looped_bfs, 4, 1, 1));
  CHECK(test::schedule_fits(ScheduleKind::looped_bfs, 4, 3, 5));
  CHECK(test::schedule_fits(ScheduleKind::zbv_zero_bubble, 4, 2, 3));
  CHECK_FALSE(test::schedule_fits(ScheduleKind::zbv_zero_bubble, 4, 1, 8));
  // DualPipeV: V = 2 and a microbatch per stage at least, any count above (PyTorch's rule).
  CHECK(min_microbatches(ScheduleKind::dual_pipe_v, 4) == 8);
  CHECK(test::schedule_fits(ScheduleKind::dual_pipe_v, 4, 2, 9));
}

TEST_CASE("pipeline: the V placement puts stages down the ranks and back up") {
  // Looping: stage s on rank s % P. V: rank r holds r and 2P-1-r (and, past two rounds,
  // 2P + r, 4P - 1 - r, ...): the first and last stages on rank 0, the middle two on P-1.
  for (int P = 1; P <= 8; ++P)
    for (int s = 0; s < 4 * P; ++s) {
      CAPTURE(P);
      CAPTURE(s);
      CHECK(rank_of_stage(Placement::loop, P, s) == s % P);
      const int round = s / P;
      CHECK(rank_of_stage(Placement::vee, P, s) == (round % 2 == 0 ? s % P : P - 1 - s % P));
      for (Placement pl : {Placement::loop, Placement::vee})
        CHECK(stage_of_rank(pl, P, rank_of_stage(pl, P, s), round) == s);  // the inverse, by local index
    }
  CHECK(placement_of(ScheduleKind::zbv_zero_bubble) == Placement::vee);
  CHECK(placement_of(ScheduleKind::dual_pipe_v) == Placement::vee);
  CHECK(placement_of(ScheduleKind::interleaved_1f1b) == Placement::loop);
  const Schedule zbv = make_schedule(ScheduleKind::zbv_zero_bubble, 4, 2, 8);
  CHECK(zbv.stages_of(0) == std::vector<int>{0, 7});
  CHECK(zbv.stages_of(3) == std::vector<int>{3, 4});
  CHECK(zbv.rank_of(7) == 0);
  CHECK(zbv.rank_of(5) == 2);
}

TEST_CASE("pipeline: 1F1B schedule order and timeline match the hand-derived ones") {
  // P = 2, M = 3. Rank 0 warms up with P-1-0 = 1 forward, rank 1 with none.
  const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 2, 1, 3);
  CHECK(format_order(s) ==
        "rank 0: F0 F1 B0 F2 B1 B2\n"
        "rank 1: F0 B0 F1 B1 F2 B2\n");
  // Forward 1, backward 2 (backward_input 1 + backward_weight 1). Rank 1's B0 ends at 4, so
  // rank 0's B0 runs 4-6; F2 6-7; rank 1 runs F2 7-8 and B2 8-10; rank 0 B2 10-12.
  CHECK(format_timeline(s) ==
        "rank 0: F0 F1 .  .  B0 -- F2 B1 -- .  B2 --\n"
        "rank 1: .  F0 B0 -- F1 B1 -- F2 B2 -- .  .\n");
  // P = 4, M = 8: warm-ups of 3, 2, 1, 0 forwards, then one forward and one backward in turn.
  CHECK(format_order(make_schedule(ScheduleKind::one_f_one_b, 4, 1, 8)) ==
        "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7\n"
        "rank 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7\n"
        "rank 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7\n"
        "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7\n");
  CHECK(format_order(make_schedule(ScheduleKind::gpipe, 2, 1, 3)) ==
        "rank 0: F0 F1 F2 B0 B1 B2\n"
        "rank 1: F0 F1 F2 B0 B1 B2\n");
}

TEST_CASE("pipeline: interleaved and zero-bubble schedule orders match the hand-derived ones") {
  // Interleaved1F1B, P = 2, V = 2 (stages 0, 2 on rank 0; 1, 3 on rank 1), M = 2. Warm-up
  // (V-1) P + 2 (P-1-r): 4 on rank 0 (all its forwards), 2 on rank 1.
  const Schedule il = make_schedule(ScheduleKind::interleaved_1f1b, 2, 2, 2);
  CHECK(il.stages_of(0) == std::vector<int>{0, 2});
  CHECK(il.rank_of(3) == 1);
  CHECK(format_order(il) ==
        "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n"
        "rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1\n");
  // 3B0 runs 4-6 on rank 1, so 2B0 runs 6-8 on rank 0; 3B1 7-9, 2B1 9-11; 1B0 9-11,
  // 1B1 11-13; 0B0 11-13, 0B1 13-15. Busy 12 of 15 on each rank: bubble 1/5.
  CHECK(format_timeline(il) ==
        "rank 0: 0F0 0F1 2F0 2F1 .   .   2B0 --- .   2B1 --- 0B0 --- 0B1 ---\n"
        "rank 1: .   1F0 1F1 3F0 3B0 --- 3F1 3B1 --- 1B0 --- 1B1 --- .   .\n");
  // InterleavedZeroBubble with V = 1 (ZB-H1), P = 2, M = 2: rank 1 delays each W by one backward.
  const Schedule zb = make_schedule(ScheduleKind::interleaved_zero_bubble, 2, 1, 2);
  CHECK(format_order(zb) ==
        "rank 0: F0 F1 I0 W0 I1 W1\n"
        "rank 1: F0 I0 F1 I1 W0 W1\n");
  CHECK(format_timeline(zb) ==
        "rank 0: F0 F1 .  I0 W0 I1 W1\n"
        "rank 1: .  F0 I0 F1 I1 W0 W1\n");
  CHECK(simulate(zb).bubble == doctest::Approx(1.0 / 7.0));
}

TEST_CASE("pipeline: LoopedBFS and ZBVZeroBubble orders match the hand-derived ones") {
  // LoopedBFS, P = 2, V = 2, M = 2: each stage's forwards in turn, then the backwards from
  // the last stage and the last microbatch.
  const Schedule bfs = make_schedule(ScheduleKind::looped_bfs, 2, 2, 2);
  CHECK(format_order(bfs) ==
        "rank 0: 0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0\n"
        "rank 1: 1F0 1F1 3F0 3F1 3B1 3B0 1B1 1B0\n");
  CHECK(format_timeline(bfs) ==
        "rank 0: 0F0 0F1 2F0 2F1 .   .   .   2B1 --- 2B0 --- 0B1 --- 0B0 ---\n"
        "rank 1: .   1F0 1F1 3F0 3F1 3B1 --- 3B0 --- 1B1 --- 1B0 --- .   .\n");
  // ZBVZeroBubble, P = 2, M = 3 (= 2P - 1: no microbatch left out). Rank 0 holds stages 0
  // and 3, rank 1 stages 1 and 2.
  //   rank 0: 2(P-0)-1 = 3 forwards of stage 0; P = 2 times F, I, W of stage 3; then stage
  //   0's I, W, stage 3's F, I, W; then P times stage 0's I and W.
  //   rank 1: 1 forward of stage 1; once F of stage 2, F of stage 1; once F, I, W of stage
  //   2; then stage 1's F, I, W and stage 2's F, I, W; once I of 1, I of 2; once I of 1 and
  //   stage 1's oldest W owed; the W's still owed, stage 2's first.
  const Schedule zbv = make_schedule(ScheduleKind::zbv_zero_bubble, 2, 2, 3);
  CHECK(format_order(zbv) ==
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2\n"
        "rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2\n");
  // Stage 1 -> 2 stays on rank 1 and stage 3 on rank 0 turns the microbatch round at once:
  // one unit of idle time a rank, (P-1) F.
  CHECK(format_timeline(zbv) ==
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2 .\n"
        "rank 1: .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2\n");
  // Fewer microbatches than 2P - 1: the same order with microbatch 2 left out.
  CHECK(format_order(make_schedule(ScheduleKind::zbv_zero_bubble, 2, 2, 2)) ==
        "rank 0: 0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1\n"
        "rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1\n");
}

TEST_CASE("pipeline: DualPipeV's order matches the hand-derived one") {
  // P = 2, M = 4, rank 0 (stages 0 and 3): 2(P-1) = 2 forwards of stage 0; once F of 0,
  // F of 3; once I of 3, its W, F of 3; M-2P+1 = 1 time F of 0, B of 3, F of 3, B of 0;
  // once B of 3, F of 3, B of 0; once B of 3 whole, then (halfway, rank 0 even) I of 0;
  // once the oldest W owed, I of 0; once the last W.
  const Schedule dpv = make_schedule(ScheduleKind::dual_pipe_v, 2, 2, 4);
  CHECK(format_order(dpv) ==
        "rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3\n"
        "rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3\n");
  // Whole backwards in the steady state, split ones in the warm-up and cool-down only.
  int whole = 0, split = 0;
  for (const auto& list : dpv.per_rank)
    for (const Action& a : list) {
      whole += a.op == B;
      split += a.op == I;
    }
  CHECK(whole == 11);
  CHECK(split == 5);
}

TEST_CASE("pipeline: every schedule over a grid of shapes is complete, well placed and free of deadlocks") {
  int checked = 0;
  for (ScheduleKind k : test::kAllScheduleKinds)
    for (int P = 1; P <= 8; ++P)
      for (int V = 1; V <= 4; ++V)
        for (int M = 1; M <= 16; ++M) {
          if (!test::schedule_fits(k, P, V, M)) continue;
          const std::string kind = name_of(k);
          CAPTURE(kind);
          CAPTURE(P);
          CAPTURE(V);
          CAPTURE(M);
          const Schedule s = make_schedule(k, P, V, M);
          REQUIRE(static_cast<int>(s.per_rank.size()) == P);
          // Counted here, independently of validate(): each op once per (stage, microbatch).
          const int S = P * V;
          std::vector<int> count(static_cast<std::size_t>(S * M * 4), 0);
          for (int r = 0; r < P; ++r)
            for (const Action& a : s.per_rank[static_cast<std::size_t>(r)]) {
              REQUIRE(a.stage >= 0);
              REQUIRE(a.stage < S);
              REQUIRE(a.microbatch >= 0);
              REQUIRE(a.microbatch < M);
              // The looping placement, or for ZBV and DualPipeV stages r and 2P-1-r.
              const bool vee = k == ScheduleKind::zbv_zero_bubble || k == ScheduleKind::dual_pipe_v;
              CHECK((vee ? (a.stage < P ? a.stage : 2 * P - 1 - a.stage) : a.stage % P) == r);
              ++count[static_cast<std::size_t>((a.stage * M + a.microbatch) * 4 + static_cast<int>(a.op))];
            }
          // Each backward whole, or split into I and W: every one for the zero-bubble
          // schedules, none for the others, some for DualPipeV.
          const bool split = k == ScheduleKind::interleaved_zero_bubble || k == ScheduleKind::zbv_zero_bubble;
          const bool mixed = k == ScheduleKind::dual_pipe_v;
          bool once = true;
          for (int i = 0; i < S * M; ++i) {
            const int* c = &count[static_cast<std::size_t>(i * 4)];
            const bool whole = c[1] == 1 && c[2] == 0 && c[3] == 0, parts = c[1] == 0 && c[2] == 1 && c[3] == 1;
            once = once && c[0] == 1 && (mixed ? whole || parts : split ? parts : whole);
          }
          CHECK(once);
          // Completes (simulate throws on a deadlock) under costs of different shapes.
          for (const Costs& c : {Costs{}, Costs{2, 3, 1}, Costs{3, 1, 1}}) {
            const Simulation sim = simulate(s, c);
            CHECK(sim.makespan > 0);
            CHECK(sim.bubble >= 0);
            CHECK(sim.bubble < 1);
          }
          ++checked;
        }
  // + LoopedBFS (every V, M) + ZBVZeroBubble (V = 2, every M) + DualPipeV (V = 2, M >= 2P)
  CHECK(checked == 580 + 8 * 4 * 16 + 8 * 16 + 64);
}

TEST_CASE("pipeline: simulated schedule bubbles equal the textbook figures") {
  // GPipe and 1F1B: (P-1)/(M+P-1) exactly, for forward 1 and backward 2 (backward_input 1
  // + backward_weight 1), and for other uniform costs; interleaved: (P-1)/(V M+P-1);
  // zero bubble with equal costs: (P-1)/(3 V M+P-1).
  for (int P = 1; P <= 8; ++P)
    for (int M = 1; M <= 16; ++M) {
      CAPTURE(P);
      CAPTURE(M);
      for (const Costs& c : {Costs{1, 1, 1}, Costs{2, 3, 1}, Costs{3, 0.5, 0.5}}) {
        CHECK(simulate(make_schedule(ScheduleKind::gpipe, P, 1, M), c).bubble == doctest::Approx(bubble_1f1b(P, M)));
        if (M >= P)
          CHECK(simulate(make_schedule(ScheduleKind::one_f_one_b, P, 1, M), c).bubble ==
                doctest::Approx(bubble_1f1b(P, M)));
      }
      for (int V = 1; V <= 4; ++V) {
        CAPTURE(V);
        if (V >= 2 && test::schedule_fits(ScheduleKind::interleaved_1f1b, P, V, M))
          CHECK(simulate(make_schedule(ScheduleKind::interleaved_1f1b, P, V, M)).bubble ==
                doctest::Approx(bubble_interleaved(P, V, M)));
        if (test::schedule_fits(ScheduleKind::interleaved_zero_bubble, P, V, M))
          CHECK(simulate(make_schedule(ScheduleKind::interleaved_zero_bubble, P, V, M)).bubble ==
                doctest::Approx(bubble_zero_bubble(P, V, M)));
        // LoopedBFS, once a rank's first stage has work for every rank (M >= P): the
        // interleaved bubble, under any uniform costs.
        if (M >= P)
          for (const Costs& c : {Costs{1, 1, 1}, Costs{2, 3, 1}})
            CHECK(simulate(make_schedule(ScheduleKind::looped_bfs, P, V, M), c).bubble ==
                  doctest::Approx(bubble_interleaved(P, V, M)));
      }
      // ZBVZeroBubble with the V filled (M >= 2P - 1) and equal costs: (P-1) F idle a rank,
      // the zero-bubble figure of two stages per rank.
      if (M >= 2 * P - 1)
        CHECK(simulate(make_schedule(ScheduleKind::zbv_zero_bubble, P, 2, M)).bubble ==
              doctest::Approx(bubble_zero_bubble(P, 2, M)));
      // DualPipeV run one op at a time: the same with equal costs.
      if (M >= 2 * P)
        CHECK(simulate(make_schedule(ScheduleKind::dual_pipe_v, P, 2, M)).bubble ==
              doctest::Approx(bubble_zero_bubble(P, 2, M)));
    }
  CHECK(bubble_1f1b(4, 8) == doctest::Approx(3.0 / 11.0));
  CHECK(bubble_interleaved(4, 2, 8) == doctest::Approx(3.0 / 19.0));
  CHECK(bubble_zero_bubble(4, 1, 8) == doctest::Approx(3.0 / 27.0));
  CHECK(bubble_1f1b(1, 5) == 0.0);
}

TEST_CASE("pipeline: interleaved and zero-bubble schedules have smaller bubbles than 1F1B") {
  for (int P = 2; P <= 8; ++P)
    for (int M = P; M <= 16; ++M) {
      CAPTURE(P);
      CAPTURE(M);
      const double one_f_one_b = simulate(make_schedule(ScheduleKind::one_f_one_b, P, 1, M)).bubble;
      CHECK(simulate(make_schedule(ScheduleKind::interleaved_zero_bubble, P, 1, M)).bubble < one_f_one_b);
      for (int V = 2; V <= 4; ++V) {
        CAPTURE(V);
        if (M % P != 0) continue;
        const double interleaved = simulate(make_schedule(ScheduleKind::interleaved_1f1b, P, V, M)).bubble;
        CHECK(interleaved < one_f_one_b);
        CHECK(simulate(make_schedule(ScheduleKind::interleaved_zero_bubble, P, V, M)).bubble < interleaved);
      }
    }
}

TEST_CASE("pipeline: schedule activation memory: 1F1B holds P microbatches on rank 0, GPipe all M") {
  for (int P = 1; P <= 8; ++P)
    for (int M = P; M <= 16; ++M) {
      CAPTURE(P);
      CAPTURE(M);
      const Simulation gpipe = simulate(make_schedule(ScheduleKind::gpipe, P, 1, M));
      const Simulation one = simulate(make_schedule(ScheduleKind::one_f_one_b, P, 1, M));
      const Simulation zb = simulate(make_schedule(ScheduleKind::interleaved_zero_bubble, P, 1, M));
      for (int r = 0; r < P; ++r) {
        CAPTURE(r);
        CHECK(gpipe.peak_in_flight[static_cast<std::size_t>(r)] == M);
        CHECK(one.peak_in_flight[static_cast<std::size_t>(r)] == P - r);
        CHECK(zb.peak_in_flight[static_cast<std::size_t>(r)] == P - r);  // ZB-H1: 1F1B's memory
      }
    }
  // LoopedBFS holds every microbatch of every stage; ZBVZeroBubble, once its V is filled,
  // 2P stage activations on every rank (each half a rank's layers: 1F1B's P on rank 0, on
  // every rank), and never more.
  for (int P = 1; P <= 8; ++P)
    for (int M = 1; M <= 16; ++M) {
      CAPTURE(P);
      CAPTURE(M);
      const Simulation bfs = simulate(make_schedule(ScheduleKind::looped_bfs, P, 2, M));
      const Simulation zbv = simulate(make_schedule(ScheduleKind::zbv_zero_bubble, P, 2, M));
      const Simulation dpv = M >= 2 * P ? simulate(make_schedule(ScheduleKind::dual_pipe_v, P, 2, M)) : Simulation{};
      for (int r = 0; r < P; ++r) {
        CAPTURE(r);
        CHECK(bfs.peak_in_flight[static_cast<std::size_t>(r)] == 2 * M);
        CHECK(zbv.peak_in_flight[static_cast<std::size_t>(r)] <= 2 * P);
        if (M >= 2 * P - 1) CHECK(zbv.peak_in_flight[static_cast<std::size_t>(r)] == 2 * P);
        // DualPipeV: one more, the forward it runs before the backward it is paired with.
        if (M >= 2 * P) CHECK(dpv.peak_in_flight[static_cast<std::size_t>(r)] == 2 * P + 1);
      }
    }
  // Interleaved, P = 4, V = 2, M = 8: warm-up (V-1) P + 2 (P-1-r) forwards, one more in the
  // steady state: 11, 9, 7, 5 stage activations (each half a rank's layers).
  CHECK(simulate(make_schedule(ScheduleKind::interleaved_1f1b, 4, 2, 8)).peak_in_flight == std::vector<int>{11, 9, 7, 5});
  // In general the warm-up plus one, at most all V M: (V-1) P + 2 (P-1-r) + 1 interleaved,
  // (V-1) P + (P-1-r) + 1 zero bubble.
  for (int P = 1; P <= 8; ++P)
    for (int V = 1; V <= 4; ++V)
      for (int M = P; M <= 16; M += P) {
        CAPTURE(P);
        CAPTURE(V);
        CAPTURE(M);
        const Simulation zb = simulate(make_schedule(ScheduleKind::interleaved_zero_bubble, P, V, M));
        const Simulation il = V >= 2 ? simulate(make_schedule(ScheduleKind::interleaved_1f1b, P, V, M)) : Simulation{};
        for (int r = 0; r < P; ++r) {
          CAPTURE(r);
          CHECK(zb.peak_in_flight[static_cast<std::size_t>(r)] == std::min((V - 1) * P + (P - 1 - r) + 1, V * M));
          if (V >= 2)
            CHECK(il.peak_in_flight[static_cast<std::size_t>(r)] == std::min((V - 1) * P + 2 * (P - 1 - r) + 1, V * M));
        }
      }
}

TEST_CASE("pipeline: schedule validation and deadlocks are errors naming the rank and the action") {
  // The hand-made schedules below have P = 2 ranks, M = 2 microbatches, one stage per rank.
  const std::vector<Action> good0 = {{F, 0, 0}, {F, 0, 1}, {B, 0, 0}, {B, 0, 1}};
  const std::vector<Action> good1 = {{F, 1, 0}, {B, 1, 0}, {F, 1, 1}, {B, 1, 1}};
  CHECK(simulate(custom(2, 2, {good0, good1})).makespan == doctest::Approx(9.0));
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {good0})), "has lists for 1 ranks, expected 2");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {{{F, 0, 0}, {F, 0, 2}, {B, 0, 0}, {B, 0, 1}}, good1})),
                       "rank 0, action 1 (forward of stage 0, microbatch 2) is out of range: 2 stages, 2 microbatches");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {good0, {{F, 1, 0}, {static_cast<Op>(7), 1, 0}, {F, 1, 1}, {B, 1, 1}}})),
                       "pipeline schedule 1F1B: rank 1, action 1 has no valid op (7)");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {{{F, 0, 0}, {F, 1, 1}, {B, 0, 0}, {B, 0, 1}}, good1})),
                       "rank 0, action 1 (forward of stage 1, microbatch 1) belongs to rank 1");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {{{F, 0, 0}, {F, 0, 0}, {B, 0, 0}, {B, 0, 1}}, good1})),
                       "rank 0, action 1 (forward of stage 0, microbatch 0) repeats an action");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {{{F, 0, 0}, {B, 0, 0}, {B, 0, 1}}, good1})),
                       "stage 0, microbatch 1 has no forward (on rank 0)");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {{{F, 0, 0}, {F, 0, 1}, {B, 0, 0}, {I, 0, 1}}, good1})),
                       "stage 0, microbatch 1 (rank 0) needs one backward or one backward_input and one "
                       "backward_weight, has 0 backward, 1 backward_input, 0 backward_weight");
  // A cycle across ranks: rank 0's B0 waits for rank 1's B0, which comes after rank 1's
  // F of microbatch 1, which waits for rank 0's F1, which comes after rank 0's B0.
  CHECK_ERROR_CONTAINS(
      simulate(custom(2, 2, {{{F, 0, 0}, {B, 0, 0}, {F, 0, 1}, {B, 0, 1}}, {{F, 1, 1}, {F, 1, 0}, {B, 1, 0}, {B, 1, 1}}})),
      "pipeline schedule 1F1B deadlocks: rank 0 waits at action 1 (backward of stage 0, microbatch 0) for the backward "
      "of stage 1, microbatch 0 on rank 1; rank 1 waits at action 0 (forward of stage 1, microbatch 1) for the "
      "forward of stage 0, microbatch 1 on rank 0");
  // A weight gradient before its input gradient on the same rank waits for ever.
  Schedule w_first{ScheduleKind::interleaved_zero_bubble, 1, 1, 1, {{{F, 0, 0}, {W, 0, 0}, {I, 0, 0}}}};
  CHECK_ERROR_CONTAINS(simulate(w_first), "pipeline schedule InterleavedZeroBubble deadlocks: rank 0 waits at action 1 "
                                          "(backward_weight of stage 0, microbatch 0) for the backward_input of stage "
                                          "0, microbatch 0 on rank 0");
  CHECK_ERROR_CONTAINS(simulate(custom(2, 2, {good0, good1}), Costs{-1, 1, 1}),
                       "pipeline simulation: costs must be non-negative");
  CHECK_ERROR_CONTAINS(format_timeline(custom(2, 2, {good0, good1}), Costs{1, 0.5, 1}),
                       "pipeline timeline: needs whole-number costs of at least 1, got forward 1, backward_input 0.5");
}

TEST_CASE("pipeline: schedule description for logs") {
  CHECK(describe(make_schedule(ScheduleKind::one_f_one_b, 4, 1, 8)) ==
        "1F1B, 4 ranks x 1 stage, 8 microbatches, bubble 27.3%");
  CHECK(describe(make_schedule(ScheduleKind::interleaved_1f1b, 4, 2, 8)) ==
        "Interleaved1F1B, 4 ranks x 2 stages, 8 microbatches, bubble 15.8%");
  CHECK(describe(make_schedule(ScheduleKind::gpipe, 1, 1, 1)) == "GPipe, 1 rank x 1 stage, 1 microbatch, bubble 0.0%");
  CHECK(describe(make_schedule(ScheduleKind::zbv_zero_bubble, 4, 2, 8)) ==
        "ZBVZeroBubble, 4 ranks x 2 stages, 8 microbatches, bubble 5.9%");
  const Simulation sim = simulate(make_schedule(ScheduleKind::one_f_one_b, 4, 1, 8));
  CHECK(sim.makespan == doctest::Approx(33.0));  // (M + P - 1) x (1 + 2)
  CHECK(sim.busy == std::vector<double>{24.0, 24.0, 24.0, 24.0});
}

}  // namespace test_schedule
