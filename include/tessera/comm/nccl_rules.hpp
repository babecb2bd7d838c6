// NcclRulesEngine: an in-process or MPI engine held to what NCCL requires
// (`comm.check_nccl_semantics = true`).
//
// No machine here has two GPUs, and NCCL refuses two ranks on one, so the code that
// will run over NCCL runs first on the CPU engines under NCCL's rules. Each rule either
// refuses the violating call, naming the operation, the rank and the buffer, or makes
// the violation show deterministically in the result:
//
//   memory      every buffer is memory of this rank's own device (MemoryAccess::where):
//               a host variable is refused (NCCL moves device memory only), and so is a
//               tensor of another rank's device (one rank per device: a rank reaches
//               only its own).
//   tags        a transfer with a tag other than 0 is refused: NCCL matches sends and
//               recvs between two ranks by issue order only.
//   completion  until its Handle is waited on, an operation's output holds a poison
//               pattern (every bit set: NaN in floating point, -1 in integers) and its
//               result waits in scratch memory; wait() copies it in. A kernel or a copy
//               to the host that reads a result before its wait() -- on a GPU, before
//               the stream was ordered after the collective -- reads NaN, and the run's
//               losses show it. An input changed before wait() (NCCL reads inputs while
//               the collective runs on its stream) is refused at wait().
//   host        a barrier's wait() does not hold the host, as NCCL's orders only the
//               stream: the host waits at its next synchronisation (B::synchronize() or
//               a copy to the host; core/host_sync.hpp). Host code that must not run
//               before the other ranks arrive synchronises after the barrier.
//
// The inner engine enforces what needs its insides: ThreadEngine in its NCCL mode
// (ThreadOptions::nccl_rules) completes a send only when its receiver's recv runs
// (rendezvous, no buffering) and runs one group at a time per rank and communicator;
// every ThreadEngine collective checks that all ranks issued the same one (kind, count,
// element type, reduction, root). Over MPI (mpi_world_nccl_rules) sends are synchronous
// (MPI_Issend), this engine finishes a rank's previous group of transfers before it
// issues anything else on the communicator, as NCCL's one stream would, and it checks
// the issue order itself (NcclRulesOptions::check_same_calls): before each collective
// the ranks exchange what they are about to issue (one small all_gather on the inner
// engine), so ranks that issue different collectives fail naming both calls instead of
// exchanging mismatched buffers.
//
// The checks copy every buffer once more (a snapshot of each input, the result through
// scratch): cheap on the small models the parity tests train.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/comm/engine.hpp"
#include "tessera/comm/memory_access.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/host_sync.hpp"

namespace tessera::comm {

namespace detail {

/// Bytes in the engine's memory, released with the last owner.
class RulesScratch {
 public:
  RulesScratch(const MemoryAccess& m, std::size_t bytes) : m_(m), bytes_(bytes), p_(m.allocate(bytes > 0 ? bytes : 1)) {}
  ~RulesScratch() { m_.release(p_); }
  RulesScratch(const RulesScratch&) = delete;
  RulesScratch& operator=(const RulesScratch&) = delete;
  char* data() const { return static_cast<char*>(p_); }
  std::size_t bytes() const { return bytes_; }

 private:
  MemoryAccess m_;
  std::size_t bytes_;
  void* p_;
};

inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

/// One operation in flight under the rules: the inputs' snapshots, the outputs' scratch,
/// and the inner engine's handle. complete() finishes the inner operation once (the
/// engine may do it before the next group); finish() checks the inputs and copies the
/// results in, once.
struct RulesOp {
  struct Input {
    const void* user;
    std::unique_ptr<RulesScratch> snapshot;
    bool check = true;  // false where the input lies inside an output (in place)
  };
  struct Output {
    void* user;
    std::unique_ptr<RulesScratch> result;
  };

  MemoryAccess memory;
  std::string what;  // "all_gather #12 (rank 1 of 4 on its communicator)"
  std::vector<Input> inputs;
  std::vector<Output> outputs;
  Handle inner;
  bool finished = false;

  void complete() { inner.wait(); }

