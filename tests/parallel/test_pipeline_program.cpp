// Pipeline schedules lowered to point-to-point programs under NCCL's rules
// (parallel/pipeline_program.hpp): every schedule over a grid of shapes, and the
// forward-only walk, lower to programs the checker accepts; each send goes out right after
// the compute that makes it; and the checker refuses the programs that break the rules
// (rendezvous sends not grouped, transfers in swapped order, data used before its recv
// or sent before it is computed), each next to the valid program it was made from.
// Run alone with --test-case='pipeline program:*'.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/parallel/pipeline_program.hpp"
#include "tessera/parallel/pipeline_runner.hpp"
#include "tessera/parallel/schedule.hpp"
#include "schedule_shapes.hpp"

namespace test_pipeline_program {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::parallel;
using tessera::parallel::Op;  // the schedule's action kind, not the checkpoint policy's tessera::Op

namespace {

/// The program a runtime with buffered sends would issue: each recv just before the
/// compute that needs it and each send just after the compute that makes it, every
/// transfer a group of its own.
Program eager(const Schedule& s) {
  Program p{s.ranks, s.stages_per_rank, s.placement(), {}};
  const int S = s.stages();
  for (int r = 0; r < s.ranks; ++r) {
    std::vector<Step> steps;
    for (const Action& a : s.per_rank[static_cast<std::size_t>(r)]) {
      if (const auto in = input_of(a, S); in && s.rank_of(in->stage) != r)
        steps.push_back(Step::transfers({{Transfer::Kind::recv, s.rank_of(in->stage), *in}}));
      steps.push_back(Step::compute(a));
      if (const auto out = output_of(a, S); out && s.rank_of(out->consumer()) != r)
        steps.push_back(Step::transfers({{Transfer::Kind::send, s.rank_of(out->consumer()), *out}}));
    }
    p.per_rank.push_back(std::move(steps));
  }
  return p;
}

Transfer send(int peer, Carries c, int stage, int m) { return {Transfer::Kind::send, peer, {c, stage, m}}; }
Transfer recv(int peer, Carries c, int stage, int m) { return {Transfer::Kind::recv, peer, {c, stage, m}}; }
Step compute(Op op, int stage, int m) { return Step::compute({op, stage, m}); }

constexpr Carries A = Carries::activation, G = Carries::gradient;

/// Stages whose tensors are one number naming what they carry: stage s's forward of
/// microbatch m outputs 100 m + s, its backward -(100 m + s); each checks its input and
/// records what ran, so a tensor delivered to the wrong compute shows.
struct NumberStages {
  using tensor_type = Tensor<float>;
  int stages = 1;
  std::vector<Action> ran;
  std::vector<std::string> wrong;
  std::vector<std::pair<int, int>> weight_grads_owed;

