// The Communicator: collectives between ranks, whatever engine carries them.
//
// An engine is any type satisfying comm::Engine: all_gather, reduce_scatter,
// all_reduce, broadcast, grouped send/recv and barrier, each returning a Handle that
// completes asynchronously; split by color and key; abort. Three engines exist:
// ThreadEngine (in-process thread ranks, comm/thread.hpp), MpiEngine (Open MPI,
// comm/mpi.hpp) and NcclEngine (comm/nccl.hpp, with the CUDA backend).
//
// comm::Communicator holds any engine behind one value type. The launch (mpirun, one
// process with N thread ranks, torchrun) is a run-time choice, and a collective moves
// kilobytes to megabytes, so one indirect call per collective costs nothing next to
// it; erasing the engine keeps it out of every model and policy type.
//
// The typed front checks sizes and element types, counts the bytes each rank sends, and,
// while a profile records on the calling thread, makes each collective and its wait a
// span of it (core/profile.hpp). With a flight recorder attached (record_flights()), it
// records each collective with its group and its number there, and the rank's wait for
// it (comm/flight_recorder.hpp); a communicator knows its group's world ranks (split_strided
// computes them; split by color leaves them unknown) and the name a mesh gave it (named()).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tessera/comm/engine.hpp"
#include "tessera/comm/flight_recorder.hpp"
#include "tessera/comm/self.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/profile.hpp"

namespace tessera::comm {

/// Bytes one rank sent, per collective kind. A collective over p ranks of N bytes in
/// all counts (p-1)/p * N for all_gather and reduce_scatter, 2 (p-1)/p * N for
/// all_reduce (the bandwidth-optimal volume ring algorithms reach), N * (p-1) for
/// the broadcast root, and every byte of a send.
struct Traffic {
  std::uint64_t all_gather = 0, reduce_scatter = 0, all_reduce = 0, broadcast = 0, send = 0;
  std::uint64_t collectives = 0;
  std::uint64_t total() const { return all_gather + reduce_scatter + all_reduce + broadcast + send; }
};

class Communicator {
 public:
  /// One rank alone: every collective is a copy.
  Communicator();

  // Communicator is no engine of its own: the first test keeps copying and moving one from
  // asking whether it is (Engine<Communicator> asks whether Communicator is
  // move-constructible, which would ask this constructor again: Clang rejects that loop).
  template <class E>
    requires(!std::same_as<std::remove_cvref_t<E>, Communicator> && Engine<E>)
  explicit Communicator(E engine, std::shared_ptr<Traffic> traffic = std::make_shared<Traffic>())
      : impl_(std::make_shared<Model<E>>(std::move(engine))), traffic_(std::move(traffic)),
        group_(std::make_shared<GroupInfo>(GroupInfo{"world", std::vector<int>(static_cast<std::size_t>(size()))})) {
    std::iota(group_->world_ranks.begin(), group_->world_ranks.end(), 0);
  }

  int rank() const { return impl_->rank(); }
  int size() const { return impl_->size(); }
  std::string_view engine_name() const { return impl_->engine_name(); }

  /// out (size() * in.size()) = the ins of every rank, in rank order.
  template <class T>
  Handle all_gather_async(std::span<const T> in, std::span<T> out) {
    TESSERA_CHECK(out.size() == in.size() * static_cast<std::size_t>(size()), "all_gather: output of ", out.size(),
                  " elements for ", in.size(), " per rank over ", size(), " ranks");
    count(traffic_->all_gather, in.size_bytes() * static_cast<std::uint64_t>(size() - 1));
    return issued("all_gather", out.size_bytes(),
                  [&] { return impl_->all_gather(in.data(), out.data(), in.size(), data_type_of<T>()); });
  }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) {
    all_gather_async(in, out).wait();
  }

