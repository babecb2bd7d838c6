// A layout's dry run is its ranks' real run: for every layout of bench-policy-matrix on 8
// ranks, in every checkpoint mode, each thread rank that trains the parity model
// (tests/parallel/harness.hpp) has the memory peak, to the byte, and sends the bytes, to
// the byte, that the dry run of that rank predicts (plan::dry_run_step at that rank, its
// peers phantoms). And the dry run of its pipeline position's first rank stands for it:
// the same bytes sent, the same memory but for the few hundred bytes of host-built tables
// that depend on which elements a rank owns (a DDP replica other than the first owns no
// gradient-norm pieces; FSDP shards cut different parameters). That is the check that
// data- and tensor-parallel peers are symmetric, which lets one rank per pipeline position
// stand for a layout. Two of the layouts are checked again without sequence parallelism,
// and four with context parallelism (one checkpoint mode each, in turn); a context-parallel
// rank's trace is its ring's (chunk blocks, keys and gradients passed to its neighbours)
// and holds a cp-th of one rank's activations. Under the sanitizers each layout runs one
// checkpoint mode, in turn (test::ac_modes_for).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "../parallel/harness.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/phantom.hpp"

namespace test_layout_trace {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {

struct Layout {
  const char* name;
  comm::MeshShape shape;  // {pp, dp_replicate, dp_shard, tp, cp}
  const char* schedule;   // "" without a pipeline
};

// bench-policy-matrix's layouts (bench/policy_matrix.cpp).
const Layout kLayouts[] = {
    {"FSDP 8", {1, 1, 8, 1}, ""},
    {"HSDP 2x4", {1, 2, 4, 1}, ""},
    {"DDP 8", {1, 8, 1, 1}, ""},
    {"TP 8", {1, 1, 1, 8}, ""},
    {"TP 2 x FSDP 4", {1, 1, 4, 2}, ""},
    {"TP 4 x FSDP 2", {1, 1, 2, 4}, ""},
    {"HSDP 2x2 x TP 2", {1, 2, 2, 2}, ""},
    {"PP 8 GPipe", {8, 1, 1, 1}, "GPipe"},
    {"PP 8 1F1B", {8, 1, 1, 1}, "1F1B"},
    {"PP 2 x FSDP 4 GPipe", {2, 1, 4, 1}, "GPipe"},
    {"PP 2 x FSDP 4 1F1B", {2, 1, 4, 1}, "1F1B"},
    {"PP 2 x FSDP 4 Interleaved1F1B", {2, 1, 4, 1}, "Interleaved1F1B"},
    {"PP 2 x FSDP 4 InterleavedZeroBubble", {2, 1, 4, 1}, "InterleavedZeroBubble"},
    {"PP 4 x FSDP 2 GPipe", {4, 1, 2, 1}, "GPipe"},
    {"PP 4 x FSDP 2 1F1B", {4, 1, 2, 1}, "1F1B"},
    {"PP 4 x FSDP 2 Interleaved1F1B", {4, 1, 2, 1}, "Interleaved1F1B"},
    {"PP 4 x FSDP 2 InterleavedZeroBubble", {4, 1, 2, 1}, "InterleavedZeroBubble"},
    {"TP 2 x PP 2 x FSDP 2 1F1B", {2, 1, 2, 2}, "1F1B"},
    {"TP 2 x PP 2 x FSDP 2 InterleavedZeroBubble", {2, 1, 2, 2}, "InterleavedZeroBubble"},
};

/// The parity job on `l`, two steps (the dry run traces the second, the runtime's peak
/// covers both), with the checkpoint mode `ac`.
train::JobConfig job(const Layout& l, const std::vector<std::string>& ac) {
  std::vector<std::string> keys = {
      "--parallelism.data_parallel_replicate_degree", std::to_string(l.shape.dp_replicate),
      "--parallelism.data_parallel_shard_degree", std::to_string(l.shape.dp_shard),
      "--parallelism.tensor_parallel_degree", std::to_string(l.shape.tp),
      "--parallelism.pipeline_parallel_degree", std::to_string(l.shape.pp),
      "--parallelism.context_parallel_degree", std::to_string(l.shape.cp),
  };
  if (*l.schedule) keys.insert(keys.end(), {"--parallelism.pipeline_parallel_schedule", l.schedule});
  keys.insert(keys.end(), ac.begin(), ac.end());
  return test::debug_job(test::kParityBatch / l.shape.dp(), test::kParityBatch, 2, keys);
}

/// How far a rank's memory may be from its pipeline position's representative's.
constexpr std::int64_t kTableBytes = 4096;

std::int64_t sent_bytes(const trace::Trace& t) {
  std::int64_t sent = 0;
  for (const auto& c : t.all<trace::Collective>()) sent += c.sent_bytes();
  return sent;
}

/// Every rank of `l` trained on thread ranks against the dry run of its pipeline position,
/// each dry run tracing the step after `steps_before` steps (plan::dry_run_step).
void check_layout(const Layout& l, const test::AcMode& ac, int steps_before = 0) {
  const train::JobConfig c = job(l, ac.keys);
  const int world = l.shape.world();
  std::vector<test::RunResult> ranks(static_cast<std::size_t>(world));
  comm::run_thread_ranks(
      world,
      [&](comm::Communicator& w) {
        ranks[static_cast<std::size_t>(w.rank())] = test::train_layout(w, l.shape, c);
      },
      test::nccl_rules());
  const std::vector<int> positions = plan::distinct_ranks(l.shape);
  REQUIRE(positions.size() == static_cast<std::size_t>(l.shape.pp));
  for (int r = 0; r < world; ++r) {
    const int p = r / l.shape.per_stage();
    const plan::StepTrace own = plan::dry_run_step<float>(c, 0, world, r, steps_before);
    const plan::StepTrace position =
        plan::dry_run_step<float>(c, 0, world, positions[static_cast<std::size_t>(p)], steps_before);
    const test::RunResult& run = ranks[static_cast<std::size_t>(r)];
    INFO(std::string(l.name), ", checkpointing ", std::string(ac.name), ", rank ", r, " (pipeline rank ", p, ")");
    CHECK(run.peak_memory_bytes == own.peak_bytes);
    CHECK(static_cast<std::int64_t>(run.comm_bytes) == sent_bytes(own.trace));
    // The position's trace stands for the rank: the same bytes sent, and the same memory
    // but for the host-built tables of what this rank owns (gradient-norm pieces, AdamW
    // blocks of its shard), a few hundred bytes.
    CHECK(static_cast<std::int64_t>(run.comm_bytes) == sent_bytes(position.trace));
    const auto gap = static_cast<std::int64_t>(run.peak_memory_bytes) - static_cast<std::int64_t>(position.peak_bytes);
    CHECK(std::abs(gap) <= kTableBytes);
  }
}

}  // namespace

TEST_CASE("layout dry run: each rank's memory peak and bytes sent are its thread rank's, on every layout") {
  // Every checkpoint mode on every layout; under the sanitizers one mode a layout, in turn.
  for (std::size_t i = 0; i < std::size(kLayouts); ++i)
    for (const auto& ac : test::ac_modes_for(i)) check_layout(kLayouts[i], ac);
}

TEST_CASE("layout dry run: the same without sequence parallelism (every row on every tp rank)") {
  const std::vector<std::string> no_sp = {"--parallelism.disable_sequence_parallel", "true"};
  const Layout layouts[] = {Layout{"TP 4 x FSDP 2", {1, 1, 2, 4}, ""},
                            Layout{"TP 2 x PP 2 x FSDP 2 1F1B", {2, 1, 2, 2}, "1F1B"}};
  for (std::size_t i = 0; i < std::size(layouts); ++i)
    for (const auto& ac : test::ac_modes_for(i + 1))
      check_layout(layouts[i], test::AcMode{ac.name, test::with(ac.keys, no_sp)});
}

// Context parallelism composed with FSDP, HSDP, TP and PP (their parity:
// tests/parallel/test_context_parallel.cpp).
const Layout kContextLayouts[] = {
    {"CP 2 x FSDP 4", {1, 1, 4, 1, 2}, ""},
    {"CP 4 x HSDP 2x1", {1, 2, 1, 1, 4}, ""},
    {"CP 2 x TP 2 x FSDP 2", {1, 1, 2, 2, 2}, ""},
    {"CP 2 x PP 2 x FSDP 2 1F1B", {2, 1, 2, 1, 2}, "1F1B"},
};

TEST_CASE("layout dry run: the same with context parallelism (FSDP over dp_shard x cp, the ring's send/recv)") {
  // Traced after a step rather than after Trainer::prepare, as the thread ranks run:
  // prepare() grows the rotary tables to the whole sequence on every rank, where a
  // context-parallel rank's rows reach only its second chunk's end (rank i of cp: the
  // sequence less i chunks), so the lazy tables of ranks other than the first are
  // smaller (16 bytes a position here). The first, which a layout's plan traces, holds
  // the last chunk: its tables are the whole sequence either way.
  for (std::size_t i = 0; i < std::size(kContextLayouts); ++i) check_layout(kContextLayouts[i], test::kAcModes[i % 4], 1);
}

TEST_CASE("layout dry run: a context-parallel rank's attention is the ring's: chunk blocks, keys passed round") {
  // CP 4 x FSDP 2 in bf16, no recomputation: every attention call is one block of a
  // chunk's queries against a chunk's keys (32 tokens a sequence, 8 chunks of 4), causal
  // on the diagonal and full below it: 3 blocks at the ring's first step, 2 at each of
  // the 3 others, forward and backward. Keys and values go to the next rank and come from
  // the one before over the cp group (ranks tp apart), packed in bf16, once a step but the
  // last, forward and again backward; the running dk, dv go round at every backward step
  // in fp32 (accum_t).
  const Layout l{"CP 4 x FSDP 2", {1, 1, 2, 1, 4}, ""};
  const train::JobConfig c =
      job(l, {"--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "none"});
  const auto& a = c.model.args;
  const int cp = 4, layers = static_cast<int>(a.n_layers);
  const std::int64_t batch = c.training.local_batch_size, chunk = c.training.seq_len / (2 * cp);
  const plan::StepTrace st = plan::dry_run_step<bf16>(c, 0, 8, 0);
  int causal[2] = {0, 0}, full[2] = {0, 0};
  for (const auto& x : st.trace.all<trace::Attention>()) {
    CHECK(x.shape.batch == batch);
    CHECK(x.shape.seq_len == chunk);
    CHECK(x.shape.n_heads == a.n_heads);
    CHECK(x.shape.n_kv_heads == a.kv_heads());
    ++(x.shape.causal ? causal : full)[x.backward ? 1 : 0];
  }
  for (int pass = 0; pass < 2; ++pass) {
    CHECK(causal[pass] == 2 * layers);                   // the two diagonal blocks of the first step
    CHECK(full[pass] == (1 + 2 * (cp - 1)) * layers);  // the rest of the first step, then 2 a step
  }
  // The packed keys and values of this rank's 2 chunks a sequence: 2 x (batch x 2 chunk) rows.
  const std::int64_t kv_numel = 2 * (batch * 2 * chunk) * a.kv_heads() * a.head_dim();
  int kv_groups = 0, gradient_groups = 0;
  std::vector<std::uint64_t> issued, waited;
  for (const auto& e : st.trace.events()) {
    if (const auto* w = std::get_if<trace::CommWait>(&e.op)) waited.push_back(w->id);
    const auto* x = std::get_if<trace::Collective>(&e.op);
    if (x == nullptr) continue;
    issued.push_back(x->id);
    if (std::string_view(x->kind) != "send_recv") continue;
    CHECK(x->group.size == cp);
    CHECK(x->group.stride == 1);  // tp 1: the ring's ranks are neighbours
    REQUIRE(x->peers.size() == 2);
    const trace::PeerBytes& send = x->peers[0].send ? x->peers[0] : x->peers[1];
    const trace::PeerBytes& recv = x->peers[0].send ? x->peers[1] : x->peers[0];
    CHECK(send.peer == 1);
    CHECK(recv.peer == cp - 1);
    CHECK(send.bytes == recv.bytes);
    if (send.bytes == kv_numel * 2) ++kv_groups;
    else if (send.bytes == kv_numel * 4) ++gradient_groups;
    else CHECK_MESSAGE(false, "a send/recv of ", send.bytes, " bytes");
  }
  CHECK(kv_groups == 2 * (cp - 1) * layers);
  CHECK(gradient_groups == cp * layers);
  std::sort(issued.begin(), issued.end());
  std::sort(waited.begin(), waited.end());
  CHECK(issued == waited);
}

TEST_CASE("layout dry run: without the head-tail balance the last context-parallel rank computes 4 cp - 1 blocks, "
          "and is the one a layout's plan traces") {
  const Layout l{"CP 4 x FSDP 2", {1, 1, 2, 1, 4}, ""};
  const train::JobConfig c = job(l, {"--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode",
                                     "none", "--parallelism.context_parallel_load_balancer", "none"});
  const int cp = 4, layers = static_cast<int>(c.model.args.n_layers);
  // Rank r's cp coordinate is r (tp 1); its queries see every earlier rank's keys whole.
  for (int r : {0, cp - 1}) {
    CAPTURE(r);
    const plan::StepTrace st = plan::dry_run_step<bf16>(c, 0, 8, r);
    int forward = 0;
    for (const auto& x : st.trace.all<trace::Attention>()) forward += !x.backward;
    CHECK(forward == (4 * r + 3) * layers);
  }
  CHECK(plan::distinct_ranks({1, 1, 2, 1, 4}, c) == std::vector<int>{cp - 1});
  CHECK(plan::distinct_ranks({2, 1, 1, 2, 2}, c) == std::vector<int>{2, 6});  // cp coordinate 1, tp 2 apart
}

TEST_CASE("layout dry run: a context-parallel rank holds a cp-th of one rank's activations") {
  // The same global batch of 8 sequences of 256 tokens on one rank and over cp 2 and 4
  // (every rank all 8 sequences, a cp-th of each): the saved activations divide by cp,
  // and the memory peak falls.
  const std::vector<std::string> keys = {"--training.seq_len", "256", "--model.max_seq_len", "256",
                                         "--parallelism.data_parallel_shard_degree", "1"};
  std::size_t saved[3] = {}, peak[3] = {};
  for (int i = 0; i < 3; ++i) {
    const int cp = 1 << i;
    const train::JobConfig c = test::debug_job(test::kParityBatch, test::kParityBatch, 2,
                                               test::with(keys, {"--parallelism.context_parallel_degree", std::to_string(cp)}));
    const plan::StepTrace st = plan::dry_run_step<float>(c, 0, cp, 0);
    CHECK(st.mesh.cp == cp);
    saved[i] = st.saved_activation_bytes;
    peak[i] = st.peak_bytes;
  }
  REQUIRE(saved[0] > 0);
  CHECK(saved[1] * 2 == saved[0]);  // to the byte: every saved tensor is per token
  CHECK(saved[2] * 4 == saved[0]);
  CHECK(peak[1] < peak[0]);
  CHECK(peak[2] < peak[1]);
}

TEST_CASE("layout dry run: collectives carry their group, and every one is waited for") {
  const Layout l{"HSDP 2x2 x TP 2", {1, 2, 2, 2}, ""};
  const plan::StepTrace st = plan::dry_run_step<float>(job(l, {}), 0, 8, 5);  // coordinates r 1, s 0, t 1
  std::vector<std::uint64_t> issued, waited;
  bool tp = false, shard = false, replicate = false, world = false;
  for (const auto& e : st.trace.events()) {
    if (const auto* c = std::get_if<trace::Collective>(&e.op)) {
      issued.push_back(c->id);
      const trace::CommGroup g = c->group;
      CHECK(g.size * g.stride <= 8);
      auto is = [&](int stride, int size, int rank, bool& seen) {
        if (g.stride != stride || g.size != size) return;
        seen = true;
        CHECK(g.rank == rank);
      };
      is(1, 2, 1, tp);
      is(2, 2, 0, shard);
      is(4, 2, 1, replicate);
      is(1, 8, 5, world);
    }
    if (const auto* w = std::get_if<trace::CommWait>(&e.op)) waited.push_back(w->id);
  }
  CHECK(tp);
  CHECK(shard);
  CHECK(replicate);
  CHECK(world);
  std::sort(issued.begin(), issued.end());
  std::sort(waited.begin(), waited.end());
  CHECK(issued == waited);
}

namespace {
/// Where a step's host reads fall (copies to the host: each waits for the device): before
/// its first operation on the device, between that and its optimizer's launch, and after.
struct HostReads {
  int before = 0, inside = 0, after = 0;
  std::vector<std::string> inside_sites;
};
HostReads host_reads(const trace::Trace& t) {
  const auto& events = t.events();
  auto computes = [](const trace::Event& e) {
    return std::holds_alternative<trace::Gemm>(e.op) || std::holds_alternative<trace::Attention>(e.op) ||
           std::holds_alternative<trace::Kernel>(e.op);
  };
  std::size_t first = events.size(), adamw = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (first == events.size() && computes(events[i])) first = i;
    if (const auto* k = std::get_if<trace::Kernel>(&events[i].op); k && std::string_view(k->functor).starts_with("AdamWMultiStep"))
      adamw = i;
  }
  HostReads r;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const auto* x = std::get_if<trace::Transfer>(&events[i].op);
    if (x == nullptr || !x->to_host) continue;
    if (i < first) ++r.before;
    else if (i < adamw) ++r.inside, r.inside_sites.push_back(std::string(x->file) + ":" + std::to_string(x->line));
    else ++r.after;
  }
  return r;
}
}  // namespace

TEST_CASE("layout dry run: a step reads nothing back from its first kernel to its optimizer's launch, on every layout") {
  // The loss sum, the gradient norm and the clip scale stay on the device
  // (train/step_scalars.hpp); the host reads the first two once, after AdamW's launch.
  // Before the first kernel, a data-parallel step counts the batch's tokens over the ranks.
  auto check = [](const char* name, const train::JobConfig& c, int world) {
    const comm::MeshShape shape = plan::check_dry_run(c, world);
    for (int r : plan::distinct_ranks(shape)) {
      const plan::StepTrace st = plan::dry_run_step<float>(c, 0, world, r);
      const HostReads reads = host_reads(st.trace);
      INFO(std::string(name), ", rank ", r);
      CHECK(reads.inside == 0);
      for (const auto& site : reads.inside_sites) MESSAGE("read inside the step at ", site);
      CHECK(reads.after == 1);
      CHECK(reads.before == (shape.dp() > 1 ? 1 : 0));
    }
  };
  check("one rank", test::debug_job(test::kParityBatch, test::kParityBatch, 2, {}), 1);
  check("one rank, 2 micro-batches", test::debug_job(test::kParityBatch / 2, test::kParityBatch, 2, {}), 1);
  for (const Layout& l : kLayouts) check(l.name, job(l, {}), l.shape.world());
}

TEST_CASE("layout dry run: a pipeline rank's sends and recvs name their peers") {
  const Layout l{"PP 4 x FSDP 2 1F1B", {4, 1, 2, 1}, "1F1B"};
  const train::JobConfig c = job(l, {});
  for (int p = 0; p < 4; ++p) {
    const plan::StepTrace st = plan::dry_run_step<float>(c, 0, 8, p * 2);
    std::int64_t to_next = 0, from_previous = 0;
    for (const auto& x : st.trace.all<trace::Collective>()) {
      if (std::string_view(x.kind) != "send_recv") continue;
      CHECK(x.group.size == 4);
      CHECK(x.group.stride == 2);
      for (const auto& peer : x.peers) {
        CHECK((peer.peer == p - 1 || peer.peer == p + 1));
        if (peer.send && peer.peer == p + 1) to_next += peer.bytes;
        if (!peer.send && peer.peer == p - 1) from_previous += peer.bytes;
      }
    }
    // Four microbatches of one sequence of 32 rows of dim 64 floats go forward.
    CHECK(to_next == (p < 3 ? 4 * 32 * 64 * 4 : 0));
    CHECK(from_previous == (p > 0 ? 4 * 32 * 64 * 4 : 0));
  }
}

TEST_CASE("layout dry run: a layout that does not make the world is refused by key") {
  const train::JobConfig c = job(Layout{"TP 2", {1, 1, 1, 2}, ""}, {});
  CHECK_THROWS_WITH_AS(plan::dry_run_step<float>(c, 0, 3, 0), doctest::Contains("but the world has 3 ranks"), Error);
  CHECK_THROWS_WITH_AS(plan::dry_run_step<float>(c, 0, 2, 2), doctest::Contains("rank 2 is outside the world of 2"),
                       Error);
  CHECK_THROWS_WITH_AS(plan::dry_run_step<float>(c), doctest::Contains("tensor_parallel_degree 2"), Error);
  // A context-parallel degree that does not divide the world, and a sequence it cannot split.
  const train::JobConfig three = job(Layout{"CP 3", {1, 1, 1, 1, 3}, ""}, {"--training.seq_len", "24"});
  CHECK_THROWS_WITH_AS(plan::dry_run_step<float>(three, 0, 8, 0),
                       doctest::Contains("x context_parallel_degree 3 = 3, but the world has 8 ranks"), Error);
  CHECK_THROWS_WITH_AS(plan::dry_run_step<float>(job(Layout{"CP 4", {1, 1, 1, 1, 4}, ""}, {"--training.seq_len", "20"}), 0, 4, 0),
                       doctest::Contains("training.seq_len = 20 does not split into 2 x parallelism.context_parallel_degree"),
                       Error);
}

}  // namespace test_layout_trace
