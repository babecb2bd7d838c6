// The cluster model's arithmetic (plan/cluster.hpp: NCCL's algorithms on the links a
// group crosses, a send/recv's link by where its two ranks sit) and the layout timeline
// (plan/timeline.hpp): overlap, exposed communication, pipeline waits, a context-parallel
// ring beside FSDP's collectives, and every bench-policy-matrix layout (and three with
// context parallelism) replayed from its dry-run traces without a deadlock.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "../parallel/harness.hpp"
#include "tessera/plan/cluster.hpp"
#include "tessera/plan/dry_run.hpp"
#include "tessera/plan/layout.hpp"
#include "tessera/plan/machine.hpp"
#include "tessera/plan/timeline.hpp"

#ifndef TESSERA_MACHINES
#error "TESSERA_MACHINES: the folder of the machine profiles"
#endif

namespace test_cluster {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;

namespace {
/// s with every `from` replaced by `to`.
std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (std::size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

plan::Machine a100() { return plan::load_machine(std::string(TESSERA_MACHINES) + "/a100-80gb-sxm.toml"); }

trace::Collective collective(const char* kind, std::int64_t bytes, int size, int stride, std::uint64_t id = 1) {
  trace::Collective c;
  c.kind = kind;
  c.bytes = bytes;
  c.group = {size, 0, stride};
  c.id = id;
  return c;
}

/// Every operation but communication takes `seconds`.
struct FixedPricer final : plan::Pricer {
  double s = 1e-3;
  double seconds(const trace::Op&) const override { return s; }
  double peak_flops(DType) const override { return 1e12; }
  double usable_bytes() const override { return 1e12; }
  std::string name() const override { return "fixed"; }
};

}  // namespace

TEST_CASE("cluster: a group's members per node and nodes") {
  CHECK(plan::placement({8, 0, 1}, 8).per_node == 8);
  CHECK(plan::placement({8, 0, 1}, 8).nodes == 1);
  CHECK(plan::placement({4, 0, 8}, 8).per_node == 1);
  CHECK(plan::placement({4, 0, 8}, 8).nodes == 4);
  CHECK(plan::placement({4, 0, 4}, 8).per_node == 2);
  CHECK(plan::placement({4, 0, 4}, 8).nodes == 2);
  CHECK(plan::placement({64, 0, 1}, 8).nodes == 8);
  CHECK(plan::placement({2, 0, 3}, 8).nodes == 2);  // a stride that does not divide the node
}

TEST_CASE("cluster: collectives cost what NCCL's model says") {
  const plan::Machine m = a100();
  REQUIRE(m.network.has_value());
  const plan::Network& net = *m.network;
  SUBCASE("a large all-gather within a node is a ring at the NVLink bus bandwidth") {
    const double bytes = 1 << 30;
    const double expected = (8.4 + 7 * 3.4) * 1e-6 + bytes * 7 / 8 / (235e9);
    CHECK(plan::collective_seconds(collective("all_gather", 1 << 30, 8, 1), net) == doctest::Approx(expected).epsilon(1e-12));
  }
  SUBCASE("across nodes the ring runs at the NICs of the members a node holds") {
    const double bytes = 1 << 30;
    // 4 nodes of one member each: 23 GB/s, 3 network steps.
    const double one = (8.4 + 3 * 9.6) * 1e-6 + bytes * 3 / 4 / 23e9;
    CHECK(plan::collective_seconds(collective("reduce_scatter", 1 << 30, 4, 8), net) == doctest::Approx(one).epsilon(1e-12));
    // 2 nodes of 8: min(235, 8 x 23) = 184 GB/s.
    const double full = (8.4 + 14 * 3.4 + 1 * 9.6) * 1e-6 + bytes * 15 / 16 / 184e9;
    CHECK(plan::collective_seconds(collective("all_gather", 1 << 30, 16, 1), net) == doctest::Approx(full).epsilon(1e-12));
  }
  SUBCASE("a small all-reduce over many nodes takes the tree with the LL protocol") {
    const double tree_ll = (4.4 + 2 * (7 * 0.52 + 8 * 5.0)) * 1e-6;  // 256 nodes of 8
    const double t = plan::collective_seconds(collective("all_reduce", 8, 2048, 1), net);
    CHECK(t == doctest::Approx(tree_ll).epsilon(1e-3));
    const double ring = (8.4 + (2 * 2047 - 2 * 255) * 3.4 + 2 * 255 * 9.6) * 1e-6;
    CHECK(t < ring / 10);
  }
  SUBCASE("a send/recv moves its bytes over the one link between its ranks") {
    trace::Collective c = collective("send_recv", 0, 4, 8);  // pipeline peers a node apart
    c.peers = {{1, 1 << 20, true}};
    CHECK(plan::collective_seconds(c, net) == doctest::Approx((8.4 + 9.6) * 1e-6 + double(1 << 20) / 23e9));
    c.group.stride = 2;  // within a node
    CHECK(plan::collective_seconds(c, net) == doctest::Approx((8.4 + 3.4) * 1e-6 + double(1 << 20) / 235e9));
  }
  SUBCASE("a context-parallel ring moves at its slowest link: NVLink while it lies in one node") {
    const double nvlink = (8.4 + 3.4) * 1e-6 + double(1 << 20) / 235e9, network = (8.4 + 9.6) * 1e-6 + double(1 << 20) / 23e9;
    // Rank 0 of the ring sends to 1 and receives from the last, its wrap.
    trace::Collective ring = collective("send_recv", 0, 8, 1);  // cp 8 x tp 1: one node
    ring.peers = {{1, 1 << 20, true}, {7, 1 << 20, false}};
    CHECK(plan::ring_seconds(ring, net) == doctest::Approx(nvlink));
    ring = collective("send_recv", 0, 4, 2);  // cp 4 x tp 2: ranks 0, 2, 4, 6
    ring.peers = {{1, 1 << 20, true}, {3, 1 << 20, false}};
    CHECK(plan::ring_seconds(ring, net) == doctest::Approx(nvlink));
    ring = collective("send_recv", 0, 2, 8);  // cp 2 x tp 8: the two ranks a node apart
    ring.peers = {{1, 1 << 20, true}, {1, 1 << 20, false}};
    CHECK(plan::ring_seconds(ring, net) == doctest::Approx(network));
    // cp 16 over two nodes: rank 0's own transfers stay in its node, but the ring waits
    // for the two that cross (7 to 8, 15 to 0).
    ring = collective("send_recv", 0, 16, 1);
    ring.peers = {{1, 1 << 20, true}, {15, 1 << 20, false}};
    CHECK(plan::ring_seconds(ring, net) == doctest::Approx(network));
    ring.peers = {{1, 1 << 21, true}, {15, 1 << 21, false}};  // the largest transfer sets the time
    CHECK(plan::ring_seconds(ring, net) == doctest::Approx((8.4 + 9.6) * 1e-6 + double(1 << 21) / 23e9));
  }
  SUBCASE("one rank sends nothing") { CHECK(plan::collective_seconds(collective("all_reduce", 1 << 20, 1, 1), net) == 0); }
}

TEST_CASE("cluster: a machine file's network section is read whole or refused by key") {
  const std::string text = R"(
[machine]
name = "x"
device = "cuda"
[memory.capacity_bytes]
value = 1e10
source = "s"
[memory.reserved_bytes]
value = 1e9
source = "s"
[compute.bf16_tflops]
value = 1
source = "s"
[compute.fp32_tflops]
value = 1
source = "s"
[compute.sm_count]
value = 1
source = "s"
[compute.boost_clock_ghz]
value = 1
source = "s"
[compute.shared_memory_bytes_per_clock_per_sm]
value = 1
source = "s"
[gemm.bf16_efficiency]
points = [[1, 0.5]]
source = "s"
[gemm.fp32_efficiency]
points = [[1, 0.5]]
source = "s"
[hbm.bandwidth_gbs]
value = 1
source = "s"
[hbm.achieved_fraction]
value = 1
source = "s"
[host.launch_us]
value = 1
source = "s"
[host.sync_us]
value = 1
source = "s"
[host.link_gbs]
value = 1
source = "s"
)";
  CHECK_FALSE(plan::parse_machine(text, "x.toml").network.has_value());
  const std::string network = text + R"(
[network.gpus_per_node]
value = 8
source = "s"
[network.nvlink_gbs]
value = 200
source = "s"
[network.nvlink_latency_us]
value = 3
source = "s"
[network.network_gbs]
value = 20
source = "s"
)";
  CHECK_THROWS_WITH_AS(plan::parse_machine(network, "x.toml"), "x.toml: machine profile: network.network_latency_us is missing",
                       Error);
  const plan::Machine m = plan::parse_machine(network + "[network.network_latency_us]\nvalue = 9\nsource = \"s\"\n", "x.toml");
  REQUIRE(m.network.has_value());
  CHECK(m.network->network_gbs.value == 20);
  CHECK_FALSE(m.network->nics_per_node.has_value());  // optional: collectives then hold no SMs
  const std::string with_nics = network + "[network.network_latency_us]\nvalue = 9\nsource = \"s\"\n";
  CHECK(plan::parse_machine(with_nics + "[network.nics_per_node]\nvalue = 4\nsource = \"s\"\n", "x.toml")
            .network->nics_per_node->value == 4);
  CHECK_THROWS_WITH_AS(plan::parse_machine(with_nics + "[network.nics_per_node]\nvalue = 2.5\nsource = \"s\"\n", "x.toml"),
                       "x.toml: machine profile: network.nics_per_node must be a whole number up to 65536, got 2.5",
                       Error);
  // Counts the planner takes as ints: past any machine's, refused (a cast of 1e10 to int is undefined).
  std::string huge = with_nics;
  huge.replace(huge.find("value = 8"), 9, "value = 1e10");
  CHECK_THROWS_WITH_AS(plan::parse_machine(huge, "x.toml"),
                       "x.toml: machine profile: network.gpus_per_node must be a whole number up to 65536, got 1e+10",
                       Error);
  CHECK_THROWS_WITH_AS(plan::parse_machine(with_nics + "[network.nics_per_node]\nvalue = 4\n", "x.toml"),
                       doctest::Contains("network.nics_per_node has no source"), Error);
  // A GEMM beside held SMs, measured: optional; ratios of at least 1, fewer SMs held than
  // the device has (this one has 1), with a source.
  CHECK_FALSE(m.gemm_beside_held_sms.has_value());
  const std::string sms = replace_all(text, "[compute.sm_count]\nvalue = 1", "[compute.sm_count]\nvalue = 132");
  const plan::Machine held =
      plan::parse_machine(sms + "[gemm.slowdown_beside_held_sms]\npoints = [[8, 1.2], [16, 1.25]]\nsource = \"s\"\n", "x.toml");
  REQUIRE(held.gemm_beside_held_sms.has_value());
  CHECK(held.gemm_beside_held_sms->at(16, 1.0) == doctest::Approx(1.25));
  CHECK_THROWS_WITH_AS(
      plan::parse_machine(sms + "[gemm.slowdown_beside_held_sms]\npoints = [[8, 0.9]]\nsource = \"s\"\n", "x.toml"),
      doctest::Contains("a GEMM beside 8 SMs held cannot take less time than alone (ratio 0.9)"), Error);
  CHECK_THROWS_WITH_AS(
      plan::parse_machine(text + "[gemm.slowdown_beside_held_sms]\npoints = [[8, 1.2]]\nsource = \"s\"\n", "x.toml"),
      doctest::Contains("8 SMs held is not under compute.sm_count (1)"), Error);
  CHECK_THROWS_WITH_AS(plan::parse_machine(sms + "[gemm.slowdown_beside_held_sms]\npoints = [[8, 1.2]]\n", "x.toml"),
                       doctest::Contains("gemm.slowdown_beside_held_sms has no source"), Error);
}

