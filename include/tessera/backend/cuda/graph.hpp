// CUDA graphs of the backend's work: a stretch of launches captured once on the compute
// stream and replayed with one cudaGraphLaunch (backend/graph.hpp says what a stretch
// must keep to be replayed; the CPU backend's graphs, cpu/graph.hpp, run under the same
// rules, which is where they are tested).
//
// Capture. capture() waits for the stream, gives the device allocator's cached blocks
// back to the device (what the last eager step freed: the capture's pool maps it again),
// and captures the body on the compute stream in relaxed mode (the graph pool may take a
// new segment during the capture). Everything the body issues to the stream becomes a
// node: kernels, cuBLASLt matmuls, cuDNN's attention, memsets. A copy between the host
// and the device or a synchronisation inside the body is refused before CUDA sees it
// (Cuda::copy_to_host, copy_from_host, synchronize): a captured copy would replay
// whatever its pinned staging slot holds then.
//
// Memory. Inside a capture the backend allocates from the device's graph pool
// (memory.hpp: graph_allocator), a caching allocator of its own. A block released
// during the capture is reused by later allocations of the same capture, in stream
// order, as eager steps reuse blocks; after the capture it stays in the pool, which no
// eager work allocates from, so a replay writes only memory that is the graph's. One
// graph per device at a time: a new capture starts after the last graph is destroyed.
// Destroying the graph gives the pool's unused segments back.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <utility>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/core/error.hpp"

namespace tessera::cuda {

namespace detail {
/// Graphs alive per device (at most one: see the header).
inline std::array<std::atomic<int>, kMaxDevices>& live_graphs() {
  static auto* live = new std::array<std::atomic<int>, kMaxDevices>{};
  return *live;
}
}  // namespace detail

/// An instantiated graph of the compute stream's work.
class Graph {
 public:
  Graph() = default;
  Graph(Graph&& o) noexcept
      : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)), stream_(o.stream_),
        device_(std::exchange(o.device_, -1)) {}
  Graph& operator=(Graph&& o) noexcept {
    if (this != &o) {
      destroy();
      graph_ = std::exchange(o.graph_, nullptr);
      exec_ = std::exchange(o.exec_, nullptr);
      stream_ = o.stream_;
      device_ = std::exchange(o.device_, -1);
    }
    return *this;
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() { destroy(); }

  /// Launches the graph on the stream it was captured on; returns without waiting.
  void replay() const {
    TESSERA_CHECK(exec_ != nullptr, "CUDA backend: replay of an empty graph");
    TESSERA_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
  }

  /// Nodes in the graph (kernels, memsets, library calls' own nodes).
  std::size_t size() const {
    if (graph_ == nullptr) return 0;
    std::size_t n = 0;
    TESSERA_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
    return n;
  }
  bool empty() const { return graph_ == nullptr; }

 private:
  template <class F>
  friend Graph capture(cudaStream_t stream, int device, F&& body);
  Graph(cudaGraph_t graph, cudaGraphExec_t exec, cudaStream_t stream, int device)
      : graph_(graph), exec_(exec), stream_(stream), device_(device) {}

  void destroy() noexcept {
    if (device_ < 0) return;
    // The last replay may still run: the pool's blocks are given back after it.
    (void)cudaStreamSynchronize(stream_);
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
    graph_allocator(device_).empty_cache();
    detail::live_graphs()[static_cast<std::size_t>(device_)].fetch_sub(1);
    exec_ = nullptr;
    graph_ = nullptr;
    device_ = -1;
  }

  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
};

/// Captures the work `body` issues to `stream` (device `device`'s compute stream) as a
/// graph, nothing of it run: the first replay runs it. An error thrown by `body` ends
/// the capture and is rethrown.
template <class F>
Graph capture(cudaStream_t stream, int device, F&& body) {
  TESSERA_CHECK(detail::capture_allocator == nullptr, "CUDA backend: a graph capture inside a graph capture");
  TESSERA_CHECK(detail::live_graphs()[static_cast<std::size_t>(device)].load() == 0, "CUDA backend: cuda:", device,
                " already has a graph; destroy it before capturing another (its pool is the device's one)");
  TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
  device_allocator(device).empty_cache();
  CachingAllocator& pool = graph_allocator(device);
  TESSERA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  detail::capture_allocator = &pool;
  cudaGraph_t graph = nullptr;
  try {
    body();
  } catch (...) {
    detail::capture_allocator = nullptr;
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    throw;
  }
  detail::capture_allocator = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  if (const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0); status != cudaSuccess) {
    (void)cudaGraphDestroy(graph);
    TESSERA_CUDA_CHECK(status);
  }
  detail::live_graphs()[static_cast<std::size_t>(device)].fetch_add(1);
  return Graph(graph, exec, stream, device);
}

/// Whether this thread is capturing a graph now.
inline bool capturing() { return detail::capture_allocator != nullptr; }

}  // namespace tessera::cuda
