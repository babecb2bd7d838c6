// The CPU backend's graphs: a stretch of the backend's work recorded once and replayed,
// with the rules a CUDA graph runs under (backend/graph.hpp), so that what a GPU will
// replay is first replayed here.
//
// While a thread captures (Cpu::capture), the backend records each launch, GEMM,
// attention call and zero fill as a copy of its arguments and runs nothing: replay()
// runs the recorded work in order, from the recorded arguments, as cudaGraphLaunch runs a
// captured graph's kernels with the parameters they were captured with. A value the
// host wrote into a launch's arguments is the capture's ever after; a step whose
// learning rate, loss scale or ids travel that way trains a different model replayed
// than eager, and the tests that compare the two see it. A copy between the host and
// the backend, or a synchronisation, inside a capture is an error, as on a GPU.
//
// Memory. A tensor allocated during a capture may be written by every replay, so its
// memory must not go to anyone else while the graph lives: the blocks a capture
// allocated are freed only when the graph is gone and they are released (GraphMemory),
// as a CUDA graph's private pool keeps its blocks (cuda/graph.hpp). The CPU keeps them
// without reuse inside the capture, which a small model's step affords.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace tessera::cpu {

/// The blocks of one capture: released ones are held until the graph is gone.
class GraphMemory {
 public:
  GraphMemory() = default;
  GraphMemory(const GraphMemory&) = delete;
  GraphMemory& operator=(const GraphMemory&) = delete;
  ~GraphMemory() { end(); }

  /// A block of this capture released by its tensor: held while the graph lives (true),
  /// or to be freed now (false).
  bool hold(void* p) {
    std::lock_guard lock(mutex_);
    if (!graph_alive_) return false;
    held_.push_back(p);
    return true;
  }

  /// The graph is gone: its held blocks are freed, later releases free at once.
  void end() {
    std::vector<void*> held;
    {
      std::lock_guard lock(mutex_);
      graph_alive_ = false;
      held.swap(held_);
    }
    for (void* p : held) std::free(p);
  }

  std::size_t held_blocks() const {
    std::lock_guard lock(mutex_);
    return held_.size();
  }

 private:
  mutable std::mutex mutex_;
  bool graph_alive_ = true;
  std::vector<void*> held_;
};

/// One recorded piece of work: a launch (the functor's bytes and the instantiation that
/// runs it: one small function per functor type, so that every for_each does not also
/// instantiate a std::function) or any other call.
class RecordedOp {
 public:
  /// A launch of `n` indices: `run(n, f)` on a copy of the `bytes` bytes at `f` (a
  /// trivially copyable functor; memcpy makes its copy, C++20's implicit object creation).
  static RecordedOp launch(void (*run)(std::int64_t, const void*), std::int64_t n, const void* f, std::size_t bytes) {
    RecordedOp op;
    op.launch_ = run;
    op.n_ = n;
    op.storage_ = std::make_unique<std::max_align_t[]>((bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t));
    std::memcpy(op.storage_.get(), f, bytes);
    return op;
  }
  static RecordedOp call(std::function<void()> f) {
    RecordedOp op;
    op.call_ = std::move(f);
    return op;
  }
  void operator()() const {
    if (launch_ != nullptr)
      launch_(n_, storage_.get());
    else
      call_();
  }

 private:
  void (*launch_)(std::int64_t, const void*) = nullptr;
  std::int64_t n_ = 0;
  std::unique_ptr<std::max_align_t[]> storage_;
  std::function<void()> call_;
};

/// A recorded stretch of the CPU backend's work.
class Graph {
 public:
  Graph() = default;
  Graph(Graph&&) noexcept = default;
  Graph& operator=(Graph&& other) noexcept {
    if (this != &other) {
      release();
      ops_ = std::move(other.ops_);
      memory_ = std::move(other.memory_);
    }
    return *this;
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() { release(); }

  /// Runs the recorded work in order, with the arguments it was recorded with.
  void replay() const {
    for (const auto& op : ops_) op();
  }
  /// Launches, GEMMs, attention calls and fills recorded.
  std::size_t size() const { return ops_.size(); }
  bool empty() const { return ops_.empty(); }
  /// Blocks the capture allocated, released since and held for the replays.
  std::size_t held_blocks() const { return memory_ ? memory_->held_blocks() : 0; }

 private:
  friend struct Capture;
  void release() {
    if (memory_) memory_->end();
    memory_.reset();
    ops_.clear();
  }
  std::vector<RecordedOp> ops_;
  std::shared_ptr<GraphMemory> memory_;
};

/// The capture under way on a thread.
struct Capture {
  std::vector<RecordedOp> ops;
  std::shared_ptr<GraphMemory> memory = std::make_shared<GraphMemory>();

  Capture() = default;
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  ~Capture() {
    if (memory) memory->end();  // abandoned: no graph will replay into its blocks
  }

  Graph finish() && {
    Graph g;
    g.ops_ = std::move(ops);
    g.memory_ = std::move(memory);
    return g;
  }
};

namespace detail {
inline thread_local Capture* capture = nullptr;
}  // namespace detail

/// The capture under way on this thread, or null.
inline Capture* capturing() { return detail::capture; }

}  // namespace tessera::cpu
