// Row-major GEMMs on the device through cuBLASLt.
//
// Layout. tessera's operands are row-major rank-2 views with unit column stride and a
// leading dimension (ld, the row stride, which may exceed the width: a slice_cols view).
// cuBLASLt is column-major, and a row-major (r x c) matrix with leading dimension ld is
// the column-major (c x r) matrix with the same ld. So C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T: cuBLASLt's first operand is B's storage with B's transpose
// flag, its second is A's storage with A's, and its output is C's storage as an
// (n x m) column-major matrix. No data moves.
//
// Precision. float GEMMs use CUBLAS_COMPUTE_32F: fp32 products and sums, never TF32,
// so a float model on the GPU follows the CPU backend's arithmetic (up to summation
// order). bf16 GEMMs read and write bf16 (CUDA_R_16BF) and accumulate in fp32
// (CUBLAS_COMPUTE_32F); the only bf16 rounding is of the result. A bf16 GEMM may also
// write an fp32 C (the mixed-precision weight gradient, accumulated in fp32 with beta 1,
// or fp32 logits for the loss). alpha and beta are fp32 (accum_t<T>) in every case. Split-K algorithms are limited to
// cuBLASLt's COMPUTE_TYPE reduction: partial sums in an fp32 workspace, added in a
// separate pass, never in the output type nor in place in the output.
//
// Float8. gemm_float8 multiplies two float8 operands (Float8GemmOperand, backend.hpp:
// e4m3 x e4m3, or either with one e5m2) into bf16 or fp32, in the one layout cuBLASLt's
// float8 matmul takes on Hopper ("TN": both operands with the reduction along their
// stored rows, so tessera's op(A) = A, op(B) = B^T), with CUBLAS_COMPUTE_32F. The inverse
// scales go in as cuBLASLt's A and B scale pointers, single (SCALAR_32F) or one per row of
// each operand (OUTER_VEC_32F: per row of D's rows and columns); fast accumulation
// (CUBLASLT_MATMUL_DESC_FAST_ACCUM) where the caller asks. Scale pointers are part of the
// matmul descriptor, so a float8 GEMM's descriptor is made for each call (host work
// only) while its layouts and algorithm are cached as any GEMM's. It needs float8 tensor
// cores (compute capability 8.9 or later), checked once per device.
//
// Algorithms. cuBLASLt's heuristic (cublasLtMatmulAlgoGetHeuristic) picks an algorithm
// for a GEMM key: m, n, k, the transposes, the three leading dimensions, the element
// type, whether beta is zero, the device, and the byte alignment of each operand's
// pointer (capped at 256: the heuristic assumes 256-byte alignment unless told, and a
// view into the middle of a tensor is less aligned). Per key, a process-wide map guarded
// by a mutex caches a GemmPlan: the matmul descriptor, the three layouts and the
// heuristic's first choice, so descriptors are created and the heuristic runs once per
// key, and a GEMM afterwards costs one lookup and cublasLtMatmul. Plans are shared
// read-only by every thread (thread ranks on one GPU). The map holds at most
// kGemmPlanCapacity keys and starts over when a new one would exceed it, a bound no
// training step comes near (it meets a few dozen shapes).
// For benchmarks: gemm_candidates() returns every algorithm the heuristic offers for a
// GEMM, gemm() runs a given one, and gemm_chosen_algo() is the cached choice (GemmAlgo
// compares equal to the candidate it is), so the choice can be timed against the fastest.
//
// Resources. Each host thread has its own cuBLASLt handle and its own 32 MiB workspace
// per device, created on its first GEMM there (the workspace from the device's caching
// allocator) and given back when the thread ends. The workspace is not shared between
// threads even though every GEMM runs on the one compute stream (memory.hpp): one
// cublasLtMatmul may enqueue several kernels (a split-K GEMM's partial sums, then their
// reduction, both through the workspace), and another thread's launches can land between
// them. With the workspace shared, thread ranks sharing one GPU trained a wrong model by
// an amount that varied from run to run; with one each they train the right one (an
// H200, tests/gpu "Virtual ranks on one GPU").
//
// Degenerate shapes need no cuBLASLt: m == 0 or n == 0 does nothing, k == 0 sets
// C = beta * C (zero when beta is zero, whatever C held), as the CPU backend does.
//
// Errors. The operand checks and their messages are the CPU backend's. Every cuBLASLt
// call is checked by TESSERA_CUBLAS_CHECK, whose error names the call, cuBLAS's status
// name and text, and the GEMM; a shape for which the heuristic has no algorithm is an
// error naming the GEMM.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/cuda/check.hpp"
#include "tessera/backend/cuda/kernels.hpp"
#include "tessera/backend/cuda/memory.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::cuda::detail {