TEST_CASE("cluster: a collective between nodes holds two SMs for each NIC its members reach") {
  plan::Network net = *a100().network;  // 8 GPUs and 8 NICs a node
  REQUIRE(net.nics_per_node.has_value());
  CHECK(plan::collective_sms(collective("all_gather", 1 << 20, 64, 1), net) == 16);     // 8 rings, doubled
  CHECK(plan::collective_sms(collective("reduce_scatter", 1 << 20, 16, 4), net) == 4);  // 2 members a node
  CHECK(plan::collective_sms(collective("all_reduce", 1 << 20, 8, 8), net) == 2);       // one a node
  CHECK(plan::collective_sms(collective("all_reduce", 1 << 20, 8, 1), net) == 0);       // within a node
  trace::Collective p2p = collective("send_recv", 0, 2, 8);
  p2p.peers = {{1, 1 << 20, true}};
  CHECK(plan::collective_sms(p2p, net) == 0);  // its own p2p channels: not counted
  net.nics_per_node->value = 4;                // p4de: 4 EFA NICs for 8 GPUs
  CHECK(plan::collective_sms(collective("all_gather", 1 << 20, 64, 1), net) == 8);
  net.nics_per_node.reset();
  CHECK(plan::collective_sms(collective("all_gather", 1 << 20, 64, 1), net) == 0);
}