  void finish() {
    if (finished) return;
    finished = true;
    complete();
    for (const Input& in : inputs) {
      if (!in.check) continue;
      const std::size_t n = in.snapshot->bytes();
      std::vector<char> now(n), then(n);
      memory.copy(now.data(), in.user, n);
      memory.copy(then.data(), in.snapshot->data(), n);
      TESSERA_CHECK(now == then, what, ": its input (", in.user, ", ", n,
                    " bytes) changed before wait(): NCCL reads an input while the operation runs on its stream, "
                    "so it must stay untouched until the operation is waited on");
    }
    for (const Output& out : outputs) memory.copy(out.user, out.result->data(), out.result->bytes());
  }
};

struct RulesHandle final : Handle::Impl {
  explicit RulesHandle(std::shared_ptr<RulesOp> o) : op(std::move(o)) {}
  void wait() override { op->finish(); }
  std::shared_ptr<RulesOp> op;
};

/// A barrier's handle: wait() leaves the host's wait (and `then`, a check to run
/// after it) for the host's next synchronisation.
struct DeferredHostHandle final : Handle::Impl {
  DeferredHostHandle(Handle h, std::function<void()> then_)
      : inner(std::make_shared<Handle>(std::move(h))), then(std::move(then_)) {}
  void wait() override {
    tessera::detail::deferred_host_waits.emplace_back([h = std::move(inner), check = std::move(then)] {
      h->wait();
      if (check) check();
    });
  }
  std::shared_ptr<Handle> inner;
  std::function<void()> then;
};

}  // namespace detail

struct NcclRulesOptions {
  /// Finish a rank's previous group of transfers before it issues its next operation on
  /// the communicator (NCCL's one stream per communicator). ThreadEngine in its NCCL mode
  /// does this itself; MpiEngine needs it here.
  bool serialize_groups = false;
  /// Before each collective (and each barrier and split), check that every rank of the
  /// communicator is issuing the same one: kind, count, element type, reduction, root.
  /// ThreadEngine checks this itself; MpiEngine needs it here.
  bool check_same_calls = false;
};

template <Engine E>
class NcclRulesEngine {
 public:
  NcclRulesEngine(E inner, MemoryAccess memory, NcclRulesOptions options = {})
      : inner_(std::move(inner)),
        memory_(memory),
        options_(options),
        state_(std::make_shared<State>()) {
    TESSERA_CHECK(memory_.where != nullptr, "comm.check_nccl_semantics: the ", inner_.engine_name(),
                  " engine's memory cannot tell a backend's device memory from host memory (give it the "
                  "backend's memory_access())");
    state_->name = std::string(inner_.engine_name()) + " under NCCL's rules";
  }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  std::string_view engine_name() const { return state_->name; }

  Handle all_gather(const void* in, void* out, std::size_t n, DataType t) {
    const std::size_t bytes = n * size_of(t);
    auto op = begin(CollectiveCall{"all_gather", n, t});
    add_input(*op, in, bytes, out, bytes * static_cast<std::size_t>(size()));
    void* result = add_output(*op, out, bytes * static_cast<std::size_t>(size()));
    op->inner = inner_.all_gather(op->inputs[0].snapshot->data(), result, n, t);
    return issue(std::move(op));
  }

  Handle reduce_scatter(const void* in, void* out, std::size_t n, DataType t, ReduceOp rop) {
    const std::size_t bytes = n * size_of(t);
    auto op = begin(CollectiveCall{"reduce_scatter", n, t, static_cast<int>(rop)});
    add_input(*op, in, bytes * static_cast<std::size_t>(size()), out, bytes);
    void* result = add_output(*op, out, bytes);
    op->inner = inner_.reduce_scatter(op->inputs[0].snapshot->data(), result, n, t, rop);
    return issue(std::move(op));
  }

  Handle all_reduce(const void* in, void* out, std::size_t n, DataType t, ReduceOp rop) {
    const std::size_t bytes = n * size_of(t);
    auto op = begin(CollectiveCall{"all_reduce", n, t, static_cast<int>(rop)});
    add_input(*op, in, bytes, out, bytes);
    void* result = add_output(*op, out, bytes);
    op->inner = inner_.all_reduce(op->inputs[0].snapshot->data(), result, n, t, rop);
    return issue(std::move(op));
  }

  Handle broadcast(void* data, std::size_t n, DataType t, int root) {
    const std::size_t bytes = n * size_of(t);
    auto op = begin(CollectiveCall{"broadcast", n, t, -1, root});
    void* buffer = nullptr;
    if (rank() == root) {
      add_input(*op, data, bytes, nullptr, 0);
      buffer = op->inputs[0].snapshot->data();
    } else {
      buffer = add_output(*op, data, bytes);
    }
    op->inner = inner_.broadcast(buffer, n, t, root);
    return issue(std::move(op));
  }

  Handle send_recv(std::span<const PeerOp> ops) {
    auto op = begin("send_recv");
    std::vector<PeerOp> inner_ops(ops.begin(), ops.end());
    for (PeerOp& o : inner_ops) {
      const bool send = o.kind == PeerOp::Kind::send;
      TESSERA_CHECK(o.tag == 0, op->what, ": the ", send ? "send to" : "recv from", " peer ", o.peer, " has tag ",
                    o.tag, ": NCCL has no tags (the k-th send from a rank to a peer matches the peer's k-th recv "
                           "from it), so every transfer must have tag 0");
      const std::size_t bytes = o.count * size_of(o.type);
      if (send) {
        add_input(*op, o.data, bytes, nullptr, 0);
        o.data = op->inputs.back().snapshot->data();
      } else {
        o.data = add_output(*op, o.data, bytes);
      }
    }
    op->inner = inner_.send_recv(inner_ops);
    Handle h = issue(op);
    if (options_.serialize_groups) state_->last_group = std::move(op);
    return h;
  }

  Handle barrier() {
    settle();
    // Under check_same_calls the comparison is the barrier (its all_gather completes once
    // every rank has issued it), waited on and checked at the host's next
    // synchronisation: it must not hold the host either.
    if (auto check = agreement(describe("barrier", ++state_->issued), CollectiveCall{"barrier"}))
      return Handle(std::make_unique<detail::DeferredHostHandle>(Handle(), std::move(check)));
    return Handle(std::make_unique<detail::DeferredHostHandle>(inner_.barrier(), nullptr));
  }

