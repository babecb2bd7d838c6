// A layout's step in time: every pipeline position's trace replayed on a compute stream
// and on one stream per communicator, as NcclEngine runs it (comm/nccl.hpp).
//
// Each position is the trace of one rank (plan/dry_run.hpp: distinct_ranks); its data-,
// context- and tensor-parallel peers run the same trace at the same time. Replaying them:
//   compute     each operation after the one before, at the pricer's time (plan/cost.hpp)
//   collective  starts on its communicator's stream once the compute issued before it is
//               done and the stream's previous collective is, and takes what NCCL takes on
//               the cluster (plan/cluster.hpp); a group that spans pipeline positions (the
//               world, the pipeline's own) starts when every position has issued it
//   send/recv   a transfer starts when both ranks' groups have started (NCCL pairs the
//               k-th send from a rank with the k-th recv from it), and a group ends with
//               its last transfer; a group whose peers are within the position (the
//               context-parallel ring: ranks tp apart in one stage) is every peer's at
//               once, since the peers run the same program, so it starts when the
//               position issues it and takes what the ring takes (ring_seconds)
//   wait        the compute stream waits for the collective's end (CommWait)
//   host        the rank's host thread, as plan/cost.hpp's HostDeviceClock has it: the
//               host backend's loops (CPU offload's) run on its clock, beside the
//               device's work where the host waited only for a fence; the device starts
//               what the host issues after them once it is issued
// so what overlaps is what the code overlaps: an FSDP unit's prefetched all-gather runs
// beside the unit before it, a reduce-scatter beside the next unit's backward, a ring
// step's keys beside that step's attention, and a pipeline stage waits for its recv as
// long as the stage before it takes to send. The step ends when the last position's
// compute does. Time a position's compute spends waiting is exposed communication (the
// ring's waits among it), or pipeline wait where it waits for a pipeline send/recv: the
// bubble of the schedule as the program runs it, with the transfers' own time in it.
//
// A collective between nodes holds SMs while it runs (plan/cluster.hpp, collective_sms),
// and a GEMM or an attention kernel beside it runs on the others: its work, spread over
// the SMs left, takes sm_count / (sm_count - held) as long for as long as the
// collectives run (until the first of them ends, where several streams run at once). A
// GEMM takes what the machine profile measured instead where it has the figure
// (gemm.slowdown_beside_held_sms: Hopper's cuBLASLt kernels lose more than the SMs'
// share). Memory-bound kernels keep their time: the SMs left still move the device's
// bandwidth.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/core/error.hpp"
#include "tessera/plan/cluster.hpp"
#include "tessera/plan/cost.hpp"