TEST_CASE("timeline: a collective overlaps the compute issued after it, and what it outlasts is exposed") {
  const plan::Machine m = a100();
  FixedPricer compute;  // 1 ms per operation
  trace::Trace t;
  t.add(collective("all_gather", 1 << 30, 8, 1, 1));  // about 4.6 ms
  t.add(trace::Fill{4});
  t.add(trace::Fill{4});
  t.add(trace::CommWait{1});
  t.add(trace::Fill{4});
  const double comm = plan::collective_seconds(collective("all_gather", 1 << 30, 8, 1), *m.network);
  const plan::Timeline tl = plan::simulate_step({&t}, 8, compute, *m.network);
  REQUIRE(tl.positions.size() == 1);
  CHECK(tl.positions[0].compute_seconds == doctest::Approx(3e-3));
  CHECK(tl.positions[0].exposed_comm_seconds == doctest::Approx(comm - 2e-3));
  CHECK(tl.step_seconds == doctest::Approx(comm + 1e-3));
}

TEST_CASE("timeline: a host loop after a fence's wait runs beside the device's later work; after a synchronisation, not") {
  // 1 ms an operation (host loops too; fences and their waits take nothing, as GpuPricer
  // prices them): device A, fence, device B, the host waits for the fence, a host loop,
  // device C. The host's loop runs beside B: the step is 3 ms where the sum is 4.
  struct HostPricer final : plan::Pricer {
    bool cpu = false;
    double seconds(const trace::Op& op) const override {
      return std::holds_alternative<trace::Fence>(op) || std::holds_alternative<trace::FenceWait>(op) ? 0 : 1e-3;
    }
    double peak_flops(DType) const override { return 1e12; }
    double usable_bytes() const override { return 1e12; }
    std::string name() const override { return "host"; }
    bool host_runs_device_work() const override { return cpu; }
  };
  trace::Kernel host_loop;
  host_loop.functor = "AdamWMultiStep<float, float>";
  host_loop.on_host = true;
  const auto step = [&](bool fence, bool cpu) {
    trace::Trace t;
    t.add(trace::Fill{4});
    t.add(trace::Fence{7});
    t.add(trace::Fill{4});
    if (fence) t.add(trace::FenceWait{7});
    else t.add(trace::Synchronize{});
    t.add(host_loop);
    t.add(trace::Fill{4});
    HostPricer pricer;
    pricer.cpu = cpu;
    const plan::Timeline tl = plan::simulate_step({&t}, 1, pricer, plan::Network{});
    const plan::StepShape shape;
    const plan::Prediction p = plan::predict(t, pricer, shape, 0, {});
    CHECK(p.step_seconds == doctest::Approx(tl.step_seconds));  // one rank: the replay and the timeline agree
    CHECK(tl.positions[0].host_seconds == doctest::Approx(1e-3));
    CHECK(tl.positions[0].hidden_host_seconds == doctest::Approx(p.hidden_host_seconds));
    return tl;
  };
  CHECK(step(true, false).step_seconds == doctest::Approx(3e-3));
  CHECK(step(true, false).positions[0].hidden_host_seconds == doctest::Approx(1e-3));
  CHECK(step(false, false).step_seconds == doctest::Approx(5e-3));  // the synchronisation's own 1 ms among them
  CHECK(step(false, false).positions[0].hidden_host_seconds == 0);
  CHECK(step(true, true).step_seconds == doctest::Approx(4e-3));  // a CPU's cores run both: the sum
  trace::Trace unpaired;
  unpaired.add(trace::FenceWait{3});
  CHECK_THROWS_WITH_AS(plan::simulate_step({&unpaired}, 1, HostPricer{}, plan::Network{}),
                       doctest::Contains("never recorded"), Error);
}

