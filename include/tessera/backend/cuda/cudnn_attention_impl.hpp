// Attention through cuDNN's fused SDPA: the definitions of cudnn_attention.hpp.
//
// Include this header in exactly ONE translation unit of a program (host C++: g++ or
// nvcc), compiled with the frontend's include folder and
// -DTESSERA_WITH_CUDNN_FRONTEND=1 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING; without the
// first macro it defines the same functions, reporting that the build has no frontend.
// Meson does this in examples/meson.build (the `cudnn_attention` library).
//
// How the graphs map the model's layouts. A (B*T, heads*hd) row-major matrix with
// leading dimension ld is, as cuDNN's 4-D (b, h, s, d) tensor, dims {B, heads, T, hd}
// with strides {T*ld, hd, ld, 1} (the BSHD layout): Q, K, V, O, dO, dQ, dK and dV are
// declared that way and bound to the tensors' own pointers. Stats is {B, H, T, 1} fp32
// with strides {H*T, T, 1, 1}: the lse array. K and V (and dK, dV) have KV heads; cuDNN
// reduces the group's gradients itself. A causal call (AttentionShape::causal) has the
// causal mask with top-left alignment (query i sees keys 0..i); a full one has no mask.
// The scale is 1/sqrt(hd).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/backend/caching_allocator.hpp"
#include "tessera/backend/cuda/attention_engine.hpp"
#include "tessera/backend/cuda/cudnn_attention.hpp"
#include "tessera/core/error.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/flash_attention.hpp"

#if TESSERA_WITH_CUDNN_FRONTEND
#include <dlfcn.h>

#include <cudnn_frontend.h>

#ifndef NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#error "tessera: compile the cuDNN attention with -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING (binaries load libcudnn at run time)"
#endif

// The library handle the frontend's dynamic loading resolves every cuDNN symbol from;
// the program defines it (here) and opens it (cudnn_availability()).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}
#endif

namespace tessera::cuda {

#if !TESSERA_WITH_CUDNN_FRONTEND

std::string cudnn_frontend_version() { return {}; }

CudnnAvailability cudnn_availability() {
  CudnnAvailability a;
  a.why_not = "this build has no cuDNN frontend headers (run tools/install-deps.sh and rebuild)";
  return a;
}

std::string cudnn_attention_support(const AttentionShape&, bool) { return cudnn_availability().why_not; }

const AttentionEngine* cudnn_attention_engine(bool) { fail("cuDNN attention: ", cudnn_availability().why_not); }

#else

namespace detail {

namespace fe = cudnn_frontend;

inline std::string cudnn_shape_text(const AttentionShape& s) {
  return tessera::detail::concat("batch ", s.batch, ", seq ", s.seq_len, ", ", s.n_heads, " heads (", s.n_kv_heads,
                                 " kv), head dim ", s.head_dim, s.causal ? "" : ", full");
}

/// "9.19.0" from cudnnGetVersion()'s 91900.
inline std::string cudnn_version_text(std::size_t v) {
  return tessera::detail::concat(v / 10000, ".", (v % 10000) / 100, ".", v % 100);
}

/// Loads libcudnn once per process and records what happened.
inline const CudnnAvailability& cudnn_loaded() {
  static const CudnnAvailability result = [] {
    CudnnAvailability a;
    // The frontend resolves a few CUDA runtime calls by dlopen too; name the runtime
    // this program was built against, so it never picks another major version that
    // happens to be installed (a user's own setting wins).
    const std::string cudart = tessera::detail::concat("libcudart.so.", CUDART_VERSION / 1000);
    ::setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), 0);
    (void)dlerror();
    void* handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      a.why_not = tessera::detail::concat("libcudnn.so.9 was not found at run time (", why ? why : "dlopen failed",
                         "; install cuDNN 9 or put it on LD_LIBRARY_PATH)");
      return a;
    }
    cudnn_frontend::cudnn_dlhandle = handle;
    try {
      const std::size_t version = fe::detail::get_backend_version();
      if (version < 90000) {
        a.why_not = tessera::detail::concat("the cuDNN library found is ", cudnn_version_text(version), ", older than 9.0");
        return a;
      }
      a.ok = true;
      a.library = tessera::detail::concat("cuDNN ", cudnn_version_text(version));
    } catch (const std::exception& e) {
      a.why_not = tessera::detail::concat("libcudnn.so.9 could not be used: ", e.what());
    }
    return a;
  }();
  return result;
}

enum class Direction : std::int64_t { forward = 0, backward = 1 };

