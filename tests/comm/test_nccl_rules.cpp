// NCCL's rules on thread ranks (comm/nccl_rules.hpp): each rule shown failing a program
// that breaks it -- a host buffer, another rank's tensor, a tag, a result read before
// its wait(), an input changed before its wait(), collectives issued in different
// orders, sends that rely on being buffered -- and the same programs written the legal
// way giving the right results.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/comm/thread.hpp"
#include "tessera/core/tensor.hpp"

namespace test_nccl_rules {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::comm;
using namespace std::chrono_literals;

namespace {

ThreadOptions nccl_rules(std::chrono::milliseconds timeout = 20s) {
  ThreadOptions o;
  o.memory = Cpu::memory_access();
  o.nccl_rules = true;
  o.timeout = timeout;
  return o;
}

/// A backend tensor of `values`.
Tensor<float> device(const std::vector<float>& values) {
  Tensor<float> t = Cpu::empty<float>(Shape{static_cast<std::int64_t>(values.size())});
  Cpu::copy_from_host(values.data(), t.data(), t.numel());
  return t;
}

std::vector<float> host(const Tensor<float>& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  Cpu::copy_to_host(t.data(), v.data(), t.numel());
  return v;
}

std::span<float> all(Tensor<float>& t) { return {t.data(), static_cast<std::size_t>(t.numel())}; }
std::span<const float> all(const Tensor<float>& t) { return {t.data(), static_cast<std::size_t>(t.numel())}; }

/// The message of the error run_thread_ranks rethrows ("" when none).
template <class F>
std::string error_of(int ranks, F&& fn, ThreadOptions options) {
  try {
    run_thread_ranks(ranks, fn, options);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("NCCL rules: collectives and grouped transfers on device buffers give their results") {
  for (int p : {2, 3}) {
    CAPTURE(p);
    run_thread_ranks(
        p,
        [&](Communicator& c) {
          const int r = c.rank();
          Tensor<float> mine = device({float(r), float(r) + 0.5f});
          Tensor<float> gathered = Cpu::zeros<float>(Shape{2 * p});
          c.all_gather(all(std::as_const(mine)), all(gathered));
          const std::vector<float> g = host(gathered);
          for (int q = 0; q < p; ++q) CHECK(g[static_cast<std::size_t>(2 * q)] == float(q));

          Tensor<float> sum = device({1.0f, float(r)});
          c.all_reduce(all(sum));
          CHECK(host(sum) == std::vector<float>{float(p), float(p * (p - 1) / 2)});

          Tensor<float> b = device({float(r)});
          c.broadcast(all(b), p - 1);
          CHECK(host(b)[0] == float(p - 1));

          // Both directions in one group: legal, and no order inside it deadlocks.
          Tensor<float> out = device({float(r)}), in = Cpu::zeros<float>(Shape{1});
          const int next = (r + 1) % p, prev = (r + p - 1) % p;
          const PeerOp ops[] = {{PeerOp::Kind::recv, prev, in.data(), 1, DataType::f32},
                                {PeerOp::Kind::send, next, out.data(), 1, DataType::f32}};
          c.send_recv(ops);
          CHECK(host(in)[0] == float(prev));
          Cpu::synchronize();
        },
        nccl_rules());
  }
}

TEST_CASE("NCCL rules: a host buffer is refused, naming the operation and the rank") {
  const std::string e = error_of(
      2,
      [](Communicator& c) {
        double loss = 1.5;  // what all_reduce_value did: the address of a host variable
        c.all_reduce(std::span<double>(&loss, 1));
      },
      nccl_rules());
  CHECK(e.find("all_reduce #1") != std::string::npos);
  CHECK(e.find("is host memory, which NCCL cannot move") != std::string::npos);
  CHECK(e.find("rank ") != std::string::npos);
  // The same program without the rules runs: the host engine moves host memory.
  CHECK(error_of(
            2,
            [](Communicator& c) {
              double loss = 1.5;
              c.all_reduce(std::span<double>(&loss, 1));
            },
            {}) == "");
}

TEST_CASE("NCCL rules: a tensor of another rank's device is refused (one rank per device)") {
  Tensor<float> shared;
  std::atomic<bool> made{false};
  const std::string e = error_of(
      2,
      [&](Communicator& c) {
        if (c.rank() == 0) {
          shared = Cpu::zeros<float>(Shape{4});
          made = true;
        }
        while (!made) std::this_thread::sleep_for(1ms);
        if (c.rank() == 1) c.all_reduce(std::span<float>(shared.data(), 4));
        else {
          Tensor<float> own = Cpu::zeros<float>(Shape{4});
          c.all_reduce(all(own));
        }
      },
      nccl_rules(2s));
  CHECK(e.find("memory of another rank's device") != std::string::npos);
}

TEST_CASE("NCCL rules: a transfer with a tag is refused; issue order is the only matching") {
  const std::string e = error_of(
      2,
      [](Communicator& c) {
        Tensor<float> t = Cpu::zeros<float>(Shape{1});
        const PeerOp op{c.rank() == 0 ? PeerOp::Kind::send : PeerOp::Kind::recv, 1 - c.rank(), t.data(), 1,
                        DataType::f32, 3};
        c.send_recv(std::span<const PeerOp>(&op, 1));
      },
      nccl_rules(2s));
  CHECK(e.find("has tag 3: NCCL has no tags") != std::string::npos);
}

TEST_CASE("NCCL rules: a result read before its wait() reads poison, after it the sum") {
  std::vector<float> early(2), late(2);
  run_thread_ranks(
      2,
      [&](Communicator& c) {
        Tensor<float> t = device({1.0f, 2.0f});
        Handle h = c.all_reduce_async(all(t));
        const std::vector<float> before = host(t);  // too early: on a GPU, not ordered after the collective
        h.wait();
        const std::vector<float> after = host(t);
        if (c.rank() == 0) {
          early = before;
          late = after;
        }
      },
      nccl_rules());
  CHECK(std::isnan(early[0]));
  CHECK(std::isnan(early[1]));
  CHECK(late == std::vector<float>{2.0f, 4.0f});
}

TEST_CASE("NCCL rules: an input changed before its wait() is refused at the wait") {
  const std::string e = error_of(
      2,
      [](Communicator& c) {
        Tensor<float> in = device({1.0f}), out = Cpu::zeros<float>(Shape{2});
        Handle h = c.all_gather_async(all(std::as_const(in)), all(out));
        const float changed = 7.0f;
        Cpu::copy_from_host(&changed, in.data(), 1);  // NCCL may still be reading it
        h.wait();
      },
      nccl_rules(2s));
  CHECK(e.find("all_gather #1 (rank ") != std::string::npos);
  CHECK(e.find("changed before wait()") != std::string::npos);
}

TEST_CASE("NCCL rules: collectives issued in different orders fail, naming both calls") {
  for (bool rules : {false, true}) {
    CAPTURE(rules);
    const std::string e = error_of(
        2,
        [](Communicator& c) {
          Tensor<float> a = Cpu::zeros<float>(Shape{4}), g = Cpu::zeros<float>(Shape{8});
          if (c.rank() == 0) {
            c.all_reduce(all(a));
            c.all_gather(std::span<const float>(a.data(), 4), all(g));
          } else {
            c.all_gather(std::span<const float>(a.data(), 4), all(g));
            c.all_reduce(all(a));
          }
        },
        rules ? nccl_rules(2s) : ThreadOptions{});
    CHECK(e.find("issued all_") != std::string::npos);
    CHECK(e.find("every rank must issue the same collectives in the same order") != std::string::npos);
    CHECK(e.find("all_reduce of 4 f32 (sum)") != std::string::npos);
    CHECK(e.find("all_gather of 4 f32") != std::string::npos);
  }
}

TEST_CASE("NCCL rules: sends that rely on being buffered deadlock and fail; grouped they run") {
  // Each rank sends to the other, then receives, in separate groups: eager sends make it
  // work, NCCL's do not (each send waits for a recv the peer issues only after its own send).
  auto exchange = [](bool grouped) {
    return [grouped](Communicator& c) {
      Tensor<float> out = device({float(c.rank())}), in = Cpu::zeros<float>(Shape{1});
      const PeerOp send{PeerOp::Kind::send, 1 - c.rank(), out.data(), 1, DataType::f32};
      const PeerOp recv{PeerOp::Kind::recv, 1 - c.rank(), in.data(), 1, DataType::f32};
      if (grouped) {
        const PeerOp both[] = {send, recv};
        c.send_recv(both);
      } else {
        Handle s = c.send_recv_async(std::span<const PeerOp>(&send, 1));
        c.send_recv(std::span<const PeerOp>(&recv, 1));
        s.wait();
      }
      CHECK(host(in)[0] == float(1 - c.rank()));
    };
  };
  CHECK(error_of(2, exchange(false), ThreadOptions{}) == "");  // buffered: runs
  const std::string e = error_of(2, exchange(false), nccl_rules(1s));
  CHECK(e.find("under NCCL's rules a send completes only when its receiver's recv runs") != std::string::npos);
  CHECK(e.find("timed out") != std::string::npos);
  CHECK(error_of(2, exchange(true), nccl_rules(5s)) == "");
}

TEST_CASE("NCCL rules: transfers matched in a different issue order fail on their sizes") {
  const std::string e = error_of(
      2,
      [](Communicator& c) {
        Tensor<float> small = Cpu::zeros<float>(Shape{4}), large = Cpu::zeros<float>(Shape{8});
        const auto kind = c.rank() == 0 ? PeerOp::Kind::send : PeerOp::Kind::recv;
        const PeerOp first{kind, 1 - c.rank(), (c.rank() == 0 ? small : large).data(),
                           static_cast<std::size_t>(c.rank() == 0 ? 4 : 8), DataType::f32};
        const PeerOp second{kind, 1 - c.rank(), (c.rank() == 0 ? large : small).data(),
                            static_cast<std::size_t>(c.rank() == 0 ? 8 : 4), DataType::f32};
        const PeerOp both[] = {first, second};
        c.send_recv(both);
      },
      nccl_rules(2s));
  CHECK(e.find("recv of 32 bytes from rank 0 met a send of 16 bytes") != std::string::npos);
}

TEST_CASE("NCCL rules: a barrier's wait() does not hold the host; its next synchronisation does") {
  // Rank 1 enters the barrier only after rank 0 has passed its barrier's wait(): under
  // NCCL's rules that wait returns at once, and rank 0's synchronisation then waits for
  // rank 1. (A barrier that held the host would leave both waiting: rank 1 gives up.)
  std::atomic<bool> past_wait{false};
  std::atomic<bool> rank1_saw{false};
  run_thread_ranks(
      2,
      [&](Communicator& c) {
        if (c.rank() == 0) {
          c.barrier();
          past_wait = true;
          Cpu::synchronize();  // holds the host until every rank arrived
        } else {
          for (int i = 0; i < 10000 && !past_wait; ++i) std::this_thread::sleep_for(1ms);
          rank1_saw = past_wait.load();
          c.barrier();
          Cpu::synchronize();
        }
      },
      nccl_rules());
  CHECK(rank1_saw);
}

TEST_CASE("NCCL rules: a memory access that cannot tell device from host memory is refused") {
  ThreadOptions o;
  o.nccl_rules = true;  // host MemoryAccess: no where()
  const std::string e = error_of(2, [](Communicator&) {}, o);
  CHECK(e.find("cannot tell a backend's device memory from host memory") != std::string::npos);
}

}  // namespace test_nccl_rules