TEST_CASE("timeline: GEMMs and attention beside a collective between nodes run on the SMs it leaves") {
  struct SmPricer final : plan::Pricer {  // 1 ms an operation on 100 SMs
    double seconds(const trace::Op&) const override { return 1e-3; }
    double peak_flops(DType) const override { return 1e12; }
    double usable_bytes() const override { return 1e12; }
    std::string name() const override { return "100 SMs"; }
    double sm_count() const override { return 100; }
  } compute;
  const plan::Network net = *a100().network;  // 8 NICs a node: 16 SMs held by a collective of whole nodes
  const trace::Collective long_gather = collective("all_gather", std::int64_t{1} << 33, 64, 1, 1);
  REQUIRE(plan::collective_seconds(long_gather, net) > 10e-3);
  const double k = 100.0 / 84;
  {  // the GEMM and the attention run slower for all their time; the memory-bound kernel does not
    trace::Trace t;
    t.add(long_gather);
    t.add(trace::Gemm{});
    t.add(trace::Attention{});
    t.add(trace::Fill{4});
    t.add(trace::CommWait{1});
    const plan::Timeline tl = plan::simulate_step({&t}, 64, compute, net);
    CHECK(tl.positions[0].compute_seconds == doctest::Approx(2e-3 * k + 1e-3));
    CHECK(tl.positions[0].collective_sm_seconds == doctest::Approx(2e-3 * (k - 1)));
  }
  {  // a collective that ends during the GEMM slows only the part before its end
    const trace::Collective short_gather = collective("all_gather", 1 << 20, 64, 1, 1);
    const double d = plan::collective_seconds(short_gather, net);
    REQUIRE(d < 1e-3);
    trace::Trace t;
    t.add(short_gather);
    t.add(trace::Gemm{});
    t.add(trace::CommWait{1});
    const plan::Timeline tl = plan::simulate_step({&t}, 64, compute, net);
    CHECK(tl.positions[0].compute_seconds == doctest::Approx(d + (1e-3 - d / k)));
  }
  {  // within a node, or without the machine's NICs, the GEMM keeps its time
    trace::Trace t;
    t.add(collective("all_gather", std::int64_t{1} << 33, 8, 1, 1));
    t.add(trace::Gemm{});
    t.add(trace::CommWait{1});
    CHECK(plan::simulate_step({&t}, 8, compute, net).positions[0].compute_seconds == doctest::Approx(1e-3));
    plan::Network no_nics = net;
    no_nics.nics_per_node.reset();
    trace::Trace u;
    u.add(long_gather);
    u.add(trace::Gemm{});
    u.add(trace::CommWait{1});
    const plan::Timeline tl = plan::simulate_step({&u}, 64, compute, no_nics);
    CHECK(tl.positions[0].compute_seconds == doctest::Approx(1e-3));
    CHECK(tl.positions[0].collective_sm_seconds == 0);
  }
}

