// The NCCL engine on device buffers: a one-rank NCCL world's collectives (each output
// buffer starts as a sentinel, so a collective that moved nothing or the wrong byte
// count shows), their order against a compute stream the host never synchronised
// before the collective, grouped send/recv, split, the bootstrap helpers (the device
// choice, the init timeout of a rank that never joins), the watchdog that aborts a
// collective past its timeout, and errors naming the rank. With two or more devices, a world of one thread rank per device
// checks every collective across ranks, bootstrapped through a TcpStore as torchrun
// would. The main exits 77 (Meson's skip) when no device is present.
#define DOCTEST_CONFIG_IMPLEMENT
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "../support/errors.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/nccl.hpp"

using namespace tessera;
using namespace tessera::comm;
using namespace std::chrono_literals;

namespace {

/// Throws (an exception the thread ranks can carry back too) when a CUDA call failed.
void cuda_ok(cudaError_t status, const char* call) {
  TESSERA_CHECK(status == cudaSuccess, call, ": ", cudaGetErrorName(status), ": ", cudaGetErrorString(status));
}
#define CUDA_OK(expr) cuda_ok((expr), #expr)

/// Options with this init timeout, the rest as default.
NcclOptions init_within(std::chrono::milliseconds t) {
  NcclOptions o;
  o.init_timeout = t;
  return o;
}

int devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

/// (n,) elements of T on the current device.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) { CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T))); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { (void)cudaFree(p_); }
  T* data() const { return p_; }
  std::size_t size() const { return n_; }
  std::span<T> span() const { return {p_, n_}; }
  std::span<const T> cspan() const { return {p_, n_}; }

