// The MPI engine across processes, run by run_mpi.sh under mpirun on several world
// sizes: every collective against the same definitions the thread-rank tests use,
// splits, grouped send/recv (sends waited on late, matching by tag), async handles,
// traffic counting, and MPI's errors turned into tessera errors naming the function and
// the rank. Every test case runs on every rank and issues the same collectives in the
// same order on each.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "../support/collectives.hpp"
#include "../support/errors.hpp"
#include "tessera/comm/launch.hpp"
#include "tessera/comm/mpi.hpp"
#include "tessera/comm/nccl_rules.hpp"

using namespace tessera;
using namespace tessera::comm;

namespace {

/// A fresh communicator over every rank (a dup of MPI_COMM_WORLD), with its own traffic counters.
Communicator world() { return Communicator(MpiEngine(MPI_COMM_WORLD)); }

}  // namespace

TEST_CASE("mpi: the engine is MPI_COMM_WORLD's ranks, as the launcher describes them") {
  Communicator c = world();
  int rank = -1, size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CAPTURE(rank);
  CHECK(c.engine_name() == "mpi");
  CHECK(c.rank() == rank);
  CHECK(c.size() == size);
  CHECK(size >= 2);

  const Launch l = detect_launch();
  CHECK(l.kind == LaunchKind::mpi);
  CHECK(l.rank == rank);
  CHECK(l.world_size == size);
  CHECK(l.local_rank == rank);  // one node
  CHECK(mpi_world(l).size() == size);
  const std::string mismatch = "the environment describes rank 0 of 1 (single launch), but MPI started rank " +
                               std::to_string(rank) + " of " + std::to_string(size) +
                               ": start the ranks with mpirun or srun";
  CHECK_ERROR_CONTAINS(mpi_world(Launch{}), mismatch);
}

TEST_CASE("mpi: all_gather, reduce_scatter, all_reduce and broadcast match their definitions") {
  Communicator c = world();
  CAPTURE(c.rank());
  testing::check_collectives_match_definitions(c);
}

TEST_CASE("mpi: every element type moves, and all_reduce runs out of place too") {
  Communicator c = world();
  const int r = c.rank(), p = c.size();
  CAPTURE(r);
  std::vector<std::uint8_t> bytes{static_cast<std::uint8_t>(r), 200}, all_bytes(2 * p);
  c.all_gather(std::span<const std::uint8_t>(bytes), std::span<std::uint8_t>(all_bytes));
  for (int q = 0; q < p; ++q) {
    CHECK(all_bytes[2 * q] == q);
    CHECK(all_bytes[2 * q + 1] == 200);
  }
  std::vector<std::uint16_t> halves(3, r == 0 ? 0xBEEF : 0);
  c.broadcast(std::span<std::uint16_t>(halves), 0);
  for (auto v : halves) CHECK(v == 0xBEEF);
  std::vector<std::int64_t> big(p, std::int64_t{1} << 40), big_block(1);
  c.reduce_scatter(std::span<const std::int64_t>(big), std::span<std::int64_t>(big_block));
  CHECK(big_block[0] == p * (std::int64_t{1} << 40));

  MpiEngine e(MPI_COMM_WORLD);
  std::vector<double> in(13), out(13, -1.0);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = r * 0.5 + static_cast<double>(i);
  e.all_reduce(in.data(), out.data(), in.size(), DataType::f64, ReduceOp::sum).wait();
  for (std::size_t i = 0; i < in.size(); ++i) {
    CHECK(in[i] == r * 0.5 + static_cast<double>(i));  // the input is left alone
    CHECK(out[i] == 0.5 * p * (p - 1) / 2 + p * static_cast<double>(i));
  }
}

TEST_CASE("mpi: sums are bitwise the same on every rank") {
  Communicator c = world();
  const int p = c.size();
  std::vector<float> x(1000);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0f / static_cast<float>(3 + c.rank() * 7 + i);
  c.all_reduce(std::span<float>(x));
  std::vector<float> all(x.size() * p);
  c.all_gather(std::span<const float>(x), std::span<float>(all));
  for (int q = 0; q < p; ++q)
    CHECK(std::vector<float>(all.begin() + q * x.size(), all.begin() + (q + 1) * x.size()) == x);
}