// Tensor uids in the graphs.
enum : std::int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

/// What a graph is built for: direction, deterministic, B, T, H, KV, hd, causal, then
/// the lds of q, k, v, o (forward) and of q, k, v, o, dO, dq, dk, dv (backward).
using GraphKey = std::vector<std::int64_t>;

/// Where the lds start in a GraphKey.
inline constexpr std::size_t kKeyLds = 8;

inline GraphKey graph_key(Direction dir, bool deterministic, const AttentionShape& s,
                          std::initializer_list<std::int64_t> lds) {
  GraphKey key{static_cast<std::int64_t>(dir), deterministic ? 1 : 0, s.batch, s.seq_len, s.n_heads, s.n_kv_heads,
               s.head_dim, s.causal ? 1 : 0};
  key.insert(key.end(), lds);
  return key;
}

/// One device's cuDNN state, created on first use and never destroyed (a handle or a
/// workspace freed during the process's exit could outlive the runtime).
struct CudnnDevice {
  std::mutex mutex;
  cudnnHandle_t handle = nullptr;
  std::map<GraphKey, std::shared_ptr<fe::graph::Graph>> graphs;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

inline CudnnDevice& cudnn_device(int device) {
  static std::mutex mutex;
  static auto* devices = new std::map<int, CudnnDevice*>;  // immortal: see CudnnDevice
  std::lock_guard<std::mutex> lock(mutex);
  CudnnDevice*& d = (*devices)[device];
  if (d == nullptr) d = new CudnnDevice;
  return *d;
}

/// Throws a tessera::Error with cuDNN's message when `status` is bad.
inline void cudnn_check(fe::error_t status, const char* step, const AttentionShape& s, Direction dir) {
  if (status.is_good()) return;
  fail("cuDNN attention ", dir == Direction::forward ? "forward" : "backward", " (", cudnn_shape_text(s), "): ", step,
       ": ", status.get_message());
}

/// A (B*T, heads*hd) matrix with leading dimension ld as a BSHD graph tensor.
inline std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph& g, const char* name, std::int64_t uid,
                                                           const AttentionShape& s, std::int64_t heads,
                                                           std::int64_t ld) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({s.batch, heads, s.seq_len, s.head_dim})
                      .set_stride({s.seq_len * ld, s.head_dim, ld, 1}));
}

inline void set_bshd(fe::graph::Tensor_attributes& t, std::int64_t uid, const AttentionShape& s, std::int64_t heads,
                     std::int64_t ld) {
  t.set_output(true)
      .set_uid(uid)
      .set_dim({s.batch, heads, s.seq_len, s.head_dim})
      .set_stride({s.seq_len * ld, s.head_dim, ld, 1});
}

inline std::vector<std::int64_t> stats_dim(const AttentionShape& s) { return {s.batch, s.n_heads, s.seq_len, 1}; }
inline std::vector<std::int64_t> stats_stride(const AttentionShape& s) {
  return {s.n_heads * s.seq_len, s.seq_len, 1, 1};
}

inline float cudnn_scale(const AttentionShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

/// The mask: causal (top-left: query i sees keys 0..i) when s.causal, else none.
template <class Attributes>
void set_mask(Attributes& options, const AttentionShape& s) {
  if (s.causal)
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
}

/// The forward graph for the key's lds: o and Stats from q, k, v.
inline std::shared_ptr<fe::graph::Graph> make_forward_graph(const AttentionShape& s, const GraphKey& key) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t* ld = key.data() + kKeyLds;  // q, k, v, o
  auto q = bshd(*g, "Q", kQ, s, s.n_heads, ld[0]);
  auto k = bshd(*g, "K", kK, s, s.n_kv_heads, ld[1]);
  auto v = bshd(*g, "V", kV, s, s.n_kv_heads, ld[2]);
  auto options =
      fe::graph::SDPA_attributes().set_name("tessera_sdpa").set_generate_stats(true).set_attn_scale(cudnn_scale(s));
  set_mask(options, s);
  auto [o, stats] = g->sdpa(q, k, v, options);
  set_bshd(*o, kO, s, s.n_heads, ld[3]);
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(stats_dim(s))
      .set_stride(stats_stride(s));
  return g;
}

