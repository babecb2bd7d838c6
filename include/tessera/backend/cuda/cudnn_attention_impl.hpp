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
//
// Packed documents (a call given RaggedDocuments: ops/ragged_documents.hpp) run as
// cuDNN's variable-length attention: a batch of E = batch x document_slots entries, each
// a document, dims {E, heads, T, hd} with the same strides, every tensor given its ragged
// offsets (the element where each entry starts) and the padding mask the entries'
// lengths (0 for the slots past a sequence's last document); the causal mask then keeps
// each query to its own document's earlier keys. Stats is then token-major, dims
// {E, H, T, 1} with strides {T*H, 1, H, 1} and offsets (row * H), as cuDNN's ragged
// statistics are laid out; the backend moves them to and from the lse array. One graph
// per entry count: document_slots is a power of two, so a run builds a handful.
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
#include "tessera/ops/ragged_documents.hpp"

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

std::string cudnn_attention_validate(const AttentionShape&, bool, int) { return cudnn_availability().why_not; }

const AttentionEngine* cudnn_attention_engine(bool) { fail("cuDNN attention: ", cudnn_availability().why_not); }

#else

namespace detail {

namespace fe = cudnn_frontend;

inline std::string cudnn_shape_text(const AttentionShape& s) {
  return tessera::detail::concat("batch ", s.batch, ", seq ", s.seq_len, ", ", s.n_heads, " heads (", s.n_kv_heads,
                                 " kv), head dim ", s.head_dim, s.causal ? "" : ", full",
                                 s.document_slots > 0 ? tessera::detail::concat(", packed documents (", s.document_slots,
                                                                                s.document_slots == 1 ? " slot" : " slots",
                                                                                " a sequence)")
                                                      : std::string());
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
      a.version = static_cast<std::int64_t>(version);
      a.library = tessera::detail::concat("cuDNN ", cudnn_version_text(version));
    } catch (const std::exception& e) {
      a.why_not = tessera::detail::concat("libcudnn.so.9 could not be used: ", e.what());
    }
    return a;
  }();
  return result;
}

enum class Direction : std::int64_t { forward = 0, backward = 1 };

// Tensor uids in the graphs; a ragged graph's offsets are kOffsets + ops::RaggedTensor.
enum : std::int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqLenQ, kSeqLenKV, kOffsets = 32 };

/// What a graph is built for: direction, deterministic, B, T, H, KV, hd, causal, the
/// ragged entries (0: dense), then the lds of q, k, v, o (forward) and of q, k, v, o,
/// dO, dq, dk, dv (backward).
using GraphKey = std::vector<std::int64_t>;

/// Where the ragged entries and the lds are in a GraphKey.
inline constexpr std::size_t kKeyEntries = 8, kKeyLds = 9;