/// "CUBLAS_STATUS_NOT_SUPPORTED (the functionality requested is not supported)".
inline std::string cublas_status_text(cublasStatus_t status) {
  const char* name = cublasLtGetStatusName(status);
  const char* text = cublasLtGetStatusString(status);
  std::string s = name != nullptr ? std::string(name) : "cublasStatus_t " + std::to_string(static_cast<int>(status));
  if (text != nullptr && *text != '\0') s += std::string(" (") + text + ")";
  return s;
}

/// Throws for a failed cuBLASLt call: `expr` is the call's source text (its name is the
/// part before the first parenthesis), `context` what it was doing (the GEMM).
template <class... Context>
[[noreturn]] void cublas_fail(std::string_view expr, cublasStatus_t status, Context&&... context) {
  const std::string_view call = expr.substr(0, expr.find('('));
  fail("cuBLASLt: ", call, " failed: ", cublas_status_text(status), " for ", std::forward<Context>(context)...);
}

}  // namespace tessera::cuda::detail

/// Checks a cuBLASLt call; the rest of the arguments describe what it was for (the GEMM).
#define TESSERA_CUBLAS_CHECK(expr, ...)                                                        \
  do {                                                                                         \
    const cublasStatus_t tessera_cublas_status_ = (expr);                                      \
    if (tessera_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                       \
      ::tessera::cuda::detail::cublas_fail(#expr, tessera_cublas_status_, __VA_ARGS__);        \
  } while (0)

namespace tessera::cuda {

/// Bytes of cuBLASLt workspace per device.
inline constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

/// What identifies a GEMM to the algorithm cache (row-major terms, as the caller sees it).
struct GemmKey {
  int device = 0;
  DType dtype = DType::f32;    // A's and B's (float8: A's)
  DType b_dtype = DType::f32;  // B's: dtype, except a float8 GEMM's may be the other format
  DType out = DType::f32;      // C's: dtype, or float32 for a bfloat16 or float8 GEMM writing fp32
  Trans ta = Trans::no, tb = Trans::no;
  bool beta_zero = true;
  bool scaled_by_row = false;      // float8: both operands' scales one per row (else one each)
  bool fast_accumulation = false;  // float8: cuBLASLt's fast accumulation
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::uint32_t align_a = 256, align_b = 256, align_c = 256;  // pointer alignment in bytes, at most 256

  bool operator==(const GemmKey&) const = default;

  /// "float32 GEMM m=64 n=32 k=16 op(A)=A^T op(B)=B lda=64 ldb=32 ldc=32 beta=0
  /// alignment(A,B,C)=256,4,256 bytes on cuda:0".
  std::string str() const {
    auto op = [](Trans t, const char* x) { return std::string(x) + (t == Trans::yes ? "^T" : ""); };
    const bool f8 = float8();
    return tessera::detail::concat(name_of(dtype), f8 ? " x " : "", f8 ? name_of(b_dtype) : std::string_view{},
                                   f8 && scaled_by_row ? " (scaled by row)" : "",
                                   f8 && fast_accumulation ? " (fast accumulation)" : "", " GEMM",
                                   out == dtype ? "" : " into ",
                                   out == dtype ? std::string_view{} : name_of(out), " m=", m, " n=", n, " k=", k, " op(A)=", op(ta, "A"),
                                   " op(B)=", op(tb, "B"), " lda=", lda, " ldb=", ldb, " ldc=", ldc,
                                   " beta=", beta_zero ? "0" : "nonzero", " alignment(A,B,C)=", align_a, ",",
                                   align_b, ",", align_c, " bytes on cuda:", device);
  }

  /// A GEMM of float8 operands.
  bool float8() const { return dtype == DType::f8e4m3 || dtype == DType::f8e5m2; }
};

/// One algorithm the heuristic offers for a GEMM.
struct GemmAlgo {
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace_bytes = 0;  // what it needs of the device's workspace
  float waves = 0.0f;               // the heuristic's device-utilisation estimate (1: one full wave)

  /// The same algorithm and configuration.
  friend bool operator==(const GemmAlgo& x, const GemmAlgo& y) {
    return std::memcmp(&x.algo, &y.algo, sizeof(x.algo)) == 0;
  }
};

/// "algo 66 tile 21 stages 8 split-K 4 reduction 2 workspace 1048576 bytes": the
/// configuration cuBLASLt chose, for reports and failures (reduction: cuBLASLt's
/// cublasLtReductionScheme_t; split-K 1 is none).
inline std::string gemm_algo_text(const GemmAlgo& a) {
  // Each attribute read as its own type (split-K is signed, the others unsigned); -1 where unreadable.
  auto get = [&]<class V>(cublasLtMatmulAlgoConfigAttributes_t attr, V v) -> long long {
    std::size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&a.algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS)
      return -1;
    return v;
  };
  return tessera::detail::concat(
      "algo ", get(CUBLASLT_ALGO_CONFIG_ID, std::uint32_t{}), " tile ", get(CUBLASLT_ALGO_CONFIG_TILE_ID, std::uint32_t{}),
      " stages ", get(CUBLASLT_ALGO_CONFIG_STAGES_ID, std::uint32_t{}), " split-K ",
      get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, std::int32_t{}), " reduction ",
      get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, std::uint32_t{}), " workspace ", a.workspace_bytes, " bytes");
}