/// The backward graph for the key's lds: dq, dk, dv from q, k, v, o, dO and Stats.
inline std::shared_ptr<fe::graph::Graph> make_backward_graph(const AttentionShape& s, const GraphKey& key,
                                                             bool deterministic) {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t* ld = key.data() + kKeyLds;  // q, k, v, o, dO, dq, dk, dv
  auto q = bshd(*g, "Q", kQ, s, s.n_heads, ld[0]);
  auto k = bshd(*g, "K", kK, s, s.n_kv_heads, ld[1]);
  auto v = bshd(*g, "V", kV, s, s.n_kv_heads, ld[2]);
  auto o = bshd(*g, "O", kO, s, s.n_heads, ld[3]);
  auto d_o = bshd(*g, "dO", kDO, s, s.n_heads, ld[4]);
  auto stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("Stats")
                             .set_uid(kStats)
                             .set_dim(stats_dim(s))
                             .set_stride(stats_stride(s))
                             .set_data_type(fe::DataType_t::FLOAT));
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("tessera_sdpa_backward")
                     .set_attn_scale(cudnn_scale(s))
                     .set_deterministic_algorithm(deterministic);
  set_mask(options, s);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
  set_bshd(*dq, kDQ, s, s.n_heads, ld[5]);
  set_bshd(*dk, kDK, s, s.n_kv_heads, ld[6]);
  set_bshd(*dv, kDV, s, s.n_kv_heads, ld[7]);
  return g;
}

/// The graph for `key` on `dev`, built on first use (dev.mutex held by the caller).
inline fe::graph::Graph& cudnn_graph(CudnnDevice& dev, const AttentionShape& s, const GraphKey& key) {
  auto it = dev.graphs.find(key);
  if (it != dev.graphs.end()) return *it->second;
  const auto dir = static_cast<Direction>(key[0]);
  if (dev.handle == nullptr) {
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t status = fe::detail::create_handle(&h);
    if (status != CUDNN_STATUS_SUCCESS)
      fail("cuDNN attention: cudnnCreate failed: ", fe::detail::get_error_string(status));
    dev.handle = h;
  }
  std::shared_ptr<fe::graph::Graph> g =
      dir == Direction::forward ? make_forward_graph(s, key) : make_backward_graph(s, key, key[1] != 0);
  cudnn_check(g->validate(), "validate", s, dir);
  cudnn_check(g->build_operation_graph(dev.handle), "build_operation_graph", s, dir);
  cudnn_check(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", s, dir);
  cudnn_check(g->check_support(), "check_support", s, dir);
  cudnn_check(g->build_plans(), "build_plans", s, dir);
  return *dev.graphs.emplace(key, std::move(g)).first->second;
}

/// Runs `g` with `pack` on `stream`, its workspace grown to fit (dev.mutex held).
inline void cudnn_execute(CudnnDevice& dev, fe::graph::Graph& g, std::unordered_map<std::int64_t, void*>& pack,
                          cudaStream_t stream, CachingAllocator& allocator, const AttentionShape& s, Direction dir) {
  std::int64_t need = 0;
  cudnn_check(g.get_workspace_size(need), "get_workspace_size", s, dir);
  if (static_cast<std::size_t>(need) > dev.workspace_bytes) {
    // Blocks are reused in stream order (caching_allocator.hpp), so the old workspace
    // may go back while earlier graphs on this stream still use it.
    if (dev.workspace != nullptr) CachingAllocator::release_to_owner(dev.workspace);
    dev.workspace = nullptr;
    dev.workspace_bytes = 0;
    dev.workspace = allocator.allocate(static_cast<std::size_t>(need), "the cuDNN attention workspace");
    dev.workspace_bytes = static_cast<std::size_t>(need);
  }
  const cudnnStatus_t status = fe::detail::set_stream(dev.handle, stream);
  if (status != CUDNN_STATUS_SUCCESS)
    fail("cuDNN attention: cudnnSetStream failed: ", fe::detail::get_error_string(status));
  cudnn_check(g.execute(dev.handle, pack, need > 0 ? dev.workspace : nullptr), "execute", s, dir);
}

/// Runs `body` with every failure -- the frontend's and the loader's exceptions, and
/// tessera's own (the workspace's allocation running out of memory) -- turned into one
/// tessera error naming the direction and the shape.
template <class F>
void cudnn_guard(const AttentionShape& s, const char* what, F&& body) {
  const std::string where = tessera::detail::concat("cuDNN attention ", what, " (", cudnn_shape_text(s), ")");
  try {
    body();
  } catch (const std::exception& e) {
    const std::string message = e.what();
    if (message.find(where) != std::string::npos) throw;  // cudnn_check named it already
    fail(where, ": ", message);
  }
}

inline void cudnn_forward(const AttentionForwardCall& c) {
  const AttentionShape& s = c.shape;
  ops::flash_check_forward<bf16>(s, c.q, c.k, c.v, c.o);
  if (s.rows() == 0) return;
  cudnn_guard(s, "forward", [&] {
    CudnnDevice& dev = cudnn_device(c.device);
    std::lock_guard<std::mutex> lock(dev.mutex);
    const GraphKey key = graph_key(Direction::forward, false, s, {c.q.ld(), c.k.ld(), c.v.ld(), c.o.ld()});
    fe::graph::Graph& g = cudnn_graph(dev, s, key);
    std::unordered_map<std::int64_t, void*> pack{{kQ, const_cast<bf16*>(c.q.data())},
                                                 {kK, const_cast<bf16*>(c.k.data())},
                                                 {kV, const_cast<bf16*>(c.v.data())},
                                                 {kO, c.o.data()},
                                                 {kStats, c.lse}};
    cudnn_execute(dev, g, pack, c.stream, *c.allocator, s, Direction::forward);
  });
}

template <bool deterministic>
void cudnn_backward(const AttentionBackwardCall& c) {
  const AttentionShape& s = c.shape;
  ops::flash_check_backward<bf16>(s, c.q, c.k, c.v, c.o, c.d_o, c.dq, c.dk, c.dv);
  if (s.rows() == 0) return;
  cudnn_guard(s, "backward", [&] {
    CudnnDevice& dev = cudnn_device(c.device);
    std::lock_guard<std::mutex> lock(dev.mutex);
    const GraphKey key =
        graph_key(Direction::backward, deterministic, s,
                  {c.q.ld(), c.k.ld(), c.v.ld(), c.o.ld(), c.d_o.ld(), c.dq.ld(), c.dk.ld(), c.dv.ld()});
    fe::graph::Graph& g = cudnn_graph(dev, s, key);
    std::unordered_map<std::int64_t, void*> pack{{kQ, const_cast<bf16*>(c.q.data())},
                                                 {kK, const_cast<bf16*>(c.k.data())},
                                                 {kV, const_cast<bf16*>(c.v.data())},
                                                 {kO, const_cast<bf16*>(c.o.data())},
                                                 {kDO, const_cast<bf16*>(c.d_o.data())},
                                                 {kStats, const_cast<float*>(c.lse)},
                                                 {kDQ, c.dq.data()},
                                                 {kDK, c.dk.data()},
                                                 {kDV, c.dv.data()}};
    cudnn_execute(dev, g, pack, c.stream, *c.allocator, s, Direction::backward);
  });
}

inline constexpr AttentionEngine kCudnnEngine{"cudnn", &cudnn_forward, &cudnn_backward<false>};
inline constexpr AttentionEngine kCudnnDeterministicEngine{"cudnn", &cudnn_forward, &cudnn_backward<true>};

}  // namespace detail