  NcclRulesEngine split(int color, int key) {
    settle();
    if (auto check = agreement(describe("split", state_->issued), CollectiveCall{"split"})) check();
    return NcclRulesEngine(inner_.split(color, key), memory_, options_);
  }

  void abort(const std::string& reason) { inner_.abort(reason); }

 private:
  struct State {
    std::string name;
    std::uint64_t issued = 0;
    std::shared_ptr<detail::RulesOp> last_group;  // serialize_groups: the group to finish first
  };

  /// Finishes the previous group of transfers on this communicator (serialize_groups).
  void settle() {
    if (auto last = std::exchange(state_->last_group, nullptr)) last->complete();
  }

  std::string describe(const char* name, std::uint64_t k) const {
    return tessera::detail::concat(name, " #", k, " (rank ", rank(), " of ", size(), " on its communicator)");
  }

  std::shared_ptr<detail::RulesOp> begin(const char* name) {
    settle();
    auto op = std::make_shared<detail::RulesOp>();
    op->memory = memory_;
    op->what = describe(name, ++state_->issued);
    return op;
  }

  /// A collective's operation, compared across the ranks first under check_same_calls.
  std::shared_ptr<detail::RulesOp> begin(const CollectiveCall& call) {
    auto op = begin(call.kind);
    if (auto check = agreement(op->what, call)) check();
    return op;
  }

  /// check_same_calls: every rank learns what the others are about to issue (one
  /// all_gather of a few words on the inner engine, issued now, so it matches whatever
  /// each rank issues next) and the returned check fails, naming both calls, where they
  /// differ. Every rank sees the same table, so every rank fails: none is left waiting.
  /// Empty when there is nothing to check.
  std::function<void()> agreement(const std::string& what, const CollectiveCall& call) {
    if (!options_.check_same_calls || size() == 1) return {};
    constexpr std::size_t kWords = CollectiveCall::kWords;
    const auto mine = std::make_shared<std::array<std::int64_t, kWords>>(call.words());
    auto all = std::make_shared<std::vector<std::int64_t>>(kWords * static_cast<std::size_t>(size()));
    auto gathered = std::make_shared<Handle>(inner_.all_gather(mine->data(), all->data(), kWords, DataType::i64));
    return [what, call, mine, all, gathered, n = size()] {
      gathered->wait();
      for (int r = 0; r < n; ++r) {
        const std::int64_t* theirs = all->data() + kWords * static_cast<std::size_t>(r);
        if (std::equal(mine->begin(), mine->end(), theirs)) continue;
        fail(what, ": this rank issued ", call.str(), " while rank ", r, " issued ",
             CollectiveCall::from_words(theirs).str(),
             ": NCCL matches collectives by their order on a communicator, so every rank must issue the same "
             "ones in the same order");
      }
    };
  }

  /// Refuses a buffer NCCL could not use.
  void require(const detail::RulesOp& op, const void* p, std::size_t bytes, const char* role) const {
    if (bytes == 0) return;
    switch (memory_.where(p, bytes)) {
      case Residence::this_device: return;
      case Residence::host:
        fail(op.what, ": its ", role, " (", p, ", ", bytes,
             " bytes) is host memory, which NCCL cannot move: stage host values through a backend buffer "
             "(parallel/host_values.hpp)");
      case Residence::other_device:
        fail(op.what, ": its ", role, " (", p, ", ", bytes,
             " bytes) is memory of another rank's device: NCCL runs one rank per device, and a rank reaches only "
             "its own memory");
    }
  }

  /// Snapshots an input (`out`, `out_bytes`: the operation's output, for in-place calls).
  void add_input(detail::RulesOp& op, const void* in, std::size_t bytes, const void* out, std::size_t out_bytes) {
    require(op, in, bytes, "input");
    auto snapshot = std::make_unique<detail::RulesScratch>(memory_, bytes);
    if (bytes > 0) memory_.copy(snapshot->data(), in, bytes);
    op.inputs.push_back({in, std::move(snapshot), !detail::overlaps(in, bytes, out, out_bytes)});
  }

  /// Poisons an output and returns the scratch its result goes to until wait().
  void* add_output(detail::RulesOp& op, void* out, std::size_t bytes) {
    require(op, out, bytes, "output");
    auto result = std::make_unique<detail::RulesScratch>(memory_, bytes);
    if (bytes > 0) {
      const std::vector<unsigned char> poison(bytes, 0xFF);
      memory_.copy(out, poison.data(), bytes);
    }
    void* p = result->data();
    op.outputs.push_back({out, std::move(result)});
    return p;
  }

  static Handle issue(std::shared_ptr<detail::RulesOp> op) {
    return Handle(std::make_unique<detail::RulesHandle>(std::move(op)));
  }

  E inner_;
  MemoryAccess memory_;
  NcclRulesOptions options_;
  std::shared_ptr<State> state_;  // shared by copies, not by splits
};

}  // namespace tessera::comm