TEST_CASE("timeline: a GEMM beside held SMs takes what the machine profile measured, attention the SMs' share") {
  plan::Machine m = a100();
  plan::HeldSmSlowdown measured;
  measured.points = {{8, 1.2}, {16, 1.25}};
  measured.source = "test";
  // Linear from (0, 1) to the points, flat beyond them, never under the SMs' share.
  CHECK(measured.at(0, 1.0) == 1.0);
  CHECK(measured.at(4, 1.03) == doctest::Approx(1.1));
  CHECK(measured.at(12, 1.1) == doctest::Approx(1.225));
  CHECK(measured.at(24, 1.1) == doctest::Approx(1.25));
  CHECK(measured.at(24, 1.4) == doctest::Approx(1.4));
  m.gemm_beside_held_sms = measured;
  const plan::GpuPricer gpu(m);
  const double spread = m.sm_count.value / (m.sm_count.value - 16);
  CHECK(gpu.beside_held_sms(16, true) == doctest::Approx(std::max(1.25, spread)));
  CHECK(gpu.beside_held_sms(16, false) == doctest::Approx(spread));
  CHECK(gpu.beside_held_sms(0, true) == 1.0);
  m.gemm_beside_held_sms.reset();
  CHECK(plan::GpuPricer(m).beside_held_sms(16, true) == doctest::Approx(spread));

  struct MeasuredPricer final : plan::Pricer {  // 1 ms an operation on 100 SMs; a GEMM 1.5x beside any hold
    double seconds(const trace::Op&) const override { return 1e-3; }
    double peak_flops(DType) const override { return 1e12; }
    double usable_bytes() const override { return 1e12; }
    std::string name() const override { return "100 SMs, measured"; }
    double sm_count() const override { return 100; }
    double beside_held_sms(int held, bool gemm) const override {
      return gemm ? 1.5 : plan::Pricer::beside_held_sms(held, gemm);
    }
  } compute;
  const plan::Network net = *a100().network;
  trace::Trace t;
  t.add(collective("all_gather", std::int64_t{1} << 33, 64, 1, 1));
  t.add(trace::Gemm{});
  t.add(trace::Attention{});
  t.add(trace::CommWait{1});
  const plan::Timeline tl = plan::simulate_step({&t}, 64, compute, net);
  CHECK(tl.positions[0].compute_seconds == doctest::Approx(1.5e-3 + 1e-3 * 100.0 / 84));
}