namespace detail {

struct GemmKeyHash {
  std::size_t operator()(const GemmKey& key) const {
    std::size_t h = 0;
    auto mix = [&h](std::uint64_t v) { h ^= std::hash<std::uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(static_cast<std::uint64_t>(key.device));
    mix(static_cast<std::uint64_t>(key.dtype) | (static_cast<std::uint64_t>(key.out) << 32) |
        (static_cast<std::uint64_t>(key.ta) << 8) |
        (static_cast<std::uint64_t>(key.tb) << 16) | (static_cast<std::uint64_t>(key.beta_zero) << 24) |
        (static_cast<std::uint64_t>(key.b_dtype) << 40) | (static_cast<std::uint64_t>(key.scaled_by_row) << 48) |
        (static_cast<std::uint64_t>(key.fast_accumulation) << 56));
    for (std::int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc}) mix(static_cast<std::uint64_t>(v));
    mix(static_cast<std::uint64_t>(key.align_a) | (static_cast<std::uint64_t>(key.align_b) << 16) |
        (static_cast<std::uint64_t>(key.align_c) << 32));
    return h;
  }
};

/// The largest power of two up to 256 that divides the address.
inline std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

/// The CPU backend's operand checks, with its messages; returns {m, n, k}.
template <class T, class C>
std::array<std::int64_t, 3> check_gemm_operands(Trans ta, Trans tb, TensorView<const T> a, TensorView<const T> b,
                                                 TensorView<C> c) {
  const std::int64_t m = c.rows(), n = c.cols();
  const std::int64_t k = ta == Trans::no ? a.cols() : a.rows();
  const std::int64_t am = ta == Trans::no ? a.rows() : a.cols();
  const std::int64_t bk = tb == Trans::no ? b.rows() : b.cols();
  const std::int64_t bn = tb == Trans::no ? b.cols() : b.rows();
  TESSERA_CHECK(a.rank() == 2 && b.rank() == 2 && c.rank() == 2, "gemm: operands must be rank 2");
  TESSERA_CHECK(am == m && bk == k && bn == n, "gemm: shapes do not chain: op(A) ", am, "x", k, ", op(B) ", bk, "x",
                bn, ", C ", m, "x", n);
  TESSERA_CHECK((a.cols() <= 1 || a.stride(1) == 1) && (b.cols() <= 1 || b.stride(1) == 1) &&
                    (c.cols() <= 1 || c.stride(1) == 1),
                "gemm: operands need unit column stride");
  return {m, n, k};
}

/// The leading dimension cuBLASLt sees: at least the width (a one-row view may carry any).
template <class T>
std::int64_t leading_dimension(const TensorView<T>& v) {
  return std::max<std::int64_t>(v.ld(), std::max<std::int64_t>(v.cols(), 1));
}

/// The cache key of a GEMM whose operands passed check_gemm_operands.
template <class T, class C>
GemmKey make_key(Trans ta, Trans tb, TensorView<const T> a, TensorView<const T> b, bool beta_zero, TensorView<C> c,
                 std::int64_t m, std::int64_t n, std::int64_t k) {
  GemmKey key;
  key.device = current_device();
  key.dtype = key.b_dtype = dtype_of<T>();
  key.out = dtype_of<C>();
  key.ta = ta;
  key.tb = tb;
  key.beta_zero = beta_zero;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = leading_dimension(a);
  key.ldb = leading_dimension(b);
  key.ldc = leading_dimension(c);
  key.align_a = alignment_of(a.data());
  key.align_b = alignment_of(b.data());
  key.align_c = alignment_of(c.data());
  return key;
}

/// One thread's cuBLASLt handles and GEMM workspaces, one of each per device, given
/// back when the thread ends. A workspace released then may still be read by a GEMM in
/// flight; the allocator hands its block only to work enqueued later, on the same stream.
struct ThreadLtResources {
  std::array<cublasLtHandle_t, kMaxDevices> handle{};
  std::array<void*, kMaxDevices> workspace{};
  ThreadLtResources() = default;
  ThreadLtResources(const ThreadLtResources&) = delete;
  ThreadLtResources& operator=(const ThreadLtResources&) = delete;
  ~ThreadLtResources() {  // a thread's exit cannot report
    for (cublasLtHandle_t h : handle)
      if (h != nullptr) (void)cublasLtDestroy(h);
    for (void* w : workspace)
      if (w != nullptr) CachingAllocator::release_to_owner(w);
  }
};

inline ThreadLtResources& thread_lt_resources(int device) {
  thread_local ThreadLtResources resources;
  TESSERA_CHECK(0 <= device && device < kMaxDevices, "CUDA backend: device ", device, " out of range");
  return resources;
}

/// The calling thread's cuBLASLt handle for `device` (the current one).
inline cublasLtHandle_t lt_handle(int device) {
  cublasLtHandle_t& h = thread_lt_resources(device).handle[static_cast<std::size_t>(device)];
  if (h == nullptr) TESSERA_CUBLAS_CHECK(cublasLtCreate(&h), "the cuBLASLt handle of cuda:", device);
  return h;
}

/// The calling thread's GEMM workspace on `device` (kGemmWorkspaceBytes), allocated on
/// its first GEMM there.
inline void* gemm_workspace(int device) {
  void*& w = thread_lt_resources(device).workspace[static_cast<std::size_t>(device)];
  if (w == nullptr) w = device_allocator(device).allocate(kGemmWorkspaceBytes, "a thread's cuBLASLt GEMM workspace");
  return w;
}

/// A heuristic preference descriptor, destroyed with this object.
struct LtPreference {
  cublasLtMatmulPreference_t pref = nullptr;
  LtPreference() = default;
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
  ~LtPreference() {
    if (pref != nullptr) (void)cublasLtMatmulPreferenceDestroy(pref);
  }
};

/// A matmul descriptor, destroyed with this object.
struct LtMatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  LtMatmulDesc() = default;
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;
  ~LtMatmulDesc() {
    if (desc != nullptr) (void)cublasLtMatmulDescDestroy(desc);
  }
};

