// A rank's flight recorder: the last collectives it issued, on which group, in what
// order, and whether it waited for each, kept for the moment a run fails (a peer died,
// hangs, or called another collective) and written then, one file per rank
// (comm.trace_buf_size; llama-train writes <dump_folder>/comm_traces/rank<r>_trace.json).
// Set beside each other, the ranks' files say which rank stopped where: on each group the
// collectives are numbered in the order its members must issue them, so the first
// number some member lacks, or where members disagree on the operation or its size, is
// where the run went wrong (tools/comm_trace.py reads them).
//
// The Communicator's typed front records (comm/communicator.hpp): every collective as it
// is issued (its group's name and world ranks, its number on that group, the operation,
// its payload, and the profile spans open on the issuing thread: the layer, the pipeline
// action) and, when the rank's wait for it returns, the time of that. On NCCL a wait
// orders the compute stream rather than holding the host, so "waited" says the host went
// past it; the engine's watchdog names the collective that did not complete on the device
// (comm/nccl.hpp), by the same number on its communicator.
//
// A ring of the last `entries` records (torchtitan's comm.trace_buf_size: 20,000); a
// record costs two clock reads and a small copy, next to a collective's microseconds at
// least. dump() writes the records as JSON to the path set with dump_to(); dump_all()
// writes every live recorder's, for a failure seen where no rank's code can be reached
// (the NCCL watchdog's thread).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/profile.hpp"

namespace tessera::comm {

/// A communicator's group as its records name it: the mesh's name for it ("dp_shard",
/// "tp", ...; "world"), its members' ranks in the world (empty where a split by color left
/// them unknown), and how many collectives this rank has issued on it.
struct GroupInfo {
  std::string name;
  std::vector<int> world_ranks;
  std::uint64_t issued = 0;
};

struct FlightRecord {
  std::uint64_t id = 0;    // this recorder's count, from 0
  std::string group;
  std::vector<int> ranks;  // the group's world ranks
  int group_rank = 0, group_size = 0;
  std::uint64_t seq = 0;   // its number on the group, from 1
  const char* op = "";     // "all_gather", "reduce_scatter", "all_reduce", "broadcast", "send_recv", "barrier"
  std::uint64_t bytes = 0;
  std::int64_t issued_us = 0;
  std::int64_t waited_us = -1;     // -1: not waited for
  std::vector<std::string> where;  // the profile spans open at the issue, the outermost first
};

class FlightRecorder {
 public:
  static constexpr std::size_t kDefaultEntries = 20000;

  explicit FlightRecorder(std::size_t entries = kDefaultEntries, int world_rank = 0, int world_size = 1)
      : entries_(entries == 0 ? 1 : entries), world_rank_(world_rank), world_size_(world_size) {
    std::lock_guard lock(registry().mutex);
    registry().live.push_back(this);
  }
  ~FlightRecorder() {
    std::lock_guard lock(registry().mutex);
    std::erase(registry().live, this);
  }
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  /// Records a collective issued on `group` (its `seq`-th there); returns its id for waited().
  std::uint64_t issued(const GroupInfo& group, std::uint64_t seq, const char* op, std::uint64_t bytes,
                       int group_rank, int group_size) {
    FlightRecord r;
    r.group = group.name;
    r.ranks = group.world_ranks;
    r.group_rank = group_rank;
    r.group_size = group_size;
    r.seq = seq;
    r.op = op;
    r.bytes = bytes;
    r.issued_us = now_us();
    if (const profile::Recorder* p = profile::recorder())
      for (const profile::Event* e : p->open_spans()) r.where.push_back(e->name);
    std::lock_guard lock(mutex_);
    r.id = total_++;
    if (ring_.size() < entries_) ring_.push_back(std::move(r));
    else ring_[r.id % entries_] = std::move(r);
    return total_ - 1;
  }
  /// The rank's wait for collective `id` returned (nothing once the ring dropped it).
  void waited(std::uint64_t id) {
    std::lock_guard lock(mutex_);
    if (id + entries_ < total_ || ring_.empty()) return;
    FlightRecord& r = ring_[id % entries_];
    if (r.id == id) r.waited_us = now_us();
  }