TEST_CASE("timeline: a pipeline stage waits for what the stage before it sends") {
  const plan::Machine m = a100();
  FixedPricer compute;
  trace::Trace first, second;
  trace::Collective send = collective("send_recv", 0, 2, 8, 1);
  send.peers = {{1, 1 << 20, true}};
  trace::Collective recv = collective("send_recv", 0, 2, 8, 1);
  recv.group.rank = 1;
  recv.peers = {{0, 1 << 20, false}};
  first.add(trace::Fill{4});
  first.add(send);
  first.add(trace::CommWait{1});
  second.add(recv);
  second.add(trace::CommWait{1});
  second.add(trace::Fill{4});
  const plan::Timeline tl = plan::simulate_step({&first, &second}, 8, compute, *m.network);
  const double transfer = plan::collective_seconds(send, *m.network);
  CHECK(tl.positions[1].pipeline_wait_seconds == doctest::Approx(1e-3 + transfer));
  CHECK(tl.step_seconds == doctest::Approx(2e-3 + transfer));
  // A recv nobody sends is named, not waited for forever.
  CHECK_THROWS_WITH_AS(plan::simulate_step({&second, &second}, 8, compute, *m.network),
                       doctest::Contains("the positions wait for each other"), Error);
}

TEST_CASE("timeline: a ring's send/recv within a position is every peer's at once, beside FSDP's collectives") {
  // FSDP over dp_shard x cp with dp_shard 1 is a group of the ring's stride and size; the
  // ring's communicator is another, on its own stream: the ring's keys do not wait for the
  // all-gather issued before them. Its wait is exposed communication, not pipeline wait.
  const plan::Machine m = a100();
  FixedPricer compute;
  trace::Trace t;
  const trace::Collective gather = collective("all_gather", 1 << 30, 8, 1, 1);
  trace::Collective ring = collective("send_recv", 0, 8, 1, 2);
  ring.peers = {{1, 1 << 24, true}, {7, 1 << 24, false}};
  t.add(gather);
  t.add(ring);
  t.add(trace::CommWait{2});
  t.add(trace::Fill{4});
  t.add(trace::CommWait{1});
  const plan::Timeline tl = plan::simulate_step({&t}, 8, compute, *m.network);
  const double g = plan::collective_seconds(gather, *m.network), r = plan::ring_seconds(ring, *m.network);
  REQUIRE(r + 1e-3 < g);
  CHECK(tl.step_seconds == doctest::Approx(g));
  CHECK(tl.positions[0].exposed_comm_seconds == doctest::Approx(g - 1e-3));
  CHECK(tl.positions[0].pipeline_wait_seconds == 0);
  CHECK(r == plan::ring_seconds(ring, *m.network));
  CHECK(tl.positions[0].comm_seconds == doctest::Approx(g + r));
}