/// A float8 GEMM's inverse scales, device pointers, in tessera's terms: A's and B's.
struct Float8Scales {
  const float* a = nullptr;
  const float* b = nullptr;
};

/// The CUDA data type of a GEMM element type.
inline cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f8e4m3: return CUDA_R_8F_E4M3;
    case DType::f8e5m2: return CUDA_R_8F_E5M2;
    default: break;
  }
  fail("CUDA backend: no GEMM of ", name_of(t), " elements");
}

/// The matmul and layout descriptors of a GEMM key (destroyed with this object).
class GemmDescriptors {
 public:
  explicit GemmDescriptors(const GemmKey& key) : key_(key) {
    try {
      create();
    } catch (...) {
      destroy();  // the destructor does not run for a constructor that throws
      throw;
    }
  }
  GemmDescriptors(const GemmDescriptors&) = delete;
  GemmDescriptors& operator=(const GemmDescriptors&) = delete;
  ~GemmDescriptors() { destroy(); }

  /// Up to `max_count` algorithms for the key, the heuristic's best estimate first.
  /// `scales`: a float8 GEMM's (its descriptor made with them), else none.
  std::vector<GemmAlgo> heuristic(cublasLtHandle_t handle, int max_count, const Float8Scales* scales = nullptr) const {
    TESSERA_CHECK(max_count > 0, "gemm_candidates: max_count must be positive, not ", max_count);
    LtPreference guard;
    TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&guard.pref), key_.str());
    const cublasLtMatmulPreference_t pref = guard.pref;
    const std::uint64_t workspace = kGemmWorkspaceBytes;
    TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &workspace, sizeof(workspace)),
                         key_.str());
    // The first operand is B's storage, the second A's; C and D are both C's.
    const std::uint32_t align[4] = {key_.align_b, key_.align_a, key_.align_c, key_.align_c};
    const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
      TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof(align[i])),
                           key_.str());
    // Split-K partial sums go to an fp32 workspace and are reduced in a separate pass:
    // never in the (bf16) output type, never in place in the output.
    const std::uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                              &reduction, sizeof(reduction)),
                         key_.str());
    // Not a std::vector: nvcc's front end fails on destroying the unnamed struct's elements.
    const auto results = std::make_unique<cublasLtMatmulHeuristicResult_t[]>(static_cast<std::size_t>(max_count));
    int returned = 0;
    LtMatmulDesc scaled;
    const cublasLtMatmulDesc_t op = matmul_desc(scales, scaled);
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, op, first_, second_, out_, out_, pref,
                                                                 max_count, results.get(), &returned);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED) returned = 0;  // no heuristic for this configuration
    else if (status != CUBLAS_STATUS_SUCCESS)
      detail::cublas_fail("cublasLtMatmulAlgoGetHeuristic", status, key_.str());
    std::vector<GemmAlgo> algos;
    for (int i = 0; i < std::min(returned, max_count); ++i) {
      const auto& r = results[static_cast<std::size_t>(i)];
      if (r.state == CUBLAS_STATUS_SUCCESS && r.workspaceSize <= kGemmWorkspaceBytes)
        algos.push_back(GemmAlgo{r.algo, r.workspaceSize, r.wavesCount});
    }
    if (algos.empty())
      fail("cuBLASLt has no algorithm for the ", key_.str(),
           status == CUBLAS_STATUS_NOT_SUPPORTED ? " (cublasLtMatmulAlgoGetHeuristic: CUBLAS_STATUS_NOT_SUPPORTED)"
                                                 : "");
    return algos;
  }

  /// Runs D = alpha op(A) op(B) + beta C with `algo` on the compute stream, C and D of
  /// one layout (the same matrix, or C read apart from D); `scales`: a float8 GEMM's.
  void run(cublasLtHandle_t handle, const GemmAlgo& algo, const float* alpha, const void* a, const void* b,
           const float* beta, const void* c, void* d, void* workspace, const Float8Scales* scales = nullptr) const {
    LtMatmulDesc scaled;
    const cublasLtMatmulDesc_t op = matmul_desc(scales, scaled);
    TESSERA_CUBLAS_CHECK(cublasLtMatmul(handle, op, alpha, b, first_, a, second_, beta, c, out_, d, out_, &algo.algo,
                                        workspace, kGemmWorkspaceBytes, compute_stream()),
                         key_.str());
  }

 private:
  /// The descriptor a call uses: the cached one, or for a float8 GEMM one made in `made`
  /// with its scale pointers (cuBLASLt's first operand is B's storage: its scale is B's).
  cublasLtMatmulDesc_t matmul_desc(const Float8Scales* scales, LtMatmulDesc& made) const {
    if (!key_.float8()) return op_;
    TESSERA_CHECK(scales != nullptr && scales->a != nullptr && scales->b != nullptr, "CUDA backend: the ",
                  key_.str(), " was given no scales");
    make_op(made.desc);
    const void* first_scale = scales->b;
    const void* second_scale = scales->a;
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(made.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &first_scale,
                                                        sizeof(first_scale)),
                         key_.str());
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(made.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                        &second_scale, sizeof(second_scale)),
                         key_.str());
    return made.desc;
  }

  /// A matmul descriptor with the key's transposes and, for float8, its accumulation and
  /// scale modes.
  void make_op(cublasLtMatmulDesc_t& op) const {
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), key_.str());
    // cuBLASLt's first operand is B's storage, its second A's (see the header comment).
    const std::int32_t trans_first = key_.tb == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
    const std::int32_t trans_second = key_.ta == Trans::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_first, sizeof(trans_first)),
        key_.str());
    TESSERA_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_second, sizeof(trans_second)),
        key_.str());
    if (!key_.float8()) return;
    const std::int8_t fast = key_.fast_accumulation ? 1 : 0;
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                         key_.str());
    if (key_.scaled_by_row) {
      // One scale per row of each operand as stored: per row of D (tessera's A) and per
      // column (tessera's B), cuBLASLt's M and N.
      const std::int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      for (const cublasLtMatmulDescAttributes_t attr : {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE})
        TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, attr, &mode, sizeof(mode)), key_.str());
    }
  }

  void create() {
    const bool plain = (key_.dtype == DType::f32 || key_.dtype == DType::bf16) && key_.b_dtype == key_.dtype &&
                       (key_.out == key_.dtype || key_.out == DType::f32);
    const bool float8 = key_.float8() && (key_.b_dtype == DType::f8e4m3 || key_.b_dtype == DType::f8e5m2) &&
                        !(key_.dtype == DType::f8e5m2 && key_.b_dtype == DType::f8e5m2) &&
                        (key_.out == DType::bf16 || key_.out == DType::f32) && key_.ta == Trans::no &&
                        key_.tb == Trans::yes;
    TESSERA_CHECK(plain || float8, "CUDA backend: the ", key_.str(),
                  " is not supported (float32, bfloat16, bfloat16 into float32, and float8 in cuBLASLt's layout "
                  "into bfloat16 or float32 are)");
    // The first operand is B's storage, the second A's.
    const cudaDataType_t type = cuda_data_type(key_.dtype), first_type = cuda_data_type(key_.b_dtype);
    const cudaDataType_t out_type = cuda_data_type(key_.out);
    make_op(op_);
    // Row-major (r x c) storage is column-major (c x r): B is (k x n) as stored, or (n x k)
    // when used transposed; A is (m x k), or (k x m); C is (m x n).
    const auto b_rows = static_cast<std::uint64_t>(key_.tb == Trans::no ? key_.k : key_.n);
    const auto b_cols = static_cast<std::uint64_t>(key_.tb == Trans::no ? key_.n : key_.k);
    const auto a_rows = static_cast<std::uint64_t>(key_.ta == Trans::no ? key_.m : key_.k);
    const auto a_cols = static_cast<std::uint64_t>(key_.ta == Trans::no ? key_.k : key_.m);
    TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&first_, first_type, b_cols, b_rows, key_.ldb), key_.str());
    TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&second_, type, a_cols, a_rows, key_.lda), key_.str());
    TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&out_, out_type, static_cast<std::uint64_t>(key_.n),
                                                    static_cast<std::uint64_t>(key_.m), key_.ldc),
                         key_.str());
  }

  void destroy() noexcept {
    if (out_ != nullptr) (void)cublasLtMatrixLayoutDestroy(out_);
    if (second_ != nullptr) (void)cublasLtMatrixLayoutDestroy(second_);
    if (first_ != nullptr) (void)cublasLtMatrixLayoutDestroy(first_);
    if (op_ != nullptr) (void)cublasLtMatmulDescDestroy(op_);
    out_ = second_ = first_ = nullptr;
    op_ = nullptr;
  }

  GemmKey key_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t first_ = nullptr;   // B's storage
  cublasLtMatrixLayout_t second_ = nullptr;  // A's storage
  cublasLtMatrixLayout_t out_ = nullptr;     // C's storage (both C and D)
};

