// Pipeline schedules lowered to point-to-point programs that NCCL can run, and a checker
// that proves a program free of deadlocks and mismatches under NCCL's rules.
//
// A Schedule (schedule.hpp) says what each rank computes and in which order; it says
// nothing about the transfers between ranks. A Program adds them: each rank gets an
// ordered list of steps, each step either one compute Action or one group of transfers
// issued together (one Communicator::send_recv_async call). The rules the lowering must
// satisfy are NCCL's, on one communicator, taken at their strictest:
//   - no tags: the k-th send from rank A to rank B matches the k-th recv on B from A, in
//     issue order, and both must move the same data;
//   - each rank runs its groups one at a time, in issue order (one stream);
//   - a send completes only when its receiver's matching recv runs (no buffering);
//   - the operations of one group progress together; the group completes when all of
//     them have, and the rank's next group starts only after that;
//   - a compute that needs a received tensor waits for the group of its recv.
// Issuing a group does not block the host: a compute that needs nothing received runs
// while the rank's earlier groups are still in flight.
//
// The lowering (lower, lower_forward). Rendezvous sends deadlock when two ranks disagree
// on the order of the transfers between them (1F1B's steady state done naively: rank r
// sends activation m+1 and then waits for gradient m, rank r+1 sends gradient m and then
// waits for activation m+1). So every rank issues its transfers in one global order:
//   1. run the action lists as if sends were buffered, each op taking one unit of time
//      (what simulate() in schedule.hpp does), which gives the time each tensor is made;
//   2. order every transfer by that time (ties broken by the tensor itself), the same
//      order on both of its ends;
//   3. walk each rank's actions: before an action, issue its recv (and every transfer
//      ordered before it); after an action, issue its send (and every transfer ordered
//      before it, which can be: a send ordered before it was made by an earlier action,
//      and a recv may be issued before it is needed).
// A group ends at each recv, so a compute waits for its recv and what is ordered before
// it, never for a later transfer; the sends and the recv issued between two computes go
// in one group and progress together. Every send is issued right after the compute that
// makes it (the earliest point the rules allow), and a recv no later than just before the
// compute that needs it.
// Why it cannot deadlock: take the first transfer, in the global order, that has not
// completed. Every transfer before it has, so on both of its ranks the groups before it
// have completed, no host waits for anything before it, and both ranks have issued it:
// its group runs on both ends, and it completes. The tests also run check_program on
// every schedule and shape.
//
// check_program simulates the rules over every rank's program at once and throws on a
// deadlock (naming each stuck rank, its group and what the peer is doing), on a
// mismatched pair (the k-th send and the k-th recv of a rank pair moving different
// data) and on data used before it exists (a compute before the recv of its input, a
// send before the compute of its data).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/schedule.hpp"

namespace tessera::parallel {

/// What crosses between two stages: the activation a stage's forward produces (the next
/// stage's input), or the gradient its backward produces (the previous stage's output
/// gradient).
enum class Carries : std::uint8_t { activation, gradient };

/// One tensor moved between stages, named by the stage that produces it.
struct Payload {
  Carries what = Carries::activation;
  int stage = 0;       ///< the producer: forward of `stage` (activation), backward of `stage` (gradient)
  int microbatch = 0;
  friend bool operator==(const Payload&, const Payload&) = default;

  /// The stage that consumes it: stage + 1 for an activation, stage - 1 for a gradient.
  [[nodiscard]] int consumer() const { return what == Carries::activation ? stage + 1 : stage - 1; }
};

/// One send or recv of a group; `peer` is a pipeline rank.
struct Transfer {
  enum class Kind : std::uint8_t { send, recv };
  Kind kind = Kind::send;
  int peer = 0;
  Payload payload;
  friend bool operator==(const Transfer&, const Transfer&) = default;
};

/// One step of a rank's program: a compute, or a group of transfers issued together.
struct Step {
  enum class Kind : std::uint8_t { compute, transfers };
  Kind kind = Kind::compute;
  Action action;                ///< kind == compute
  std::vector<Transfer> group;  ///< kind == transfers: issued as one send_recv_async call