TEST_CASE("mpi: traffic counts the bytes each rank sends") {
  Communicator c = world();
  const int p = c.size();
  const std::uint64_t up = static_cast<std::uint64_t>(p);
  std::vector<float> in(10), out(10 * p), full(10 * p), block(10);
  c.all_gather(std::span<const float>(in), std::span<float>(out));
  CHECK(c.traffic().all_gather == 40 * (up - 1));
  c.reduce_scatter(std::span<const float>(full), std::span<float>(block));
  CHECK(c.traffic().reduce_scatter == 40 * (up - 1));
  c.all_reduce(std::span<float>(full));
  CHECK(c.traffic().all_reduce == 2 * (40 * up) * (up - 1) / up);
  CHECK(c.traffic().collectives == 3);
  c.broadcast(std::span<float>(block), 0);
  CHECK(c.traffic().broadcast == (c.rank() == 0 ? 40 * (up - 1) : 0));
  Communicator half = c.split(c.rank() % 2, c.rank());
  const std::uint64_t q = static_cast<std::uint64_t>(half.size());
  half.all_reduce(std::span<float>(block));
  CHECK(c.traffic().all_reduce == 2 * (40 * up) * (up - 1) / up + 2 * 40 * (q - 1) / q);  // into the parent's Traffic
}

TEST_CASE("mpi: split groups ranks by color, ranked by key") {
  Communicator c = world();
  const int r = c.rank(), p = c.size();
  CAPTURE(r);
  const int parity = r % 2;
  const int members = (p - parity + 1) / 2;  // ranks of my parity
  Communicator sub = c.split(parity, -r);    // reversed order inside each color
  CHECK(sub.size() == members);
  CHECK(sub.rank() == members - 1 - r / 2);
  std::vector<std::int32_t> ids(members), expect;
  for (int q = p - 1; q >= 0; --q)
    if (q % 2 == parity) expect.push_back(q);
  const std::int32_t me = r;
  sub.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(ids));
  CHECK(ids == expect);
  Communicator nested = sub.split(0, sub.rank());
  CHECK(nested.all_reduce_value<std::int64_t>(1) == members);

  // Any int is a color, as with thread ranks (MPI itself takes only colors >= 0).
  Communicator negative = c.split(parity == 0 ? INT_MIN : -1, r);
  CHECK(negative.size() == members);
  CHECK(negative.all_reduce_value<std::int64_t>(r) == [&] {
    std::int64_t s = 0;
    for (int q : expect) s += q;
    return s;
  }());
  Communicator alone = c.split(INT_MAX - r, 0);
  CHECK(alone.size() == 1);
  CHECK(alone.all_reduce_value<std::int64_t>(r) == r);
}

TEST_CASE("mpi: grouped send/recv around a ring and both ways at once") {
  Communicator c = world();
  const int r = c.rank(), p = c.size();
  CAPTURE(r);
  testing::check_ring_send_recv(c);

  // Large messages (past the eager limit) both ways at once.
  std::vector<double> out(1 << 17, r), in(1 << 17);
  const PeerOp swap[] = {
      {PeerOp::Kind::send, (r + 1) % p, out.data(), out.size(), DataType::f64},
      {PeerOp::Kind::recv, (r + p - 1) % p, in.data(), in.size(), DataType::f64},
  };
  c.send_recv(swap);
  CHECK(in.front() == (r + p - 1) % p);
  CHECK(in.back() == (r + p - 1) % p);
}

TEST_CASE("mpi: sends in calls of their own, waited on after the recvs, never deadlock") {
  Communicator c = world();
  const int r = c.rank(), p = c.size(), next = (r + 1) % p, prev = (r + p - 1) % p;
  CAPTURE(r);
  // Large messages (past the eager limit): MPI completes such a send only once its recv
  // is posted, so each rank waits on its sends after its recv.
  std::vector<double> out(1 << 17, r + 0.5), in(1 << 17);
  const PeerOp send{PeerOp::Kind::send, next, out.data(), out.size(), DataType::f64};
  const PeerOp recv{PeerOp::Kind::recv, prev, in.data(), in.size(), DataType::f64};
  Handle sent = c.send_recv_async(std::span<const PeerOp>(&send, 1));
  c.send_recv(std::span<const PeerOp>(&recv, 1));
  sent.wait();
  CHECK(in.front() == prev + 0.5);
  CHECK(in.back() == prev + 0.5);
}