TEST_CASE("timeline: every bench-policy-matrix layout replays from its positions' traces") {
  const plan::Machine m = a100();
  const plan::GpuPricer gpu(m);
  struct L {
    comm::MeshShape shape;
    const char* schedule;
  };
  const L layouts[] = {{{1, 1, 8, 1}, ""},          {{1, 2, 4, 1}, ""},          {{1, 8, 1, 1}, ""},
                       {{1, 1, 1, 8}, ""},          {{1, 2, 2, 2}, ""},          {{8, 1, 1, 1}, "GPipe"},
                       {{8, 1, 1, 1}, "1F1B"},      {{2, 1, 4, 1}, "Interleaved1F1B"},
                       {{4, 1, 2, 1}, "InterleavedZeroBubble"}, {{2, 1, 2, 2}, "1F1B"},
                       {{1, 1, 4, 1, 2}, ""},       {{1, 2, 1, 2, 2}, ""},       {{2, 1, 2, 1, 2}, "1F1B"}};
  for (const L& l : layouts) {
    std::vector<std::string> keys = {
        "--parallelism.data_parallel_replicate_degree", std::to_string(l.shape.dp_replicate),
        "--parallelism.data_parallel_shard_degree", std::to_string(l.shape.dp_shard),
        "--parallelism.tensor_parallel_degree", std::to_string(l.shape.tp),
        "--parallelism.pipeline_parallel_degree", std::to_string(l.shape.pp),
        "--parallelism.context_parallel_degree", std::to_string(l.shape.cp)};
    if (*l.schedule) keys.insert(keys.end(), {"--parallelism.pipeline_parallel_schedule", l.schedule});
    const train::JobConfig c = test::debug_job(test::kParityBatch / l.shape.dp(), test::kParityBatch, 2, keys);
    std::vector<plan::StepTrace> traces;
    for (int r : plan::distinct_ranks(l.shape)) traces.push_back(plan::dry_run_step<float>(c, 0, l.shape.world(), r));
    std::vector<const trace::Trace*> positions;
    for (const auto& st : traces) positions.push_back(&st.trace);
    INFO(l.shape.str(), " ", std::string(l.schedule));
    const plan::Timeline tl = plan::simulate_step(positions, l.shape.per_stage(), gpu, *m.network);
    REQUIRE(tl.positions.size() == static_cast<std::size_t>(l.shape.pp));
    for (const auto& p : tl.positions) {
      CHECK(p.collectives > 0);
      CHECK(p.end_seconds <= tl.step_seconds);
      CHECK(p.end_seconds == doctest::Approx(p.compute_seconds + p.exposed_comm_seconds + p.pipeline_wait_seconds));
      if (l.shape.pp > 1) CHECK(p.pipeline_wait_seconds > 0);
      else CHECK(p.pipeline_wait_seconds == 0);
    }
  }
}