  static Step compute(Action a) { return Step{Kind::compute, a, {}}; }
  static Step transfers(std::vector<Transfer> g) { return Step{Kind::transfers, {}, std::move(g)}; }
};

/// Every pipeline rank's steps, in the order each rank runs them.
struct Program {
  int ranks = 1;            ///< P
  int stages_per_rank = 1;  ///< V
  Placement placement = Placement::loop;
  std::vector<std::vector<Step>> per_rank;

  [[nodiscard]] int stages() const { return ranks * stages_per_rank; }
  [[nodiscard]] int rank_of(int stage) const { return rank_of_stage(placement, ranks, stage); }
};

/// The tensor `a` takes from another stage, if any: a forward's input activation (not on
/// stage 0, which reads the tokens), a backward's output gradient (not on the last stage,
/// whose forward made it). A backward_weight takes nothing.
inline std::optional<Payload> input_of(const Action& a, int stages) {
  if (a.op == Op::forward && a.stage > 0) return Payload{Carries::activation, a.stage - 1, a.microbatch};
  if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage < stages - 1)
    return Payload{Carries::gradient, a.stage + 1, a.microbatch};
  return std::nullopt;
}

/// The tensor `a` hands to another stage, if any: a forward's output (not on the last
/// stage, which computes the loss), a backward's input gradient (not on stage 0).
inline std::optional<Payload> output_of(const Action& a, int stages) {
  if (a.op == Op::forward && a.stage < stages - 1) return Payload{Carries::activation, a.stage, a.microbatch};
  if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage > 0)
    return Payload{Carries::gradient, a.stage, a.microbatch};
  return std::nullopt;
}

namespace detail {

/// When each action of `lists` starts if every transfer were buffered and each op took
/// one unit of time (the schedule's simulate() with its default costs, for any lists of
/// actions, forward-only ones too): start[r][i] for rank r's i-th action. Throws if the
/// lists deadlock even so.
inline std::vector<std::vector<double>> buffered_start_times(int ranks, int stages,
                                                             const std::vector<std::vector<Action>>& lists) {
  int M = 1;
  for (const auto& list : lists)
    for (const Action& a : list) M = std::max(M, a.microbatch + 1);
  auto at = [&](const Payload& x) {
    return static_cast<std::size_t>((static_cast<int>(x.what) * stages + x.stage) * M + x.microbatch);
  };
  std::vector<double> made(static_cast<std::size_t>(2 * stages * M), -1.0);  // when each payload exists
  std::vector<std::vector<double>> start(static_cast<std::size_t>(ranks));
  std::vector<double> clock(static_cast<std::size_t>(ranks), 0.0);
  std::size_t remaining = 0;
  for (const auto& list : lists) remaining += list.size();
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < ranks; ++r) {
      const auto& list = lists[static_cast<std::size_t>(r)];
      auto& begun = start[static_cast<std::size_t>(r)];
      double& now = clock[static_cast<std::size_t>(r)];
      while (begun.size() < list.size()) {
        const Action& a = list[begun.size()];
        double ready = 0.0;
        if (const auto in = input_of(a, stages)) ready = made[at(*in)];
        if (ready < 0) break;
        begun.push_back(std::max(now, ready));
        now = begun.back() + 1.0;
        if (const auto out = output_of(a, stages)) made[at(*out)] = now;
        --remaining;
        progress = true;
      }
    }
    TESSERA_CHECK(progress, "pipeline program: the action lists deadlock even with buffered sends");
  }
  return start;
}