TEST_CASE("mpi: a recv takes the send with its tag, and equal tags keep their order") {
  Communicator c = world();
  const int r = c.rank(), p = c.size(), next = (r + 1) % p, prev = (r + p - 1) % p;
  CAPTURE(r);
  // Tag 1 then tag 2 (same size, different contents, one large), received tag 2 first.
  const std::size_t n = 1 << 16;
  std::vector<float> first(n, 100.0f + r), second(n, 200.0f + r), got2(n), got1(n);
  const PeerOp send1{PeerOp::Kind::send, next, first.data(), n, DataType::f32, 1};
  const PeerOp send2{PeerOp::Kind::send, next, second.data(), n, DataType::f32, 2};
  Handle h1 = c.send_recv_async(std::span<const PeerOp>(&send1, 1));
  Handle h2 = c.send_recv_async(std::span<const PeerOp>(&send2, 1));
  const PeerOp recv2{PeerOp::Kind::recv, prev, got2.data(), n, DataType::f32, 2};
  const PeerOp recv1{PeerOp::Kind::recv, prev, got1.data(), n, DataType::f32, 1};
  c.send_recv(std::span<const PeerOp>(&recv2, 1));
  c.send_recv(std::span<const PeerOp>(&recv1, 1));
  h1.wait();
  h2.wait();
  CHECK(got2.front() == 200.0f + prev);
  CHECK(got2.back() == 200.0f + prev);
  CHECK(got1.front() == 100.0f + prev);
  CHECK(got1.back() == 100.0f + prev);

  // Three sends with tag kMaxTag and one with tag 0 between them: the tag-0 one first,
  // then the others in the order they were sent.
  std::vector<std::int32_t> a{10 * r}, b{10 * r + 1}, z{-r}, d{10 * r + 2}, got(4, -1);
  const PeerOp sends[] = {{PeerOp::Kind::send, next, a.data(), 1, DataType::i32, kMaxTag},
                          {PeerOp::Kind::send, next, b.data(), 1, DataType::i32, kMaxTag},
                          {PeerOp::Kind::send, next, z.data(), 1, DataType::i32, 0},
                          {PeerOp::Kind::send, next, d.data(), 1, DataType::i32, kMaxTag}};
  Handle hs = c.send_recv_async(sends);
  const PeerOp zero{PeerOp::Kind::recv, prev, &got[0], 1, DataType::i32, 0};
  c.send_recv(std::span<const PeerOp>(&zero, 1));
  const PeerOp rest[] = {{PeerOp::Kind::recv, prev, &got[1], 1, DataType::i32, kMaxTag},
                         {PeerOp::Kind::recv, prev, &got[2], 1, DataType::i32, kMaxTag},
                         {PeerOp::Kind::recv, prev, &got[3], 1, DataType::i32, kMaxTag}};
  c.send_recv(rest);
  hs.wait();
  CHECK(got == std::vector<std::int32_t>{-prev, 10 * prev, 10 * prev + 1, 10 * prev + 2});
}

TEST_CASE("mpi: async collectives complete while the caller computes, in any wait order") {
  Communicator c = world();
  const int p = c.size();
  std::vector<float> a(1 << 16, 1.0f), b(1 << 16, 2.0f);
  Handle ha = c.all_reduce_async(std::span<float>(a));
  Handle hb = c.all_reduce_async(std::span<float>(b));
  CHECK(ha.pending());
  double busy = 0;
  for (int i = 0; i < 1000; ++i) busy += i;  // the caller's own work
  hb.wait();
  ha.wait();
  CHECK_FALSE(ha.pending());
  CHECK(busy > 0);
  CHECK(a.front() == static_cast<float>(p));
  CHECK(b.back() == static_cast<float>(2 * p));

  std::vector<std::int32_t> mine{c.rank()}, all(p), root(4, c.rank() == 1 ? 7 : 0);
  {
    Handle g = c.all_gather_async(std::span<const std::int32_t>(mine), std::span<std::int32_t>(all));
    Handle bc = c.broadcast_async(std::span<std::int32_t>(root), 1);
    // Dropped unwaited: the destructors complete them before the buffers may go.
  }
  for (int q = 0; q < p; ++q) CHECK(all[q] == q);
  for (auto v : root) CHECK(v == 7);

  // A handle keeps its communicator alive after the engine that started it is gone.
  std::vector<float> z(5, 1.0f);
  Handle late;
  {
    Communicator temp = c.split(0, c.rank());
    late = temp.all_reduce_async(std::span<float>(z));
  }
  late.wait();
  CHECK(z[4] == static_cast<float>(p));
}