inline GraphKey graph_key(Direction dir, bool deterministic, const AttentionShape& s, std::int64_t entries,
                          std::initializer_list<std::int64_t> lds) {
  GraphKey key{static_cast<std::int64_t>(dir), deterministic ? 1 : 0, s.batch, s.seq_len, s.n_heads, s.n_kv_heads,
               s.head_dim, s.causal ? 1 : 0, entries};
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

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

/// What a graph's tensors are laid out as: the shape, and for a ragged graph its entries
/// and the offset tensors each operand takes (kOffsets + ops::RaggedTensor).
struct Layout {
  const AttentionShape& s;
  std::int64_t entries = 0;  // 0: dense
  fe::graph::Graph* g = nullptr;
  std::int64_t batch() const { return entries > 0 ? entries : s.batch; }
  /// The ragged offsets of tensor `t`, a graph input of entries + 1 int64 elements.
  TensorPtr offsets(ops::RaggedTensor t) const {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(tessera::detail::concat("ragged_offsets_", static_cast<int>(t)))
                         .set_uid(kOffsets + static_cast<std::int64_t>(t))
                         .set_dim({entries + 1, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT64));
  }
  /// Each entry's length, a graph input of `entries` int32 elements.
  TensorPtr lengths(std::int64_t uid, const char* name) const {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({entries, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  }
  /// A (B*T, heads*hd) matrix with leading dimension ld as BSHD dims and strides (a
  /// ragged graph's batch is its entries), given its offsets when ragged.
  void bshd(fe::graph::Tensor_attributes& t, ops::RaggedTensor which, std::int64_t heads, std::int64_t ld) const {
    t.set_dim({batch(), heads, s.seq_len, s.head_dim}).set_stride({s.seq_len * ld, s.head_dim, ld, 1});
    if (entries > 0) t.set_ragged_offset(offsets(which));
  }
  TensorPtr input(const char* name, std::int64_t uid, ops::RaggedTensor which, std::int64_t heads,
                  std::int64_t ld) const {
    auto t = g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid));
    bshd(*t, which, heads, ld);
    return t;
  }
  void output(fe::graph::Tensor_attributes& t, std::int64_t uid, ops::RaggedTensor which, std::int64_t heads,
              std::int64_t ld) const {
    t.set_output(true).set_uid(uid);
    bshd(t, which, heads, ld);
  }
  /// Stats: the (B, H, T) lse array, or token-major (rows, H) with offsets when ragged.
  void stats(fe::graph::Tensor_attributes& t) const {
    t.set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({batch(), s.n_heads, s.seq_len, 1});
    if (entries == 0) {
      t.set_stride({s.n_heads * s.seq_len, s.seq_len, 1, 1});
      return;
    }
    t.set_stride({s.seq_len * s.n_heads, 1, s.n_heads, 1}).set_ragged_offset(offsets(ops::kRaggedStats));
  }
  /// The mask: causal (top-left: query i sees keys 0..i) when s.causal, else none; and
  /// when ragged, the padding mask of each entry's length.
  template <class Attributes>
  void mask(Attributes& options) const {
    if (s.causal)
      options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    if (entries > 0)
      options.set_padding_mask(true)
          .set_seq_len_q(lengths(kSeqLenQ, "seq_len_q"))
          .set_seq_len_kv(lengths(kSeqLenKV, "seq_len_kv"))
          .set_max_total_seq_len_q(s.rows())
          .set_max_total_seq_len_kv(s.rows());
  }
};

inline float cudnn_scale(const AttentionShape& s) { return 1.0f / std::sqrt(static_cast<float>(s.head_dim)); }

/// A graph whose nodes take compute capability `sm_version` (90: sm_90) instead of the
/// current device's (0: the device's, found when the graph is validated).
inline std::shared_ptr<fe::graph::Graph> new_graph(int sm_version) {
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);
  return g;
}

/// The forward graph for the key's lds: o and Stats from q, k, v.
inline std::shared_ptr<fe::graph::Graph> make_forward_graph(const AttentionShape& s, const GraphKey& key,
                                                            int sm_version) {
  auto g = new_graph(sm_version);
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t* ld = key.data() + kKeyLds;  // q, k, v, o
  const Layout l{s, key[kKeyEntries], g.get()};
  auto q = l.input("Q", kQ, ops::kRaggedQ, s.n_heads, ld[0]);
  auto k = l.input("K", kK, ops::kRaggedK, s.n_kv_heads, ld[1]);
  auto v = l.input("V", kV, ops::kRaggedV, s.n_kv_heads, ld[2]);
  auto options =
      fe::graph::SDPA_attributes().set_name("tessera_sdpa").set_generate_stats(true).set_attn_scale(cudnn_scale(s));
  l.mask(options);
  auto [o, stats] = g->sdpa(q, k, v, options);
  l.output(*o, kO, ops::kRaggedO, s.n_heads, ld[3]);
  stats->set_output(true);
  l.stats(*stats);
  return g;
}