std::string cudnn_frontend_version() {
  return tessera::detail::concat(CUDNN_FRONTEND_MAJOR_VERSION, ".", CUDNN_FRONTEND_MINOR_VERSION, ".", CUDNN_FRONTEND_PATCH_VERSION);
}

CudnnAvailability cudnn_availability() { return detail::cudnn_loaded(); }

std::string cudnn_attention_support(const AttentionShape& s, bool deterministic_backward) {
  const CudnnAvailability& a = detail::cudnn_loaded();
  if (!a.ok) return a.why_not;
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    (void)cudaGetLastError();
    return tessera::detail::concat("cudaGetDevice: ", cudaGetErrorString(e));
  }
  try {
    detail::CudnnDevice& dev = detail::cudnn_device(device);
    std::lock_guard<std::mutex> lock(dev.mutex);
    const std::int64_t ldq = s.n_heads * s.head_dim, ldk = s.n_kv_heads * s.head_dim;
    const detail::GraphKey forward = detail::graph_key(detail::Direction::forward, false, s, {ldq, ldk, ldk, ldq});
    const detail::GraphKey backward = detail::graph_key(detail::Direction::backward, deterministic_backward, s,
                                                        {ldq, ldk, ldk, ldq, ldq, ldq, ldk, ldk});
    detail::cudnn_graph(dev, s, forward);
    detail::cudnn_graph(dev, s, backward);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

const AttentionEngine* cudnn_attention_engine(bool deterministic_backward) {
  const CudnnAvailability& a = detail::cudnn_loaded();
  TESSERA_CHECK(a.ok, "cuDNN attention: ", a.why_not);
  return deterministic_backward ? &detail::kCudnnDeterministicEngine : &detail::kCudnnEngine;
}

#endif

}  // namespace tessera::cuda
