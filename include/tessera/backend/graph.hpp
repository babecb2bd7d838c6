// Graphs: a stretch of a backend's work captured once and replayed as a whole.
//
// A backend that captures (Cpu, Cuda) has a Graph type and B::capture(body): the work
// `body` issues is recorded, not run, and graph.replay() runs it, each launch with the
// arguments it was captured with, at the addresses it was captured with. On a GPU that
// is one cudaGraphLaunch for a training step of a thousand launches (cuda/graph.hpp);
// the CPU backend records the same work as calls (cpu/graph.hpp), so a step that would
// replay wrongly on a GPU replays wrongly on the CPU first, where tests compare it with
// the eager step.
//
// What a replayed stretch must keep (train/trainer.hpp's step keeps it):
// - No value the host chooses per replay in a launch's arguments: such values (the
//   learning rate, the loss scale, the ids) are written to fixed tensors before each
//   replay, and the launches read them there.
// - The same launches at the same addresses: fixed shapes, the tensors it reads and
//   writes between replays kept, not reallocated.
// - No copy between the host and the backend and no synchronisation inside: both are
//   errors during a capture on either backend.
// - One rank: collectives are not captured.
#pragma once

#include <concepts>

namespace tessera {

namespace detail {
struct NoWork {
  void operator()() const {}
};
}  // namespace detail

/// A backend whose work can be captured as a graph and replayed.
template <class B>
concept CapturesGraphs = requires(const typename B::Graph& g, detail::NoWork body) {
  { B::capture(body) } -> std::same_as<typename B::Graph>;
  g.replay();
};

namespace detail {
/// What a backend that does not capture has for a graph: nothing to replay.
struct NoGraph {
  void replay() const {}
};
template <class B>
struct GraphOf {
  using type = NoGraph;
};
template <CapturesGraphs B>
struct GraphOf<B> {
  using type = typename B::Graph;
};
}  // namespace detail

/// B::Graph where B captures, else a type with nothing to replay (for members that exist
/// on every backend and are used only on the ones that capture).
template <class B>
using graph_t = typename detail::GraphOf<B>::type;

}  // namespace tessera