  /// The records kept, oldest first.
  std::vector<FlightRecord> records() const {
    std::lock_guard lock(mutex_);
    std::vector<FlightRecord> out;
    out.reserve(ring_.size());
    const std::size_t start = total_ <= entries_ ? 0 : static_cast<std::size_t>(total_ % entries_);
    for (std::size_t i = 0; i < ring_.size(); ++i) out.push_back(ring_[(start + i) % ring_.size()]);
    return out;
  }
  /// Collectives recorded, ever (those kept and those the ring dropped).
  std::uint64_t total() const {
    std::lock_guard lock(mutex_);
    return total_;
  }

  /// The records as one JSON object: {"rank", "world_size", "reason", "recorded",
  /// "kept", "collectives": [{"id", "group", "ranks", "group_rank", "group_size", "seq",
  /// "op", "bytes", "issued_us", "waited_us" (null: not waited for), "where"}]}.
  std::string json(std::string_view reason) const {
    const std::vector<FlightRecord> kept = records();
    std::string out = "{\"rank\":" + std::to_string(world_rank_) + ",\"world_size\":" + std::to_string(world_size_) +
                      ",\"reason\":\"";
    profile::detail::append_escaped(out, reason);
    out += "\",\"recorded\":" + std::to_string(total()) + ",\"kept\":" + std::to_string(kept.size()) +
           ",\"collectives\":[";
    for (std::size_t i = 0; i < kept.size(); ++i) {
      const FlightRecord& r = kept[i];
      out += i == 0 ? "\n" : ",\n";
      out += "{\"id\":" + std::to_string(r.id) + ",\"group\":\"";
      profile::detail::append_escaped(out, r.group);
      out += "\",\"ranks\":[";
      for (std::size_t k = 0; k < r.ranks.size(); ++k) out += (k ? "," : "") + std::to_string(r.ranks[k]);
      out += "],\"group_rank\":" + std::to_string(r.group_rank) + ",\"group_size\":" + std::to_string(r.group_size) +
             ",\"seq\":" + std::to_string(r.seq) + ",\"op\":\"" + r.op + "\",\"bytes\":" + std::to_string(r.bytes) +
             ",\"issued_us\":" + std::to_string(r.issued_us) +
             ",\"waited_us\":" + (r.waited_us < 0 ? std::string("null") : std::to_string(r.waited_us)) +
             ",\"where\":[";
      for (std::size_t k = 0; k < r.where.size(); ++k) {
        out += k ? ",\"" : "\"";
        profile::detail::append_escaped(out, r.where[k]);
        out += "\"";
      }
      out += "]}";
    }
    out += "\n]}\n";
    return out;
  }

  /// Where dump() writes (its folder made then).
  void dump_to(std::string path) {
    std::lock_guard lock(mutex_);
    path_ = std::move(path);
  }
  /// Writes json(reason) to the dump_to() path; the path written, or "" when none is set
  /// or it cannot be written (a failing run is not made to fail otherwise).
  std::string dump(std::string_view reason) const {
    std::string path;
    {
      std::lock_guard lock(mutex_);
      path = path_;
    }
    if (path.empty()) return "";
    try {
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out << json(reason);
      out.close();
      return out.good() ? path : "";
    } catch (const std::exception&) {
      return "";
    }
  }
  /// dump(reason) of every live recorder in the process.
  static void dump_all(std::string_view reason) {
    std::lock_guard lock(registry().mutex);
    for (const FlightRecorder* r : registry().live) r->dump(reason);
  }

 private:
  static std::int64_t now_us() { return profile::now_ns() / 1000; }

  struct Registry {
    std::mutex mutex;
    std::vector<FlightRecorder*> live;
  };
  static Registry& registry() {
    static auto* r = new Registry;  // never destroyed: a recorder may outlive statics
    return *r;
  }

  mutable std::mutex mutex_;
  std::size_t entries_;
  int world_rank_, world_size_;
  std::vector<FlightRecord> ring_;
  std::uint64_t total_ = 0;
  std::string path_;
};

}  // namespace tessera::comm
