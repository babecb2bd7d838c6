// The thread-rank engine: every collective against its definition, on several world
// sizes; splits; grouped send/recv in orders that would deadlock if posted one by
// one, eager sends, matching by tag; async handles; and failure: a throwing or missing
// rank ends every rank with its reason within the timeout.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "../support/collectives.hpp"
#include "../support/errors.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/core/tensor.hpp"

namespace test_thread {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::comm;

TEST_CASE("thread ranks: all_gather, reduce_scatter, all_reduce and broadcast match their definitions") {
  for (int p : {1, 2, 3, 4, 8}) {
    CAPTURE(p);
    std::atomic<int> checked{0};
    run_thread_ranks(p, [&](Communicator& c) {
      REQUIRE(c.size() == p);
      testing::check_collectives_match_definitions(c);
      ++checked;
    });
    CHECK(checked == p);
  }
}

TEST_CASE("thread ranks: sums are bitwise the same on every rank") {
  std::vector<std::vector<float>> results(4);
  run_thread_ranks(4, [&](Communicator& c) {
    std::vector<float> x(1000);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0f / static_cast<float>(3 + c.rank() * 7 + i);
    c.all_reduce(std::span<float>(x));
    results[c.rank()] = x;
  });
  for (int r = 1; r < 4; ++r) CHECK(results[r] == results[0]);
}

TEST_CASE("thread ranks: bf16 collectives move 2-byte elements and sum in fp32, rounded once per partial sum") {
  run_thread_ranks(3, [&](Communicator& c) {
    const int r = c.rank();
    std::vector<bf16> mine = {bf16(1.0f + r), bf16(-0.375f * r)}, all(6);
    c.all_gather(std::span<const bf16>(mine), std::span<bf16>(all));
    for (int q = 0; q < 3; ++q) {
      CHECK(static_cast<float>(all[2 * q]) == 1.0f + q);
      CHECK(static_cast<float>(all[2 * q + 1]) == -0.375f * q);
    }
    CHECK(c.traffic().all_gather == 2 * 2 * sizeof(bf16));  // its block to each of the 2 others
    // 256 + 1 + 1 in rank order: 256 + 1 rounds to 256 in bf16 (8 bits), and so does
    // 256 + 1 again; the sum is the same bits on every rank.
    std::vector<bf16> x = {bf16(r == 0 ? 256.0f : 1.0f), bf16(0.5f * (r + 1))};
    c.all_reduce(std::span<bf16>(x));
    CHECK(static_cast<float>(x[0]) == 256.0f);
    CHECK(static_cast<float>(x[1]) == 3.0f);
    std::vector<bf16> m = {bf16(static_cast<float>(r))};
    c.all_reduce(std::span<bf16>(m), ReduceOp::max);
    CHECK(static_cast<float>(m[0]) == 2.0f);
  });
}

TEST_CASE("thread ranks: traffic counts the bytes each rank sends") {
  run_thread_ranks(4, [&](Communicator& c) {
    std::vector<float> in(10), out(40), full(40), block(10);
    c.all_gather(std::span<const float>(in), std::span<float>(out));
    CHECK(c.traffic().all_gather == 3 * 40);
    c.reduce_scatter(std::span<const float>(full), std::span<float>(block));
    CHECK(c.traffic().reduce_scatter == 3 * 40);
    c.all_reduce(std::span<float>(full));
    CHECK(c.traffic().all_reduce == 2 * 160 * 3 / 4);
    CHECK(c.traffic().collectives == 3);
    Communicator half = c.split(c.rank() % 2, c.rank());
    half.all_reduce(std::span<float>(block));
    CHECK(c.traffic().all_reduce == 2 * 160 * 3 / 4 + 2 * 40 * 1 / 2);  // children count into the parent's Traffic
  });
}

TEST_CASE("thread ranks: split groups ranks by color, ranked by key") {
  run_thread_ranks(6, [&](Communicator& c) {
    const int r = c.rank();
    Communicator sub = c.split(r % 2, -r);  // reversed order inside each color
    CHECK(sub.size() == 3);
    CHECK(sub.rank() == 2 - r / 2);
    std::vector<std::int32_t> ids(3);
    std::int32_t me = r;
    sub.all_gather(std::span<const std::int32_t>(&me, 1), std::span<std::int32_t>(ids));
    if (r % 2 == 0)
      CHECK(ids == std::vector<std::int32_t>{4, 2, 0});
    else
      CHECK(ids == std::vector<std::int32_t>{5, 3, 1});
    Communicator nested = sub.split(0, sub.rank());
    CHECK(nested.all_reduce_value<std::int64_t>(1) == 3);
  });
}

TEST_CASE("thread ranks: grouped send/recv around a ring and both ways at once") {
  run_thread_ranks(5, [&](Communicator& c) { testing::check_ring_send_recv(c); });
}

TEST_CASE("thread ranks: async collectives complete in issue order while the caller computes") {
  run_thread_ranks(3, [&](Communicator& c) {
    std::vector<float> a(1 << 16, 1.0f), b(1 << 16, 2.0f);
    Handle ha = c.all_reduce_async(std::span<float>(a));
    Handle hb = c.all_reduce_async(std::span<float>(b));
    double busy = 0;
    for (int i = 0; i < 1000; ++i) busy += i;  // the caller's own work
    hb.wait();
    ha.wait();
    CHECK(busy > 0);
    CHECK(a.front() == 3.0f);
    CHECK(b.back() == 6.0f);
  });
}

TEST_CASE("thread ranks: a rank that throws ends every rank with its reason") {
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_ERROR_CONTAINS(run_thread_ranks(4,
                                        [&](Communicator& c) {
                                          std::vector<float> x(8, 1.0f);
                                          c.all_reduce(std::span<float>(x));
                                          if (c.rank() == 2) fail("bad batch on this rank");
                                          for (int step = 0; step < 3; ++step) c.all_reduce(std::span<float>(x));
                                        }),
                       "rank 2: bad batch on this rank");
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
}

TEST_CASE("thread ranks: a rank that never arrives times out every rank") {
  ThreadOptions o;
  o.timeout = std::chrono::milliseconds(300);
  CHECK_ERROR_CONTAINS(run_thread_ranks(
                           3,
                           [&](Communicator& c) {
                             if (c.rank() == 1) return;  // skips the collective the others wait in
                             c.barrier();
                           },
                           o),
                       "timed out after 0.3 s");
}

TEST_CASE("thread ranks: a recv that does not match its send fails the job, naming both ranks and sizes") {
  CHECK_ERROR_CONTAINS(run_thread_ranks(2,
                                        [&](Communicator& c) {
                                          std::vector<float> buf(c.rank() == 0 ? 4 : 5);
                                          const PeerOp op{c.rank() == 0 ? PeerOp::Kind::send : PeerOp::Kind::recv,
                                                          1 - c.rank(), buf.data(), buf.size(), DataType::f32};
                                          c.send_recv(std::span<const PeerOp>(&op, 1));
                                        }),
                       "rank 1: recv of 20 bytes from rank 0 met a send of 16 bytes (tag 0)");
  // The sizes compared are those of the send the tag matches, not of the oldest send.
  CHECK_ERROR_CONTAINS(run_thread_ranks(2,
                                        [&](Communicator& c) {
                                          std::vector<std::int32_t> small(2), large(3);
                                          if (c.rank() == 0) {
                                            const PeerOp sends[] = {
                                                {PeerOp::Kind::send, 1, small.data(), 2, DataType::i32, 4},
                                                {PeerOp::Kind::send, 1, large.data(), 3, DataType::i32, 9}};
                                            c.send_recv(sends);
                                          } else {
                                            const PeerOp recv{PeerOp::Kind::recv, 0, large.data(), 3, DataType::i32, 4};
                                            c.send_recv(std::span<const PeerOp>(&recv, 1));
                                          }
                                        }),
                       "rank 1: recv of 12 bytes from rank 0 met a send of 8 bytes (tag 4)");
}

TEST_CASE("thread ranks: sends never wait for their receiver") {
  ThreadOptions o;
  o.timeout = std::chrono::seconds(5);  // a send that waited would end this with a timeout, not hang the suite
  run_thread_ranks(
      2,
      [&](Communicator& c) {
        const int r = c.rank(), peer = 1 - r;
        // Each rank sends, in a call of its own, before it receives: a send that waited for
        // its receiver would leave both ranks in their sends.
        std::vector<double> out(1 << 12, r + 0.25), in(1 << 12);
        const PeerOp send{PeerOp::Kind::send, peer, out.data(), out.size(), DataType::f64};
        const PeerOp recv{PeerOp::Kind::recv, peer, in.data(), in.size(), DataType::f64};
        c.send_recv(std::span<const PeerOp>(&send, 1));
        std::fill(out.begin(), out.end(), -1.0);  // the send is complete: its bytes were copied
        c.send_recv(std::span<const PeerOp>(&recv, 1));
        CHECK(in.front() == peer + 0.25);
        CHECK(in.back() == peer + 0.25);

        // A handle of sends waited on after the recv issued after it.
        std::vector<std::int32_t> token{10 * r + 1}, got{0};
        const PeerOp send2{PeerOp::Kind::send, peer, token.data(), 1, DataType::i32, 7};
        const PeerOp recv2{PeerOp::Kind::recv, peer, got.data(), 1, DataType::i32, 7};
        Handle sent = c.send_recv_async(std::span<const PeerOp>(&send2, 1));
        c.send_recv(std::span<const PeerOp>(&recv2, 1));
        sent.wait();
        CHECK(got[0] == 10 * peer + 1);
      },
      o);
}

TEST_CASE("thread ranks: a recv takes the send with its tag, whatever the order they were sent in") {
  run_thread_ranks(3, [&](Communicator& c) {
    const int r = c.rank();
    if (r == 0) {
      std::vector<float> first(6, 1.0f), second(6, 2.0f);
      const PeerOp send1{PeerOp::Kind::send, 1, first.data(), first.size(), DataType::f32, 1};
      const PeerOp send2{PeerOp::Kind::send, 1, second.data(), second.size(), DataType::f32, 2};
      c.send_recv(std::span<const PeerOp>(&send1, 1));
      c.send_recv(std::span<const PeerOp>(&send2, 1));
    } else if (r == 1) {
      std::vector<float> got2(6), got1(6);
      const PeerOp recv2{PeerOp::Kind::recv, 0, got2.data(), got2.size(), DataType::f32, 2};
      const PeerOp recv1{PeerOp::Kind::recv, 0, got1.data(), got1.size(), DataType::f32, 1};
      c.send_recv(std::span<const PeerOp>(&recv2, 1));
      c.send_recv(std::span<const PeerOp>(&recv1, 1));
      CHECK(got2 == std::vector<float>(6, 2.0f));
      CHECK(got1 == std::vector<float>(6, 1.0f));
    }
    // Rank 2 takes no part; the tags of one pair never touch another pair's mail.
    c.barrier();
  });
}

TEST_CASE("thread ranks: sends with the same tag are received in the order they were sent") {
  run_thread_ranks(2, [&](Communicator& c) {
    constexpr int kTagA = 3, kTagB = kMaxTag;
    if (c.rank() == 0) {
      // a0 b0 a1 a2 b1, in three calls.
      std::vector<std::int64_t> a0{100}, a1{101}, a2{102}, b0{200}, b1{201};
      const PeerOp first[] = {{PeerOp::Kind::send, 1, a0.data(), 1, DataType::i64, kTagA},
                              {PeerOp::Kind::send, 1, b0.data(), 1, DataType::i64, kTagB}};
      const PeerOp second{PeerOp::Kind::send, 1, a1.data(), 1, DataType::i64, kTagA};
      const PeerOp third[] = {{PeerOp::Kind::send, 1, a2.data(), 1, DataType::i64, kTagA},
                              {PeerOp::Kind::send, 1, b1.data(), 1, DataType::i64, kTagB}};
      c.send_recv(first);
      c.send_recv(std::span<const PeerOp>(&second, 1));
      c.send_recv(third);
    } else {
      // Every b first, then the a's: two in one call, one in the next.
      std::vector<std::int64_t> got(5, -1);
      const PeerOp bs[] = {{PeerOp::Kind::recv, 0, &got[0], 1, DataType::i64, kTagB},
                           {PeerOp::Kind::recv, 0, &got[1], 1, DataType::i64, kTagB}};
      const PeerOp as[] = {{PeerOp::Kind::recv, 0, &got[2], 1, DataType::i64, kTagA},
                           {PeerOp::Kind::recv, 0, &got[3], 1, DataType::i64, kTagA}};
      const PeerOp last{PeerOp::Kind::recv, 0, &got[4], 1, DataType::i64, kTagA};
      c.send_recv(bs);
      c.send_recv(as);
      c.send_recv(std::span<const PeerOp>(&last, 1));
      CHECK(got == std::vector<std::int64_t>{200, 201, 100, 101, 102});
    }
  });
}

TEST_CASE("thread ranks: a tag outside 0..kMaxTag is refused, naming the rank, the peer and the tag") {
  CHECK(kMaxTag == 16383);
  run_thread_ranks(2, [&](Communicator& c) {
    const int r = c.rank(), peer = 1 - r;
    float x = 0;
    const PeerOp too_big{PeerOp::Kind::send, peer, &x, 1, DataType::f32, kMaxTag + 1};
    const PeerOp negative{PeerOp::Kind::recv, peer, &x, 1, DataType::f32, -1};
    const std::string rank = "rank " + std::to_string(r) + ": send_recv: the ";
    CHECK_ERROR_CONTAINS(c.send_recv(std::span<const PeerOp>(&too_big, 1)),
                         rank + "send to peer " + std::to_string(peer) + " has tag 16384, outside 0..16383");
    CHECK_ERROR_CONTAINS(c.send_recv(std::span<const PeerOp>(&negative, 1)),
                         rank + "recv from peer " + std::to_string(peer) + " has tag -1, outside 0..16383");
    c.barrier();  // nothing was posted: both ranks are still in step
  });
  // The engine itself checks too, naming the rank in the world.
  auto world = std::make_shared<comm::detail::ThreadWorld>(ThreadOptions{});
  auto group = std::make_shared<comm::detail::ThreadGroup>(2, world, std::vector<int>{0, 1});
  ThreadEngine engine(group, 1);
  float x = 0;
  const PeerOp bad{PeerOp::Kind::send, 0, &x, 1, DataType::f32, 20000};
  CHECK_ERROR_CONTAINS(engine.send_recv(std::span<const PeerOp>(&bad, 1)),
                       "rank 1: send_recv: the send to peer 0 has tag 20000, outside 0..16383");
  const PeerOp self{PeerOp::Kind::send, 1, &x, 1, DataType::f32};
  CHECK_ERROR_CONTAINS(engine.send_recv(std::span<const PeerOp>(&self, 1)),
                       "rank 1: send_recv: rank 1 cannot exchange with peer 1 of 2");
}

TEST_CASE("thread ranks: a recv left waiting fails naming its rank, its peer and its tag") {
  // Its peer fails.
  std::atomic<bool> posted{false};
  std::string seen;
  CHECK_ERROR_CONTAINS(run_thread_ranks(2,
                                        [&](Communicator& c) {
                                          float x = 0;
                                          if (c.rank() == 0) {
                                            while (!posted.load()) std::this_thread::yield();
                                            fail("bad batch on this rank");
                                          }
                                          const PeerOp recv{PeerOp::Kind::recv, 0, &x, 1, DataType::f32, 3};
                                          Handle h = c.send_recv_async(std::span<const PeerOp>(&recv, 1));
                                          posted.store(true);
                                          seen = testing::error_of([&] { h.wait(); });
                                        }),
                       "rank 0: bad batch on this rank");
  CHECK(seen.find("rank 1: recv from rank 0 (tag 3) abandoned: rank 0: bad batch on this rank") != std::string::npos);

  // Its peer never sends.
  ThreadOptions o;
  o.timeout = std::chrono::milliseconds(300);
  CHECK_ERROR_CONTAINS(run_thread_ranks(
                           2,
                           [&](Communicator& c) {
                             if (c.rank() == 0) return;
                             float x = 0;
                             const PeerOp recv{PeerOp::Kind::recv, 0, &x, 1, DataType::f32, 3};
                             c.send_recv(std::span<const PeerOp>(&recv, 1));
                           },
                           o),
                       "rank 1: recv from rank 0 (tag 3) timed out after 0.3 s");
}

TEST_CASE("thread ranks: a send that no recv takes fails the job, naming both ranks and the tag") {
  CHECK_ERROR_CONTAINS(run_thread_ranks(3,
                                        [&](Communicator& c) {
                                          std::vector<float> x(4, 1.0f);
                                          if (c.rank() == 2) {
                                            const PeerOp sends[] = {
                                                {PeerOp::Kind::send, 1, x.data(), 4, DataType::f32, 5},
                                                {PeerOp::Kind::send, 1, x.data(), 2, DataType::f32, 6}};
                                            c.send_recv(sends);
                                          }
                                        }),
                       "rank 2 sent 2 messages to rank 1 that no recv took (the first with tag 5, 16 bytes)");
  // Also on a split communicator, which names the ranks in the world.
  CHECK_ERROR_CONTAINS(run_thread_ranks(4,
                                        [&](Communicator& c) {
                                          Communicator odd_even = c.split(c.rank() % 2, -c.rank());
                                          std::int32_t v = 1;
                                          if (c.rank() == 3) {
                                            const PeerOp send{PeerOp::Kind::send, 1, &v, 1, DataType::i32};
                                            odd_even.send_recv(std::span<const PeerOp>(&send, 1));
                                          }
                                        }),
                       "rank 3 sent 1 message to rank 1 that no recv took (the first with tag 0, 4 bytes)");
}

TEST_CASE("the default communicator is one rank whose collectives are copies") {
  Communicator c;
  CHECK(c.size() == 1);
  CHECK(c.engine_name() == "self");
  std::vector<float> in{1, 2, 3}, out(3);
  c.all_gather(std::span<const float>(in), std::span<float>(out));
  CHECK(out == in);
  CHECK(c.all_reduce_value(2.5) == 2.5);
  CHECK(c.split(7, 0).size() == 1);
  CHECK_ERROR_CONTAINS(c.all_gather(std::span<const float>(in), std::span<float>(out.data(), 2)),
                       "all_gather: output of 2 elements for 3 per rank over 1 ranks");
}

TEST_CASE("thread ranks: each rank counts its own memory") {
  std::vector<std::size_t> peaks(3);
  run_thread_ranks(3, [&](Communicator& c) {
    Tensor<float> t(Shape{static_cast<std::int64_t>(1000 * (c.rank() + 1))});
    peaks[c.rank()] = memory_stats(Device::cpu).peak();
    c.barrier();
  });
  CHECK(peaks[0] == 4000);
  CHECK(peaks[1] == 8000);
  CHECK(peaks[2] == 12000);
}

}  // namespace test_thread