  /// out (in.size() / size()) = this rank's block of the element-wise reduction of every rank's in.
  template <class T>
  Handle reduce_scatter_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    TESSERA_CHECK(in.size() == out.size() * static_cast<std::size_t>(size()), "reduce_scatter: input of ",
                  in.size(), " elements for ", out.size(), " per rank over ", size(), " ranks");
    count(traffic_->reduce_scatter, out.size_bytes() * static_cast<std::uint64_t>(size() - 1));
    return issued("reduce_scatter", in.size_bytes(),
                  [&] { return impl_->reduce_scatter(in.data(), out.data(), out.size(), data_type_of<T>(), op); });
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(in, out, op).wait();
  }

  /// data = the element-wise reduction of every rank's data, the same on every rank.
  template <class T>
  Handle all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::sum) {
    return all_reduce_async(std::span<const T>(data), data, op);
  }
  template <class T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::sum) {
    all_reduce_async(data, op).wait();
  }
  /// out = the element-wise reduction of every rank's in (out of place; in is untouched;
  /// in == out reduces in place).
  template <class T>
  Handle all_reduce_async(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    TESSERA_CHECK(in.size() == out.size(), "all_reduce: input of ", in.size(), " elements, output of ", out.size());
    const auto p = static_cast<std::uint64_t>(size());
    count(traffic_->all_reduce, 2 * in.size_bytes() * (p - 1) / p);
    return issued("all_reduce", in.size_bytes(),
                  [&] { return impl_->all_reduce(in.data(), out.data(), in.size(), data_type_of<T>(), op); });
  }
  template <class T>
  void all_reduce(std::span<const T> in, std::span<T> out, ReduceOp op = ReduceOp::sum) {
    all_reduce_async(in, out, op).wait();
  }
  /// One host value reduced over every rank: host engines only (thread ranks, MPI
  /// without the NCCL rules). NCCL moves device memory only, and its wait() does not hold
  /// the host; library code reduces host values with parallel::all_reduce_host<B>.
  template <class T>
  T all_reduce_value(T value, ReduceOp op = ReduceOp::sum) {
    all_reduce(std::span<T>(&value, 1), op);
    return value;
  }

  /// data = root's data on every rank.
  template <class T>
  Handle broadcast_async(std::span<T> data, int root) {
    TESSERA_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " outside ", size(), " ranks");
    count(traffic_->broadcast, rank() == root ? data.size_bytes() * static_cast<std::uint64_t>(size() - 1) : 0);
    return issued("broadcast", data.size_bytes(),
                  [&] { return impl_->broadcast(data.data(), data.size(), data_type_of<T>(), root); });
  }
  template <class T>
  void broadcast(std::span<T> data, int root) {
    broadcast_async(data, root).wait();
  }

  /// Sends and receives issued as one group: no order among them can deadlock. A recv
  /// takes the oldest unmatched send from its peer (with the same tag; NCCL has no tags,
  /// portable code uses 0). A send may wait for its receiver (NCCL's always do): put the
  /// transfers a peer waits for in the same group as the recvs this rank waits for
  /// (PeerOp, engine.hpp). The sent buffers must stay untouched until the Handle is waited on.
  Handle send_recv_async(std::span<const PeerOp> ops) {
    std::uint64_t sent = 0, moved = 0;
    for (const auto& o : ops) {
      TESSERA_CHECK(o.peer >= 0 && o.peer < size() && o.peer != rank(), "send_recv: rank ", rank(),
                    " cannot exchange with peer ", o.peer, " of ", size());
      detail::check_tag(o, rank());
      if (o.kind == PeerOp::Kind::send) sent += o.count * size_of(o.type);
      moved += o.count * size_of(o.type);
    }
    count(traffic_->send, sent);
    return issued("send_recv", moved, [&] { return impl_->send_recv(ops); });
  }
  void send_recv(std::span<const PeerOp> ops) { send_recv_async(ops).wait(); }

  /// Every rank waits for every other (on NCCL: the GPUs' work is ordered, the hosts not
  /// held). A collective like the others: profiled and flight-recorded.
  void barrier() {
    issued("barrier", 0, [&] { return impl_->barrier(); }).wait();
  }

  /// The ranks with the same color form a new communicator, ranked by key (then by
  /// rank here). Every rank of this communicator must call it. The child counts its
  /// traffic into the same Traffic as this one.
  Communicator split(int color, int key) const {
    return Communicator(impl_->split(color, key), traffic_, std::make_shared<GroupInfo>(GroupInfo{"split", {}}),
                        flight_);
  }

  /// The ranks that differ from this one only in the digit of weight `stride` and base
  /// `size` of their rank: rank = (a x size + i) x stride + b with b < stride, ranked by
  /// i. A mesh dimension's communicator (comm/mesh.hpp) and a tensor-parallel group's
  /// holders are such groups. Every rank must call it with the same `stride` and `size`,
  /// and stride x size must divide size(). It is split(color, key) on every engine but the
  /// dry run's (plan/phantom.hpp), which has no peers to ask for their colors and so
  /// splits this way alone.
  Communicator split_strided(int stride, int size) const {
    TESSERA_CHECK(stride >= 1 && size >= 1 && this->size() % (stride * size) == 0, "split_strided: stride ", stride,
                  " x size ", size, " does not divide the communicator's ", this->size(), " ranks");
    // This rank's group: the ranks that share its digits but the one of weight `stride`.
    const int block = stride * size, r = rank();
    std::vector<int> members;
    if (!group_->world_ranks.empty())
      for (int i = 0; i < size; ++i)
        members.push_back(group_->world_ranks[static_cast<std::size_t>(r / block * block + r % stride + i * stride)]);
    return Communicator(impl_->split_strided(stride, size), traffic_,
                        std::make_shared<GroupInfo>(GroupInfo{"split", std::move(members)}), flight_);
  }

  /// This communicator under `name` in its flight records (a mesh names its dimensions'):
  /// a copy sharing the engine, its collectives numbered afresh.
  Communicator named(std::string name) const {
    return Communicator(impl_, traffic_, std::make_shared<GroupInfo>(GroupInfo{std::move(name), group_->world_ranks}),
                        flight_);
  }
  /// The group as flight records name it.
  const GroupInfo& group() const { return *group_; }

  /// Records this communicator's collectives in `recorder` from now on (nullptr: stops),
  /// and those of the communicators split from it afterwards.
  void record_flights(std::shared_ptr<FlightRecorder> recorder) { flight_ = std::move(recorder); }
  const std::shared_ptr<FlightRecorder>& flight_recorder() const { return flight_; }

  /// Makes every rank's pending and future collectives fail with `reason` (thread
  /// ranks), or ends the job (MPI): the way a failing rank never leaves the others hanging.
  void abort(const std::string& reason) { impl_->abort(reason); }

  const Traffic& traffic() const { return *traffic_; }
  void reset_traffic() { *traffic_ = Traffic{}; }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual std::string_view engine_name() const = 0;
    virtual Handle all_gather(const void*, void*, std::size_t, DataType) = 0;
    virtual Handle reduce_scatter(const void*, void*, std::size_t, DataType, ReduceOp) = 0;
    virtual Handle all_reduce(const void*, void*, std::size_t, DataType, ReduceOp) = 0;
    virtual Handle broadcast(void*, std::size_t, DataType, int) = 0;
    virtual Handle send_recv(std::span<const PeerOp>) = 0;
    virtual Handle barrier() = 0;
    virtual std::shared_ptr<Concept> split(int, int) = 0;
    virtual std::shared_ptr<Concept> split_strided(int, int) = 0;
    virtual void abort(const std::string&) = 0;
  };

  template <class E>
  struct Model final : Concept {
    explicit Model(E e) : engine(std::move(e)) {}
    int rank() const override { return engine.rank(); }
    int size() const override { return engine.size(); }
    std::string_view engine_name() const override { return engine.engine_name(); }
    Handle all_gather(const void* in, void* out, std::size_t n, DataType t) override {
      return engine.all_gather(in, out, n, t);
    }
    Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) override {
      return engine.reduce_scatter(in, out, n, t, op);
    }
    Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) override {
      return engine.all_reduce(in, out, n, t, op);
    }
    Handle broadcast(void* data, std::size_t n, DataType t, int root) override {
      return engine.broadcast(data, n, t, root);
    }
    Handle send_recv(std::span<const PeerOp> ops) override { return engine.send_recv(ops); }
    Handle barrier() override { return engine.barrier(); }
    std::shared_ptr<Concept> split(int color, int key) override {
      return std::make_shared<Model<E>>(engine.split(color, key));
    }
    std::shared_ptr<Concept> split_strided(int stride, int size) override {
      if constexpr (requires { { engine.split_strided(stride, size) } -> std::same_as<E>; }) {
        return std::make_shared<Model<E>>(engine.split_strided(stride, size));
      } else {
        const int r = engine.rank();
        return split(r / (stride * size) * stride + r % stride, r / stride % size);
      }
    }
    void abort(const std::string& reason) override { engine.abort(reason); }
    E engine;
  };

  /// A collective issued by `issue`: a span of the recording thread's profile (its
  /// payload in bytes and the group's size), and its wait another (Handle::timed).
  template <class Issue>
  Handle issued(const char* what, std::uint64_t bytes, Issue&& issue) {
    if (!flight_) {
      const profile::Span span("comm", what, bytes, size());
      return issue().timed(what, bytes, size());
    }
    // Recorded before its own span opens: the record's context is what issued it.
    const std::uint64_t id = flight_->issued(*group_, ++group_->issued, what, bytes, rank(), size());
    const profile::Span span("comm", what, bytes, size());
    return issue().timed(what, bytes, size()).then([flight = flight_, id] { flight->waited(id); });
  }

  Communicator(std::shared_ptr<Concept> impl, std::shared_ptr<Traffic> traffic, std::shared_ptr<GroupInfo> group,
               std::shared_ptr<FlightRecorder> flight)
      : impl_(std::move(impl)), traffic_(std::move(traffic)), group_(std::move(group)), flight_(std::move(flight)) {}

  void count(std::uint64_t& field, std::uint64_t bytes) {
    field += bytes;
    ++traffic_->collectives;
  }

  std::shared_ptr<Concept> impl_;
  std::shared_ptr<Traffic> traffic_;
  std::shared_ptr<GroupInfo> group_;        // copies share it: one group, one numbering
  std::shared_ptr<FlightRecorder> flight_;  // record_flights()
};

inline Communicator::Communicator() : Communicator(SelfEngine{}) {}

}  // namespace tessera::comm
