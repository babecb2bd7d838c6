// What a collective costs on a cluster: NCCL's algorithms on the links its group crosses.
//
// A machine file's [network] section (plan/machine.hpp) says how the GPUs are joined:
// GPUs per node; the bus bandwidth NCCL reaches among the GPUs of one node (NVLink and
// NVSwitch) and the latency of one ring step there; the network's bandwidth per GPU
// between nodes (each GPU has its own NIC on DGX-style nodes) and the latency of one step
// over it. A collective's group (trace::CommGroup: size and stride in world ranks, ranks
// laid out node by node, tensor-parallel peers adjacent) tells how many of its members
// share a node and how many nodes it spans.
//
// A collective is priced as NCCL's own tuning model prices it (NVIDIA/nccl,
// src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime): time = latency +
// bytes / algorithm bandwidth, for each algorithm and protocol NCCL could pick, and NCCL
// picks the fastest:
//   ring    every kind; n - 1 steps (all-gather, reduce-scatter) or 2 (n - 1)
//           (all-reduce), of which (nodes - 1) or 2 (nodes - 1) cross the network;
//           algorithm bandwidth = bus bandwidth x n / steps; latency = base + the steps'
//           latencies; a multi-node ring all-reduce of large messages pays 1.9x latency
//   tree    all-reduce across nodes: a chain within each node and a binary tree between
//           them, up and down; algorithm bandwidth = half the bus bandwidth (x 0.9,
//           capped at 80 GB/s beyond two nodes, 110 within); latency 2 ((per node - 1)
//           intra + log2(nodes) inter)
//   protocols  Simple (full bandwidth, the machine file's step latencies) and LL (a
//           quarter of a ring's bandwidth, a 3.8th of a tree's; NCCL's LL latencies,
//           scaled by the machine's over NCCL's Simple ones)
// where the bus bandwidth is the node's NVLink bus bandwidth within a node, and across
// nodes the smaller of it and the network bandwidth of the members one node holds (NCCL
// runs a channel through each of their NICs). A send/recv moves its bytes over the one
// link between its two ranks at that link's bandwidth after one step's latency (a
// pipeline's neighbours, `stride` apart: within a node where two strides fit one). A
// context-parallel ring's send/recv (ring_seconds) moves at its slowest link: every rank
// sends to the next and receives from the one before at once, and each waits for its
// receive before its next step, so the ring is on NVLink while the whole group (cp ranks
// tp apart) lies in one node, and on the network once it spans nodes. Left out:
// NVLink SHARP and CollNet (faster all-reduce where a cluster has them), LL128, the tree's
// correction at medium sizes, and links shared by concurrent collectives.
//
// What a collective takes from the compute beside it (collective_sms): NCCL runs a
// collective as one kernel of one thread block per channel, resident for the whole
// collective, and a GEMM's blocks (one per SM, most of its registers and shared memory)
// do not fit beside one, so each channel holds an SM that the GEMMs and the attention
// overlapping it do not get (an all-gather's 24 blocks beside a GEMM on an H100,
// forums.developer.nvidia.com, "Compute-Communication Overlap Causes Severe GEMM
// Performance Degradation because of Tail Effect"). Between nodes NCCL's search builds a
// ring through each NIC the group's members reach (a node's members, at most its NICs),
// and ncclTopoPostset doubles the rings it found (src/graph/connect.cc: "nChannels =
// comm->nChannels = std::min(MAXCHANNELS, nChannels*2)"): channels = 2 x min(NICs per
// node, members per node). NCCL's logs of 16 ranks on two p4d nodes (4 EFA NICs) read 8
// channels (NVIDIA/nccl#520), and 2 where the logs show the first NIC alone in use
// (aws/aws-ofi-nccl#64, NVIDIA/nccl#527). Within a node the count depends on NVLink's
// speeds in NCCL's search, which no source here gives: those collectives, and send/recv
// (its own p2p channels), hold none. A machine file without network.nics_per_node counts
// none.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "tessera/backend/trace.hpp"
#include "tessera/plan/machine.hpp"

