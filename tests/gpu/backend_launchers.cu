// Launchers for the CUDA backend tests: move host tensors to the device through the
// backend, call it, bring the results back. The checks are in test_gpu_backend.cpp.
#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "backend_launchers.hpp"
#include "tessera/backend/cuda/cuda.cuh"
#include "tessera/ops/ops.hpp"

namespace tessera::gpu_test {

namespace {

/// The view into `device_store` at the offset and strides `host_view` has in `host_store`.
template <class T, class V>
TensorView<T> same_view(const Tensor<T>& device_store, const Tensor<T>& host_store, TensorView<V> host_view) {
  const std::int64_t offset = host_store.data() == nullptr ? 0 : host_view.data() - host_store.data();
  std::array<std::int64_t, kMaxRank> strides{};
  for (int i = 0; i < host_view.rank(); ++i) strides[static_cast<std::size_t>(i)] = host_view.stride(i);
  return TensorView<T>(device_store.data() == nullptr ? nullptr : device_store.data() + offset, host_view.shape(),
                       strides);
}

}  // namespace

template <class T, class C>
Tensor<C> cuda_gemm(Trans ta, Trans tb, accum_t<T> alpha, const Tensor<T>& a_store, TensorView<const T> a,
                    const Tensor<T>& b_store, TensorView<const T> b, accum_t<T> beta, const Tensor<C>& c_store,
                    TensorView<C> c) {
  const Tensor<T> da = upload<Cuda>(a_store), db = upload<Cuda>(b_store);
  const Tensor<C> dc = upload<Cuda>(c_store);
  Cuda::gemm(ta, tb, alpha, TensorView<const T>(same_view(da, a_store, a)),
             TensorView<const T>(same_view(db, b_store, b)), beta, same_view(dc, c_store, c));
  return download<Cuda>(dc);
}

template Tensor<float> cuda_gemm(Trans, Trans, float, const Tensor<float>&, TensorView<const float>,
                                 const Tensor<float>&, TensorView<const float>, float, const Tensor<float>&,
                                 TensorView<float>);
template Tensor<bf16> cuda_gemm(Trans, Trans, float, const Tensor<bf16>&, TensorView<const bf16>, const Tensor<bf16>&,
                                TensorView<const bf16>, float, const Tensor<bf16>&, TensorView<bf16>);
template Tensor<float> cuda_gemm(Trans, Trans, float, const Tensor<bf16>&, TensorView<const bf16>,
                                 const Tensor<bf16>&, TensorView<const bf16>, float, const Tensor<float>&,
                                 TensorView<float>);

template <class T, class C>
std::pair<Tensor<C>, Tensor<C>> cuda_gemm_apart(Trans ta, Trans tb, accum_t<T> alpha, const Tensor<T>& a,
                                                const Tensor<T>& b, accum_t<T> beta, const Tensor<C>& c) {
  const Tensor<T> da = upload<Cuda>(a), db = upload<Cuda>(b);
  const Tensor<C> dc = upload<Cuda>(c);
  const Tensor<C> dd = Cuda::empty<C>(c.shape());
  Cuda::gemm(ta, tb, alpha, da.cview(), db.cview(), beta, dc.cview(), dd.view());
  return {download<Cuda>(dd), download<Cuda>(dc)};
}
template std::pair<Tensor<float>, Tensor<float>> cuda_gemm_apart(Trans, Trans, float, const Tensor<float>&,
                                                                 const Tensor<float>&, float, const Tensor<float>&);
template std::pair<Tensor<bf16>, Tensor<bf16>> cuda_gemm_apart(Trans, Trans, float, const Tensor<bf16>&,
                                                               const Tensor<bf16>&, float, const Tensor<bf16>&);
template std::pair<Tensor<float>, Tensor<float>> cuda_gemm_apart(Trans, Trans, float, const Tensor<bf16>&,
                                                                 const Tensor<bf16>&, float, const Tensor<float>&);

template <class T>
std::vector<Tensor<T>> cuda_gemm_each_candidate(Trans ta, Trans tb, float alpha, const Tensor<T>& a, const Tensor<T>& b,
                                                float beta, const Tensor<T>& c, std::vector<std::string>* described) {
  const Tensor<T> da = upload<Cuda>(a), db = upload<Cuda>(b);
  const Tensor<T> dc0 = upload<Cuda>(c);
  const auto candidates = cuda::gemm_candidates<T>(ta, tb, da.cview(), db.cview(), beta, dc0.view());
  std::vector<Tensor<T>> results;
  for (const cuda::GemmAlgo& algo : candidates) {
    if (described != nullptr) described->push_back(cuda::gemm_algo_text(algo));
    const Tensor<T> dc = upload<Cuda>(c);
    cuda::gemm<T>(ta, tb, alpha, da.cview(), db.cview(), beta, dc.view(), &algo);
    results.push_back(download<Cuda>(dc));
  }
  return results;
}
template std::vector<Tensor<float>> cuda_gemm_each_candidate(Trans, Trans, float, const Tensor<float>&,
                                                             const Tensor<float>&, float, const Tensor<float>&,
                                                             std::vector<std::string>*);
template std::vector<Tensor<bf16>> cuda_gemm_each_candidate(Trans, Trans, float, const Tensor<bf16>&,
                                                            const Tensor<bf16>&, float, const Tensor<bf16>&,
                                                            std::vector<std::string>*);

int chosen_algo_index(Trans ta, Trans tb, const Tensor<float>& a, const Tensor<float>& b, const Tensor<float>& c) {
  const Tensor<float> da = upload<Cuda>(a), db = upload<Cuda>(b), dc = upload<Cuda>(c);
  const auto candidates = cuda::gemm_candidates<float>(ta, tb, da.cview(), db.cview(), 1.0f, dc.view());
  const cuda::GemmAlgo chosen = cuda::gemm_chosen_algo<float>(ta, tb, da.cview(), db.cview(), 1.0f, dc.view());
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (candidates[i] == chosen) return static_cast<int>(i);
  return -1;
}

std::size_t candidates_for_misaligned_gemm() {
  // A (8 x 8) float matrix one byte into a device block: no kernel can load it.
  const Tensor<float> store = Cuda::zeros<float>({9, 8});
  const Tensor<float> b = Cuda::zeros<float>({8, 8}), c = Cuda::zeros<float>({8, 8});
  const auto* base = reinterpret_cast<const unsigned char*>(store.data());
  const TensorView<const float> a(reinterpret_cast<const float*>(base + 1), Shape{8, 8});
  return cuda::gemm_candidates<float>(Trans::no, Trans::no, a, b.cview(), 0.0f, c.view()).size();
}

void failing_cublas_call() {
  cublasLtMatmulPreference_t pref = nullptr;
  cuda::GemmKey key;
  key.m = 4;
  key.n = 5;
  key.k = 6;
  key.lda = 6;
  key.ldb = 5;
  key.ldc = 5;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), key.str());
  struct Guard {
    cublasLtMatmulPreference_t p;
    ~Guard() { (void)cublasLtMatmulPreferenceDestroy(p); }
  } guard{pref};
  const std::uint64_t workspace = 1024;
  // One byte where the attribute takes eight: cuBLASLt answers CUBLAS_STATUS_INVALID_VALUE.
  TESSERA_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, 1),
      key.str());
}

