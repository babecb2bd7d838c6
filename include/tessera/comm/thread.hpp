// ThreadEngine: ranks that are threads of one process, exchanging through shared memory.
//
// Unit tests run N ranks in one process with it, and several virtual ranks share one
// device with it (NCCL refuses two ranks on one GPU). Each rank's engine has a worker
// thread that runs its collectives in issue order, so an *_async call returns at once
// and the caller computes while the worker communicates: the overlap FSDP prefetch
// relies on, the same shape as a NCCL stream.
//
// A collective is a rendezvous: each rank posts its buffers and what it called in its
// slot, all meet, all check that every rank called the same collective (kind, count,
// element type, reduction, root: a mismatch fails the job naming both calls, before any
// rank reads another's buffers), each computes its own part of the result by reading
// the others' buffers, all meet again before any buffer may change. Reductions add ranks' contributions in rank
// order, so every rank gets bitwise the same sums.
//
// Sends and receives go through a mailbox per ordered pair of ranks. A send is eager:
// when the rank's worker reaches it, the bytes are copied into a parcel the mailbox owns
// and the send is complete, whether or not its receiver has posted the recv, so two
// ranks that each send to the other before receiving never deadlock. A recv waits for
// the oldest parcel from its peer with its tag (FIFO among equal tags). A parcel still
// in a mailbox when the job ends is a send nobody received: run_thread_ranks fails.
// Under NCCL's rules (ThreadOptions::nccl_rules, comm/nccl_rules.hpp) a send instead
// completes only when its receiver has taken it, and a group's task (so the rank's
// next operation on the communicator) waits for that, as on NCCL's stream.
//
// Failure: any rank may abort the world (run_thread_ranks does when a rank throws).
// A recv whose size differs from its send's fails the job, naming both ranks and sizes.
// Every wait checks the abort flag at least every 50 ms and gives up after the
// timeout, so a failed or missing rank makes all the others fail with its reason
// within a bounded time instead of hanging.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/comm/communicator.hpp"
#include "tessera/comm/engine.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/comm/nccl_rules.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"

namespace tessera::comm {

struct ThreadOptions {
  /// How long a rank waits for the others at one collective before failing the job.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// The memory the ranks' buffers live in (comm/memory_access.hpp): the host's, or a
  /// backend's (several virtual ranks on one GPU).
  MemoryAccess memory{};
  /// Hold every rank to NCCL's rules (comm/nccl_rules.hpp): run_thread_ranks wraps each
  /// engine in NcclRulesEngine, and a send completes only when its receiver's recv runs.
  /// `memory` must tell device memory from host memory (Cpu::memory_access()).
  bool nccl_rules = false;
};

namespace detail {

using Clock = std::chrono::steady_clock;
inline constexpr auto kPollInterval = std::chrono::milliseconds(50);

/// Shared by every communicator split from one thread world: the first failure wins.
struct ThreadWorld {
  explicit ThreadWorld(ThreadOptions o) : options(o) {}
  ThreadOptions options;
  std::atomic<bool> aborted{false};
  std::mutex mutex;
  std::string reason;
  std::string undelivered;  // the first send no recv took, noted when its group ended

  /// Records the first reason; later ones are consequences of it.
  void abort(const std::string& why) {
    std::lock_guard lock(mutex);
    if (!aborted.load()) {
      reason = why;
      aborted.store(true);
    }
  }
  /// Records the first send that no recv took (ThreadGroup's destructor does).
  void note_undelivered(const std::string& what) {
    std::lock_guard lock(mutex);
    if (undelivered.empty()) undelivered = what;
  }
  [[noreturn]] void throw_aborted(int world_rank, std::string_view what) {
    std::string why;
    {
      std::lock_guard lock(mutex);
      why = reason;
    }
    fail("rank ", world_rank, ": ", what, " abandoned: ", why);
  }
};

/// A send's bytes, copied out of the sender's buffer and owned by the mailbox until a
/// recv with the same tag takes them.
struct Parcel {
  int tag = 0;
  std::size_t bytes = 0;
  std::unique_ptr<char[]> data;
  std::shared_ptr<bool> taken;  // set (under the group's lock) when a recv takes it
};

/// The state the ranks of one communicator share.
class ThreadGroup {
 public:
  ThreadGroup(int size, std::shared_ptr<ThreadWorld> world, std::vector<int> world_ranks)
      : size_(size),
        world_(std::move(world)),
        world_ranks_(std::move(world_ranks)),
        slots_(static_cast<std::size_t>(size)),
        mail_(static_cast<std::size_t>(size * size)) {}
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  /// Notes the first parcel no recv took; run_thread_ranks fails the job with it.
  ~ThreadGroup() {
    for (int from = 0; from < size_; ++from)
      for (int to = 0; to < size_; ++to) {
        const auto& box = mail_[index(from, to)];
        if (box.empty()) continue;
        try {
          world_->note_undelivered(tessera::detail::concat(
              "rank ", world_rank(from), " sent ", box.size(), box.size() == 1 ? " message" : " messages",
              " to rank ", world_rank(to), " that no recv took (the first with tag ", box.front().tag, ", ",
              box.front().bytes, " bytes)"));
        } catch (...) {
          // Out of memory while ending: the job loses this note only.
        }
        return;
      }
  }