TEST_CASE("mpi: copies share the communicator and the last one frees it") {
  MpiEngine a(MPI_COMM_WORLD);
  MpiEngine b = a;
  CHECK(b.native() == a.native());
  MpiEngine moved = std::move(a);
  CHECK(moved.native() == b.native());
  {
    MpiEngine gone = std::move(moved);
  }
  std::int32_t one = 1;
  b.all_reduce(&one, &one, 1, DataType::i32, ReduceOp::sum).wait();
  CHECK(one == b.size());
  int result = MPI_UNEQUAL;
  MPI_Comm_compare(b.native(), MPI_COMM_WORLD, &result);
  CHECK(result == MPI_CONGRUENT);  // a dup of the world, never the world itself
}

TEST_CASE("mpi: bad calls and MPI's own errors name the function and the rank") {
  Communicator c = world();
  const int r = c.rank(), p = c.size();
  CAPTURE(r);
  const std::string rank = "rank " + std::to_string(r) + ": ";
  std::vector<std::uint8_t> u8(4);
  CHECK_ERROR_CONTAINS(c.all_reduce(std::span<std::uint8_t>(u8)),
                       rank + "all_reduce: reduction over u8 elements is not supported: reduce f32, f64, i32 or i64");
  std::vector<std::uint16_t> u16(2 * p), u16_block(2);
  CHECK_ERROR_CONTAINS(c.reduce_scatter(std::span<const std::uint16_t>(u16), std::span<std::uint16_t>(u16_block)),
                       rank + "reduce_scatter: reduction over u16 elements is not supported");

  MpiEngine e(MPI_COMM_WORLD);
  std::int32_t x = 0;
  CHECK_ERROR_CONTAINS(e.broadcast(&x, 1, DataType::i32, p + 3), rank + "MPI_Ibcast failed: MPI_ERR_ROOT");
  CHECK_ERROR_CONTAINS(e.all_gather(nullptr, nullptr, std::size_t{INT_MAX} + 1, DataType::f32),
                       rank + "all_gather of 2147483648 elements exceeds MPI's count limit of 2147483647");
  const PeerOp bad{PeerOp::Kind::send, p, &x, 1, DataType::i32};
  CHECK_ERROR_CONTAINS(e.send_recv(std::span<const PeerOp>(&bad, 1)),
                       rank + "send_recv: rank " + std::to_string(r) + " cannot exchange with peer " +
                           std::to_string(p) + " of " + std::to_string(p));
  const int next = (r + 1) % p;
  const PeerOp bad_tag{PeerOp::Kind::recv, next, &x, 1, DataType::i32, kMaxTag + 1};
  const std::string refused =
      rank + "send_recv: the recv from peer " + std::to_string(next) + " has tag 16384, outside 0..16383";
  CHECK_ERROR_CONTAINS(e.send_recv(std::span<const PeerOp>(&bad_tag, 1)), refused);
  CHECK_ERROR_CONTAINS(c.send_recv(std::span<const PeerOp>(&bad_tag, 1)), refused);
  c.barrier();  // nothing above was posted: every rank is still in step
}

TEST_CASE("mpi: a recv that does not match its send fails on the receiving rank") {
  Communicator c = world();
  const int r = c.rank();
  CAPTURE(r);
  if (r < 2) {
    // A short send into a longer recv: the rest of the buffer would be stale.
    std::vector<float> buf(r == 0 ? 4 : 5);
    PeerOp op{r == 0 ? PeerOp::Kind::send : PeerOp::Kind::recv, 1 - r, buf.data(), buf.size(), DataType::f32};
    if (r == 0)
      c.send_recv(std::span<const PeerOp>(&op, 1));
    else
      CHECK_ERROR_CONTAINS(c.send_recv(std::span<const PeerOp>(&op, 1)),
                           "rank 1: recv of 20 bytes from rank 0 met a send of 16 bytes");
    // A long send into a shorter recv: MPI truncates and reports it.
    std::vector<float> buf2(r == 0 ? 5 : 4);
    op.data = buf2.data();
    op.count = buf2.size();
    if (r == 0)
      c.send_recv(std::span<const PeerOp>(&op, 1));
    else
      CHECK_ERROR_CONTAINS(c.send_recv(std::span<const PeerOp>(&op, 1)),
                           "rank 1: MPI_Wait (send_recv) failed: MPI_ERR_TRUNCATE");
  }
  c.barrier();
}