void check_device_count(bool runtime_error) {
  if (runtime_error) cuda::detail::check_device_count(cudaErrorNoDevice, 0);
  else cuda::detail::check_device_count(cudaSuccess, 0);
}

std::pair<Tensor<bf16>, Tensor<float>> cuda_attention_forward_bf16(const AttentionShape& s, const Tensor<bf16>& q,
                                                                   const Tensor<bf16>& k, const Tensor<bf16>& v) {
  const Tensor<bf16> dq = upload<Cuda>(q), dk = upload<Cuda>(k), dv = upload<Cuda>(v);
  Tensor<bf16> o = Cuda::zeros<bf16>(q.shape());
  Tensor<float> lse = Cuda::zeros<float>({s.batch, s.n_heads, s.seq_len});
  Cuda::attention_forward<bf16>(s, dq.cview(), dk.cview(), dv.cview(), o.view(), lse.data());
  return {download<Cuda>(o), download<Cuda>(lse)};
}

template <class T>
Tensor<T> round_trip(const Tensor<T>& host, Device* uploaded_on) {
  const Tensor<T> d = upload<Cuda>(host);
  *uploaded_on = d.device();
  Cuda::synchronize();
  return download<Cuda>(d);
}

template Tensor<float> round_trip(const Tensor<float>&, Device*);
template Tensor<bf16> round_trip(const Tensor<bf16>&, Device*);

namespace {
template <class T>
struct FillOnes {
  T* p;
  TESSERA_HD void operator()(std::int64_t i) const { p[i] = convert<T>(1.0f); }
};
}  // namespace

template <class T>
Tensor<T> zeros_after_reuse(Shape shape) {
  {
    const Tensor<T> ones = Cuda::empty<T>(shape);
    Cuda::for_each(ones.numel(), FillOnes<T>{ones.data()});
  }
  return download<Cuda>(Cuda::zeros<T>(shape));
}

template Tensor<float> zeros_after_reuse<float>(Shape);
template Tensor<bf16> zeros_after_reuse<bf16>(Shape);

Tensor<float> cuda_swiglu(const Tensor<float>& a, const Tensor<float>& b) {
  const Tensor<float> da = upload<Cuda>(a), db = upload<Cuda>(b);
  const Tensor<float> g = Cuda::empty<float>(a.shape());
  Cuda::for_each(a.numel(), ops::SwiGluForward<float>{da.data(), db.data(), g.data()});
  return download<Cuda>(g);
}