/// What a GEMM key needs to run: its descriptors and layouts, and the heuristic's first
/// choice. Shared read-only by every thread that runs the key (cuBLASLt only reads them).
struct GemmPlan {
  GemmDescriptors desc;
  GemmAlgo algo;
  GemmPlan(const GemmKey& key, cublasLtHandle_t handle, const Float8Scales* scales)
      : desc(key), algo(desc.heuristic(handle, 1, scales).front()) {}
};

/// Keys the plan cache holds at most; meeting one more starts it over (plans in use stay
/// alive with their callers).
inline constexpr std::size_t kGemmPlanCapacity = 1024;

/// The process-wide cache of GEMM plans.
struct GemmPlanCache {
  std::mutex mutex;
  std::unordered_map<GemmKey, std::shared_ptr<const GemmPlan>, GemmKeyHash> plans;
};

inline GemmPlanCache& gemm_plan_cache() {
  static GemmPlanCache* cache = new GemmPlanCache;  // immortal: GEMMs may run during static teardown
  return *cache;
}

/// The cached plan of `key`, made on a miss (descriptors created and the heuristic asked
/// outside the lock; when two threads miss at once, the first to insert wins).
inline std::shared_ptr<const GemmPlan> gemm_plan(const GemmKey& key, cublasLtHandle_t handle,
                                                 const Float8Scales* scales = nullptr) {
  auto& cache = gemm_plan_cache();
  {
    std::lock_guard lock(cache.mutex);
    if (auto it = cache.plans.find(key); it != cache.plans.end()) return it->second;
  }
  auto made = std::make_shared<const GemmPlan>(key, handle, scales);
  std::lock_guard lock(cache.mutex);
  if (auto it = cache.plans.find(key); it != cache.plans.end()) return it->second;
  if (cache.plans.size() >= kGemmPlanCapacity) cache.plans.clear();
  return cache.plans.emplace(key, std::move(made)).first->second;
}