TEST_CASE("mpi: errors name the rank in MPI_COMM_WORLD, also on a split communicator") {
  Communicator c = world();
  const int r = c.rank(), p = c.size();
  Communicator reversed = c.split(0, p - 1 - r);  // rank p-1-r there
  CHECK(reversed.rank() == p - 1 - r);
  if (r == 0 || r == p - 1) {
    // World ranks 0 and p-1 are ranks p-1 and 0 of `reversed`.
    std::vector<float> buf(r == 0 ? 3 : 2);
    const PeerOp op{r == 0 ? PeerOp::Kind::recv : PeerOp::Kind::send, r == 0 ? 0 : p - 1, buf.data(), buf.size(),
                    DataType::f32};
    if (r == 0)
      CHECK_ERROR_CONTAINS(reversed.send_recv(std::span<const PeerOp>(&op, 1)),
                           "rank 0: recv of 12 bytes from rank " + std::to_string(p - 1) + " met a send of 8 bytes");
    else
      reversed.send_recv(std::span<const PeerOp>(&op, 1));
  }
  c.barrier();
}

namespace {
/// Every buffer counts as this rank's device memory: the rules' other checks pass, and
/// the issue order is what is tested.
MemoryAccess all_device_memory() {
  MemoryAccess m;
  m.where = [](const void*, std::size_t) { return Residence::this_device; };
  return m;
}
}  // namespace

TEST_CASE("mpi under NCCL's rules: ranks issuing different collectives fail naming both, never exchange") {
  Communicator c(NcclRulesEngine(MpiEngine(MPI_COMM_WORLD), all_device_memory(),
                                 NcclRulesOptions{.serialize_groups = true, .check_same_calls = true}));
  const int r = c.rank();
  std::vector<float> in(4, 1.0f), out(4 * static_cast<std::size_t>(c.size()));
  // The same collectives in the same order pass.
  c.all_gather(std::span<const float>(in), std::span<float>(out));
  CHECK(out[0] == 1.0f);
  // Rank 0 reduces while the others gather: every rank fails, naming what rank 0 issued.
  const std::string mismatch = r == 0 ? "this rank issued all_reduce of 4 f32 (sum) while rank 1 issued all_gather of 4 f32"
                                      : "while rank 0 issued all_reduce of 4 f32 (sum)";
  if (r == 0)
    CHECK_ERROR_CONTAINS(c.all_reduce(std::span<float>(in)), mismatch);
  else
    CHECK_ERROR_CONTAINS(c.all_gather(std::span<const float>(in), std::span<float>(out)), mismatch);
  // Same kind, another count.
  std::vector<float> shorter(r == 0 ? 3 : 4);
  CHECK_ERROR_CONTAINS(c.all_reduce(std::span<float>(shorter)), "issued all_reduce of 3 f32 (sum)");
  // A barrier on rank 0 against a broadcast elsewhere: the others fail at once; rank 0,
  // whose barrier does not hold the host, at its next synchronisation.
  if (r == 0) {
    c.barrier();
    CHECK_ERROR_CONTAINS(tessera::detail::run_deferred_host_waits(), "this rank issued barrier while rank 1 issued broadcast");
  } else {
    CHECK_ERROR_CONTAINS(c.broadcast(std::span<float>(in), 0), "while rank 0 issued barrier");
  }
  // Every rank failed before its operation reached MPI: the communicator is still in step.
  c.all_gather(std::span<const float>(in), std::span<float>(out));
  CHECK(out.back() == 1.0f);
}

int main(int argc, char** argv) {
  int failed = 0;
  {
    Communicator world = mpi_world();  // initialises MPI; it is finalized at exit
    doctest::Context context(argc, argv);
    if (world.rank() != 0) context.setOption("minimal", true);  // every rank reports its failures, rank 0 the summary
    failed = context.run() != 0 ? 1 : 0;
    if (!context.shouldExit()) failed = world.all_reduce_value<std::int32_t>(failed, ReduceOp::max);
  }
  return failed;
}