  struct Slot {
    CollectiveCall call;
    const void* in = nullptr;
    void* out = nullptr;
    int color = 0, key = 0;
    std::shared_ptr<ThreadGroup> child;
    std::vector<int> child_world_ranks;
  };

  int size() const { return size_; }
  ThreadWorld& world() { return *world_; }
  const std::shared_ptr<ThreadWorld>& world_ptr() const { return world_; }
  int world_rank(int rank) const { return world_ranks_[static_cast<std::size_t>(rank)]; }
  Slot& slot(int rank) { return slots_[static_cast<std::size_t>(rank)]; }

  /// The first meeting of a collective: waits until every rank has posted its
  /// buffers. A rank that gives up here (the world aborted, or the timeout) takes its
  /// arrival back, so the others can never pass this meeting and read its buffers.
  void enter(int rank, std::string_view what) {
    std::unique_lock lock(mutex_);
    const std::uint64_t gen = generation_;
    if (arrive()) return;
    try {
      wait(lock, rank, what, [&] { return generation_ != gen; }, true);
    } catch (...) {
      if (generation_ == gen) --arrived_;  // still under the lock
      throw;
    }
  }

  /// A later meeting of the same collective. Every rank passed enter(), and between
  /// meetings ranks only copy and add, so all of them arrive: this waits for them even
  /// when the world is aborting, because a rank that left early could free a buffer
  /// another is still reading. Only the timeout (a bug, not a failure) ends it.
  void meet(int rank, std::string_view what) {
    std::unique_lock lock(mutex_);
    const std::uint64_t gen = generation_;
    if (arrive()) return;
    wait(lock, rank, what, [&] { return generation_ != gen; }, false);
  }

  /// Copies `bytes` bytes from `data` into a parcel for `to`: an eager send is then
  /// complete. Returns the flag a recv sets when it takes the parcel.
  std::shared_ptr<bool> post(int from, int to, int tag, const void* data, std::size_t bytes) {
    Parcel parcel{tag, bytes, std::make_unique_for_overwrite<char[]>(bytes), std::make_shared<bool>(false)};
    if (bytes > 0) world_->options.memory.copy(parcel.data.get(), data, bytes);
    std::shared_ptr<bool> taken = parcel.taken;
    std::lock_guard lock(mutex_);
    mail_[index(from, to)].push_back(std::move(parcel));
    cv_.notify_all();
    return taken;
  }

  /// Waits until a recv has taken every parcel in `taken` (NCCL's rule: a send completes
  /// when its receiver's recv runs). `peers[i]` is the receiver of taken[i], for messages.
  void wait_taken(int from, const std::vector<std::shared_ptr<bool>>& taken, const std::vector<int>& peers) {
    std::unique_lock lock(mutex_);
    std::size_t i = 0;
    const auto ready = [&] {
      while (i < taken.size() && *taken[i]) ++i;
      return i == taken.size();
    };
    if (ready()) return;
    wait(lock, from,
         tessera::detail::concat("send to rank ", world_rank(peers[i]),
                                 " (under NCCL's rules a send completes only when its receiver's recv runs)"),
         ready, true);
  }

  /// The first meeting of a collective, then the check that every rank issued the same
  /// one: each compares every slot's call (so all see a mismatch, or none does), all meet
  /// again (no slot changes while another rank reads it), and on a mismatch all throw,
  /// naming both calls, before any rank touches another's buffers.
  void enter_checked(int rank, const CollectiveCall& call) {
    slot(rank).call = call;
    enter(rank, call.kind);
    int differs = -1;
    for (int r = 0; r < size_ && differs < 0; ++r)
      if (!(slots_[static_cast<std::size_t>(r)].call == call)) differs = r;
    std::string why;
    if (differs >= 0)
      why = tessera::detail::concat("rank ", world_rank(rank), " issued ", call.str(), " while rank ",
                                    world_rank(differs), " issued ", slots_[static_cast<std::size_t>(differs)].call.str(),
                                    " as the same collective of their communicator: every rank must issue the same "
                                    "collectives in the same order");
    meet(rank, call.kind);
    if (differs >= 0) {
      world_->abort(why);
      fail(why);
    }
  }

