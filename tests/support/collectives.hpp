// Every collective of a communicator against its definition, and grouped send/recv
// around a ring, run on each rank by the engines' tests (the thread ranks of tests/comm,
// the MPI processes of tests/mpi), so that both engines are held to one statement of
// what all_gather, reduce_scatter, all_reduce, broadcast and send_recv do.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "tessera/comm/communicator.hpp"

namespace tessera::testing {

/// Rank `rank`'s element i of the tests' inputs: distinct across ranks and positions, and
/// exact in float (halves of integers).
inline float collective_value(int rank, std::size_t i) {
  return static_cast<float>(rank * 1000 + static_cast<int>(i)) * 0.5f;
}

/// All-gather, reduce-scatter, all-reduce (sum over an uneven 11 elements, in place; max
/// and min; one value of each of int64, int32 and float) and broadcast from the last rank,
/// each against its definition, then a barrier. Every rank of `c` calls it.
inline void check_collectives_match_definitions(comm::Communicator& c) {
  using comm::ReduceOp;
  const int r = c.rank(), p = c.size();
  const std::size_t n = 7;
  std::vector<float> mine(n), gathered(n * p);
  for (std::size_t i = 0; i < n; ++i) mine[i] = collective_value(r, i);
  c.all_gather(std::span<const float>(mine), std::span<float>(gathered));
  for (int q = 0; q < p; ++q)
    for (std::size_t i = 0; i < n; ++i) CHECK(gathered[q * n + i] == collective_value(q, i));

  std::vector<float> full(n * p), block(n);
  for (std::size_t i = 0; i < full.size(); ++i) full[i] = collective_value(r, i);
  c.reduce_scatter(std::span<const float>(full), std::span<float>(block));
  for (std::size_t i = 0; i < n; ++i) {
    float expect = 0;
    for (int q = 0; q < p; ++q) expect += collective_value(q, r * n + i);
    CHECK(block[i] == expect);
  }

  // Uneven chunking: 11 elements over p ranks, in place; max and min too.
  std::vector<double> x(11);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = r + 0.25 * static_cast<double>(i);
  c.all_reduce(std::span<double>(x));
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(x[i] == p * (p - 1) / 2.0 + p * 0.25 * static_cast<double>(i));
  CHECK(c.all_reduce_value<std::int64_t>(r, ReduceOp::max) == p - 1);
  CHECK(c.all_reduce_value<std::int64_t>(r + 5, ReduceOp::min) == 5);
  CHECK(c.all_reduce_value<std::int32_t>(r + 1) == p * (p + 1) / 2);
  CHECK(c.all_reduce_value<float>(static_cast<float>(r) - 0.5f, ReduceOp::min) == -0.5f);

  std::vector<std::int32_t> b(5, r == p - 1 ? 42 : -1);
  c.broadcast(std::span<std::int32_t>(b), p - 1);
  for (auto v : b) CHECK(v == 42);
  c.barrier();
}

/// Grouped send/recv around a ring, both ways at once: 100 floats to the next rank and 3
/// to the one before, the receives posted first (one by one and blocking, that order would
/// deadlock). `c`'s traffic counters must start at zero. Every rank of `c` calls it.
inline void check_ring_send_recv(comm::Communicator& c) {
  using comm::DataType;
  using comm::PeerOp;
  const int r = c.rank(), p = c.size();
  std::vector<float> to_next(100, static_cast<float>(r)), from_prev(100), to_prev(3, -static_cast<float>(r)),
      from_next(3);
  const PeerOp ops[] = {
      {PeerOp::Kind::recv, (r + p - 1) % p, from_prev.data(), from_prev.size(), DataType::f32},
      {PeerOp::Kind::recv, (r + 1) % p, from_next.data(), from_next.size(), DataType::f32},
      {PeerOp::Kind::send, (r + 1) % p, to_next.data(), to_next.size(), DataType::f32},
      {PeerOp::Kind::send, (r + p - 1) % p, to_prev.data(), to_prev.size(), DataType::f32},
  };
  c.send_recv(ops);
  for (float v : from_prev) CHECK(v == static_cast<float>((r + p - 1) % p));
  for (float v : from_next) CHECK(v == -static_cast<float>((r + 1) % p));
  CHECK(c.traffic().send == 103 * sizeof(float));
}

}  // namespace tessera::testing