/// Lowers per-rank action lists over `ranks` x `stages_per_rank` stages placed by
/// `placement` (see the header comment). A tensor whose producer and consumer share a
/// rank (one rank only, or the two middle stages of the V placement) gets no transfer:
/// the runner hands it over in memory.
inline Program lower_lists(int ranks, int stages_per_rank, Placement placement,
                           const std::vector<std::vector<Action>>& lists) {
  Program p{ranks, stages_per_rank, placement, {}};
  const int S = p.stages();
  const auto start = buffered_start_times(ranks, S, lists);
  // The order every rank issues its transfers in: by when the payload is made (in the
  // buffered run above), ties broken by the payload itself, so both ends agree.
  struct Keyed {
    double made;
    Transfer t;
  };
  auto key = [](const Keyed& k) {
    const Payload& x = k.t.payload;
    return std::tuple{k.made, x.stage, x.microbatch, static_cast<int>(x.what)};
  };
  std::vector<std::vector<Keyed>> order(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const auto& list = lists[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      const double made = start[static_cast<std::size_t>(r)][i] + 1.0;
      if (const auto out = output_of(list[i], S); out && p.rank_of(out->consumer()) != r) {
        const int to = p.rank_of(out->consumer());
        order[static_cast<std::size_t>(r)].push_back({made, {Transfer::Kind::send, to, *out}});
        order[static_cast<std::size_t>(to)].push_back({made, {Transfer::Kind::recv, r, *out}});
      }
    }
  }
  for (int r = 0; r < ranks; ++r) {
    auto& ops = order[static_cast<std::size_t>(r)];
    std::sort(ops.begin(), ops.end(), [&](const Keyed& a, const Keyed& b) { return key(a) < key(b); });
  }

  for (int r = 0; r < ranks; ++r) {
    const auto& list = lists[static_cast<std::size_t>(r)];
    const auto& ops = order[static_cast<std::size_t>(r)];
    std::vector<Step> steps;
    std::vector<Transfer> group;  // sends issued since the last compute, not yet in a step
    std::size_t next = 0;         // the first transfer not issued
    auto flush = [&] {
      if (!group.empty()) steps.push_back(Step::transfers(std::exchange(group, {})));
    };
    // Issues ops[next, end): a group ends at each recv, so a compute waits for its
    // recv and what is ordered before it, never for a transfer ordered after it.
    auto issue = [&](std::size_t end) {
      for (; next < end; ++next) {
        group.push_back(ops[next].t);
        if (ops[next].t.kind == Transfer::Kind::recv) flush();
      }
    };
    auto position = [&](const Payload& x) {
      std::size_t at = 0;
      while (ops[at].t.payload != x) ++at;
      return at;
    };
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      // Its recv, after every transfer ordered before it (each send ordered before it
      // was made by an earlier compute); already issued when a send came after it.
      if (const auto in = input_of(a, S); in && p.rank_of(in->stage) != r) issue(std::max(next, position(*in) + 1));
      flush();
      steps.push_back(Step::compute(a));
      // Its send, after every transfer ordered before it: always possible, as each send
      // ordered before it was made by an earlier compute and recvs can be issued early.
      if (const auto out = output_of(a, S); out && p.rank_of(out->consumer()) != r) issue(position(*out) + 1);
    }
    issue(ops.size());
    flush();
    p.per_rank.push_back(std::move(steps));
  }
  return p;
}

inline const char* carries_name(Carries c) { return c == Carries::activation ? "activation" : "gradient"; }

/// "send activation of stage 1, microbatch 2 to rank 2".
inline std::string spell(const Transfer& t) {
  return ::tessera::detail::concat(t.kind == Transfer::Kind::send ? "send " : "recv ", carries_name(t.payload.what),
                                   " of stage ", t.payload.stage, ", microbatch ", t.payload.microbatch,
                                   t.kind == Transfer::Kind::send ? " to rank " : " from rank ", t.peer);
}

/// "{send ...; recv ...}".
inline std::string spell(const std::vector<Transfer>& group) {
  std::string s = "{";
  for (std::size_t i = 0; i < group.size(); ++i) s += (i ? "; " : "") + spell(group[i]);
  return s + "}";
}

}  // namespace detail