namespace tessera::plan {

/// How a group sits on the nodes: members per node and nodes spanned.
struct Placement {
  int per_node = 1;
  int nodes = 1;
};

/// Ranks are numbered node by node (gpus_per_node each); a group's members are
/// `stride` apart.
inline Placement placement(const trace::CommGroup& g, int gpus_per_node) {
  Placement p;
  if (g.stride < gpus_per_node && gpus_per_node % g.stride == 0) p.per_node = std::min(g.size, gpus_per_node / g.stride);
  p.nodes = (g.size + p.per_node - 1) / p.per_node;
  return p;
}

namespace nccl {
// NCCL's tuning model (src/graph/tuning.cc): base latencies (us) per algorithm and
// protocol, and per-step hardware latencies on NVLink and on the network.
inline constexpr double kRingSimpleBase = 8.4, kRingLlBase = 3.6, kTreeLlBase = 4.4, kTreeSimpleBase = 0;
inline constexpr double kNvlinkRingSimple = 3.4, kNvlinkRingLl = 0.47, kNvlinkTreeSimple = 28, kNvlinkTreeLl = 0.52;
inline constexpr double kNetRingSimple = 9.6, kNetRingLl = 2.7, kNetTreeSimple = 50, kNetTreeLl = 5.0;
}  // namespace nccl

/// The SMs `c` holds while it runs on `net`: its channels between nodes (above), 0 for a
/// collective within a node, a send/recv, or a machine file without network.nics_per_node.
inline int collective_sms(const trace::Collective& c, const Network& net) {
  const std::string_view kind = c.kind;
  if (!net.nics_per_node || c.group.size <= 1 || kind == "send_recv" || kind == "barrier") return 0;
  const Placement at = placement(c.group, static_cast<int>(net.gpus_per_node.value));
  if (at.nodes <= 1) return 0;
  return 2 * std::min(static_cast<int>(net.nics_per_node->value), at.per_node);
}

/// Seconds one collective takes on `net`: NCCL's fastest algorithm and protocol.
inline double collective_seconds(const trace::Collective& c, const Network& net) {
  const std::string_view kind = c.kind;
  const int n = c.group.size;
  if (n <= 1) return 0;
  const int gpn = static_cast<int>(net.gpus_per_node.value);
  const Placement at = placement(c.group, gpn);
  const double intra_bw = net.nvlink_gbs.value;
  const double bus = at.nodes == 1 ? intra_bw : std::min(intra_bw, net.network_gbs.value * at.per_node);
  // The machine's step latencies, and NCCL's others scaled as the machine's Simple ones are.
  const double intra_scale = net.nvlink_latency_us.value / nccl::kNvlinkRingSimple;
  const double inter_scale = net.network_latency_us.value / nccl::kNetRingSimple;
  const double bytes = static_cast<double>(c.bytes);

  if (kind == "send_recv") {
    // Each transfer on its own link; the group completes with its slowest.
    double worst = 0;
    for (const auto& x : c.peers) {
      const trace::CommGroup pair{2, 0, c.group.stride * std::max(1, std::abs(x.peer - c.group.rank))};
      const bool same_node = placement(pair, gpn).nodes == 1;
      const double bw = same_node ? intra_bw : net.network_gbs.value;
      const double lat = same_node ? net.nvlink_latency_us.value : net.network_latency_us.value;
      worst = std::max(worst, (nccl::kRingSimpleBase + lat) * 1e-6 + static_cast<double>(x.bytes) / (bw * 1e9));
    }
    return worst;
  }
  if (kind == "barrier") {  // an all-reduce of one int (NcclEngine's barrier)
    trace::Collective one = c;
    one.kind = "all_reduce";
    one.bytes = 4;
    return collective_seconds(one, net);
  }
  const bool all_reduce = kind == "all_reduce";
  const int steps = all_reduce ? 2 * (n - 1) : kind == "broadcast" ? n : n - 1;
  const int inter_steps = all_reduce ? 2 * (at.nodes - 1) : kind == "broadcast" ? at.nodes : at.nodes - 1;
  const int intra_steps = steps - inter_steps;

  auto seconds = [&](double latency_us, double alg_gbs) { return latency_us * 1e-6 + bytes / (alg_gbs * 1e9); };
  const double ring_bw = bus * n / steps;
  double lat = nccl::kRingSimpleBase + intra_steps * nccl::kNvlinkRingSimple * intra_scale +
               inter_steps * nccl::kNetRingSimple * inter_scale;
  if (all_reduce && at.nodes > 1 && bytes >= n / 16.0 * 65536) lat *= 1.9;  // NCCL's ring plateau
  double best = seconds(lat, ring_bw);
  const double ring_ll_lat = nccl::kRingLlBase + intra_steps * nccl::kNvlinkRingLl * intra_scale +
                             inter_steps * nccl::kNetRingLl * inter_scale;
  best = std::min(best, seconds(ring_ll_lat, ring_bw / (at.nodes > 1 || all_reduce ? 4.0 : 3.0)));
  if (all_reduce && at.nodes > 1) {
    const double tree_bus = std::min(bus * 0.9, at.nodes > 2 ? 80.0 : 110.0);
    const double hops = std::log2(static_cast<double>(at.nodes));
    const double simple = nccl::kTreeSimpleBase + 2 * ((at.per_node - 1) * nccl::kNvlinkTreeSimple * intra_scale +
                                                       hops * nccl::kNetTreeSimple * inter_scale);
    const double ll = nccl::kTreeLlBase +
                      2 * ((at.per_node - 1) * nccl::kNvlinkTreeLl * intra_scale + hops * nccl::kNetTreeLl * inter_scale);
    best = std::min({best, seconds(simple, tree_bus * 0.5), seconds(ll, tree_bus * 0.5 / 3.8)});
  }
  return best;
}

/// Seconds a context-parallel ring's send/recv group takes on `net` (a group among the
/// ranks of one pipeline position, plan/timeline.hpp): each transfer at the ring's
/// slowest link, NVLink while the group lies in one node, else the network (above); the
/// group completes with its largest.
inline double ring_seconds(const trace::Collective& c, const Network& net) {
  const bool one_node = placement(c.group, static_cast<int>(net.gpus_per_node.value)).nodes == 1;
  const double bw = one_node ? net.nvlink_gbs.value : net.network_gbs.value;
  const double lat = one_node ? net.nvlink_latency_us.value : net.network_latency_us.value;
  double worst = 0;
  for (const auto& x : c.peers)
    worst = std::max(worst, (nccl::kRingSimpleBase + lat) * 1e-6 + static_cast<double>(x.bytes) / (bw * 1e9));
  return worst;
}

}  // namespace tessera::plan