namespace tessera::plan {

/// One pipeline position's replay.
struct PositionTime {
  double end_seconds = 0;        // when its compute stream (and its host thread) finished the step
  double compute_seconds = 0;    // busy on the compute stream (and its host synchronisations)
  double host_seconds = 0;       // the host backend's loops (CPU offload)
  double hidden_host_seconds = 0;  // of which beside the compute stream's work
  double exposed_comm_seconds = 0;  // waiting for collectives
  double pipeline_wait_seconds = 0;  // waiting for send/recv groups
  double comm_seconds = 0;       // collectives' own time, overlapped or not
  double collective_sm_seconds = 0;  // what the collectives' SMs added to the compute beside them
  std::int64_t collectives = 0;
};

struct Timeline {
  double step_seconds = 0;
  std::vector<PositionTime> positions;
};

/// Replays `positions` (the traces of a layout's pipeline positions, in pipeline order;
/// `block` = the world ranks per position, MeshShape::per_stage()) on `compute` and `net`.
///
/// Each communicator has its stream, known by its group's stride and size. Two of a mesh's
/// can share those (FSDP's dp_shard x cp group is the cp group when dp_shard is 1), and
/// then the send/recv groups within a position (the ring's) are kept on a stream of their
/// own: the ring's communicator is not FSDP's.
inline Timeline simulate_step(const std::vector<const trace::Trace*>& positions, int block, const Pricer& compute,
                              const Network& net) {
  const int P = static_cast<int>(positions.size());
  TESSERA_CHECK(P >= 1 && block >= 1, "simulate_step: no positions");
  struct Issued {
    int pos = 0;
    double start = 0;
    std::optional<double> end;
    const trace::Collective* c = nullptr;
    int sms = 0;  // what it holds while it runs (collective_sms), where SMs are shared
    bool cross = false;
    bool ring = false;  // a send/recv group among the position's own ranks
    std::tuple<int, int, std::int64_t> rendezvous{};  // (stride, size, ordinal) of a cross-position group
    // Each send/recv: (from, to, ordinal) and its place in the collective's peers.
    std::vector<std::pair<std::tuple<int, int, std::int64_t>, std::size_t>> transfers;
  };
  std::vector<Issued> issued;
  std::map<std::tuple<int, int, std::int64_t>, std::vector<std::size_t>> rendezvous;  // -> issued entries
  std::map<std::tuple<int, int, std::int64_t>, std::pair<std::optional<std::size_t>, std::optional<std::size_t>>>
      pairs;  // (from, to, ordinal) -> (the sender's group, the receiver's group)

  struct State {
    std::size_t next = 0;
    HostDeviceClock clock;  // the compute stream's and the host thread's
    std::map<std::tuple<int, int, bool>, std::optional<std::size_t>> stream;  // communicator -> its last collective
    std::map<std::tuple<int, int, bool>, std::int64_t> ordinal;               // communicator -> collectives issued
    std::map<std::pair<int, int>, std::int64_t> sent, received;        // (from, to) -> transfers issued
    std::map<std::uint64_t, std::size_t> by_id;
    PositionTime time;
  };
  std::vector<State> state(static_cast<std::size_t>(P));
  for (State& st : state) st.clock = HostDeviceClock(compute.host_runs_device_work());

  // The end of issued[i], once every rank it needs has issued its part.
  auto end_of = [&](std::size_t i) -> std::optional<double> {
    Issued& x = issued[i];
    if (x.end) return x.end;
    const double price = x.ring ? ring_seconds(*x.c, net) : collective_seconds(*x.c, net);
    if (x.cross) {
      const auto& all = rendezvous[x.rendezvous];
      if (static_cast<int>(all.size()) < P) return std::nullopt;
      double start = 0;
      for (std::size_t j : all) start = std::max(start, issued[j].start);
      for (std::size_t j : all) issued[j].end = start + price;
      return x.end;
    }
    if (x.transfers.empty()) return x.end = x.start + price;
    double end = x.start;
    for (const auto& [key, peer] : x.transfers) {
      const auto& [s, r] = pairs[key];
      if (!s || !r) return std::nullopt;
      trace::Collective one = *x.c;  // this transfer alone, on its link
      one.peers = {x.c->peers[peer]};
      end = std::max(end, std::max(issued[*s].start, issued[*r].start) + collective_seconds(one, net));
    }
    return x.end = end;
  };

  // A GEMM's or an attention kernel's `s` seconds on position `st` with the collectives
  // running beside it holding their SMs (see above).
  const double sms = compute.sm_count();
  const bool shared_sms = sms > 0 && net.nics_per_node.has_value();
  // `now`: when it starts.
  auto beside_collectives = [&](const State& st, double now, double s, bool gemm) {
    int held = 0;
    double until = std::numeric_limits<double>::infinity();
    for (const auto& [comm, last] : st.stream) {
      if (!last || issued[*last].sms == 0) continue;
      const auto e = end_of(*last);  // a stream's collectives run back to back until its last ends
      if (!e || *e <= now) continue;
      held += issued[*last].sms;
      until = std::min(until, *e);
    }
    if (held == 0) return s;
    const double k = compute.beside_held_sms(held, gemm);
    const double slowed = std::min(s * k, until - now);
    return slowed + (s - slowed / k);
  };

  auto advance = [&](int p) {
    State& st = state[static_cast<std::size_t>(p)];
    const auto& events = positions[static_cast<std::size_t>(p)]->events();
    bool moved = false;
    while (st.next < events.size()) {
      const trace::Op& op = events[st.next].op;
      if (const auto* c = std::get_if<trace::Collective>(&op)) {
        // A send/recv group among this position's own ranks: a ring whose peers run it too.
        const bool ring = std::string_view(c->kind) == "send_recv" && c->group.stride * c->group.size <= block;
        const std::tuple<int, int, bool> comm{c->group.stride, c->group.size, ring};
        double free = 0;
        if (const auto& last = st.stream[comm]) {
          const auto e = end_of(*last);
          if (!e) return moved;  // the stream is busy with what its peers have not issued yet
          free = *e;
        }
        Issued x;
        x.pos = p;
        x.start = std::max(st.clock.next_start(), free);
        x.c = c;
        x.sms = shared_sms ? collective_sms(*c, net) : 0;
        x.ring = ring;
        x.cross = c->group.stride * c->group.size > block && std::string_view(c->kind) != "send_recv";
        const std::size_t id = issued.size();
        if (x.cross) {
          x.rendezvous = {c->group.stride, c->group.size, st.ordinal[comm]++};
          rendezvous[x.rendezvous].push_back(id);
        }
        for (std::size_t i = 0; !ring && i < c->peers.size(); ++i) {
          const trace::PeerBytes& peer = c->peers[i];
          // Pipeline peers: the group's ranks are the positions (its stride is the block).
          TESSERA_CHECK(c->group.stride == block && c->group.size == P, "simulate_step: a send/recv outside the "
                        "pipeline's group (stride ", c->group.stride, ", size ", c->group.size, ")");
          const int q = peer.peer;
          const auto key = peer.send ? std::tuple{p, q, st.sent[{p, q}]++} : std::tuple{q, p, st.received[{q, p}]++};
          x.transfers.push_back({key, i});
          (peer.send ? pairs[key].first : pairs[key].second) = id;
        }
        issued.push_back(x);
        st.stream[comm] = id;
        st.by_id[c->id] = id;
        st.time.comm_seconds += ring ? ring_seconds(*c, net) : collective_seconds(*c, net);
        ++st.time.collectives;
      } else if (const auto* w = std::get_if<trace::CommWait>(&op)) {
        const auto it = st.by_id.find(w->id);
        TESSERA_CHECK(it != st.by_id.end(), "simulate_step: position ", p, " waits for collective ", w->id,
                      " it never issued");
        const auto e = end_of(it->second);
        if (!e) return moved;
        const double waited = std::max(0.0, *e - st.clock.device());
        (issued[it->second].transfers.empty() ? st.time.exposed_comm_seconds : st.time.pipeline_wait_seconds) += waited;
        st.clock.device_until(st.clock.device() + waited);
      } else if (!std::holds_alternative<trace::Memory>(op)) {
        // Everything else on the two clocks (host loops, fences, synchronisations, device work).
        double s = compute.seconds(op);
        if (shared_sms && (std::holds_alternative<trace::Gemm>(op) || std::holds_alternative<trace::Attention>(op))) {
          const double alone = s;
          s = beside_collectives(st, st.clock.next_start(), s, std::holds_alternative<trace::Gemm>(op));
          st.time.collective_sm_seconds += s - alone;
        }
        if (const auto* k = std::get_if<trace::Kernel>(&op); !k || !k->on_host) st.time.compute_seconds += s;
        st.clock.replay(op, s);
      }
      ++st.next;
      moved = true;
    }
    return moved;
  };

  for (;;) {
    bool moved = false, done = true;
    for (int p = 0; p < P; ++p) {
      moved = advance(p) || moved;
      done = done && state[static_cast<std::size_t>(p)].next == positions[static_cast<std::size_t>(p)]->events().size();
    }
    if (done) break;
    if (!moved) {
      std::string stuck;
      for (int p = 0; p < P; ++p)
        if (state[static_cast<std::size_t>(p)].next < positions[static_cast<std::size_t>(p)]->events().size())
          stuck += tessera::detail::concat(stuck.empty() ? "" : ", ", p, " at operation ",
                                           state[static_cast<std::size_t>(p)].next);
      fail("simulate_step: the positions wait for each other (pipeline positions ", stuck,
           "): their collectives or send/recv groups do not pair up");
    }
  }
  Timeline t;
  for (const State& st : state) {
    PositionTime pt = st.time;
    pt.end_seconds = st.clock.end();
    pt.host_seconds = st.clock.host_seconds();
    pt.hidden_host_seconds = st.clock.hidden_host_seconds();
    t.step_seconds = std::max(t.step_seconds, pt.end_seconds);
    t.positions.push_back(pt);
  }
  return t;
}

}  // namespace tessera::plan