  /// Waits for the oldest parcel from `from` to `to` with `tag` and copies it into `dst`
  /// (`bytes` long). A parcel of another size fails the job, naming both ranks.
  void take(int from, int to, int tag, void* dst, std::size_t bytes) {
    Parcel parcel;
    {
      std::unique_lock lock(mutex_);
      auto& box = mail_[index(from, to)];
      auto match = box.end();
      const auto ready = [&] {
        match = std::find_if(box.begin(), box.end(), [&](const Parcel& p) { return p.tag == tag; });
        return match != box.end();
      };
      if (!ready())
        wait(lock, to, tessera::detail::concat("recv from rank ", world_rank(from), " (tag ", tag, ")"), ready, true);
      parcel = std::move(*match);
      box.erase(match);
      *parcel.taken = true;
      cv_.notify_all();
    }
    // The parcel is this rank's alone now: copy it without the lock.
    if (parcel.bytes != bytes) {
      const std::string why =
          tessera::detail::concat("rank ", world_rank(to), ": recv of ", bytes, " bytes from rank ", world_rank(from),
                                  " met a send of ", parcel.bytes, " bytes (tag ", tag, ")");
      world_->abort(why);
      fail(why);
    }
    if (bytes > 0) world_->options.memory.copy(dst, parcel.data.get(), bytes);
  }

 private:
  std::size_t index(int from, int to) const { return static_cast<std::size_t>(from * size_ + to); }

  /// Counts this rank in; true (and the next generation begun) if it was the last.
  bool arrive() {
    if (++arrived_ < size_) return false;
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return true;
  }

  /// Waits (polling the abort flag) until ready(); throws with the group's lock still
  /// held, so the caller can undo its arrival before anyone else sees the group again.
  /// The world's mutex is only ever taken inside a group's.
  template <class Ready>
  void wait(std::unique_lock<std::mutex>& lock, int rank, std::string_view what, Ready ready, bool abortable) {
    const auto deadline = Clock::now() + world_->options.timeout;
    while (!ready()) {
      if (abortable && world_->aborted.load()) world_->throw_aborted(world_rank(rank), what);
      if (Clock::now() >= deadline) {
        const auto secs = std::chrono::duration<double>(world_->options.timeout).count();
        const std::string why = tessera::detail::concat("rank ", world_rank(rank), ": ", what, " timed out after ",
                                                        secs, " s waiting for the other ranks of a group of ", size_);
        world_->abort(why);
        fail(why);
      }
      cv_.wait_for(lock, kPollInterval);
    }
  }

  int size_;
  std::shared_ptr<ThreadWorld> world_;
  std::vector<int> world_ranks_;
  std::vector<Slot> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  std::vector<std::deque<Parcel>> mail_;  // [from * size + to], oldest first
};

/// Completion of one queued operation.
struct Completion {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    std::lock_guard lock(mutex);
    error = std::move(e);
    done = true;
    cv.notify_all();
  }
};

struct CompletionHandle final : Handle::Impl {
  explicit CompletionHandle(std::shared_ptr<Completion> c) : completion(std::move(c)) {}
  void wait() override {
    std::unique_lock lock(completion->mutex);
    completion->cv.wait(lock, [&] { return completion->done; });
    if (completion->error) std::rethrow_exception(completion->error);
  }
  std::shared_ptr<Completion> completion;
};

/// One rank's worker: runs that rank's operations on one communicator in issue order.
class RankWorker {
 public:
  RankWorker() : thread_([this] { run(); }) {}
  RankWorker(const RankWorker&) = delete;
  RankWorker& operator=(const RankWorker&) = delete;
  ~RankWorker() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  Handle submit(std::function<void()> task) {
    auto completion = std::make_shared<Completion>();
    {
      std::lock_guard lock(mutex_);
      queue_.emplace_back(std::move(task), completion);
    }
    cv_.notify_all();
    return Handle(std::make_unique<CompletionHandle>(std::move(completion)));
  }