/// C = beta * C over a (rows x cols) view with row stride ld: the k == 0 GEMM.
template <class T>
struct ScaleMatrix {
  T* c;
  std::int64_t cols, ld;
  float beta;
  TESSERA_HD void operator()(std::int64_t i) const {
    T& x = c[(i / cols) * ld + i % cols];
    x = convert<T>(beta * convert<float>(x));
  }
};

/// The k == 0 GEMM: C = beta * C, and zero (not beta times a NaN) when beta is zero.
template <class T>
void scale_or_zero(float beta, TensorView<T> c, std::int64_t m, std::int64_t n) {
  const std::int64_t ld = leading_dimension(c);
  if (beta == 0.0f) {
    TESSERA_CUDA_CHECK(cudaMemset2DAsync(c.data(), static_cast<std::size_t>(ld) * sizeof(T), 0,
                                         static_cast<std::size_t>(n) * sizeof(T), static_cast<std::size_t>(m),
                                         compute_stream()));
  } else {
    tessera::cuda::launch_op(m * n, ScaleMatrix<T>{c.data(), n, ld, beta}, compute_stream());
  }
}

/// The k == 0 GEMM with C read apart from D (of D's leading dimension): D = beta * C,
/// and zero when beta is zero.
template <class T>
void scale_or_zero(float beta, TensorView<const T> c, TensorView<T> d, std::int64_t m, std::int64_t n) {
  if (beta != 0.0f && c.data() != d.data()) {
    const std::size_t pitch = static_cast<std::size_t>(leading_dimension(d)) * sizeof(T);
    TESSERA_CUDA_CHECK(cudaMemcpy2DAsync(d.data(), pitch, c.data(), pitch, static_cast<std::size_t>(n) * sizeof(T),
                                         static_cast<std::size_t>(m), cudaMemcpyDeviceToDevice, compute_stream()));
  }
  scale_or_zero(beta, d, m, n);
}