  /// Enqueued on `stream`; the host does not wait.
  void upload(const std::vector<T>& v, cudaStream_t stream) const {
    TESSERA_CHECK(v.size() == n_, "upload of ", v.size(), " elements into ", n_);
    CUDA_OK(cudaMemcpyAsync(p_, v.data(), n_ * sizeof(T), cudaMemcpyHostToDevice, stream));
  }
  /// Every byte 0xff, enqueued on `stream`.
  void poison(cudaStream_t stream) const { CUDA_OK(cudaMemsetAsync(p_, 0xff, n_ * sizeof(T), stream)); }
  /// After everything enqueued on `stream` so far.
  std::vector<T> download(cudaStream_t stream) const {
    std::vector<T> v(n_);
    CUDA_OK(cudaMemcpyAsync(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

std::vector<float> ramp(std::size_t n, float offset) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = offset + 0.5f * static_cast<float>(i % 4099);
  return v;
}

/// A port free on 127.0.0.1 now.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

TEST_CASE("nccl: one rank's collectives on device buffers, ordered on the compute stream") {
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  {
    NcclOptions options;
    options.compute = compute;
    NcclEngine engine = nccl_from_unique_id(nccl_unique_id(), 0, 1, 0, options);
    CHECK(engine.compute_stream() == compute);
    CHECK(engine.comm_stream() != compute);
    Communicator c(engine);  // a copy: both share one ncclComm_t
    CHECK(c.engine_name() == "nccl");
    CHECK(c.rank() == 0);
    CHECK(c.size() == 1);

    // 64 MiB, uploaded on the compute stream with no host synchronisation before each
    // collective: had the comm stream not waited for the compute stream, it would read
    // a buffer still being written.
    const std::size_t n = std::size_t{1} << 24;
    const auto x = ramp(n, 1.0f), y = ramp(n, -3.0f);
    DeviceBuffer<float> in(n), out(n);

    in.upload(x, compute);
    out.poison(compute);
    c.all_gather(in.cspan(), out.span());
    CHECK(out.download(compute) == x);

    in.upload(y, compute);
    out.poison(compute);
    c.reduce_scatter(in.cspan(), out.span(), ReduceOp::sum);
    CHECK(out.download(compute) == y);

    // In place through the Communicator, for each op; out of place through the engine.
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
      in.upload(x, compute);
      c.all_reduce(in.span(), op);
      CHECK(in.download(compute) == x);
    }
    in.upload(y, compute);
    out.poison(compute);
    engine.all_reduce(in.data(), out.data(), n, DataType::f32, ReduceOp::sum).wait();
    CHECK(out.download(compute) == y);

    // i64 and f64 reductions.
    std::vector<std::int64_t> big(1000);
    for (std::size_t i = 0; i < big.size(); ++i) big[i] = (std::int64_t{1} << 40) + static_cast<std::int64_t>(i);
    DeviceBuffer<std::int64_t> di(1000), dj(1000);
    di.upload(big, compute);
    dj.poison(compute);
    engine.all_reduce(di.data(), dj.data(), 1000, DataType::i64, ReduceOp::max).wait();
    CHECK(dj.download(compute) == big);
    std::vector<double> dv(333, 0.125);
    DeviceBuffer<double> dd(333);
    dd.upload(dv, compute);
    c.all_reduce(dd.span());
    CHECK(dd.download(compute) == dv);

    // u16 elements move as bytes: twice the count, every element arrives.
    std::vector<std::uint16_t> h(4097);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint16_t>(i * 13);
    DeviceBuffer<std::uint16_t> hin(h.size()), hout(h.size());
    hin.upload(h, compute);
    hout.poison(compute);
    c.all_gather(hin.cspan(), hout.span());
    CHECK(hout.download(compute) == h);
    c.broadcast(hin.span(), 0);
    CHECK(hin.download(compute) == h);

    // Async: several in flight; a handle dropped unwaited still orders the compute stream.
    in.upload(x, compute);
    out.poison(compute);
    Handle first = c.all_gather_async(in.cspan(), out.span());
    c.barrier();
    { Handle dropped = c.all_reduce_async(dd.span()); }
    first.wait();
    CHECK_FALSE(first.pending());
    CHECK(out.download(compute) == x);
    CHECK(dd.download(compute) == dv);
    CHECK(c.traffic().collectives > 0);
  }
  CUDA_OK(cudaStreamSynchronize(compute));
  CUDA_OK(cudaStreamDestroy(compute));
}

TEST_CASE("nccl: grouped send and receive, and split") {
  CUDA_OK(cudaSetDevice(0));
  NcclEngine engine = nccl_from_unique_id(nccl_unique_id(), 0, 1, 0);  // the legacy default stream
  CHECK(engine.compute_stream() == nullptr);
  std::vector<std::int32_t> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>(i * 7 - 3);
  DeviceBuffer<std::int32_t> a(v.size()), b(v.size());
  a.upload(v, nullptr);
  b.poison(nullptr);
  const PeerOp ops[] = {{PeerOp::Kind::recv, 0, b.data(), b.size(), DataType::i32},
                        {PeerOp::Kind::send, 0, a.data(), a.size(), DataType::i32}};
  engine.send_recv(ops).wait();
  CHECK(b.download(nullptr) == v);

  NcclEngine alone = engine.split(3, 0);
  CHECK(alone.size() == 1);
  CHECK(alone.rank() == 0);
  CHECK(alone.nccl_comm() != engine.nccl_comm());
  b.poison(nullptr);
  alone.all_reduce(a.data(), b.data(), a.size(), DataType::i32, ReduceOp::min).wait();
  CHECK(b.download(nullptr) == v);
  CHECK_ERROR_CONTAINS(engine.split(-1, 0), "rank 0: split color -1 is negative");
}

TEST_CASE("nccl: bootstrap helpers for torchrun and for a launcher's own broadcast") {
  CUDA_OK(cudaSetDevice(0));
  Launch launch;
  launch.kind = LaunchKind::torchrun;  // a one-rank world needs no master to meet
  NcclEngine t = nccl_from_torchrun(launch, init_within(5s));
  CHECK(t.size() == 1);
  CHECK(t.device() == 0);

  int calls = 0;
  NcclEngine m = nccl_from_broadcast(0, 1, 0, [&](std::span<std::uint8_t> id) {
    ++calls;
    CHECK(id.size() == sizeof(ncclUniqueId));
  });
  CHECK(calls == 1);
  DeviceBuffer<float> d(16);
  d.upload(ramp(16, 2.0f), nullptr);
  m.all_reduce(d.data(), d.data(), 16, DataType::f32, ReduceOp::sum).wait();
  CHECK(d.download(nullptr) == ramp(16, 2.0f));

  CHECK_ERROR_CONTAINS(nccl_from_broadcast(1, 2, 0, [](std::span<std::uint8_t>) {}),
                       "rank 1: the NCCL id is still all zeros after the broadcast");
  launch.world_size = 2;  // two ranks meet at MASTER_ADDR:MASTER_PORT, which this launch lacks
  launch.launcher = Launcher::mpirun;
  CHECK_ERROR_CONTAINS(nccl_from_torchrun(launch, init_within(5s)),
                       "launch: rank 0 (local rank 0) of 2 (mpirun): the NCCL id is exchanged at "
                       "MASTER_ADDR:MASTER_PORT, which are not both set");
  if (devices() >= 2) {  // more ranks on the node than its GPUs: refused before any rank meets
    Launch crowded;
    crowded.kind = LaunchKind::torchrun;
    crowded.rank = 1;
    crowded.local_rank = 1;
    crowded.world_size = crowded.local_world_size = devices() + 1;
    crowded.local_size_var = "LOCAL_WORLD_SIZE";
    crowded.master_addr = "127.0.0.1";
    crowded.master_port = free_port();
    CHECK_ERROR_CONTAINS(nccl_from_torchrun(crowded, init_within(5s)),
                         "ranks on this node but this process sees " + std::to_string(devices()) + " CUDA devices");
  }
  CHECK_ERROR_CONTAINS(nccl_from_unique_id(nccl_unique_id(), 0, 1, devices()),
                       "rank 0: CUDA device " + std::to_string(devices()) + " does not exist");
}

TEST_CASE("nccl: errors name the rank, and abort fails every copy with its reason") {
  CUDA_OK(cudaSetDevice(0));
  NcclEngine engine = nccl_from_unique_id(nccl_unique_id(), 0, 1, 0);
  DeviceBuffer<std::uint16_t> h(4);
  CHECK_ERROR_CONTAINS(engine.all_reduce(h.data(), h.data(), 4, DataType::u16, ReduceOp::sum),
                       "rank 0: reduction over u16 elements is not supported: reduce f32, f64, bf16, i32 or i64");
  CHECK_ERROR_CONTAINS(engine.broadcast(h.data(), 4, DataType::u16, 1), "rank 0: broadcast root 1 outside 1 ranks");
  // A host variable, what all_reduce_value used to hand over, is refused by name.
  double loss = 1.5;
  CHECK_ERROR_CONTAINS(engine.all_reduce(&loss, &loss, 1, DataType::f64, ReduceOp::sum),
                       "rank 0: all_reduce: the input (");
  CHECK_ERROR_CONTAINS(engine.all_reduce(&loss, &loss, 1, DataType::f64, ReduceOp::sum),
                       "is host memory, which NCCL cannot move");
  const PeerOp host_send{PeerOp::Kind::send, 0, &loss, 1, DataType::f64};
  CHECK_ERROR_CONTAINS(engine.send_recv(std::span<const PeerOp>(&host_send, 1)), "send_recv: the send buffer");
  CHECK_ERROR_CONTAINS(comm::detail::nccl_check(ncclInvalidArgument, "ncclAllReduce", 5),
                       std::string("rank 5: ncclAllReduce failed: ") + ncclGetErrorString(ncclInvalidArgument));
  CHECK_ERROR_CONTAINS(comm::detail::nccl_cuda_check(cudaErrorInvalidValue, "cudaMalloc", 5),
                       "rank 5: cudaMalloc failed: cudaErrorInvalidValue");

  NcclEngine copy = engine;
  Handle before = copy.barrier();
  CHECK_ERROR_CONTAINS(engine.abort("rank 3 ran out of data"),
                       "rank 0: NCCL communicator aborted: rank 3 ran out of data");
  CHECK_ERROR_CONTAINS(before.wait(),
                       "rank 0: barrier on an aborted NCCL communicator: rank 0: NCCL communicator "
                       "aborted: rank 3 ran out of data");
  CHECK_ERROR_CONTAINS(copy.all_reduce(h.data(), h.data(), 2, DataType::f32, ReduceOp::sum),
                       "rank 0: all_reduce on an aborted NCCL communicator");
  CHECK_ERROR_CONTAINS(copy.split(0, 0), "rank 0: split on an aborted NCCL communicator");
  CUDA_OK(cudaDeviceSynchronize());
}

TEST_CASE("nccl: a rank that never joins fails ncclCommInitRank within the init timeout") {
  CUDA_OK(cudaSetDevice(0));
  const auto start = std::chrono::steady_clock::now();
  // Rank 0 of 2, and rank 1 never comes: the non-blocking init is polled, then aborted.
  CHECK_ERROR_CONTAINS(nccl_from_unique_id(nccl_unique_id(), 0, 2, 0, init_within(2s)),
                       "rank 0: ncclCommInitRank (2 ranks, CUDA device 0) did not finish within 2 s");
  CHECK(std::chrono::steady_clock::now() - start < 60s);
}

TEST_CASE("nccl: one thread rank per device, bootstrapped through a TcpStore") {
  const int p = std::min(devices(), 4);
  if (p < 2) {
    MESSAGE("one device: the multi-rank NCCL case needs two or more");
    return;
  }
  const int port = free_port();
  std::vector<std::string> errors(static_cast<std::size_t>(p));
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r)
    threads.emplace_back([&, r] {
      try {
        Launch l;
        l.kind = LaunchKind::torchrun;
        l.rank = r;
        l.world_size = p;
        l.local_rank = r;
        l.master_addr = "127.0.0.1";
        l.master_port = port;
        Communicator c(nccl_from_torchrun(l, init_within(60s)));
        TESSERA_CHECK(c.rank() == r && c.size() == p, "rank ", r, ": communicator rank ", c.rank(), " of ", c.size());
        const std::size_t n = 1000;
        DeviceBuffer<float> mine(n), all(n * p), full(n * p), block(n);
        mine.upload(ramp(n, static_cast<float>(r)), nullptr);
        c.all_gather(mine.cspan(), all.span());
        const auto gathered = all.download(nullptr);
        for (int q = 0; q < p; ++q) {
          const auto theirs = ramp(n, static_cast<float>(q));
          for (std::size_t i = 0; i < n; ++i)
            TESSERA_CHECK(gathered[q * n + i] == theirs[i], "rank ", r, ": all_gather at ", q, ",", i);
        }
        full.upload(ramp(n * p, static_cast<float>(r)), nullptr);
        c.reduce_scatter(full.cspan(), block.span());
        const auto reduced = block.download(nullptr);
        std::vector<float> expect(n, 0.0f);  // multiples of 0.5 below 2^20: exact in any summation order
        for (int q = 0; q < p; ++q) {
          const auto theirs = ramp(n * p, static_cast<float>(q));
          for (std::size_t i = 0; i < n; ++i) expect[i] += theirs[r * n + i];
        }
        TESSERA_CHECK(reduced == expect, "rank ", r, ": reduce_scatter differs from the sum of every rank's block");
        mine.upload(std::vector<float>(n, static_cast<float>(r + 1)), nullptr);
        c.all_reduce(mine.span(), ReduceOp::max);
        for (float v : mine.download(nullptr))
          TESSERA_CHECK(v == static_cast<float>(p), "rank ", r, ": all_reduce max");
        mine.upload(std::vector<float>(n, static_cast<float>(r)), nullptr);
        c.broadcast(mine.span(), p - 1);
        for (float v : mine.download(nullptr))
          TESSERA_CHECK(v == static_cast<float>(p - 1), "rank ", r, ": broadcast from rank ", p - 1);
        // A ring: send to the next rank, receive from the previous.
        DeviceBuffer<std::int32_t> to_next(10), from_prev(10);
        to_next.upload(std::vector<std::int32_t>(10, r), nullptr);
        const PeerOp ops[] = {{PeerOp::Kind::send, (r + 1) % p, to_next.data(), 10, DataType::i32},
                              {PeerOp::Kind::recv, (r + p - 1) % p, from_prev.data(), 10, DataType::i32}};
        c.send_recv(ops);
        for (auto v : from_prev.download(nullptr))
          TESSERA_CHECK(v == (r + p - 1) % p, "rank ", r, ": received ", v, " from rank ", (r + p - 1) % p);
        Communicator pair = c.split(r % 2, -r);
        DeviceBuffer<std::int64_t> one(1);
        one.upload({1}, nullptr);
        pair.all_reduce(one.span());
        TESSERA_CHECK(one.download(nullptr)[0] == (p + 1 - r % 2) / 2, "rank ", r, ": split all_reduce");
        c.barrier();
        CUDA_OK(cudaDeviceSynchronize());
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = "unknown exception";
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < p; ++r) CHECK(errors[static_cast<std::size_t>(r)] == "");
}

TEST_CASE("nccl: a rank that stops calling collectives ends the other within the timeout, naming the operation") {
  if (devices() < 2) {
    MESSAGE("one device: the case of a silent peer needs two");
    return;
  }
  const int port = free_port();
  std::mutex m;
  std::string reported[2];  // rank 1 may learn of rank 0's abort too: each rank's own
  std::string errors[2];
  std::atomic<bool> done{false};
  std::thread ranks[2];
  for (int r = 0; r < 2; ++r)
    ranks[r] = std::thread([&, r] {
      try {
        Launch l;
        l.kind = LaunchKind::torchrun;
        l.rank = l.local_rank = r;
        l.world_size = 2;
        l.master_addr = "127.0.0.1";
        l.master_port = port;
        NcclOptions options = init_within(60s);
        options.timeout = 1s;
        options.on_failure = [&](const std::string& why) {
          std::lock_guard<std::mutex> lock(m);
          reported[r] = why;
        };
        NcclEngine e = nccl_from_torchrun(l, options);
        DeviceBuffer<float> d(64);
        d.upload(ramp(64, 1.0f), nullptr);
        e.all_reduce(d.data(), d.data(), 64, DataType::f32, ReduceOp::sum).wait();  // both: completes
        CUDA_OK(cudaDeviceSynchronize());
        if (r == 0) e.all_reduce(d.data(), d.data(), 64, DataType::f32, ReduceOp::sum);  // rank 1 never comes
        const auto until = std::chrono::steady_clock::now() + 30s;
        while (!done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(20ms);
        if (r == 0) (void)cudaDeviceSynchronize();  // returns: the abort ended NCCL's kernel
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (int i = 0; i < 400; ++i) {
    std::this_thread::sleep_for(50ms);
    std::lock_guard<std::mutex> lock(m);
    if (!reported[0].empty()) break;
  }
  done = true;
  for (auto& t : ranks) t.join();
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
  std::lock_guard<std::mutex> lock(m);
  CHECK_ERROR_CONTAINS(fail(reported[0]), "rank 0: NCCL all_reduce (collective #2 of 2 ranks) did not complete within 1 s");
}

namespace {
/// A host function on a stream that holds it until `release` is set, or 2 s pass (the
/// abort may wait for the device, which this holds).
void CUDART_CB hold_stream(void* release) {
  const auto until = std::chrono::steady_clock::now() + 2s;
  while (!static_cast<std::atomic<bool>*>(release)->load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(1ms);
}
}  // namespace

// Last in this file: the collective held here still runs on the aborted communicator
// once the stream is released.
TEST_CASE("nccl: the watchdog aborts a collective that does not complete within the timeout") {
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t compute = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  std::atomic<bool> release{false};
  std::mutex m;
  std::string reported;
  {
    NcclOptions options;
    options.compute = compute;
    options.timeout = 300ms;
    options.on_failure = [&](const std::string& why) {
      std::lock_guard<std::mutex> lock(m);
      reported = why;
    };
    NcclEngine engine = nccl_from_unique_id(nccl_unique_id(), 0, 1, 0, options);
    DeviceBuffer<float> d(16);
    d.upload(ramp(16, 1.0f), compute);
    engine.all_reduce(d.data(), d.data(), 16, DataType::f32, ReduceOp::sum).wait();  // completes: not reported
    CUDA_OK(cudaStreamSynchronize(compute));
    std::this_thread::sleep_for(500ms);
    {
      std::lock_guard<std::mutex> lock(m);
      CHECK(reported == "");
    }
    // The compute stream is held, so the next collective (ordered after it) cannot complete.
    CUDA_OK(cudaLaunchHostFunc(compute, hold_stream, &release));
    Handle h = engine.all_reduce(d.data(), d.data(), 16, DataType::f32, ReduceOp::sum);
    for (int i = 0; i < 200; ++i) {
      std::this_thread::sleep_for(50ms);
      std::lock_guard<std::mutex> lock(m);
      if (!reported.empty()) break;
    }
    {
      std::lock_guard<std::mutex> lock(m);
      CHECK_ERROR_CONTAINS(fail(reported), "rank 0: NCCL all_reduce (collective #2 of 1 ranks) did not complete "
                                           "within 0.3 s: a rank died, hangs, or stopped calling the same collectives");
      CHECK_ERROR_CONTAINS(fail(reported), "the communicator was aborted");
    }
    CHECK_ERROR_CONTAINS(h.wait(), "rank 0: all_reduce on an aborted NCCL communicator: rank 0: NCCL all_reduce");
    CHECK_ERROR_CONTAINS(engine.barrier(), "rank 0: barrier on an aborted NCCL communicator");
    release = true;
    CUDA_OK(cudaStreamSynchronize(compute));
  }
  (void)cudaDeviceSynchronize();
  CUDA_OK(cudaStreamDestroy(compute));
}

int main(int argc, char** argv) {
  if (devices() == 0) {
    std::printf("no CUDA device: NCCL tests skipped\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