 private:
  void run() {
    for (;;) {
      std::pair<std::function<void()>, std::shared_ptr<Completion>> item;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error;
      try {
        item.first();
      } catch (...) {
        error = std::current_exception();
      }
      item.second->finish(error);
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Completion>>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

/// Memory counters for `ranks` thread ranks (kDeviceKinds each). They are never
/// freed: a tensor a rank hands out may be released after its thread has ended.
inline MemoryStats* rank_memory_stats(int ranks) {
  static std::mutex mutex;
  static std::deque<std::unique_ptr<MemoryStats[]>> all;
  std::lock_guard lock(mutex);
  all.push_back(std::make_unique<MemoryStats[]>(static_cast<std::size_t>(kDeviceKinds * ranks)));
  return all.back().get();
}

}  // namespace detail

class ThreadEngine {
 public:
  ThreadEngine(std::shared_ptr<detail::ThreadGroup> group, int rank)
      : group_(std::move(group)), rank_(rank), worker_(std::make_shared<detail::RankWorker>()) {}

  int rank() const { return rank_; }
  int size() const { return group_->size(); }
  std::string_view engine_name() const { return "threads"; }

  Handle all_gather(const void* in, void* out, std::size_t n, DataType t) {
    return submit([=, this] {
      auto& g = *group_;
      const std::size_t bytes = n * size_of(t);
      g.slot(rank_).in = in;
      g.enter_checked(rank_, {"all_gather", n, t});
      for (int r = 0; r < size(); ++r)
        if (bytes > 0) memory().copy(static_cast<char*>(out) + r * bytes, g.slot(r).in, bytes);
      g.meet(rank_, "all_gather");
    });
  }

  Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    check_reducible(t);  // here, not between meetings: a rank must not leave a collective midway
    return submit([=, this] {
      auto& g = *group_;
      const std::size_t bytes = n * size_of(t);
      g.slot(rank_).in = in;
      g.enter_checked(rank_, {"reduce_scatter", n, t, static_cast<int>(op)});
      const std::size_t offset = static_cast<std::size_t>(rank_) * bytes;
      if (bytes > 0) memory().copy(out, static_cast<const char*>(g.slot(0).in) + offset, bytes);
      for (int r = 1; r < size(); ++r) memory().reduce(out, static_cast<const char*>(g.slot(r).in) + offset, n, t, op);
      g.meet(rank_, "reduce_scatter");
    });
  }

  Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp op) {
    check_reducible(t);
    return submit([=, this] {
      auto& g = *group_;
      const std::size_t es = size_of(t), p = static_cast<std::size_t>(size());
      auto chunk = [&](int r) {
        const std::size_t per = (n + p - 1) / p;
        const std::size_t b = std::min(n, per * static_cast<std::size_t>(r));
        return std::pair{b, std::min(n, b + per) - b};
      };
      g.slot(rank_).in = in;
      g.slot(rank_).out = out;
      g.enter_checked(rank_, {"all_reduce", n, t, static_cast<int>(op)});
      // Reduce this rank's chunk of every input, in rank order.
      const auto [begin, len] = chunk(rank_);
      Scratch mine(memory(), len * es);
      if (len > 0) {
        memory().copy(mine.data(), static_cast<const char*>(g.slot(0).in) + begin * es, len * es);
        for (int r = 1; r < size(); ++r)
          memory().reduce(mine.data(), static_cast<const char*>(g.slot(r).in) + begin * es, len, t, op);
      }
      g.meet(rank_, "all_reduce");  // every input read: outputs may change (in place too)
      if (len > 0) memory().copy(static_cast<char*>(out) + begin * es, mine.data(), len * es);
      g.meet(rank_, "all_reduce");
      for (int r = 0; r < size(); ++r) {
        if (r == rank_) continue;
        const auto [b, l] = chunk(r);
        if (l > 0) memory().copy(static_cast<char*>(out) + b * es, static_cast<const char*>(g.slot(r).out) + b * es, l * es);
      }
      g.meet(rank_, "all_reduce");
    });
  }

  Handle broadcast(void* data, std::size_t n, DataType t, int root) {
    return submit([=, this] {
      auto& g = *group_;
      g.slot(rank_).out = data;
      g.enter_checked(rank_, {"broadcast", n, t, -1, root});
      if (rank_ != root && n > 0) memory().copy(data, g.slot(root).out, n * size_of(t));
      g.meet(rank_, "broadcast");
    });
  }

