// The dry run's communicator: one rank of a layout, whose peers do not exist.
//
// PhantomEngine satisfies comm::Engine for a communicator of `size` ranks of which this is
// `rank`; none of the others runs. Every collective and grouped send/recv returns at once
// and touches no buffer (the Meta backend's have no storage), and is recorded in the trace
// open on this thread as a trace::Collective: its kind, its bytes, its group (size, this
// rank's place, the stride in world ranks between members) and, for a send/recv, each
// transfer's peer and bytes. Waiting on its Handle records a trace::CommWait: where the
// compute stream needs the result. Together they say what a rank's step sends, on which
// communicator, and what compute runs while it is in flight.
//
// It splits only into strided groups (Communicator::split_strided), the one split a rank
// can make without asking its peers for their colors. Every mesh dimension is one
// (comm/mesh.hpp), and so are a tensor-parallel group's holders; each child keeps its
// stride in world ranks, from which the cluster model knows the links it crosses.
//
// That the peers need not run is what makes a layout's dry run cheap: data- and
// tensor-parallel peers run the same program on their own shards, so one rank at each
// pipeline position stands for all of them (plan/dry_run.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/backend/trace.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/comm/engine.hpp"
#include "tessera/core/error.hpp"

namespace tessera::plan {

class PhantomEngine {
 public:
  /// Rank `rank` of a world of `size` ranks.
  PhantomEngine(int rank, int size) : PhantomEngine(rank, size, 1, std::make_shared<std::uint64_t>(0)) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string_view engine_name() const { return "phantom"; }

  comm::Handle all_gather(const void*, void*, std::size_t n, comm::DataType t) {
    return issue("all_gather", n * size_of(t) * static_cast<std::size_t>(size_));
  }
  comm::Handle reduce_scatter(const void*, void*, std::size_t n, comm::DataType t, comm::ReduceOp) {
    return issue("reduce_scatter", n * size_of(t) * static_cast<std::size_t>(size_));
  }
  comm::Handle all_reduce(const void*, void*, std::size_t n, comm::DataType t, comm::ReduceOp) {
    return issue("all_reduce", n * size_of(t));
  }
  comm::Handle broadcast(void*, std::size_t n, comm::DataType t, int root) {
    return issue("broadcast", n * size_of(t), root);
  }
  comm::Handle send_recv(std::span<const comm::PeerOp> ops) {
    std::vector<trace::PeerBytes> peers;
    for (const auto& o : ops)
      peers.push_back({o.peer, static_cast<std::int64_t>(o.count * size_of(o.type)), o.kind == comm::PeerOp::Kind::send});
    return issue("send_recv", 0, -1, std::move(peers));
  }
  comm::Handle barrier() { return issue("barrier", 0); }

  comm::Handle issue(const char* kind, std::size_t bytes, int root = -1, std::vector<trace::PeerBytes> peers = {}) {
    trace::Collective c;
    c.kind = kind;
    c.bytes = static_cast<std::int64_t>(bytes);
    c.root = root;
    c.group = {size_, rank_, stride_};
    c.peers = std::move(peers);
    c.id = ++*ids_;
    trace::record(std::move(c));
    return comm::Handle(std::make_unique<Wait>(*ids_));
  }

  PhantomEngine split(int, int) {
    fail("a dry run splits communicators only into strided groups (Communicator::split_strided): it has no peers to "
         "ask for their colors");
  }
  PhantomEngine split_strided(int stride, int size) const {
    return PhantomEngine(rank_ / stride % size, size, stride_ * stride, ids_);
  }
  void abort(const std::string&) {}

 private:
  PhantomEngine(int rank, int size, int stride, std::shared_ptr<std::uint64_t> ids)
      : rank_(rank), size_(size), stride_(stride), ids_(std::move(ids)) {
    TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "PhantomEngine: rank ", rank, " of ", size);
  }

  struct Wait final : comm::Handle::Impl {
    explicit Wait(std::uint64_t id) : id(id) {}
    void wait() override { trace::record(trace::CommWait{id}); }
    std::uint64_t id;
  };

  int rank_ = 0, size_ = 1, stride_ = 1;
  std::shared_ptr<std::uint64_t> ids_;  // shared by a world and its splits: one numbering
};

static_assert(comm::Engine<PhantomEngine>);

}  // namespace tessera::plan