template <class T, class C>
constexpr void check_element_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>, "tessera: Cuda::gemm supports float and bf16");
  static_assert(std::is_same_v<C, T> || std::is_same_v<C, float>,
                "tessera: Cuda::gemm writes C as its operands' type, or float32 from bf16 operands");
}

}  // namespace detail

/// The cache key of a GEMM: what its algorithm is chosen (and cached) for. The operands
/// are checked as gemm() checks them.
template <class T, class C>
GemmKey gemm_key(Trans ta, Trans tb, TensorView<const T> a, TensorView<const T> b, accum_t<T> beta, TensorView<C> c) {
  detail::check_element_type<T, C>();
  require_device();
  const std::array<std::int64_t, 3> mnk = detail::check_gemm_operands(ta, tb, a, b, c);
  return detail::make_key(ta, tb, a, b, static_cast<float>(beta) == 0.0f, c, mnk[0], mnk[1], mnk[2]);
}

/// Every algorithm cuBLASLt's heuristic offers for this GEMM (at most `max_count`), its
/// best estimate first; empty for a degenerate GEMM (m, n or k zero), which runs no
/// cuBLASLt kernel. Each can be passed to gemm().
template <class T, class C>
std::vector<GemmAlgo> gemm_candidates(Trans ta, Trans tb, TensorView<const T> a, TensorView<const T> b,
                                      accum_t<T> beta, TensorView<C> c, int max_count = 32) {
  const GemmKey key = gemm_key(ta, tb, a, b, beta, c);
  if (key.m == 0 || key.n == 0 || key.k == 0) return {};
  const cublasLtHandle_t handle = detail::lt_handle(key.device);
  return detail::gemm_plan(key, handle)->desc.heuristic(handle, max_count);
}

/// The algorithm gemm() runs for this GEMM when given none: the heuristic's first
/// choice, cached. Throws for a degenerate GEMM, which runs none.
template <class T, class C>
GemmAlgo gemm_chosen_algo(Trans ta, Trans tb, TensorView<const T> a, TensorView<const T> b, accum_t<T> beta,
                          TensorView<C> c) {
  const GemmKey key = gemm_key(ta, tb, a, b, beta, c);
  TESSERA_CHECK(key.m != 0 && key.n != 0 && key.k != 0, "gemm_chosen_algo: the ", key.str(),
                " is degenerate and runs no cuBLASLt algorithm");
  return detail::gemm_plan(key, detail::lt_handle(key.device))->algo;
}

/// C = alpha * op(A) * op(B) + beta * C, row-major, on the current device's compute
/// stream (asynchronous to the host). `algo`: one of gemm_candidates() for this GEMM,
/// or nullptr for the cached heuristic choice.
template <class T, class C>
void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b, accum_t<T> beta,
          TensorView<C> c, const GemmAlgo* algo = nullptr) {
  const GemmKey key = gemm_key(ta, tb, a, b, beta, c);
  const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
  if (key.m == 0 || key.n == 0) return;
  if (key.k == 0) {
    detail::scale_or_zero(beta32, c, key.m, key.n);
    return;
  }
  const cublasLtHandle_t handle = detail::lt_handle(key.device);
  const std::shared_ptr<const detail::GemmPlan> plan = detail::gemm_plan(key, handle);
  plan->desc.run(handle, algo != nullptr ? *algo : plan->algo, &alpha32, a.data(), b.data(), &beta32, c.data(),
                 c.data(), detail::gemm_workspace(key.device));
}

/// D = alpha * op(A) * op(B) + beta * C, C read apart from D (of D's shape and leading
/// dimension: check_gemm_out_of_place), one cublasLtMatmul on the current device's compute
/// stream: D is rounded once from the fp32 alpha op(A) op(B) + beta C. Cached by D's key,
/// its C alignment the lesser of C's and D's.
template <class T, class C>
void gemm(Trans ta, Trans tb, accum_t<T> alpha, TensorView<const T> a, TensorView<const T> b, accum_t<T> beta,
          TensorView<const C> c, TensorView<C> d) {
  check_gemm_out_of_place(ta, tb, a, b, c, d);
  GemmKey key = gemm_key(ta, tb, a, b, beta, d);
  key.align_c = std::min(key.align_c, detail::alignment_of(c.data()));
  const float alpha32 = static_cast<float>(alpha), beta32 = static_cast<float>(beta);
  if (key.m == 0 || key.n == 0) return;
  if (key.k == 0) {
    detail::scale_or_zero(beta32, c, d, key.m, key.n);
    return;
  }
  const cublasLtHandle_t handle = detail::lt_handle(key.device);
  const std::shared_ptr<const detail::GemmPlan> plan = detail::gemm_plan(key, handle);
  plan->desc.run(handle, plan->algo, &alpha32, a.data(), b.data(), &beta32, c.data(), d.data(),
                 detail::gemm_workspace(key.device));
}