TEST_CASE("layout: one rank's layout prices as predict does; a layout's sums hold") {
  const plan::Machine m = a100();
  const plan::GpuPricer gpu(m);
  {
    const train::JobConfig c = test::debug_job(test::kParityBatch, test::kParityBatch, 2, {});
    const std::vector<plan::StepTrace> one{plan::dry_run_step<float>(c)};
    const plan::LayoutPrediction l = plan::predict_layout(one, gpu, *m.network);
    const plan::Prediction p = plan::predict(one[0].trace, gpu, one[0].shape, one[0].peak_bytes, one[0].at_peak);
    CHECK(l.step_seconds == doctest::Approx(p.step_seconds));
    CHECK(l.tokens_per_sec == doctest::Approx(p.tokens_per_sec));
    CHECK(l.mfu_pct == doctest::Approx(p.mfu_pct));
    CHECK(l.peak_memory_bytes == p.peak_memory_bytes);
    CHECK(l.fits == p.fits);
  }
  // FSDP 2 x PP 2 on 4 ranks: tokens/s per GPU, the largest position's peak, the last to finish.
  const train::JobConfig c = test::debug_job(test::kParityBatch / 2, test::kParityBatch, 2,
                                             {"--parallelism.pipeline_parallel_degree", "2"});
  const comm::MeshShape shape{2, 1, 2, 1};
  std::vector<plan::StepTrace> traces;
  for (int r : plan::distinct_ranks(shape)) traces.push_back(plan::dry_run_step<float>(c, 0, shape.world(), r));
  const plan::LayoutPrediction l = plan::predict_layout(traces, gpu, *m.network);
  REQUIRE(l.positions.size() == 2);
  CHECK(l.gpus == 4);
  CHECK(l.tokens_per_sec * 4 * l.step_seconds == doctest::Approx(static_cast<double>(traces[0].shape.tokens)));
  CHECK(l.peak_memory_bytes == std::max(traces[0].peak_bytes, traces[1].peak_bytes));
  CHECK(l.step_seconds == std::max(l.positions[0].time.end_seconds, l.positions[1].time.end_seconds));
  CHECK(l.fits);
  // Traces that are not one per position are refused.
  CHECK_THROWS_WITH_AS(plan::predict_layout({traces[0]}, gpu, *m.network),
                       doctest::Contains("1 traces for 2 pipeline positions"), Error);
}

TEST_CASE("layout: ZeRO-1 splits the replicas' optimizer state and work, and halves bf16 gradients") {
  const plan::Machine m = a100();
  const plan::GpuPricer gpu(m);
  const comm::MeshShape shape{1, 4, 1, 1};
  const train::JobConfig c = test::debug_job(test::kParityBatch / 4, test::kParityBatch, 2,
                                             {"--parallelism.data_parallel_replicate_degree", "4",
                                              "--parallelism.data_parallel_shard_degree", "1",
                                              "--training.mixed_precision_param", "bfloat16"});
  plan::StepTrace ddp = plan::dry_run_step<bf16>(c, 0, shape.world(), 0);
  plan::StepTrace z = ddp;
  plan::account_zero1(z);
  const std::size_t opt = ddp.at_peak[MemoryUse::optimizer], grads = ddp.at_peak[MemoryUse::gradients];
  REQUIRE(opt > 0);
  CHECK(z.at_peak[MemoryUse::optimizer] == opt / 4);
  CHECK(z.at_peak[MemoryUse::gradients] == grads / 2);
  CHECK(ddp.peak_bytes - z.peak_bytes == (opt - opt / 4) + (grads - grads / 2));
  // The optimizer's kernels move a quarter of the bytes; the gradients' all-reduce half.
  auto optimizer_bytes = [](const plan::StepTrace& st) {
    double b = 0;
    for (const auto& e : st.trace.events())
      if (const auto* k = std::get_if<trace::Kernel>(&e.op); k && std::string_view(e.region) == region::kOptimizer)
        b += static_cast<double>(k->traffic.bytes_read + k->traffic.bytes_written);
    return b;
  };
  auto reduced = [](const plan::StepTrace& st) {
    std::int64_t b = 0;
    for (const auto& c : st.trace.all<trace::Collective>())
      if (std::string_view(c.kind) == "all_reduce" && c.group.size == 4 && c.bytes > 64) b += c.bytes;
    return b;
  };
  CHECK(optimizer_bytes(z) == doctest::Approx(optimizer_bytes(ddp) / 4).epsilon(0.01));
  CHECK(reduced(z) * 2 == reduced(ddp));
  CHECK(plan::predict_layout({z}, gpu, *m.network).step_seconds < plan::predict_layout({ddp}, gpu, *m.network).step_seconds);
  // ZeRO-1 shards the optimizer of replicas: an FSDP trace is refused.
  const train::JobConfig fsdp =
      test::debug_job(test::kParityBatch / 4, test::kParityBatch, 2, {"--training.mixed_precision_param", "bfloat16"});
  plan::StepTrace sharded = plan::dry_run_step<bf16>(fsdp, 0, 4, 0);
  CHECK_THROWS_WITH_AS(plan::account_zero1(sharded), doctest::Contains("plan.zero1: the data-parallel ranks must be replicas"),
                       Error);
}

}  // namespace test_cluster