  Tensor<float> transfer_buffer() const { return Cpu::empty<float>(Shape{1}); }
  Tensor<float> number(float v) const {
    Tensor<float> t = Cpu::empty<float>(Shape{1});
    t.data()[0] = v;
    return t;
  }
  void expect(const Tensor<float>& x, float v, const Action& a) {
    if (x.empty() || x.data()[0] != v)
      wrong.push_back(tessera::detail::concat(parallel::detail::spell(a), " got ", x.empty() ? -1.0f : x.data()[0], ", not ", v));
  }
  Tensor<float> forward(int s, int m, Tensor<float> x, double& loss) {
    ran.push_back({Op::forward, s, m});
    if (s > 0) expect(x, static_cast<float>(100 * m + s - 1), ran.back());
    if (s == stages - 1) {
      loss += 100 * m + s;
      return {};
    }
    return number(static_cast<float>(100 * m + s));
  }
  Tensor<float> backward(int s, int m, Tensor<float> dy, bool defer) {
    ran.push_back({defer ? Op::backward_input : Op::backward, s, m});
    if (s < stages - 1) expect(dy, -static_cast<float>(100 * m + s + 1), ran.back());
    if (defer) weight_grads_owed.emplace_back(s, m);
    return s == 0 ? Tensor<float>{} : number(-static_cast<float>(100 * m + s));
  }
  void backward_weight(int s, int m) {
    ran.push_back({Op::backward_weight, s, m});
    std::erase(weight_grads_owed, std::pair{s, m});
  }
};

}  // namespace

TEST_CASE("pipeline program: every schedule over a grid of shapes lowers to a program the checker accepts") {
  int lowered = 0;
  for (ScheduleKind kind : test::kAllScheduleKinds)
    for (int P = 2; P <= 4; ++P)
      for (int V = 1; V <= 3; ++V)
        for (int M = 1; M <= 3 * P; ++M) {
          if (!test::schedule_fits(kind, P, V, M)) continue;
          CAPTURE(std::string(name_of(kind)));
          CAPTURE(P);
          CAPTURE(V);
          CAPTURE(M);
          const Schedule s = make_schedule(kind, P, V, M);
          const Program p = lower(s);
          CHECK_NOTHROW(check_program(p));
          ++lowered;

          const int S = s.stages();
          int sends = 0, recvs = 0, expected = 0;
          for (int r = 0; r < P; ++r) {
            const auto& steps = p.per_rank[static_cast<std::size_t>(r)];
            std::vector<Action> computes;
            for (std::size_t i = 0; i < steps.size(); ++i) {
              const Step& step = steps[i];
              if (step.kind == Step::Kind::compute) {
                computes.push_back(step.action);
                // Each output for another rank is sent before the next compute (the V
                // placement's middle stages hand theirs over on the rank).
                if (const auto out = output_of(step.action, S); out && p.rank_of(out->consumer()) != r) {
                  ++expected;
                  const Transfer sent{Transfer::Kind::send, p.rank_of(out->consumer()), *out};
                  bool issued = false;
                  for (std::size_t j = i + 1; j < steps.size() && steps[j].kind == Step::Kind::transfers; ++j)
                    for (const Transfer& t : steps[j].group) issued = issued || t == sent;
                  CAPTURE(i);
                  CHECK(issued);
                }
                continue;
              }
              // A group: sends, then at most one recv, last.
              for (std::size_t k = 0; k < step.group.size(); ++k) {
                const bool is_recv = step.group[k].kind == Transfer::Kind::recv;
                (is_recv ? recvs : sends) += 1;
                CHECK((!is_recv || k + 1 == step.group.size()));
              }
            }
            CHECK(computes == s.per_rank[static_cast<std::size_t>(r)]);  // the schedule's order, untouched
          }
          CHECK(sends == expected);
          CHECK(recvs == expected);
        }
  CHECK(lowered > 50);
}

TEST_CASE("pipeline program: the forward-only walk lowers to a program the checker accepts") {
  for (Placement placement : {Placement::loop, Placement::vee})
    for (int P = 1; P <= 4; ++P)
      for (int V = 1; V <= 3; ++V) {
        CAPTURE(P);
        CAPTURE(V);
        const Program p = lower_forward(P, V, placement);
        CHECK_NOTHROW(check_program(p));
        for (int r = 0; r < P; ++r) {
          int forwards = 0;
          for (const Step& step : p.per_rank[static_cast<std::size_t>(r)])
            forwards += step.kind == Step::Kind::compute && step.action.op == Op::forward &&
                        rank_of_stage(placement, P, step.action.stage) == r;
          CHECK(forwards == V);
        }
      }
  // The V placement on 2 ranks x 2 stages: stage 1 hands its activation to stage 2 on
  // rank 1 itself: one transfer each way between the ranks (rank 0 sends stage 0's and
  // asks for stage 2's in one group), none for the middle.
  const Program vee = lower_forward(2, 2, Placement::vee);
  CHECK(format_program(vee) ==
        "rank 0: 0F0 [s a0.0->1 r a2.0<-1] 3F0\n"
        "rank 1: [r a0.0<-0] 1F0 2F0 [s a2.0->0]\n");
  // One rank: no transfers at all.
  const Program one = lower(make_schedule(ScheduleKind::one_f_one_b, 1, 1, 4));
  CHECK_NOTHROW(check_program(one));
  for (const Step& step : one.per_rank[0])
    CHECK(step.kind == Step::Kind::compute);
}

TEST_CASE("pipeline program: 1F1B on 2 ranks, transfers in the order their data is made") {
  const Program p = lower(make_schedule(ScheduleKind::one_f_one_b, 2, 1, 3));
  CHECK(format_program(p) ==
        "rank 0: F0 [s a0.0->1] F1 [s a0.1->1 r g1.0<-1] B0 F2 [s a0.2->1 r g1.1<-1] B1 [r g1.2<-1] B2\n"
        "rank 1: [r a0.0<-0] F0 B0 [r a0.1<-0] [s g1.0->0] F1 B1 [r a0.2<-0] [s g1.1->0] F2 B2 [s g1.2->0]\n");
}

TEST_CASE("pipeline program: the checker refuses the eager sends of a buffered runtime (1F1B deadlocks)") {
  for (int P = 2; P <= 4; ++P) {
    CAPTURE(P);
    const Schedule s = make_schedule(ScheduleKind::one_f_one_b, P, 1, 2 * P);
    CHECK_NOTHROW(check_program(lower(s)));
    const std::string message = testing::error_of([&] { check_program(eager(s)); });
    INFO(message);
    CHECK(message.find("pipeline program deadlocks:") != std::string::npos);
    CHECK(message.find("rank 0 waits at step") != std::string::npos);
    CHECK(message.find("rank 1 waits at step") != std::string::npos);
    CHECK(message.find("send activation of stage 0") != std::string::npos);
  }
  // GPipe, whose sends all go one way, runs even so.
  CHECK_NOTHROW(check_program(eager(make_schedule(ScheduleKind::gpipe, 3, 1, 4))));
  // The example of the rules: rank 0 sends activation 1 then receives gradient 0, rank 1
  // sends gradient 0 then receives activation 1, each on its own.
  Program p{2, 1, Placement::loop, {}};
  p.per_rank = {
      {compute(Op::forward, 0, 0), Step::transfers({send(1, A, 0, 0)}), compute(Op::forward, 0, 1),
       Step::transfers({send(1, A, 0, 1)}), Step::transfers({recv(1, G, 1, 0)}), compute(Op::backward, 0, 0),
       Step::transfers({recv(1, G, 1, 1)}), compute(Op::backward, 0, 1)},
      {Step::transfers({recv(0, A, 0, 0)}), compute(Op::forward, 1, 0), compute(Op::backward, 1, 0),
       Step::transfers({send(0, G, 1, 0)}), Step::transfers({recv(0, A, 0, 1)}), compute(Op::forward, 1, 1),
       compute(Op::backward, 1, 1), Step::transfers({send(0, G, 1, 1)})}};
  CHECK_ERROR_CONTAINS(check_program(p),
                       "rank 0 waits at step 5 (backward of stage 0, microbatch 0) for its recv, its transfer group at "
                       "step 3 is stuck on [send activation of stage 0, microbatch 1 to rank 1, whose match is in rank "
                       "1's group at step 4]; rank 1 waits at step 5 (forward of stage 1, microbatch 1) for its recv, "
                       "its transfer group at step 3 is stuck on [send gradient of stage 1, microbatch 0 to rank 0, "
                       "whose match is in rank 0's group at step 4]");
  // Grouping either side's pair is enough.
  p.per_rank[0][3] = Step::transfers({send(1, A, 0, 1), recv(1, G, 1, 0)});
  p.per_rank[0].erase(p.per_rank[0].begin() + 4);
  CHECK_NOTHROW(check_program(p));
}

TEST_CASE("pipeline program: the checker refuses transfers in swapped issue order") {
  // GPipe on 2 ranks, 2 microbatches; rank 1 receives both activations up front.
  Program p{2, 1, Placement::loop, {}};
  p.per_rank = {
      {compute(Op::forward, 0, 0), Step::transfers({send(1, A, 0, 0)}), compute(Op::forward, 0, 1),
       Step::transfers({send(1, A, 0, 1), recv(1, G, 1, 0)}), compute(Op::backward, 0, 0),
       Step::transfers({recv(1, G, 1, 1)}), compute(Op::backward, 0, 1)},
      {Step::transfers({recv(0, A, 0, 0)}), Step::transfers({recv(0, A, 0, 1)}), compute(Op::forward, 1, 0),
       compute(Op::forward, 1, 1), compute(Op::backward, 1, 0), Step::transfers({send(0, G, 1, 0)}),
       compute(Op::backward, 1, 1), Step::transfers({send(0, G, 1, 1)})}};
  CHECK_NOTHROW(check_program(p));
  std::swap(p.per_rank[1][0], p.per_rank[1][1]);
  CHECK_ERROR_CONTAINS(check_program(p),
                       "pipeline program: mismatched transfer 0 from rank 0 to rank 1: rank 0 issues send activation "
                       "of stage 0, microbatch 0 to rank 1 (step 1) but rank 1 issues recv activation of stage 0, "
                       "microbatch 1 from rank 0 (step 0)");
  std::swap(p.per_rank[1][0], p.per_rank[1][1]);
  // A recv that has no send.
  p.per_rank[1].insert(p.per_rank[1].begin() + 2, Step::transfers({recv(0, A, 0, 1)}));
  CHECK_ERROR_CONTAINS(check_program(p), "rank 0 sends 2 tensors to rank 1, which receives 3 from it");
}

TEST_CASE("pipeline program: the checker refuses data used before its recv or sent before it is computed") {
  Program p = lower(make_schedule(ScheduleKind::one_f_one_b, 2, 1, 2));
  CHECK_NOTHROW(check_program(p));
  // rank 1: [r a0.0<-0] F0 B0 ... with the recv after the forward that needs it.
  auto& rank1 = p.per_rank[1];
  REQUIRE(rank1[0].kind == Step::Kind::transfers);
  std::swap(rank1[0], rank1[1]);
  CHECK_ERROR_CONTAINS(check_program(p), "pipeline program: rank 1, step 0 (forward of stage 1, microbatch 0) uses the "
                                         "activation of stage 0, microbatch 0 before any group receives it");
  std::swap(rank1[0], rank1[1]);
  CHECK_NOTHROW(check_program(p));
  // rank 0: F0 [s a0.0->1] ... with the send before the forward that makes it.
  auto& rank0 = p.per_rank[0];
  std::swap(rank0[0], rank0[1]);
  CHECK_ERROR_CONTAINS(check_program(p), "pipeline program: rank 0, step 0: send activation of stage 0, microbatch 0 "
                                         "to rank 1 before the compute that makes it");
  std::swap(rank0[0], rank0[1]);
  // A transfer to the wrong rank.
  rank0[1].group[0].peer = 0;
  CHECK_ERROR_CONTAINS(check_program(p), "is out of range (2 ranks, 2 stages) or to itself");
}

TEST_CASE("pipeline program: run_pipeline delivers every tensor to its compute over thread ranks, untagged") {
  for (ScheduleKind kind : test::kAllScheduleKinds)
    for (int P = 2; P <= 3; ++P) {
      const int V = default_stages_per_rank(kind), M = 2 * P;
      CAPTURE(std::string(name_of(kind)));
      CAPTURE(P);
      const Schedule s = make_schedule(kind, P, V, M);
      const Program program = lower(s);
      std::vector<NumberStages> stages(static_cast<std::size_t>(P));
      std::vector<double> losses(static_cast<std::size_t>(P));
      comm::run_thread_ranks(P, [&](comm::Communicator& c) {
        NumberStages& mine = stages[static_cast<std::size_t>(c.rank())];
        mine.stages = s.stages();
        losses[static_cast<std::size_t>(c.rank())] = run_pipeline<Cpu>(program, c.rank(), c, mine).loss;
      }, tessera::test::nccl_rules());
      double expected = 0;
      for (int m = 0; m < M; ++m) expected += 100 * m + s.stages() - 1;
      for (int r = 0; r < P; ++r) {
        CAPTURE(r);
        const NumberStages& st = stages[static_cast<std::size_t>(r)];
        CHECK(st.ran == s.per_rank[static_cast<std::size_t>(r)]);
        CHECK(st.wrong.empty());
        if (!st.wrong.empty()) INFO(st.wrong.front());
        CHECK(st.weight_grads_owed.empty());
        CHECK(losses[static_cast<std::size_t>(r)] == expected);
      }
    }
  // The forward-only walk, under both placements.
  for (Placement placement : {Placement::loop, Placement::vee}) {
    const int P = 3, V = 2;
    std::vector<NumberStages> stages(static_cast<std::size_t>(P));
    std::vector<double> losses(static_cast<std::size_t>(P));
    comm::run_thread_ranks(P, [&](comm::Communicator& c) {
      NumberStages& mine = stages[static_cast<std::size_t>(c.rank())];
      mine.stages = P * V;
      losses[static_cast<std::size_t>(c.rank())] =
          run_pipeline<Cpu>(lower_forward(P, V, placement), c.rank(), c, mine).loss;
    }, tessera::test::nccl_rules());
    for (int r = 0; r < P; ++r) {
      CHECK(stages[static_cast<std::size_t>(r)].wrong.empty());
      CHECK(losses[static_cast<std::size_t>(r)] == P * V - 1);
    }
  }
}

}  // namespace test_pipeline_program