/// The backward graph for the key's lds: dq, dk, dv from q, k, v, o, dO and Stats.
inline std::shared_ptr<fe::graph::Graph> make_backward_graph(const AttentionShape& s, const GraphKey& key,
                                                             int sm_version) {
  const bool deterministic = key[1] != 0;
  auto g = new_graph(sm_version);
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t* ld = key.data() + kKeyLds;  // q, k, v, o, dO, dq, dk, dv
  const Layout l{s, key[kKeyEntries], g.get()};
  auto q = l.input("Q", kQ, ops::kRaggedQ, s.n_heads, ld[0]);
  auto k = l.input("K", kK, ops::kRaggedK, s.n_kv_heads, ld[1]);
  auto v = l.input("V", kV, ops::kRaggedV, s.n_kv_heads, ld[2]);
  auto o = l.input("O", kO, ops::kRaggedO, s.n_heads, ld[3]);
  auto d_o = l.input("dO", kDO, ops::kRaggedDO, s.n_heads, ld[4]);
  auto stats = g->tensor(fe::graph::Tensor_attributes().set_name("Stats"));
  l.stats(*stats);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("tessera_sdpa_backward")
                     .set_attn_scale(cudnn_scale(s))
                     .set_deterministic_algorithm(deterministic);
  l.mask(options);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
  l.output(*dq, kDQ, ops::kRaggedDQ, s.n_heads, ld[5]);
  l.output(*dk, kDK, ops::kRaggedDK, s.n_kv_heads, ld[6]);
  l.output(*dv, kDV, ops::kRaggedDV, s.n_kv_heads, ld[7]);
  return g;
}

/// The graph of `key` (its direction's), not yet validated.
inline std::shared_ptr<fe::graph::Graph> make_graph(const AttentionShape& s, const GraphKey& key, int sm_version = 0) {
  return static_cast<Direction>(key[0]) == Direction::forward ? make_forward_graph(s, key, sm_version)
                                                              : make_backward_graph(s, key, sm_version);
}

/// The forward and backward graphs' keys of `s` with packed operands (ld = heads * hd),
/// the variable-length ones with s.document_slots.
inline std::vector<GraphKey> packed_keys(const AttentionShape& s, bool deterministic_backward) {
  const std::int64_t ldq = s.n_heads * s.head_dim, ldk = s.n_kv_heads * s.head_dim;
  const std::int64_t entries = s.document_slots > 0 ? s.batch * s.document_slots : 0;
  return {graph_key(Direction::forward, false, s, entries, {ldq, ldk, ldk, ldq}),
          graph_key(Direction::backward, deterministic_backward, s, entries, {ldq, ldk, ldk, ldq, ldq, ldq, ldk, ldk})};
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
  std::shared_ptr<fe::graph::Graph> g = make_graph(s, key);
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
    fail_like(e, where, ": ", message);
  }
}

/// A ragged call's offsets and lengths bound in `pack` (the offsets of the tensors in
/// `tensors`); the statistics are the ragged scratch.
inline void bind_ragged(std::unordered_map<std::int64_t, void*>& pack, const RaggedDocuments& r,
                        std::initializer_list<ops::RaggedTensor> tensors) {
  for (ops::RaggedTensor t : tensors) {
    const auto i = static_cast<std::int64_t>(t);
    pack[kOffsets + i] = const_cast<std::int64_t*>(r.offsets + i * (r.entries + 1));
  }
  pack[kSeqLenQ] = const_cast<std::int32_t*>(r.lengths);
  pack[kSeqLenKV] = const_cast<std::int32_t*>(r.lengths);
  pack[kStats] = r.stats;
}