Tensor<float> cuda_empty(Shape shape) { return Cuda::empty<float>(shape); }

CachingAllocator::Stats allocator_stats() { return cuda::device_allocator().stats(); }

GrowthCheck allocator_growth() {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  CachingAllocator& a = cuda::device_allocator();
  // Fills `bytes` at p with `value` and reads back its first and last 16 MiB.
  const auto fills = [](void* p, std::size_t bytes, unsigned char value) {
    TESSERA_CUDA_CHECK(cudaMemset(p, value, bytes));
    std::vector<unsigned char> head(16 * MiB), tail(16 * MiB);
    TESSERA_CUDA_CHECK(cudaMemcpy(head.data(), p, head.size(), cudaMemcpyDeviceToHost));
    TESSERA_CUDA_CHECK(
        cudaMemcpy(tail.data(), static_cast<char*>(p) + bytes - tail.size(), tail.size(), cudaMemcpyDeviceToHost));
    const auto is_value = [value](unsigned char v) { return v == value; };
    return std::all_of(head.begin(), head.end(), is_value) && std::all_of(tail.begin(), tail.end(), is_value);
  };
  GrowthCheck r;
  r.mode = cuda::expandable_segments_status(cuda::current_device());
  a.empty_cache();  // nothing free at the end: a block no free one fits is the last one
  // Larger than any block the suite's earlier tests leave free, so each is placed at the end.
  void* x = a.allocate(256 * MiB, "growth check x");
  const std::size_t before_y = a.stats().reserved_bytes;
  void* y = a.allocate(512 * MiB, "growth check y");
  r.y_at_end = a.stats().reserved_bytes > before_y;
  a.release(y);
  r.reserved_before = a.stats().reserved_bytes;
  void* z = a.allocate(1024 * MiB, "growth check z");
  r.reserved_after = a.stats().reserved_bytes;
  r.same_address = z == y;
  r.values_read_back = fills(z, 1024 * MiB, 0x5a);
  // z's pages inside the segment, x still in use before them and w after: empty_cache
  // unmaps them, and a block over them maps them again.
  void* w = a.allocate(256 * MiB, "growth check w");
  a.release(z);
  const std::size_t before_empty = a.stats().reserved_bytes;
  a.empty_cache();
  r.unmapped_inside = before_empty - a.stats().reserved_bytes;
  void* v = a.allocate(768 * MiB, "growth check v");
  r.remapped_same_address = v == z;
  r.remapped_read_back = fills(v, 768 * MiB, 0x3c);
  for (void* p : {v, w, x}) a.release(p);
  a.empty_cache();
  return r;
}

CaptureCheck capture_backend_work(const Tensor<float>& a, const Tensor<float>& b) {
  CaptureCheck r;
  const cudaStream_t s = cuda::compute_stream();
  r.created = s != nullptr;
  r.stable = cuda::compute_stream() == s && Cuda::stream() == s;
  const std::int64_t m = a.size(0), n = b.size(1);
  const Tensor<float> da = upload<Cuda>(a), db = upload<Cuda>(b);
  Tensor<float> eager = Cuda::empty<float>(Shape{m, n}), replayed = Cuda::empty<float>(Shape{m, n});
  const auto work = [&](Tensor<float>& c) {
    Cuda::gemm(Trans::no, Trans::no, 1.0f, da.cview(), db.cview(), 0.0f, c.view());
    Cuda::for_each(m * n, ops::Scale<float>{0.5f, c.data()});
  };
  work(eager);  // also makes the GEMM's plan and this thread's workspace: nothing to allocate under capture
  {
    Cuda::Graph graph = Cuda::capture([&] {
      work(replayed);
      // Scratch allocated and released inside the capture comes from the graph's pool.
      Tensor<float> scratch = Cuda::empty<float>(Shape{m, n});
      Cuda::for_each(m * n, ops::Copy<float>{replayed.data(), scratch.data()});
      r.scratch_from_pool = cuda::graph_allocator(cuda::current_device()).owns(scratch.data());
    });
    r.nodes = graph.size();
    graph.replay();
    graph.replay();  // a replay writes what the first wrote
    Cuda::synchronize();
  }
  // A copy from the host inside a capture is refused, and the stream captures no more.
  try {
    (void)Cuda::capture([&] { (void)upload<Cuda>(std::span<const float>(a.data(), 4)); });
  } catch (const Error& e) {
    r.copy_refused = std::string(e.what()).find("a copy from the host inside a graph capture") != std::string::npos;
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusActive;
  TESSERA_CUDA_CHECK(cudaStreamIsCapturing(s, &status));
  r.capture_ended = status == cudaStreamCaptureStatusNone;
  r.eager = download<Cuda>(eager);
  r.replayed = download<Cuda>(replayed);
  return r;
}

}  // namespace tessera::gpu_test
