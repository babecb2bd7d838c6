// The TCP rendezvous of torchrun-style launches: ranks are threads on 127.0.0.1. Its
// operations against their definitions on 1, 2 and 5 ranks; and every failure (a rank
// that never comes, a port nobody listens on, a peer that writes garbage, dies or calls
// another operation) ends in an error naming the rank, the address and what was awaited,
// within the timeout.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/comm/tcp_store.hpp"

namespace test_tcp_store {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::comm;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<std::uint8_t>;

/// A port free on 127.0.0.1 now: bind port 0 and read back what the kernel chose.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Runs `fn(store)` for each rank in `ranks` (of a world of `world`), each on its own
/// thread with its own store; returns each rank's error message ("" when it succeeded).
std::vector<std::string> run_store_ranks(int world, int port, std::chrono::milliseconds timeout,
                                         const std::function<void(TcpStore&)>& fn, std::vector<int> ranks = {}) {
  if (ranks.empty())
    for (int r = 0; r < world; ++r) ranks.push_back(r);
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r : ranks)
    threads.emplace_back([&, r] {
      try {
        TcpStore store("127.0.0.1", port, r, world, timeout);
        fn(store);
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

Bytes blob_of(int rank, std::size_t n) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(rank * 31 + static_cast<int>(i));
  return b;
}

/// A raw client socket connected to 127.0.0.1:port, retrying while nobody listens yet.
int connect_raw(int port) {
  const auto deadline = Clock::now() + 5s;
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    ::close(fd);
    REQUIRE(Clock::now() < deadline);
    std::this_thread::sleep_for(10ms);
  }
}

/// A listening socket on 127.0.0.1:port that plays rank 0 badly.
int listen_raw(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  const int one = 1;
  REQUIRE(::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  return fd;
}

void write_all(int fd, const Bytes& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t k = ::send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    REQUIRE(k > 0);
    done += static_cast<std::size_t>(k);
  }
}

Bytes read_exactly(int fd, std::size_t n) {
  Bytes b(n);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t k = ::recv(fd, b.data() + done, n - done, 0);
    REQUIRE(k > 0);
    done += static_cast<std::size_t>(k);
  }
  return b;
}

/// A frame header as the store writes it: magic, kind, seq, arg, payload length.
Bytes header(std::uint32_t magic, std::uint32_t kind, std::uint64_t seq, std::uint64_t length) {
  Bytes h(32, 0);
  for (int i = 0; i < 4; ++i) h[i] = static_cast<std::uint8_t>(magic >> (8 * i));
  for (int i = 0; i < 4; ++i) h[4 + i] = static_cast<std::uint8_t>(kind >> (8 * i));
  for (int i = 0; i < 8; ++i) h[8 + i] = static_cast<std::uint8_t>(seq >> (8 * i));
  for (int i = 0; i < 8; ++i) h[24 + i] = static_cast<std::uint8_t>(length >> (8 * i));
  return h;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

TEST_CASE("tcp store: all_gather, broadcast and barrier on 1, 2 and 5 ranks") {
  for (int world : {1, 2, 5}) {
    CAPTURE(world);
    const int port = free_port();
    std::vector<std::vector<Bytes>> gathered(static_cast<std::size_t>(world)), empties(gathered.size());
    std::vector<Bytes> from_last(gathered.size()), from_first(gathered.size());
    const auto errors = run_store_ranks(world, port, 5s, [&](TcpStore& s) {
      const int r = s.rank();
      REQUIRE(s.size() == world);
      // Blobs of different lengths per rank, one of them empty.
      gathered[static_cast<std::size_t>(r)] = s.all_gather(blob_of(r, static_cast<std::size_t>(3 * r)));
      // Only the root's blob counts: the others pass something else.
      from_last[static_cast<std::size_t>(r)] = s.broadcast(blob_of(100 + r, 9), world - 1);
      s.barrier();
      from_first[static_cast<std::size_t>(r)] = s.broadcast(r == 0 ? blob_of(7, 1000) : Bytes{}, 0);
      empties[static_cast<std::size_t>(r)] = s.all_gather({});
      s.barrier();
    });
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      CHECK(errors[static_cast<std::size_t>(r)] == "");
      const auto& g = gathered[static_cast<std::size_t>(r)];
      REQUIRE(g.size() == static_cast<std::size_t>(world));
      for (int q = 0; q < world; ++q)
        CHECK(g[static_cast<std::size_t>(q)] == blob_of(q, static_cast<std::size_t>(3 * q)));
      CHECK(from_last[static_cast<std::size_t>(r)] == blob_of(100 + world - 1, 9));
      CHECK(from_first[static_cast<std::size_t>(r)] == blob_of(7, 1000));
      CHECK(empties[static_cast<std::size_t>(r)] == std::vector<Bytes>(static_cast<std::size_t>(world)));
    }
  }
}

TEST_CASE("tcp store: a rank that never comes times out the others within the timeout") {
  const int port = free_port();
  const auto t0 = Clock::now();
  const auto errors = run_store_ranks(3, port, 300ms, [](TcpStore& s) { s.barrier(); }, {0, 1});  // rank 2 never starts
  CHECK(seconds_since(t0) < 2.0);
  const std::string at = "127.0.0.1:" + std::to_string(port);
  CHECK_ERROR_CONTAINS(
      fail(errors[0]),
      "TcpStore rank 0 (at " + at + "): timed out after 0.3 s waiting for rank(s) 2 to connect (2 of 3 ranks joined)");
  // Rank 1 hears rank 0's reason, or times out itself if its clock ran out first.
  CHECK_ERROR_CONTAINS(fail(errors[1]), "TcpStore rank 1 (rank 0 at " + at + "): ");
  CHECK_ERROR_CONTAINS(fail(errors[1]), "timed out after 0.3 s waiting for");
}

TEST_CASE("tcp store: connecting to a port nobody listens on fails within the timeout") {
  const int port = free_port();
  const auto t0 = Clock::now();
  CHECK_ERROR_CONTAINS(TcpStore("127.0.0.1", port, 1, 2, 300ms),
                       "TcpStore rank 1 (rank 0 at 127.0.0.1:" + std::to_string(port) +
                           "): cannot connect to rank 0 within 0.3 s (Connection refused)");
  const double took = seconds_since(t0);
  CHECK(took >= 0.29);
  CHECK(took < 2.0);
  CHECK_ERROR_CONTAINS(TcpStore("no-such-host.invalid", port, 1, 2, 300ms),
                       "cannot resolve the master address \"no-such-host.invalid\"");
}

TEST_CASE("tcp store: rank 0 refuses a connection that writes garbage") {
  const int port = free_port();
  std::string error;
  std::thread rank0([&] {
    try {
      TcpStore s("127.0.0.1", port, 0, 2, 3s);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  const int fd = connect_raw(port);
  const std::string http = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
  write_all(fd, Bytes(http.begin(), http.end()));
  // Rank 0 answers with an error frame (kind 6) carrying its reason before it closes.
  const Bytes reply = read_exactly(fd, 32);
  CHECK(std::string(reply.begin(), reply.begin() + 4) == "TSTS");
  CHECK(reply[4] == 6);
  const Bytes reason = read_exactly(fd, reply[24] | (reply[25] << 8));
  CHECK(std::string(reason.begin(), reason.end()).find("not a TcpStore frame") != std::string::npos);
  ::close(fd);
  rank0.join();
  CHECK_ERROR_CONTAINS(fail(error), "TcpStore rank 0 (at 127.0.0.1:" + std::to_string(port) +
                                        "): malformed frame from the connection from 127.0.0.1:");
  CHECK_ERROR_CONTAINS(fail(error),
                       "while waiting for the hello of a connecting rank: its header starts with "
                       "0x47455420, not a TcpStore frame");
}

TEST_CASE("tcp store: a rank refuses malformed frames from rank 0") {
  struct Case {
    Bytes reply;
    const char* message;
  };
  const Case cases[] = {
      {header(0x12345678, 2, 0, 4), "its header starts with 0x78563412, not a TcpStore frame"},
      {header(0x53545354, 99, 0, 4), "unknown frame kind 99"},
      {header(0x53545354, 2, 0, std::uint64_t{1} << 40),
       "it announces 1099511627776 payload bytes, over the limit of 1073741824"},
      {header(0x53545354, 3, 0, 0), "expected its welcome (4 bytes), got all_gather #0 of 0 bytes"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.message);
    const int port = free_port();
    const int listener = listen_raw(port);
    std::thread fake_rank0([&] {
      const int fd = ::accept(listener, nullptr, nullptr);
      REQUIRE(fd >= 0);
      read_exactly(fd, 32 + 8);  // the rank's hello
      write_all(fd, c.reply);
      std::this_thread::sleep_for(50ms);
      ::close(fd);
    });
    const auto t0 = Clock::now();
    const std::string error = testing::error_of([&] { TcpStore("127.0.0.1", port, 1, 2, 2s); });
    fake_rank0.join();
    ::close(listener);
    CHECK(seconds_since(t0) < 1.5);
    CHECK_ERROR_CONTAINS(
        fail(error), "TcpStore rank 1 (rank 0 at 127.0.0.1:" + std::to_string(port) + "): malformed frame from rank 0");
    CHECK_ERROR_CONTAINS(fail(error), c.message);
  }
}

TEST_CASE("tcp store: a rank refuses an all_gather result whose blobs do not add up") {
  const int port = free_port();
  const int listener = listen_raw(port);
  std::thread fake_rank0([&] {
    const int fd = ::accept(listener, nullptr, nullptr);
    REQUIRE(fd >= 0);
    read_exactly(fd, 32 + 8);  // the hello
    Bytes welcome = header(0x53545354, 2, 0, 4);
    welcome.insert(welcome.end(), {2, 0, 0, 0});
    write_all(fd, welcome);
    read_exactly(fd, 32 + 3);  // rank 1's all_gather #1 contribution
    // Two blobs: rank 0's of 1 byte, then one that claims 100 bytes with 3 left.
    Bytes result = header(0x53545354, 3, 1, 8 + 1 + 8 + 3);
    result.insert(result.end(), {1, 0, 0, 0, 0, 0, 0, 0, 42, 100, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3});
    write_all(fd, result);
    std::this_thread::sleep_for(50ms);
    ::close(fd);
  });
  const std::string error = testing::error_of([&] {
    TcpStore s("127.0.0.1", port, 1, 2, 2s);
    s.all_gather(Bytes{1, 2, 3});
  });
  fake_rank0.join();
  ::close(listener);
  CHECK_ERROR_CONTAINS(fail(error), "TcpStore rank 1 (rank 0 at 127.0.0.1:" + std::to_string(port) +
                                        "): malformed frame from rank 0: blob 1 of its all_gather #1 result claims "
                                        "100 bytes, only 3 remain");
}

TEST_CASE("tcp store: a rank that dies mid-exchange fails the others naming it") {
  const int port = free_port();
  const auto t0 = Clock::now();
  const auto errors = run_store_ranks(3, port, 3s, [](TcpStore& s) {
    if (s.rank() == 2) return;  // joins, then its store closes before the all_gather
    s.all_gather(Bytes{1, 2, 3});
  });
  CHECK(seconds_since(t0) < 2.0);
  CHECK(errors[2] == "");
  CHECK_ERROR_CONTAINS(
      fail(errors[0]),
      "rank 2 closed its connection while this rank was waiting for rank 2's all_gather #1 contribution");
  CHECK_ERROR_CONTAINS(fail(errors[1]), "TcpStore rank 1 (rank 0 at 127.0.0.1:" + std::to_string(port) +
                                            "): rank 0 failed during all_gather #1: TcpStore rank 0");
  CHECK_ERROR_CONTAINS(fail(errors[1]), "rank 2 closed its connection");
}

TEST_CASE("tcp store: ranks that call different operations fail naming both") {
  const int port = free_port();
  const auto errors = run_store_ranks(2, port, 3s, [](TcpStore& s) {
    if (s.rank() == 0)
      s.barrier();
    else
      s.all_gather(Bytes{4});
  });
  CHECK_ERROR_CONTAINS(fail(errors[0]),
                       "rank 1 sent all_gather #1 while this rank is in barrier #1: every rank must "
                       "call the same store operations in the same order");
  CHECK_ERROR_CONTAINS(fail(errors[1]), "rank 0 failed during all_gather #1");

  const int port2 = free_port();
  const auto roots = run_store_ranks(3, port2, 3s, [](TcpStore& s) { s.broadcast(Bytes{9}, s.rank() == 2 ? 2 : 1); });
  // Every rank reports the root it names to rank 0, so a disagreement fails every rank.
  CHECK_ERROR_CONTAINS(fail(roots[0]), "TcpStore rank 0 (at 127.0.0.1:" + std::to_string(port2) +
                                           "): rank 2 is in broadcast #1 with root 2, this rank with root 1");
  CHECK_ERROR_CONTAINS(fail(roots[1]), "rank 0 failed during broadcast #1: TcpStore rank 0");
  CHECK_ERROR_CONTAINS(fail(roots[2]), "rank 2 is in broadcast #1 with root 2");
}

TEST_CASE("tcp store: ranks started for different worlds, and bad arguments") {
  const int port = free_port();
  std::string e0, e1;
  std::thread rank0([&] {
    try {
      TcpStore s("127.0.0.1", port, 0, 2, 3s);
    } catch (const Error& e) {
      e0 = e.what();
    }
  });
  std::thread rank1([&] {
    try {
      TcpStore s("127.0.0.1", port, 1, 3, 3s);
    } catch (const Error& e) {
      e1 = e.what();
    }
  });
  rank0.join();
  rank1.join();
  CHECK_ERROR_CONTAINS(fail(e0), "rank 1 (the connection from 127.0.0.1:");
  CHECK_ERROR_CONTAINS(fail(e0), ") was started for a world of 3 ranks, rank 0 for 2");
  CHECK_ERROR_CONTAINS(fail(e1), "TcpStore rank 1 (rank 0 at 127.0.0.1:" + std::to_string(port) +
                                     "): rank 0 failed before every rank joined: ");

  CHECK_ERROR_CONTAINS(TcpStore("127.0.0.1", 1234, 3, 3, 1s), "TcpStore: rank 3 is outside [0, 3)");
  CHECK_ERROR_CONTAINS(TcpStore("127.0.0.1", 70000, 1, 3, 1s),
                       "TcpStore rank 1: master port 70000 is outside 1..65535");
  CHECK_ERROR_CONTAINS(TcpStore("", 1234, 1, 3, 1s), "TcpStore rank 1: no master address for a world of 3 ranks");
  TcpStore alone("", 0, 0, 1, 1s);
  CHECK_ERROR_CONTAINS(alone.broadcast(Bytes{1}, 1), "TcpStore rank 0: broadcast root 1 is outside [0, 1)");
}

TEST_CASE("tcp store: a world-size mismatch is one error on every rank, naming the rank and both sizes") {
  // Ranks 0 and 1 were started for 3 ranks, rank 2 for 4; then rank 0 for 2 and the
  // others for 3, so that the rank that comes last finds rank 0 already refusing. Every
  // rank fails, well inside the timeout, with the same reason.
  struct Case {
    std::vector<int> worlds;
    int odd_rank;
    const char* sizes;
  };
  for (const Case& c : {Case{{3, 3, 4}, 2, "was started for a world of 4 ranks, rank 0 for 3"},
                        Case{{2, 3, 3}, -1, "was started for a world of 3 ranks, rank 0 for 2"}}) {
    const int port = free_port();
    std::vector<std::string> errors(c.worlds.size());
    std::vector<std::thread> threads;
    const auto start = Clock::now();
    for (int r = 0; r < static_cast<int>(c.worlds.size()); ++r)
      threads.emplace_back([&, r] {
        if (r == 2) std::this_thread::sleep_for(200ms);  // the last rank comes after the refusal
        try {
          TcpStore s("127.0.0.1", port, r, c.worlds[static_cast<std::size_t>(r)], 20s);
          s.barrier();
        } catch (const Error& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    CHECK(Clock::now() - start < 10s);
    for (std::size_t r = 0; r < errors.size(); ++r) {
      INFO("rank ", r, ": ", errors[r]);
      CHECK_ERROR_CONTAINS(fail(errors[r]), c.sizes);
      CHECK_ERROR_CONTAINS(fail(errors[r]), "every rank must be started with the same world size");
      if (c.odd_rank >= 0) CHECK_ERROR_CONTAINS(fail(errors[r]), "rank " + std::to_string(c.odd_rank) + " (");
      if (r > 0) CHECK_ERROR_CONTAINS(fail(errors[r]), "rank 0 failed before every rank joined: TcpStore rank 0");
    }
  }
}

}  // namespace test_tcp_store