/// Whether `device` has float8 tensor cores (compute capability 8.9 or later), asked once.
inline bool has_float8_gemms(int device) {
  static std::array<std::atomic<int>, kMaxDevices> capability{};  // major * 10 + minor; 0: not asked yet
  TESSERA_CHECK(0 <= device && device < kMaxDevices, "CUDA backend: device ", device, " out of range");
  std::atomic<int>& known = capability[static_cast<std::size_t>(device)];
  int cc = known.load(std::memory_order_relaxed);
  if (cc == 0) {
    int major = 0, minor = 0;
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cc = major * 10 + minor;
    known.store(cc, std::memory_order_relaxed);
  }
  return cc >= 89;
}

/// C = (A B^T) * a.inverse[.] * b.inverse[.] + beta C: two float8 operands (each its
/// reduction along its rows) into bf16 or fp32 C, through cuBLASLt's float8 matmul, on
/// the current device's compute stream. A single scale beside a scaled-by-row operand is
/// refused (check_float8_gemm): nn::float8_gemm spreads it over the rows first.
/// `c_in`: C read apart from the D written (`c`), of its shape and leading dimension
/// (cuBLASLt's out-of-place matmul: one pass, D rounded once); or C itself.
template <class C>
void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<const C> c_in,
                 TensorView<C> c, bool fast_accumulation) {
  static_assert(std::is_same_v<C, float> || std::is_same_v<C, bf16>,
                "tessera: Cuda::gemm_float8 writes bfloat16 or float32");
  require_device();
  const GemmSizes s = check_float8_gemm(a, b, c);
  if (c_in.data() != c.data()) check_float8_gemm_input(c_in, c);
  if (s.m == 0 || s.n == 0) return;
  const int device = current_device();
  if (!has_float8_gemms(device)) {
    int major = 0, minor = 0;
    (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    fail("float8.emulate = false: cuda:", device, " (compute capability ", major, ".", minor,
         ") has no float8 tensor cores (8.9 or later); set float8.emulate = true to run float8 GEMMs emulated");
  }
  if (s.k == 0) {
    detail::scale_or_zero(beta, c_in, c, s.m, s.n);
    return;
  }
  GemmKey key;
  key.device = device;
  key.dtype = a.format;
  key.b_dtype = b.format;
  key.out = dtype_of<C>();
  key.ta = Trans::no;
  key.tb = Trans::yes;
  key.beta_zero = beta == 0.0f;
  key.scaled_by_row = a.per_row;
  key.fast_accumulation = fast_accumulation;
  key.m = s.m;
  key.n = s.n;
  key.k = s.k;
  key.lda = key.ldb = s.k;
  key.ldc = detail::leading_dimension(c);
  key.align_a = detail::alignment_of(a.data);
  key.align_b = detail::alignment_of(b.data);
  key.align_c = std::min(detail::alignment_of(c.data()), detail::alignment_of(c_in.data()));
  const detail::Float8Scales scales{a.inverse, b.inverse};
  const cublasLtHandle_t handle = detail::lt_handle(device);
  const std::shared_ptr<const detail::GemmPlan> plan = detail::gemm_plan(key, handle, &scales);
  const float alpha = 1.0f;
  plan->desc.run(handle, plan->algo, &alpha, a.data, b.data, &beta, c_in.data(), c.data(),
                 detail::gemm_workspace(device), &scales);
}

/// C = (A B^T) * a.inverse[.] * b.inverse[.] + beta C, in place.
template <class C>
void gemm_float8(const Float8GemmOperand& a, const Float8GemmOperand& b, float beta, TensorView<C> c,
                 bool fast_accumulation) {
  gemm_float8<C>(a, b, beta, TensorView<const C>(c), c, fast_accumulation);
}

/// GEMM keys whose plans are cached now.
inline std::size_t gemm_plans_cached() {
  auto& cache = detail::gemm_plan_cache();
  std::lock_guard lock(cache.mutex);
  return cache.plans.size();
}

/// Empties the plan cache: the next GEMM of each key creates its descriptors and asks the
/// heuristic again (for tests and benchmarks; plans in use stay alive with their callers).
inline void clear_gemm_plans() {
  auto& cache = detail::gemm_plan_cache();
  std::lock_guard lock(cache.mutex);
  cache.plans.clear();
}

}  // namespace tessera::cuda