  /// Sends first (each complete once copied, or under NCCL's rules once received), then
  /// recvs, in the order given.
  Handle send_recv(std::span<const PeerOp> ops_in) {
    const int me = group_->world_rank(rank_);
    for (const auto& o : ops_in) {
      TESSERA_CHECK(o.peer >= 0 && o.peer < size() && o.peer != rank_, "rank ", me, ": send_recv: rank ", rank_,
                    " cannot exchange with peer ", o.peer, " of ", size());
      detail::check_tag(o, me);
    }
    std::vector<PeerOp> ops(ops_in.begin(), ops_in.end());
    return submit([ops = std::move(ops), this] {
      auto& g = *group_;
      std::vector<std::shared_ptr<bool>> taken;
      std::vector<int> peers;
      for (const auto& o : ops)
        if (o.kind == PeerOp::Kind::send) {
          taken.push_back(g.post(rank_, o.peer, o.tag, o.data, o.count * size_of(o.type)));
          peers.push_back(o.peer);
        }
      for (const auto& o : ops)
        if (o.kind == PeerOp::Kind::recv) g.take(o.peer, rank_, o.tag, o.data, o.count * size_of(o.type));
      if (g.world().options.nccl_rules) g.wait_taken(rank_, taken, peers);
    });
  }

  Handle barrier() {
    return submit([this] { group_->enter_checked(rank_, {"barrier"}); });
  }

  ThreadEngine split(int color, int key) {
    std::shared_ptr<detail::ThreadGroup> child;
    int child_rank = 0;
    submit([&, this] {
      auto& g = *group_;
      g.slot(rank_).color = color;
      g.slot(rank_).key = key;
      g.slot(rank_).child.reset();
      g.enter_checked(rank_, {"split"});
      std::vector<std::pair<int, int>> members;  // (key, rank) of my color
      for (int r = 0; r < size(); ++r)
        if (g.slot(r).color == color) members.emplace_back(g.slot(r).key, r);
      std::sort(members.begin(), members.end());
      const int leader = members.front().second;
      if (leader == rank_) {
        std::vector<int> world_ranks;
        for (const auto& m : members) world_ranks.push_back(g.world_rank(m.second));
        g.slot(rank_).child = std::make_shared<detail::ThreadGroup>(static_cast<int>(members.size()), g.world_ptr(),
                                                                    std::move(world_ranks));
      }
      g.meet(rank_, "split");
      child = g.slot(leader).child;
      for (std::size_t i = 0; i < members.size(); ++i)
        if (members[i].second == rank_) child_rank = static_cast<int>(i);
      g.meet(rank_, "split");
    }).wait();
    return ThreadEngine(std::move(child), child_rank);
  }

  void abort(const std::string& reason) { group_->world().abort(reason); }

 private:
  const MemoryAccess& memory() const { return group_->world().options.memory; }

  Handle submit(std::function<void()> task) {
    if (group_->world().aborted.load()) group_->world().throw_aborted(group_->world_rank(rank_), "collective");
    return worker_->submit(std::move(task));
  }

  std::shared_ptr<detail::ThreadGroup> group_;
  int rank_;
  std::shared_ptr<detail::RankWorker> worker_;
};

static_assert(Engine<ThreadEngine>);
static_assert(Engine<NcclRulesEngine<ThreadEngine>>);

/// Runs fn(Communicator&) on `ranks` threads, one communicator each, and waits for
/// all. If a rank throws, the world is aborted (the others fail at their next
/// collective) and the first rank's error is rethrown here, naming the rank. A send
/// that no recv took fails it too, naming both ranks and the tag. Each
/// rank thread counts its allocations in its own MemoryStats (core/memory.hpp).
template <class F>
void run_thread_ranks(int ranks, F&& fn, ThreadOptions options = {}) {
  TESSERA_CHECK(ranks >= 1, "run_thread_ranks: ", ranks, " ranks");
  auto world = std::make_shared<detail::ThreadWorld>(options);
  std::vector<int> ids(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) ids[static_cast<std::size_t>(r)] = r;
  auto group = std::make_shared<detail::ThreadGroup>(ranks, world, ids);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  MemoryStats* stats = detail::rank_memory_stats(ranks);
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      ScopedMemoryStats scope(stats + kDeviceKinds * r);
      try {
        Communicator comm = options.nccl_rules ? Communicator(NcclRulesEngine(ThreadEngine(group, r), options.memory))
                                               : Communicator(ThreadEngine(group, r));
        fn(comm);
      } catch (const std::exception& e) {
        world->abort(tessera::detail::concat("rank ", r, ": ", e.what()));
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      } catch (...) {
        world->abort(tessera::detail::concat("rank ", r, ": unknown error"));
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  if (world->aborted.load()) fail(world->reason);
  group.reset();  // the ranks' engines are gone: this ends the world group, noting unreceived sends
  std::string undelivered;
  {
    std::lock_guard lock(world->mutex);
    undelivered = world->undelivered;
  }
  TESSERA_CHECK(undelivered.empty(), undelivered);
}

}  // namespace tessera::comm