/// The ragged entries of a call: 0 for dense, else its documents' (checked against the
/// shape the backend staged them for).
inline std::int64_t ragged_entries(const AttentionShape& s, const RaggedDocuments* r) {
  if (r == nullptr) {
    TESSERA_CHECK(s.documents == nullptr, "packed documents come without their ragged layout");
    return 0;
  }
  TESSERA_CHECK(s.documents != nullptr && s.document_slots > 0 && r->entries == s.batch * s.document_slots,
                "ragged layout of ", r->entries, " entries for ", s.batch, " sequences of ", s.document_slots,
                " document slots");
  return r->entries;
}

inline void cudnn_forward(const AttentionForwardCall& c) {
  const AttentionShape& s = c.shape;
  ops::flash_check_forward<bf16>(s, c.q, c.k, c.v, c.o);
  if (s.rows() == 0) return;
  cudnn_guard(s, "forward", [&] {
    const std::int64_t entries = ragged_entries(s, c.ragged);
    CudnnDevice& dev = cudnn_device(c.device);
    std::lock_guard<std::mutex> lock(dev.mutex);
    const GraphKey key = graph_key(Direction::forward, false, s, entries, {c.q.ld(), c.k.ld(), c.v.ld(), c.o.ld()});
    fe::graph::Graph& g = cudnn_graph(dev, s, key);
    std::unordered_map<std::int64_t, void*> pack{{kQ, const_cast<bf16*>(c.q.data())},
                                                 {kK, const_cast<bf16*>(c.k.data())},
                                                 {kV, const_cast<bf16*>(c.v.data())},
                                                 {kO, c.o.data()},
                                                 {kStats, c.lse}};
    if (c.ragged)
      bind_ragged(pack, *c.ragged, {ops::kRaggedQ, ops::kRaggedK, ops::kRaggedV, ops::kRaggedO, ops::kRaggedStats});
    cudnn_execute(dev, g, pack, c.stream, *c.allocator, s, Direction::forward);
  });
}

template <bool deterministic>
void cudnn_backward(const AttentionBackwardCall& c) {
  const AttentionShape& s = c.shape;
  ops::flash_check_backward<bf16>(s, c.q, c.k, c.v, c.o, c.d_o, c.dq, c.dk, c.dv);
  if (s.rows() == 0) return;
  cudnn_guard(s, "backward", [&] {
    const std::int64_t entries = ragged_entries(s, c.ragged);
    CudnnDevice& dev = cudnn_device(c.device);
    std::lock_guard<std::mutex> lock(dev.mutex);
    const GraphKey key =
        graph_key(Direction::backward, deterministic, s, entries,
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
    if (c.ragged)
      bind_ragged(pack, *c.ragged,
                  {ops::kRaggedQ, ops::kRaggedK, ops::kRaggedV, ops::kRaggedO, ops::kRaggedDO, ops::kRaggedDQ,
                   ops::kRaggedDK, ops::kRaggedDV, ops::kRaggedStats});
    cudnn_execute(dev, g, pack, c.stream, *c.allocator, s, Direction::backward);
  });
}

inline constexpr AttentionEngine kCudnnEngine{"cudnn", &cudnn_forward, &cudnn_backward<false>, true};
inline constexpr AttentionEngine kCudnnDeterministicEngine{"cudnn", &cudnn_forward, &cudnn_backward<true>, true};

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
    for (const detail::GraphKey& key : detail::packed_keys(s, deterministic_backward)) detail::cudnn_graph(dev, s, key);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

std::string cudnn_attention_validate(const AttentionShape& s, bool deterministic_backward, int sm_version) {
  const CudnnAvailability& a = detail::cudnn_loaded();
  if (!a.ok) return a.why_not;
  TESSERA_CHECK(sm_version > 0, "cudnn_attention_validate: give the GPU's compute capability (90: sm_90)");
  try {
    for (const detail::GraphKey& key : detail::packed_keys(s, deterministic_backward)) {
      const auto g = detail::make_graph(s, key, sm_version);
      detail::cudnn_check(g->validate(), "validate", s, static_cast<detail::Direction>(key[0]));
    }
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