/// The program of schedule `s` (validated first): each rank's actions with the transfers
/// between them, by the policy in the header comment.
inline Program lower(const Schedule& s) {
  validate(s);
  return detail::lower_lists(s.ranks, s.stages_per_rank, s.placement(), s.per_rank);
}

/// The program of a forward-only pass (evaluation): one microbatch through every stage
/// in order, each rank running the forwards of its stages in model order.
inline Program lower_forward(int ranks, int stages_per_rank, Placement placement = Placement::loop) {
  TESSERA_CHECK(ranks >= 1 && stages_per_rank >= 1, "pipeline program: needs at least 1 rank and 1 stage per rank, got ",
                ranks, " and ", stages_per_rank);
  std::vector<std::vector<Action>> lists(static_cast<std::size_t>(ranks));
  for (int st = 0; st < ranks * stages_per_rank; ++st)
    lists[static_cast<std::size_t>(rank_of_stage(placement, ranks, st))].push_back({Op::forward, st, 0});
  return detail::lower_lists(ranks, stages_per_rank, placement, lists);
}

/// Checks `p` against the rules in the header comment: first each rank alone (every
/// compute's input received or computed before it, every send after the compute of its
/// data, every peer the rank of the stage at the other end), then every rank pair's
/// matching (the k-th send A -> B and the k-th recv on B from A move the same payload;
/// as many sends as recvs), then all ranks together by simulation: each group runs when
/// the rank's earlier groups are complete, each transfer completes when its partner's
/// group is running, each compute runs once the group of its recv is complete. Throws
/// naming the ranks, steps and transfers when one fails or the simulation stops short
/// (a deadlock).
inline void check_program(const Program& p) {
  const int P = p.ranks, S = p.stages();
  TESSERA_CHECK(P >= 1 && p.stages_per_rank >= 1 && static_cast<int>(p.per_rank.size()) == P,
                "pipeline program: has lists for ", p.per_rank.size(), " ranks, expected ", P);
  // Each op's place: (group ordinal on its rank, index in the group).
  struct Place {
    int group = 0, index = 0;
  };
  // sends[a][b], recvs[b][a]: the sends a -> b and the recvs on b from a, in issue order.
  std::vector<std::vector<std::vector<Place>>> sends(static_cast<std::size_t>(P)), recvs(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) {
    sends[static_cast<std::size_t>(r)].resize(static_cast<std::size_t>(P));
    recvs[static_cast<std::size_t>(r)].resize(static_cast<std::size_t>(P));
  }
  std::vector<std::vector<std::size_t>> group_step(static_cast<std::size_t>(P));  // [rank][ordinal] -> step index
  std::vector<std::vector<int>> waits_for(static_cast<std::size_t>(P));  // [rank][step]: ordinal of its recv's group, -1

  // Each rank alone.
  for (int r = 0; r < P; ++r) {
    const auto& steps = p.per_rank[static_cast<std::size_t>(r)];
    auto& wait = waits_for[static_cast<std::size_t>(r)];
    wait.assign(steps.size(), -1);
    std::vector<std::pair<Payload, int>> received;  // payload, group ordinal
    std::vector<Payload> computed;
    auto has = [](const auto& list, const Payload& x) {
      for (const auto& e : list)
        if (e == x) return true;
      return false;
    };
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Step& step = steps[i];
      if (step.kind == Step::Kind::compute) {
        const Action& a = step.action;
        TESSERA_CHECK(a.stage >= 0 && a.stage < S && p.rank_of(a.stage) == r, "pipeline program: rank ", r, ", step ",
                      i, " (", detail::spell(a), ") is not a stage of rank ", r);
        if (const auto in = input_of(a, S)) {
          if (p.rank_of(in->stage) == r) {
            TESSERA_CHECK(has(computed, *in), "pipeline program: rank ", r, ", step ", i, " (", detail::spell(a),
                          ") uses the ", detail::carries_name(in->what), " of stage ", in->stage, ", microbatch ",
                          in->microbatch, " before computing it");
          } else {
            int ordinal = -1;
            for (const auto& [x, g] : received)
              if (x == *in) ordinal = g;
            TESSERA_CHECK(ordinal >= 0, "pipeline program: rank ", r, ", step ", i, " (", detail::spell(a),
                          ") uses the ", detail::carries_name(in->what), " of stage ", in->stage, ", microbatch ",
                          in->microbatch, " before any group receives it");
            wait[i] = ordinal;
          }
        }
        if (const auto out = output_of(a, S)) computed.push_back(*out);
        continue;
      }
      TESSERA_CHECK(!step.group.empty(), "pipeline program: rank ", r, ", step ", i, " is an empty group");
      const int ordinal = static_cast<int>(group_step[static_cast<std::size_t>(r)].size());
      group_step[static_cast<std::size_t>(r)].push_back(i);
      for (std::size_t k = 0; k < step.group.size(); ++k) {
        const Transfer& t = step.group[k];
        const Payload& x = t.payload;
        TESSERA_CHECK(x.stage >= 0 && x.stage < S && x.consumer() >= 0 && x.consumer() < S && t.peer >= 0 &&
                          t.peer < P && t.peer != r,
                      "pipeline program: rank ", r, ", step ", i, ": ", detail::spell(t), " is out of range (", P,
                      " ranks, ", S, " stages) or to itself");
        const bool send = t.kind == Transfer::Kind::send;
        const int here = send ? x.stage : x.consumer(), there = send ? x.consumer() : x.stage;
        TESSERA_CHECK(p.rank_of(here) == r && p.rank_of(there) == t.peer, "pipeline program: rank ", r, ", step ", i,
                      ": ", detail::spell(t), " belongs between ranks ", p.rank_of(x.stage), " and ",
                      p.rank_of(x.consumer()));
        if (send) {
          TESSERA_CHECK(has(computed, x), "pipeline program: rank ", r, ", step ", i, ": ", detail::spell(t),
                        " before the compute that makes it");
          sends[static_cast<std::size_t>(r)][static_cast<std::size_t>(t.peer)].push_back({ordinal, static_cast<int>(k)});
        } else {
          received.emplace_back(x, ordinal);
          recvs[static_cast<std::size_t>(r)][static_cast<std::size_t>(t.peer)].push_back({ordinal, static_cast<int>(k)});
        }
      }
    }
  }

  auto op_at = [&](int r, Place at) -> const Transfer& {
    const std::size_t step = group_step[static_cast<std::size_t>(r)][static_cast<std::size_t>(at.group)];
    return p.per_rank[static_cast<std::size_t>(r)][step].group[static_cast<std::size_t>(at.index)];
  };

  // Every rank pair's matching, in issue order.
  std::vector<std::vector<std::vector<Place>>> partner(static_cast<std::size_t>(P));  // [rank][ordinal][index]
  for (int r = 0; r < P; ++r)
    for (std::size_t step : group_step[static_cast<std::size_t>(r)])
      partner[static_cast<std::size_t>(r)].emplace_back(p.per_rank[static_cast<std::size_t>(r)][step].group.size());
  for (int a = 0; a < P; ++a)
    for (int b = 0; b < P; ++b) {
      const auto& out = sends[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)];
      const auto& in = recvs[static_cast<std::size_t>(b)][static_cast<std::size_t>(a)];
      for (std::size_t k = 0; k < std::min(out.size(), in.size()); ++k) {
        const Transfer &s = op_at(a, out[k]), &v = op_at(b, in[k]);
        TESSERA_CHECK(s.payload == v.payload, "pipeline program: mismatched transfer ", k, " from rank ", a,
                      " to rank ", b, ": rank ", a, " issues ", detail::spell(s), " (step ",
                      group_step[static_cast<std::size_t>(a)][static_cast<std::size_t>(out[k].group)], ") but rank ",
                      b, " issues ", detail::spell(v), " (step ",
                      group_step[static_cast<std::size_t>(b)][static_cast<std::size_t>(in[k].group)],
                      "); with no tags the k-th send matches the k-th recv");
        partner[static_cast<std::size_t>(a)][static_cast<std::size_t>(out[k].group)][static_cast<std::size_t>(out[k].index)] = in[k];
        partner[static_cast<std::size_t>(b)][static_cast<std::size_t>(in[k].group)][static_cast<std::size_t>(in[k].index)] = out[k];
      }
      TESSERA_CHECK(out.size() == in.size(), "pipeline program: rank ", a, " sends ", out.size(), " tensors to rank ",
                    b, ", which receives ", in.size(), " from it");
    }

  // All ranks together.
  std::vector<std::size_t> host(static_cast<std::size_t>(P), 0);  // the next step each host runs
  std::vector<int> issued(static_cast<std::size_t>(P), 0), complete(static_cast<std::size_t>(P), 0);
  std::vector<std::vector<std::vector<char>>> done(static_cast<std::size_t>(P));  // [rank][ordinal][index]
  for (int r = 0; r < P; ++r)
    for (const auto& g : partner[static_cast<std::size_t>(r)]) done[static_cast<std::size_t>(r)].emplace_back(g.size(), 0);
  auto groups = [&](int r) { return static_cast<int>(group_step[static_cast<std::size_t>(r)].size()); };
  auto finished = [&](int r) {
    return host[static_cast<std::size_t>(r)] == p.per_rank[static_cast<std::size_t>(r)].size() &&
           complete[static_cast<std::size_t>(r)] == groups(r);
  };
  // The group rank r runs now, or -1.
  auto running = [&](int r) {
    const int c = complete[static_cast<std::size_t>(r)];
    return c < issued[static_cast<std::size_t>(r)] ? c : -1;
  };
  for (;;) {
    bool progress = false;
    for (int r = 0; r < P; ++r) {
      const auto& steps = p.per_rank[static_cast<std::size_t>(r)];
      auto& h = host[static_cast<std::size_t>(r)];
      for (; h < steps.size(); ++h) {
        if (steps[h].kind == Step::Kind::transfers) {
          ++issued[static_cast<std::size_t>(r)];  // issuing never blocks the host
        } else if (waits_for[static_cast<std::size_t>(r)][h] >= complete[static_cast<std::size_t>(r)]) {
          break;  // its recv's group is not complete
        }
        progress = true;
      }
    }
    for (int r = 0; r < P; ++r) {
      const int g = running(r);
      if (g < 0) continue;
      auto& flags = done[static_cast<std::size_t>(r)][static_cast<std::size_t>(g)];
      for (std::size_t k = 0; k < flags.size(); ++k) {
        if (flags[k]) continue;
        const int peer = op_at(r, {g, static_cast<int>(k)}).peer;
        const Place there = partner[static_cast<std::size_t>(r)][static_cast<std::size_t>(g)][k];
        if (running(peer) != there.group) continue;  // rendezvous: both sides' groups must run
        flags[k] = 1;
        done[static_cast<std::size_t>(peer)][static_cast<std::size_t>(there.group)][static_cast<std::size_t>(there.index)] = 1;
        progress = true;
      }
    }
    for (int r = 0; r < P; ++r) {
      const int g = running(r);
      if (g < 0) continue;
      const auto& flags = done[static_cast<std::size_t>(r)][static_cast<std::size_t>(g)];
      bool all = true;
      for (char f : flags) all = all && f;
      if (all) {
        ++complete[static_cast<std::size_t>(r)];
        progress = true;
      }
    }
    bool all_finished = true;
    for (int r = 0; r < P; ++r) all_finished = all_finished && finished(r);
    if (all_finished) return;
    if (progress) continue;

    std::ostringstream why;
    why << "pipeline program deadlocks:";
    const char* sep = " ";
    for (int r = 0; r < P; ++r) {
      if (finished(r)) continue;
      why << sep << "rank " << r;
      sep = "; ";
      const auto& steps = p.per_rank[static_cast<std::size_t>(r)];
      const std::size_t h = host[static_cast<std::size_t>(r)];
      if (h < steps.size())
        why << " waits at step " << h << " (" << detail::spell(steps[h].action) << ") for its recv";
      else
        why << " has run every step";
      const int g = running(r);
      if (g < 0) continue;
      why << ", its transfer group at step " << group_step[static_cast<std::size_t>(r)][static_cast<std::size_t>(g)]
          << " is stuck on";
      const auto& flags = done[static_cast<std::size_t>(r)][static_cast<std::size_t>(g)];
      for (std::size_t k = 0; k < flags.size(); ++k) {
        if (flags[k]) continue;
        const Transfer& t = op_at(r, {g, static_cast<int>(k)});
        const Place there = partner[static_cast<std::size_t>(r)][static_cast<std::size_t>(g)][k];
        why << " [" << detail::spell(t) << ", whose match is in rank " << t.peer << "'s group at step "
            << group_step[static_cast<std::size_t>(t.peer)][static_cast<std::size_t>(there.group)] << "]";
      }
    }
    fail(why.str());
  }
}

/// Each rank's program, one line per rank: computes as the timelines label them ("F3",
/// "5F3"), each group in brackets with "s" for a send, "r" for a recv, then "a" or "g"
/// (activation, gradient), the producing stage, a dot and the microbatch, and the peer
/// after "->" or "<-": "rank 0: F0 [s a0.0->1] F1 [s a0.1->1 r g1.0<-1] B0 ...".
inline std::string format_program(const Program& p) {
  const Schedule shape{ScheduleKind::one_f_one_b, p.ranks, p.stages_per_rank, 1, {}};
  std::string out;
  for (int r = 0; r < p.ranks; ++r) {
    out += detail::rank_prefix(shape, r);
    const auto& steps = p.per_rank[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (i > 0) out += ' ';
      if (steps[i].kind == Step::Kind::compute) {
        out += action_label(shape, steps[i].action);
        continue;
      }
      out += '[';
      for (std::size_t k = 0; k < steps[i].group.size(); ++k) {
        const Transfer& t = steps[i].group[k];
        const bool send = t.kind == Transfer::Kind::send;
        out += ::tessera::detail::concat(k ? " " : "", send ? "s " : "r ",
                                         t.payload.what == Carries::activation ? 'a' : 'g', t.payload.stage, '.',
                                         t.payload.microbatch, send ? "->" : "<-", t.peer);
      }
      out += ']';
    }
    out += '\n';
  }
  return out;
}

/// The program of `kind` on `ranks` x `stages_per_rank` stages for `microbatches`,
/// lowered and checked (check_program) once per process and shared: a rank's model asks
/// for its schedule once, but a planner that traces thousands of layouts (llama-plan
/// --search) builds thousands of models of the same few schedules, and the check, which
/// simulates every rank, is quadratic in the pipeline's depth.
inline std::shared_ptr<const Program> checked_program(ScheduleKind kind, int ranks, int stages_per_rank,
                                                      int microbatches) {
  static std::mutex mutex;
  static std::map<std::array<int, 4>, std::shared_ptr<const Program>> programs;
  const std::array<int, 4> key{static_cast<int>(kind), ranks, stages_per_rank, microbatches};
  {
    std::lock_guard lock(mutex);
    if (auto it = programs.find(key); it != programs.end()) return it->second;
  }
  auto p = std::make_shared<const Program>(lower(make_schedule(kind, ranks, stages_per_rank, microbatches)));
  check_program(*p);
  std::lock_guard lock(mutex);
  return programs.emplace(key, std::move(p)).first->second;
}

}  // namespace tessera::parallel
