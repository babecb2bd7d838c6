// bench-kernels: tessera's GPU kernels on one device, each against a ceiling measured in
// the same run.
//
//   0. Ceilings: a 8192^3 GEMM in bf16 and in fp32 (no TF32) through Cuda::gemm, and a
//      device-to-device cudaMemcpyAsync (bytes read + bytes written).
//   1. GEMMs: the ones one training step of each flavor issues at batch 1 x --tokens (no
//      checkpointing), as llama-plan traces the step (bench/step_gemms.hpp): the
//      projections that read one input as one GEMM (wq/wk/wv, w1/w3), wo and w2 reading
//      the residual as their C (beta 1: timed in place, the same bytes), each weight's
//      gradient written first (beta 0) into fp32, the loss head's chunks (fp32 logits,
//      the chunks' dW summed), so a change to the model changes what is timed. Each
//      distinct GEMM once, with how often the step issues it; bf16 operands into the
//      step's own C type, and again in fp32 throughout (--dtypes). FLOPs 2 m n k. Per
//      GEMM: the time of Cuda::gemm's cached heuristic choice, and the best time among
//      cuBLASLt's heuristic candidates (cuda::gemm_candidates): every candidate is
//      screened with a short timing, the fastest --finalists are timed in full beside
//      the heuristic choice, and the best of those is compared with it (target: the
//      heuristic at >= 95% of the best rate). The best candidate's output is compared
//      with the heuristic's (relative L2 difference; into bf16 <= 1e-2, into fp32 <= 1e-4).
//      --list-gemms prints the cases and exits, without a GPU.
//   2. Attention (GQA) on each flavor's heads at each --attention-seqs T, batch =
//      tokens / T (at least 1): tessera's flash kernels (cuda::flash_attention_forward /
//      _backward) in bf16 and fp32 storage, and in bf16 cuDNN's fused attention through
//      the engine training installs (Cuda::attention_forward / _backward after
//      cuda::select_attention("cudnn"); a row saying why where cuDNN cannot run). In
//      bf16, each also without a mask (full: a context-parallel block off the diagonal)
//      and over packed documents (docs: training.document_mask, documents of T/32 to T/4
//      tokens, tessera's kernels bounding each row and cuDNN's variable-length attention)
//      at the same T; cuDNN's causal rows also in the step's layout (qkv: q, k and v the
//      column blocks of one matrix, as the fused wq/wk/wv projection writes them, and dq,
//      dk, dv into one such matrix). FLOPs: forward 4 B H T^2 hd / 2 causal (half the
//      score matrix), 4 B H T^2 hd full, 4 H hd x the sum of each document's L^2 / 2 over
//      documents, with the full-matrix count (torchtitan's convention) beside it;
//      backward 2.5 x forward.
//      Target: causal forward >= 450 TFLOP/s at hd 128, T 8192, bf16, for the attention
//      a bf16 training run uses (cuDNN where it runs, else tessera's kernels).
//   3. Memory-bound ops on --memory-flavor's shapes (float32: the ops/ functors compute
//      in their storage type): RMSNorm forward and backward (input and weight passes),
//      RoPE forward (q rotated into a new tensor) and backward (dq in place), SwiGLU
//      forward and backward, cross-entropy on one chunk of the output head's logits
//      (gradient in place), launched through Cuda::for_each as the layers launch them
//      (the ops' own kernels, backend/cuda/row_kernels.cuh).
//      Bytes = each tensor read once + each output written once; GB/s is set against a
//      device-to-device copy moving the same bytes, timed alongside.
//
//   4. Float8 GEMMs (--sections float8, not by default): the float8 GEMMs of the
//      tensorwise step (its traced step, as section 1's; float8 layers run one by one, and
//      the output projection stays bf16) in cuBLASLt's float8 layout (op(A) = A,
//      op(B) = B^T, each operand's reduction along its rows) into the step's C: by one
//      scale a tensor (tensorwise: the first operand in the step's format, e5m2 for a
//      gradient) and by one a row (rowwise: e4m3 x e4m3, outer-vector scales), fast
//      accumulation on the forward's (e4m3 x e4m3) as torchao, beside the bf16 GEMM of the
//      same shape in the same layout; TFLOP/s and the gain over bf16, the figures
//      llama-plan's [gemm.fp8_efficiency] is to be measured by. Then the casts that feed
//      them (nn::cast_to_float8: amax, scale, cast; as stored and transposed, by rows, and
//      into both layouts by one scale: nn::cast_to_float8_both_layouts)
//      on each case's first operand, in GB/s against a device copy of the same bytes.
//
// Method (CUDA events): half a second of untimed GEMMs first (clocks up, first-use
// costs paid); then per timed thing one warm-up call, one timed call to size the trial,
// and --trials trials of N back-to-back calls (N so a trial lasts >= --trial-ms, at most
// 256); the time per call is the median over trials. Variants compared with each
// other are timed in turn within each trial. Inputs are uniform random, never zeros;
// when one set of a call's operands is smaller than 3x the L2 cache, the calls rotate
// over several sets so that they read device memory, not the cache. Every CUDA and
// cuBLASLt call is checked. A trial whose calls took the host about as long to issue as the device to
// run is marked "host-bound": the figure then includes launch gaps.
//
// Exit status: 0; 1 on an error or when no CUDA device is visible; 2 when a check
// failed (the best GEMM candidate disagreeing with the heuristic's result, or a
// non-finite attention or memory-op output), after everything is printed.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/cuda/cuda.cuh"
#include "tessera/backend/cuda/select_attention.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/core/units.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/nn/float8.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/ops/attention_shape.hpp"
#include "tessera/ops/positions.hpp"
#include "tessera/ops/ragged_documents.hpp"
#include "tessera/ops/rmsnorm.hpp"
#include "tessera/ops/rope.hpp"
#include "tessera/ops/swiglu.hpp"

#include "machine.hpp"
#include "step_gemms.hpp"

namespace {

using namespace tessera::bench;
using tessera::AttentionShape;
using tessera::bf16;
using tessera::Cuda;
using tessera::decimal_bytes;
using tessera::DType;
using tessera::Shape;
using tessera::Tensor;
using tessera::TensorView;
using tessera::Trans;
using clock_type = std::chrono::steady_clock;
using json = nlohmann::json;
namespace tcuda = tessera::cuda;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------
// Options.

struct Options {
  std::int64_t tokens = 8192;
  std::vector<std::string> flavors = {"llama3.2_1b", "llama3.2_3b", "llama3_8b"};
  std::vector<std::int64_t> attention_seqs = {8192, 2048};
  std::vector<DType> dtypes = {DType::bf16, DType::f32};
  bool ceilings = true, gemm = true, attention = true, memory = true;
  bool sm_hold = false;  // not by default: run.sh's gemms step asks for it
  bool float8 = false;   // not by default: run.sh's float8 step asks for it
  std::vector<std::int64_t> held_sms = {1, 2, 4, 8, 16, 24, 32};
  std::string memory_flavor = "llama3_8b";
  std::int64_t trials = 5;
  double trial_ms = 20;
  double screen_ms = 5;
  std::int64_t candidates = 32;
  std::int64_t finalists = 3;
  std::string json_path;
  std::string commit = "-";
  double device_memory_gib = 0;  // the memory the step's trace sizes its loss-head chunks for (0: the device's)
  bool list_gemms = false;       // print the step's GEMM cases and exit, touching no device
};

constexpr const char* usage =
    "usage: bench-kernels [--tokens N] [--flavors a,b] [--attention-seqs T1,T2] [--dtypes bf16,fp32]\n"
    "                     [--sections ceilings,gemm,attention,memory,sm-hold,float8] [--memory-flavor NAME] [--held-sms A,B]\n"
    "                     [--trials N] [--trial-ms X] [--screen-ms X] [--candidates N] [--finalists N]\n"
    "                     [--json FILE] [--commit HASH] [--device-memory-gib X] [--list-gemms]\n"
    "  tessera's GPU kernels on one device: cuBLASLt GEMMs on the Llama 3 shapes (heuristic choice against the\n"
    "  best candidate), GQA flash attention (causal; in bf16 full too), and the memory-bound ops against a device copy; sm-hold\n"
    "  (not by default): each bf16 GEMM of --memory-flavor with --held-sms SMs held by spinning blocks, against\n"
    "  llama-plan's sm / (sm - held) for a GEMM beside an NCCL collective (plan/cluster.hpp).\n"
    "  The GEMMs are those one training step issues (batch 1 x --tokens, no checkpointing; float8: the tensorwise\n"
    "  step's), as llama-plan traces it; --list-gemms prints them and exits without a GPU (with --device-memory-gib,\n"
    "  the memory the loss head's chunks are sized for; by default the device's).\n"
    "  defaults: --tokens 8192 --flavors llama3.2_1b,llama3.2_3b,llama3_8b --attention-seqs 8192,2048\n"
    "            --dtypes bf16,fp32 --sections ceilings,gemm,attention,memory --memory-flavor llama3_8b\n"
    "            --trials 5 --trial-ms 20 --screen-ms 5 --candidates 32 --finalists 3 --held-sms 1,2,4,8,16,24,32\n";

std::vector<std::string> split_list(std::string_view flag, std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view item : split_commas(text)) {
    TESSERA_CHECK(!item.empty(), flag, ": empty item in '", text, "'");
    out.emplace_back(item);
  }
  return out;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--tokens") o.tokens = parse_count(flag, f.value(), 1);
    else if (flag == "--flavors") o.flavors = split_list(flag, f.value());
    else if (flag == "--attention-seqs") {
      o.attention_seqs.clear();
      for (const auto& s : split_list(flag, f.value())) o.attention_seqs.push_back(parse_count(flag, s, 1));
    } else if (flag == "--dtypes") {
      o.dtypes.clear();
      for (const auto& s : split_list(flag, f.value())) {
        const DType d = tessera::parse_dtype(s, "--dtypes");
        TESSERA_CHECK(d != DType::f64, "--dtypes: float64 is not benchmarked (bf16 and fp32 are)");
        if (std::find(o.dtypes.begin(), o.dtypes.end(), d) == o.dtypes.end()) o.dtypes.push_back(d);
      }
    } else if (flag == "--sections") {
      o.ceilings = o.gemm = o.attention = o.memory = o.sm_hold = o.float8 = false;
      for (const auto& s : split_list(flag, f.value())) {
        if (s == "ceilings") o.ceilings = true;
        else if (s == "gemm") o.gemm = true;
        else if (s == "attention") o.attention = true;
        else if (s == "memory") o.memory = true;
        else if (s == "sm-hold") o.sm_hold = true;
        else if (s == "float8") o.float8 = true;
        else tessera::fail("--sections: unknown section '", s, "' (ceilings, gemm, attention, memory, sm-hold, float8)");
      }
    } else if (flag == "--held-sms") {
      o.held_sms.clear();
      for (const auto& s : split_list(flag, f.value())) o.held_sms.push_back(parse_count(flag, s, 1));
    } else if (flag == "--memory-flavor") o.memory_flavor = std::string(f.value());
    else if (flag == "--trials") o.trials = parse_count(flag, f.value(), 1);
    else if (flag == "--trial-ms") o.trial_ms = parse_positive(flag, f.value(), "milliseconds");
    else if (flag == "--screen-ms") o.screen_ms = parse_positive(flag, f.value(), "milliseconds");
    else if (flag == "--candidates") o.candidates = parse_count(flag, f.value(), 1);
    else if (flag == "--finalists") o.finalists = parse_count(flag, f.value(), 1);
    else if (flag == "--json") o.json_path = std::string(f.value());
    else if (flag == "--commit") o.commit = std::string(f.value());
    else if (flag == "--device-memory-gib") o.device_memory_gib = parse_positive(flag, f.value(), "GiB");
    else if (flag == "--list-gemms") o.list_gemms = true;
    else if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else {
      f.unknown();
    }
  }
  TESSERA_CHECK(o.candidates <= 1024, "--candidates: at most 1024, got ", o.candidates);
  for (const auto& f : o.flavors) (void)tessera::nn::model_flavor(f);  // unknown names fail here, listing the known
  (void)tessera::nn::model_flavor(o.memory_flavor);
  return o;
}

std::string dtype_label(DType d) { return d == DType::bf16 ? "bf16" : "fp32"; }

/// The device memory the step's trace sizes its loss-head chunks for: --device-memory-gib,
/// else the current device's.
std::size_t device_bytes(const Options& o) {
  if (o.device_memory_gib > 0) return static_cast<std::size_t>(o.device_memory_gib * double(std::size_t{1} << 30));
  return Cuda::device_memory_bytes();
}

std::string fmt(const char* format, double v) {
  char s[64];
  std::snprintf(s, sizeof s, format, v);
  return s;
}


// ---------------------------------------------------------------------------------------
// The device.

struct DeviceInfo {
  int index = 0;
  std::string name, pci;
  int cc_major = 0, cc_minor = 0, sms = 0;
  int sm_clock_khz = 0, memory_clock_khz = 0, bus_bits = 0;
  double l2_bytes = 0, memory_bytes = 0;
  int driver = 0, runtime = 0;
  std::size_t cublaslt = 0;

  /// 2 transfers per memory clock over the bus, by the device's attributes.
  double attribute_bandwidth() const { return 2.0 * memory_clock_khz * 1e3 * bus_bits / 8.0; }
};

int device_attribute(cudaDeviceAttr attr, int device) {
  int v = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, device));
  return v;
}

DeviceInfo read_device() {
  DeviceInfo d;
  TESSERA_CUDA_CHECK(cudaGetDevice(&d.index));
  cudaDeviceProp p{};
  TESSERA_CUDA_CHECK(cudaGetDeviceProperties(&p, d.index));
  d.name = p.name;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.sms = p.multiProcessorCount;
  d.l2_bytes = double(p.l2CacheSize);
  d.memory_bytes = double(p.totalGlobalMem);
  d.bus_bits = p.memoryBusWidth;
  d.sm_clock_khz = device_attribute(cudaDevAttrClockRate, d.index);
  d.memory_clock_khz = device_attribute(cudaDevAttrMemoryClockRate, d.index);
  char pci[32] = {};
  TESSERA_CUDA_CHECK(cudaDeviceGetPCIBusId(pci, sizeof pci, d.index));
  d.pci = pci;
  TESSERA_CUDA_CHECK(cudaDriverGetVersion(&d.driver));
  TESSERA_CUDA_CHECK(cudaRuntimeGetVersion(&d.runtime));
  d.cublaslt = cublasLtGetVersion();
  return d;
}

/// 13000 -> "13.0" (CUDA's version numbers: 1000 x major + 10 x minor).
std::string cuda_version_text(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

/// 130001 -> "13.0.1" (cuBLASLt's: 10000 x major + 100 x minor + patch).
std::string cublaslt_version_text(std::size_t v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

// ---------------------------------------------------------------------------------------
// Device data: random fills and row-wise comparisons, as ops-style functors.

/// x[i] = uniform in [lo, hi) from Philox(seed) at counter i.
template <class T>
struct FillUniform {
  T* x;
  std::uint64_t seed;
  float lo, hi;
  TESSERA_HD void operator()(std::int64_t i) const {
    const tessera::Philox4x32 g(seed);
    std::uint32_t w[4];
    g.draw(static_cast<std::uint64_t>(i), 0, 0, w);
    const float u = static_cast<float>(w[0] >> 8) * (1.0f / 16777216.0f);
    x[i] = tessera::convert<T>(lo + (hi - lo) * u);
  }
};

/// Per row r: the squared L2 norm of (a - b) and of b, and the number of non-finite
/// values in a. With b null, only a's norm (in ref2) and its non-finite count.
template <class T>
struct RowCompare {
  const T* a;
  std::int64_t lda;
  const T* b;
  std::int64_t ldb;
  std::int64_t cols;
  double* diff2;
  double* ref2;
  double* nonfinite;
  __device__ void operator()(std::int64_t r) const {
    double d = 0, s = 0, bad = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const float x = tessera::convert<float>(a[r * lda + j]);
      if ((__float_as_uint(x) & 0x7f800000u) == 0x7f800000u) bad += 1;
      if (b != nullptr) {
        const double y = tessera::convert<float>(b[r * ldb + j]);
        d += (double(x) - y) * (double(x) - y);
        s += y * y;
      } else {
        s += double(x) * double(x);
      }
    }
    diff2[r] = d;
    ref2[r] = s;
    nonfinite[r] = bad;
  }
};

std::uint64_t next_seed() {
  static std::uint64_t seed = 0x7e55e7a;
  return ++seed;
}

template <class T>
void fill_uniform(const Tensor<T>& t, float lo, float hi) {
  Cuda::for_each(t.numel(), FillUniform<T>{t.data(), next_seed(), lo, hi});
}

template <class T>
Tensor<T> random_tensor(Shape shape, float lo, float hi) {
  Tensor<T> t = Cuda::empty<T>(shape);
  fill_uniform(t, lo, hi);
  return t;
}

struct Comparison {
  double rel_diff = kNaN;  // ||a - b|| / ||b||
  double nonfinite = 0;    // non-finite values in a
};

/// Compares a with b (same shape) on the device, or counts a's non-finite values when
/// b has no data.
template <class T>
Comparison compare(TensorView<const T> a, TensorView<const T> b) {
  const std::int64_t rows = a.rows(), cols = a.cols();
  Tensor<double> diff2 = Cuda::empty<double>(Shape{rows}), ref2 = Cuda::empty<double>(Shape{rows}),
                 bad = Cuda::empty<double>(Shape{rows});
  Cuda::for_each(rows, RowCompare<T>{a.data(), a.ld(), b.data(), b.data() != nullptr ? b.ld() : 0, cols,
                                     diff2.data(), ref2.data(), bad.data()});
  const Tensor<double> d = tessera::download<Cuda>(diff2), s = tessera::download<Cuda>(ref2),
                       n = tessera::download<Cuda>(bad);
  Comparison c;
  double dsum = 0, ssum = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    dsum += d[r];
    ssum += s[r];
    c.nonfinite += n[r];
  }
  if (b.data() != nullptr) c.rel_diff = ssum > 0 ? std::sqrt(dsum / ssum) : (dsum == 0 ? 0.0 : kNaN);
  return c;
}

/// Non-finite values in t, viewed as rows of its last dimension (a vector as rows of
/// 1024 where it divides, so that one device thread does not walk all of it).
template <class T>
double count_nonfinite(const Tensor<T>& t) {
  std::int64_t cols = t.shape().rank == 1 ? t.numel() : t.numel() / t.size(0);
  if (t.shape().rank == 1 && cols % 1024 == 0) cols = 1024;
  const std::int64_t rows = t.numel() / cols;
  const TensorView<const T> v(t.data(), Shape{rows, cols});
  return compare<T>(v, TensorView<const T>()).nonfinite;
}

/// How many operand sets calls rotate over: enough that they span 3x the L2, at most 8.
std::int64_t rotation_sets(double set_bytes, double l2_bytes) {
  if (set_bytes <= 0) return 1;
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(3.0 * l2_bytes / set_bytes)), 1, 8);
}

// ---------------------------------------------------------------------------------------
// Timing with CUDA events on the compute stream.

class Event {
 public:
  Event() { TESSERA_CUDA_CHECK(cudaEventCreate(&event_)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);  // a destructor cannot report
  }
  void record() const { TESSERA_CUDA_CHECK(cudaEventRecord(event_, Cuda::stream())); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

/// Seconds from a to b, once b has completed.
double elapsed(const Event& a, const Event& b) {
  TESSERA_CUDA_CHECK(cudaEventSynchronize(b.get()));
  float ms = 0;
  TESSERA_CUDA_CHECK(cudaEventElapsedTime(&ms, a.get(), b.get()));
  return 1e-3 * double(ms);
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Enqueues call number i of something timed (i picks the operand set).
using Call = std::function<void(std::int64_t)>;

/// At most this many calls in a row: well under the launches the driver queues (about a
/// thousand; a GEMM may launch two kernels), so that the host does not wait for room in
/// the queue and its issue time says whether it kept up with the device.
constexpr std::int64_t kMaxReps = 256;

struct TimingPolicy {
  std::int64_t trials = 5;
  double trial_seconds = 0.02;
  std::int64_t max_reps = kMaxReps;
};

struct Timing {
  double seconds = kNaN;  // per call: the median over the trials
  double spread = kNaN;   // (slowest - fastest trial) / median
  std::int64_t reps = 0;  // calls per trial
  std::int64_t trials = 0;
  bool host_bound = false;  // issuing the calls took the host >= 90% of the device's time for them

  json to_json() const {
    return {{"seconds", seconds}, {"trial_spread", spread}, {"calls_per_trial", reps}, {"trials", trials},
            {"host_bound", host_bound}};
  }
};

/// Times each call: a warm-up call and a timed call to size the trials, then
/// `policy.trials` rounds in which every call runs its trial in turn.
std::vector<Timing> time_calls(const std::vector<Call>& calls, const TimingPolicy& policy) {
  const Event start, stop;
  const std::size_t n = calls.size();
  std::vector<std::int64_t> reps(n), next(n, 0);
  for (std::size_t v = 0; v < n; ++v) {
    calls[v](next[v]++);  // first-use costs: module loads, heuristic queries, allocations
    Cuda::synchronize();
    start.record();
    calls[v](next[v]++);
    stop.record();
    const double once = std::max(elapsed(start, stop), 1e-7);
    reps[v] = std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(policy.trial_seconds / once)), 1,
                                       policy.max_reps);
  }
  std::vector<std::vector<double>> per_call(n), issue_share(n);
  for (std::int64_t t = 0; t < policy.trials; ++t)
    for (std::size_t v = 0; v < n; ++v) {
      start.record();
      const auto h0 = clock_type::now();
      for (std::int64_t r = 0; r < reps[v]; ++r) calls[v](next[v]++);
      const double issue = seconds_since(h0);
      stop.record();
      const double total = elapsed(start, stop);
      per_call[v].push_back(total / double(reps[v]));
      issue_share[v].push_back(issue / total);
    }
  std::vector<Timing> out(n);
  for (std::size_t v = 0; v < n; ++v) {
    Timing& t = out[v];
    t.seconds = median(per_call[v]);
    const auto [lo, hi] = std::minmax_element(per_call[v].begin(), per_call[v].end());
    t.spread = (*hi - *lo) / t.seconds;
    t.reps = reps[v];
    t.trials = policy.trials;
    t.host_bound = median(issue_share[v]) >= 0.9;
  }
  return out;
}

Timing time_call(const Call& call, const TimingPolicy& policy) { return time_calls({call}, policy).front(); }

/// A quick time per call for ranking candidates: a warm-up call, a timed call, and when
/// that one was shorter than `seconds` and not already over twice `best`, enough calls
/// to fill `seconds`.
double screen_call(const Call& call, double seconds, double best) {
  const Event start, stop;
  call(0);
  Cuda::synchronize();
  start.record();
  call(1);
  stop.record();
  const double once = elapsed(start, stop);
  if (once >= seconds || once > 2 * best) return once;
  const auto reps = std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(seconds / std::max(once, 1e-7))),
                                             1, kMaxReps);
  start.record();
  for (std::int64_t r = 0; r < reps; ++r) call(2 + r);
  stop.record();
  return elapsed(start, stop) / double(reps);
}

std::string host_note(const Timing& t) { return t.host_bound ? " host-bound" : ""; }

// ---------------------------------------------------------------------------------------
// 0. Ceilings.

struct Ceilings {
  double bf16_gemm = kNaN, fp32_gemm = kNaN, copy = kNaN;  // FLOP/s, FLOP/s, bytes/s
  Timing bf16_timing, fp32_timing, copy_timing;
  std::int64_t gemm_size = 8192;
  double copy_bytes = 0;  // bytes copied per call (read + written is twice this)
};

/// C = A B^T on (s, s) matrices through Cuda::gemm: the call, and its operands.
template <class T>
struct SquareGemm {
  Tensor<T> a, b, c;
  explicit SquareGemm(std::int64_t s)
      : a(random_tensor<T>(Shape{s, s}, -1, 1)), b(random_tensor<T>(Shape{s, s}, -1, 1)), c(Cuda::empty<T>(Shape{s, s})) {}
  Call call() const {
    return [this](std::int64_t) {
      Cuda::gemm<T>(Trans::no, Trans::yes, 1.0f, a.cview(), b.cview(), 0.0f, c.view());
    };
  }
};

/// Half a second of bf16 GEMMs before anything is timed: the clocks come up, and the
/// first-use costs (context, cuBLASLt handle, workspace) are paid.
void warm_up_device() {
  const SquareGemm<bf16> g(4096);
  const Call call = g.call();
  const auto t0 = clock_type::now();
  for (std::int64_t i = 0; seconds_since(t0) < 0.5; ++i) {
    call(i);
    if (i % 16 == 15) Cuda::synchronize();
  }
  Cuda::synchronize();
}

/// A device-to-device copy of `bytes` (rounded down to whole floats), rotated over sets.
struct CopyBench {
  std::vector<Tensor<float>> src, dst;
  std::size_t bytes = 0;

  CopyBench(double want_bytes, double l2_bytes) {
    const auto floats = std::max<std::int64_t>(1, static_cast<std::int64_t>(want_bytes / 4));
    bytes = static_cast<std::size_t>(floats) * 4;
    const std::int64_t sets = rotation_sets(2.0 * double(bytes), l2_bytes);
    for (std::int64_t s = 0; s < sets; ++s) {
      src.push_back(random_tensor<float>(Shape{floats}, -1, 1));
      dst.push_back(Cuda::empty<float>(Shape{floats}));
    }
  }
  Call call() const {
    return [this](std::int64_t i) {
      const auto s = static_cast<std::size_t>(i) % src.size();
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(dst[s].data(), src[s].data(), bytes, cudaMemcpyDeviceToDevice, Cuda::stream()));
    };
  }
};

Ceilings measure_ceilings(const TimingPolicy& policy, const DeviceInfo& dev) {
  Ceilings c;
  const double s = double(c.gemm_size);
  {
    const SquareGemm<bf16> g(c.gemm_size);
    c.bf16_timing = time_call(g.call(), policy);
  }
  c.bf16_gemm = 2 * s * s * s / c.bf16_timing.seconds;
  {
    const SquareGemm<float> g(c.gemm_size);
    c.fp32_timing = time_call(g.call(), policy);
  }
  c.fp32_gemm = 2 * s * s * s / c.fp32_timing.seconds;
  const CopyBench copy(double(std::int64_t{1} << 30), dev.l2_bytes);
  c.copy_bytes = double(copy.bytes);
  c.copy_timing = time_call(copy.call(), policy);
  c.copy = 2 * c.copy_bytes / c.copy_timing.seconds;
  return c;
}

// ---------------------------------------------------------------------------------------
// 1. GEMMs.

/// One GEMM a training step issues (bench/step_gemms.hpp), timed once whatever its count.
struct GemmCase {
  std::string flavor;
  std::string where;  // "blocks" or the region it runs in ("loss head")
  std::string pass;   // plan::StepGemm::pass(): "y = x W^T", "dW = dy^T x", ...
  std::int64_t count = 0;  // issues a step
  Trans ta = Trans::no, tb = Trans::no;
  std::int64_t m = 0, n = 0, k = 0;
  bool beta_one = false;            // C read (beta 1): a gradient summed into, or a residual read apart from D
  DType operands = DType::bf16;     // A's storage (a float8 GEMM's first operand's format)
  DType result = DType::bf16;       // C's, in the step

  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
  /// "x16 blocks", "x2 loss head".
  std::string layer_text() const {
    std::string s = "x";
    s += std::to_string(count);
    s += ' ';
    s += where;
    return s;
  }
  std::string mnk_text() const {
    return std::to_string(m) + " x " + std::to_string(n) + " x " + std::to_string(k);
  }
};

/// Rows per chunk of a bf16 model's output head on this GPU, as nn::ChunkedCrossEntropyHead
/// sizes them.
std::int64_t gpu_loss_chunk_rows(std::int64_t vocab, std::int64_t rows) {
  return tessera::nn::loss_chunk_rows(vocab, rows, tessera::nn::loss_chunk_bytes_per_logit(tessera::DType::bf16),
                                      tessera::nn::loss_chunk_budget(Cuda::device_memory_bytes()));
}

/// The GEMMs one training step of `flavor` issues at batch 1 x `tokens` on a device of
/// `device_bytes`, as the step traces (bench/step_gemms.hpp: the projections fused as the
/// model runs them, the gradients' first writes, the residuals read as C, the loss head's
/// chunks), in the order it first issues them. `float8`: the float8 GEMMs of the
/// tensorwise step (its bf16 output projection left out).
std::vector<GemmCase> gemm_cases(const std::string& flavor, std::int64_t tokens, std::size_t device_bytes,
                                 bool float8 = false) {
  std::vector<GemmCase> cases;
  for (const tessera::plan::StepGemm& s : step_gemms(flavor, tokens, device_bytes, float8)) {
    const tessera::trace::Gemm& g = s.gemm;
    const bool f8 = g.operands == DType::f8e4m3 || g.operands == DType::f8e5m2;
    if (f8 != float8) continue;
    GemmCase c;
    c.flavor = flavor;
    c.where = s.region.empty() ? "blocks" : s.region;
    c.pass = s.pass();
    c.count = s.count;
    c.ta = g.ta, c.tb = g.tb, c.m = g.m, c.n = g.n, c.k = g.k;
    c.beta_one = g.accumulate;
    c.operands = g.operands;
    c.result = g.result;
    cases.push_back(std::move(c));
  }
  return cases;
}

/// What identifies a case in --json: the step's GEMM, where it runs and how often.
json case_json(const GemmCase& g) {
  return {{"flavor", g.flavor},
          {"where", g.where},
          {"count", g.count},
          {"pass", g.pass},
          {"trans_a", g.ta == Trans::yes},
          {"trans_b", g.tb == Trans::yes},
          {"m", g.m},
          {"n", g.n},
          {"k", g.k},
          {"beta", g.beta_one ? 1 : 0},
          {"step_operands", std::string(tessera::name_of(g.operands))},
          {"step_result", std::string(tessera::name_of(g.result))},
          {"flops", g.flops()}};
}

/// f.template operator()<C>() with C the type a case's step writes (bf16 or float).
template <class F>
decltype(auto) with_result(const GemmCase& g, F&& f) {
  if (g.result == DType::f32) return f.template operator()<float>();
  TESSERA_CHECK(g.result == DType::bf16, "a GEMM writing ", tessera::name_of(g.result), " is not benchmarked");
  return f.template operator()<bf16>();
}

struct GemmResult {
  GemmCase c;
  DType dtype = DType::bf16;   // the operands'
  DType result = DType::bf16;  // C's
  std::int64_t sets = 1;
  std::int64_t candidates = 0;
  std::int64_t chosen_rank = 0;  // the heuristic choice's place in the candidate list (1-based; 0: not in it)
  std::int64_t best_rank = 0;    // the best's place in the candidate list (0: the heuristic path was fastest)
  bool best_is_chosen = true;    // the best is the same algorithm as the heuristic choice
  Timing heuristic, best;
  double fraction = kNaN;  // best time / heuristic time: the heuristic's share of the best rate
  double rel_diff = kNaN;  // ||C_best - C_heuristic|| / ||C_heuristic||; NaN when the same algorithm
  bool check_ok = true;
  std::int64_t failed = 0;    // candidates cuBLASLt refused to run
  std::string first_failure;  // the first one's error

  bool pass() const { return fraction >= 0.95; }
};

/// A case with operands of T into C (bf16 into the step's own result type, or fp32 throughout).
template <class T, class C>
GemmResult run_gemm(const GemmCase& g, const Options& o, const TimingPolicy& policy, const DeviceInfo& dev) {
  GemmResult r;
  r.c = g;
  r.dtype = tessera::dtype_of<T>();
  r.result = tessera::dtype_of<C>();
  const Shape sa = g.ta == Trans::no ? Shape{g.m, g.k} : Shape{g.k, g.m};
  const Shape sb = g.tb == Trans::no ? Shape{g.k, g.n} : Shape{g.n, g.k};
  const Shape sc{g.m, g.n};
  r.sets = rotation_sets(double(sa.numel() + sb.numel()) * sizeof(T) + double(sc.numel()) * sizeof(C), dev.l2_bytes);
  std::vector<Tensor<T>> a, b;
  std::vector<Tensor<C>> c;
  for (std::int64_t s = 0; s < r.sets; ++s) {
    a.push_back(random_tensor<T>(sa, -1, 1));
    b.push_back(random_tensor<T>(sb, -1, 1));
    c.push_back(random_tensor<C>(sc, -1, 1));
  }
  const float one = 1.0f, beta = g.beta_one ? 1.0f : 0.0f;  // alpha and beta are fp32 for every T
  auto run = [&](std::int64_t i, const tcuda::GemmAlgo* algo) {
    const auto s = static_cast<std::size_t>(i % r.sets);
    if (algo != nullptr) tcuda::gemm<T, C>(g.ta, g.tb, one, a[s].cview(), b[s].cview(), beta, c[s].view(), algo);
    else Cuda::gemm<T, C>(g.ta, g.tb, one, a[s].cview(), b[s].cview(), beta, c[s].view());
  };

  const std::vector<tcuda::GemmAlgo> candidates = tcuda::gemm_candidates<T, C>(
      g.ta, g.tb, a[0].cview(), b[0].cview(), beta, c[0].view(), static_cast<int>(o.candidates));
  const tcuda::GemmAlgo chosen =
      tcuda::gemm_chosen_algo<T, C>(g.ta, g.tb, a[0].cview(), b[0].cview(), beta, c[0].view());
  r.candidates = static_cast<std::int64_t>(candidates.size());
  for (std::size_t j = 0; j < candidates.size(); ++j)
    if (candidates[j] == chosen) {
      r.chosen_rank = static_cast<std::int64_t>(j) + 1;
      break;
    }

  // Screen every candidate, then time the fastest few in full beside the heuristic path.
  // A candidate cuBLASLt refuses to run (its error names the call) is left out and counted.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> screened(candidates.size(), inf);
  double fastest = inf;
  for (std::size_t j = 0; j < candidates.size(); ++j) {
    try {
      screened[j] = screen_call([&, j](std::int64_t i) { run(i, &candidates[j]); }, o.screen_ms * 1e-3, fastest);
      fastest = std::min(fastest, screened[j]);
    } catch (const tessera::Error& e) {
      ++r.failed;
      if (r.first_failure.empty()) r.first_failure = "#" + std::to_string(j + 1) + ": " + e.what();
    }
  }
  std::vector<std::size_t> order;
  for (std::size_t j = 0; j < candidates.size(); ++j)
    if (screened[j] < inf) order.push_back(j);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return screened[x] < screened[y]; });
  order.resize(std::min<std::size_t>(order.size(), static_cast<std::size_t>(o.finalists)));
  std::vector<Call> calls = {[&](std::int64_t i) { run(i, nullptr); }};
  for (std::size_t j : order) calls.push_back([&, j](std::int64_t i) { run(i, &candidates[j]); });
  const std::vector<Timing> t = time_calls(calls, policy);
  r.heuristic = t.front();
  r.best = t.front();
  const tcuda::GemmAlgo* best_algo = nullptr;
  for (std::size_t f = 0; f < order.size(); ++f)
    if (t[f + 1].seconds < r.best.seconds) {
      r.best = t[f + 1];
      r.best_rank = static_cast<std::int64_t>(order[f]) + 1;
      best_algo = &candidates[order[f]];
    }
  r.best_is_chosen = best_algo == nullptr || *best_algo == chosen;
  r.fraction = r.best.seconds / r.heuristic.seconds;

  // The best algorithm must compute what the heuristic's computes (C zeroed for both).
  if (!r.best_is_chosen) {
    const Tensor<C> check = Cuda::empty<C>(sc);
    TESSERA_CUDA_CHECK(cudaMemsetAsync(c[0].data(), 0, c[0].bytes(), Cuda::stream()));
    TESSERA_CUDA_CHECK(cudaMemsetAsync(check.data(), 0, check.bytes(), Cuda::stream()));
    Cuda::gemm<T, C>(g.ta, g.tb, one, a[0].cview(), b[0].cview(), beta, c[0].view());
    tcuda::gemm<T, C>(g.ta, g.tb, one, a[0].cview(), b[0].cview(), beta, check.view(), best_algo);
    const Comparison cmp = compare<C>(check.cview(), c[0].cview());
    r.rel_diff = cmp.rel_diff;
    const double tolerance = std::is_same_v<C, bf16> ? 1e-2 : 1e-4;
    r.check_ok = cmp.nonfinite == 0 && r.rel_diff <= tolerance;  // NaN fails
  }
  return r;
}

// ---------------------------------------------------------------------------------------
// Float8 GEMMs and their casts.

struct Float8Result {
  GemmCase c;
  Timing bf16, tensorwise, rowwise;
  Timing cast, cast_transposed, cast_rows, cast_both, copy;  // the first operand's casts, and a copy of its bytes
  double cast_bytes = 0;               // bf16 read + float8 written
  double both_bytes = 0;               // bf16 read + float8 written in both layouts
  std::string error;                   // why it did not run, else empty
};

/// One GEMM case in cuBLASLt's float8 layout: a (m x k) and b (n x k), bf16 and cast, into
/// the step's own C (bf16 or fp32). The tensorwise GEMM takes the first operand in the
/// step's format (e5m2 for a gradient), the rowwise one e4m3 for both, as torchao's recipes.
template <class C>
Float8Result run_float8_into(const GemmCase& g, const TimingPolicy& policy) {
  namespace nn = tessera::nn;
  namespace ops = tessera::ops;
  Float8Result r;
  r.c = g;
  try {
    const Tensor<bf16> a = random_tensor<bf16>(Shape{g.m, g.k}, -1, 1), b = random_tensor<bf16>(Shape{g.n, g.k}, -1, 1);
    Tensor<C> out = random_tensor<C>(Shape{g.m, g.n}, -1, 1);
    const float beta = g.beta_one ? 1.0f : 0.0f;
    const bool fast = g.operands == DType::f8e4m3;  // the forward's: fast accumulation, as torchao
    const ops::Float8Cast tensor{DType::f8e4m3, ops::Float8Axis::tensor, false};
    const ops::Float8Cast tensor_a{g.operands, ops::Float8Axis::tensor, false};
    const ops::Float8Cast by_row{DType::f8e4m3, ops::Float8Axis::rows, true};
    const nn::Float8Operand<Cuda> at = nn::cast_to_float8<Cuda>(a.cview(), tensor_a),
                                  bt = nn::cast_to_float8<Cuda>(b.cview(), tensor),
                                  ar = nn::cast_to_float8<Cuda>(a.cview(), by_row),
                                  br = nn::cast_to_float8<Cuda>(b.cview(), by_row);
    const std::vector<Timing> t = time_calls(
        {[&](std::int64_t) { Cuda::gemm<bf16, C>(Trans::no, Trans::yes, 1.0f, a.cview(), b.cview(), beta, out.view()); },
         [&](std::int64_t) { Cuda::gemm_float8(at.gemm_operand("bench"), bt.gemm_operand("bench"), beta, out.view(), fast); },
         [&](std::int64_t) { Cuda::gemm_float8(ar.gemm_operand("bench"), br.gemm_operand("bench"), beta, out.view(), fast); }},
        policy);
    r.bf16 = t[0];
    r.tensorwise = t[1];
    r.rowwise = t[2];
    // The first operand's casts (amax, scale, values), as stored and transposed by one
    // scale, by rows (one pass a row: ops::CastRowsFloat8), and into both layouts by one
    // scale (nn::cast_to_float8_both_layouts: a tensorwise output gradient's, 4 bytes an
    // element), beside a device copy of the bytes a cast moves.
    // A copy of 1.5 m k bytes reads and writes the 3 m k a cast moves (2 read, 1 written).
    const Tensor<bf16> from = Cuda::empty<bf16>(Shape{g.m, g.k}), to = Cuda::empty<bf16>(Shape{g.m, g.k});
    r.cast_bytes = 3.0 * double(g.m) * double(g.k);
    r.both_bytes = 4.0 * double(g.m) * double(g.k);
    const std::vector<Timing> c = time_calls(
        {[&](std::int64_t) { (void)nn::cast_to_float8<Cuda>(a.cview(), tensor); },
         [&](std::int64_t) { (void)nn::cast_to_float8<Cuda>(a.cview(), tensor, true); },
         [&](std::int64_t) { (void)nn::cast_to_float8<Cuda>(a.cview(), by_row); },
         [&](std::int64_t) {
           nn::Float8SharedCasts<Cuda> shared;
           (void)nn::cast_to_float8_both_layouts<Cuda>(a.cview(), tensor);
         },
         [&](std::int64_t) {
           TESSERA_CUDA_CHECK(cudaMemcpyAsync(to.data(), from.data(), static_cast<std::size_t>(g.m * g.k * 3 / 2),
                                              cudaMemcpyDeviceToDevice, tcuda::compute_stream()));
         }},
        policy);
    r.cast = c[0];
    r.cast_transposed = c[1];
    r.cast_rows = c[2];
    r.cast_both = c[3];
    r.copy = c[4];
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  return r;
}

Float8Result run_float8(const GemmCase& g, const TimingPolicy& policy) {
  return with_result(g, [&]<class C>() { return run_float8_into<C>(g, policy); });
}

void print_float8_header(std::int64_t tokens) {
  std::printf("\n== float8 GEMMs of the tensorwise step (cuBLASLt, layout TN, into the step's C; tensorwise with the "
              "step's first operand, e5m2 for a gradient, rowwise e4m3 x e4m3), %lld tokens: TFLOP/s and the gain over "
              "bf16 of the same shape; the first operand's casts in GB/s (both: into both layouts, 4 bytes an element; "
              "copy of a cast's bytes beside)\n",
              static_cast<long long>(tokens));
  std::printf("  %-12s %-14s %-22s %6s %6s %6s | %8s %10s %6s %10s %6s | %8s %8s %8s %8s %8s\n", "flavor", "where",
              "pass", "m", "n", "k", "bf16", "tensorwise", "gain", "rowwise", "gain", "cast", "cast^T", "by rows", "both",
              "copy");
}

void print_float8(const Float8Result& r) {
  const GemmCase& g = r.c;
  if (!r.error.empty()) {
    std::printf("  %-12s %-14s %-22s did not run: %s\n", g.flavor.c_str(), g.layer_text().c_str(), g.pass.c_str(),
                r.error.c_str());
    return;
  }
  const double f = g.flops() / 1e12, gb = r.cast_bytes / 1e9;
  std::printf(
      "  %-12s %-14s %-22s %6lld %6lld %6lld | %8.1f %10.1f %5.2fx %10.1f %5.2fx | %8.0f %8.0f %8.0f %8.0f %8.0f\n",
      g.flavor.c_str(), g.layer_text().c_str(), g.pass.c_str(), (long long)g.m, (long long)g.n, (long long)g.k,
      f / r.bf16.seconds, f / r.tensorwise.seconds, r.bf16.seconds / r.tensorwise.seconds, f / r.rowwise.seconds,
      r.bf16.seconds / r.rowwise.seconds, gb / r.cast.seconds, gb / r.cast_transposed.seconds, gb / r.cast_rows.seconds,
      r.both_bytes / 1e9 / r.cast_both.seconds, gb / r.copy.seconds);
}

json float8_json(const Float8Result& r) {
  const GemmCase& g = r.c;
  json j = case_json(g);
  j["gflop"] = g.flops() / 1e9;
  if (!r.error.empty()) {
    j["error"] = r.error;
    return j;
  }
  const double f = g.flops() / 1e12;
  j["bf16_tflops"] = f / r.bf16.seconds;
  j["tensorwise_tflops"] = f / r.tensorwise.seconds;
  j["rowwise_tflops"] = f / r.rowwise.seconds;
  j["cast_gbps"] = r.cast_bytes / 1e9 / r.cast.seconds;
  j["cast_transposed_gbps"] = r.cast_bytes / 1e9 / r.cast_transposed.seconds;
  j["cast_rows_gbps"] = r.cast_bytes / 1e9 / r.cast_rows.seconds;
  j["cast_both_gbps"] = r.both_bytes / 1e9 / r.cast_both.seconds;
  j["copy_gbps"] = r.cast_bytes / 1e9 / r.copy.seconds;
  j["timings"] = {{"bf16", r.bf16.to_json()}, {"tensorwise", r.tensorwise.to_json()}, {"rowwise", r.rowwise.to_json()},
                  {"cast", r.cast.to_json()}, {"cast_transposed", r.cast_transposed.to_json()},
                  {"cast_rows", r.cast_rows.to_json()}, {"cast_both", r.cast_both.to_json()},
                  {"copy", r.copy.to_json()}};
  return j;
}

void print_gemm_header(DType dtype, std::int64_t tokens) {
  std::printf("\nGEMM %s (cuBLASLt, %s), tokens %lld; TFLOP/s = 2 m n k / time; heuristic = Cuda::gemm's cached "
              "choice (#its place among the candidates); best = fastest of the heuristic and the finalists\n",
              dtype_label(dtype).c_str(),
              dtype == DType::bf16 ? "bf16 operands into the step's C (bf16, or fp32: weight gradients, logits), fp32 "
                                     "accumulation"
                                   : "fp32, no TF32",
              (long long)tokens);
  std::printf("  %-12s %-14s %-14s %-5s %-24s %18s %8s  %-9s %9s %8s  %9s\n", "flavor", "where", "pass", "C",
              "m x n x k", "heuristic ms", "TFLOP/s", "best", "ms", "TFLOP/s", "heur/best");
  std::fflush(stdout);
}

void print_gemm(const GemmResult& r) {
  const std::string heur =
      "(#" + (r.chosen_rank > 0 ? std::to_string(r.chosen_rank) : std::string("?")) + "/" + std::to_string(r.candidates) + ")";
  // "#3": the third candidate; "#1=heur": the candidate that is the heuristic's algorithm.
  const std::string best = r.best_rank == 0 ? "heuristic"
                                            : "#" + std::to_string(r.best_rank) + (r.best_is_chosen ? "=heur" : "");
  std::string note = r.pass() ? " PASS" : " MISS (trial spread " + fmt("%.1f%%", 100 * r.heuristic.spread) + ")";
  note += host_note(r.heuristic);
  if (r.failed > 0) {
    // "#5: cuBLASLt: cublasLtMatmul failed: CUBLAS_STATUS_... (...) for ...": the status is enough here.
    const std::size_t at = r.first_failure.find("failed: ");
    const std::string status =
        at == std::string::npos ? "" : " " + r.first_failure.substr(at + 8, r.first_failure.find(' ', at + 8) - at - 8);
    note += " (" + std::to_string(r.failed) + " of " + std::to_string(r.candidates) +
            " candidates failed to run; first " + r.first_failure.substr(0, r.first_failure.find(':')) + status + ")";
  }
  if (!r.check_ok) note += " CHECK FAILED: the best differs from the heuristic's result by " + fmt("%.2e", r.rel_diff);
  std::printf("  %-12s %-14s %-14s %-5s %-24s %9s %8.3f %8.1f  %-9s %9.3f %8.1f  %8.1f%%%s\n", r.c.flavor.c_str(),
              r.c.layer_text().c_str(), r.c.pass.c_str(), dtype_label(r.result).c_str(), r.c.mnk_text().c_str(),
              heur.c_str(),
              1e3 * r.heuristic.seconds, r.c.flops() / r.heuristic.seconds / 1e12, best.c_str(), 1e3 * r.best.seconds,
              r.c.flops() / r.best.seconds / 1e12, 100 * r.fraction, note.c_str());
  std::fflush(stdout);
}

json gemm_json(const GemmResult& r) {
  json j = case_json(r.c);
  j.update({{"dtype", dtype_label(r.dtype)},
          {"result", dtype_label(r.result)},
          {"operand_sets", r.sets},
          {"candidates", r.candidates},
          {"failed_candidates", r.failed},
          {"first_failure", r.first_failure},
          {"heuristic_rank", r.chosen_rank},
          {"heuristic", r.heuristic.to_json()},
          {"heuristic_tflops", r.c.flops() / r.heuristic.seconds / 1e12},
          {"best_rank", r.best_rank},
          {"best_is_heuristic_algorithm", r.best_is_chosen},
          {"best", r.best.to_json()},
          {"best_tflops", r.c.flops() / r.best.seconds / 1e12},
          {"heuristic_fraction_of_best", r.fraction},
          {"target_within_5_percent", r.pass()},
          {"best_vs_heuristic_rel_diff", std::isnan(r.rel_diff) ? json(nullptr) : json(r.rel_diff)},
          {"check_ok", r.check_ok}});
  return j;
}

// ---------------------------------------------------------------------------------------
// 2. Attention.

/// The sum over the documents of `spans` (one a row, in order) of f(the document's length).
template <class F>
double over_documents(const std::vector<tessera::ops::DocumentSpan>& spans, F f) {
  double sum = 0;
  for (std::size_t r = 0; r < spans.size(); r += static_cast<std::size_t>(spans[r].end - spans[r].begin))
    sum += f(static_cast<double>(spans[r].end - spans[r].begin));
  return sum;
}

struct AttentionResult {
  std::string flavor;
  std::string kernel = "tessera";  // "tessera" (the project's flash kernels) or "cudnn"
  DType dtype = DType::bf16;
  AttentionShape s;                           // its pointers unset: run_attention stages `documents`
  std::vector<tessera::ops::DocumentSpan> documents;  // packed documents, one span a row; empty: none
  bool step_layout = false;  // q, k, v (and dq, dk, dv) the column blocks of one matrix, as the step has them
  Timing forward, backward;
  double nonfinite = 0;  // in o, dq, dk, dv

  double forward_flops_full() const {
    return 4.0 * double(s.batch) * double(s.n_heads) * double(s.seq_len) * double(s.seq_len) * double(s.head_dim);
  }
  /// The FLOPs the call computes: half the score matrix causal, all of it full, half of
  /// each document's own square over packed documents.
  double forward_flops() const {
    if (documents.empty()) return s.causal ? forward_flops_full() / 2 : forward_flops_full();
    const double squares = over_documents(documents, [](double length) { return length * length; });
    return 4.0 * double(s.n_heads) * double(s.head_dim) * squares / 2;
  }
  double forward_tflops() const { return forward_flops() / forward.seconds / 1e12; }
  double backward_tflops() const { return 2.5 * forward_flops() / backward.seconds / 1e12; }
  /// The rates with the full matrix counted (torchtitan's convention; a full row's own).
  double forward_tflops_full() const { return forward_flops_full() / forward.seconds / 1e12; }
  double backward_tflops_full() const { return 2.5 * forward_flops_full() / backward.seconds / 1e12; }
  const char* mask() const { return !documents.empty() ? "docs" : s.causal ? "causal" : "full"; }
  const char* layout() const { return step_layout ? "qkv" : "packed"; }
  bool target_case() const {
    return dtype == DType::bf16 && s.head_dim == 128 && s.seq_len == 8192 && s.causal && documents.empty() &&
           !step_layout;
  }
  bool pass() const { return forward_tflops() >= 450; }
};

/// `cudnn`: through Cuda::attention_forward / _backward with cuDNN's engine installed
/// (the caller installs it), as a bf16 training step calls it.
/// The spans of `batch` sequences of `seq_len` tokens packed with documents of seq_len/32
/// to seq_len/4 tokens (a fixed pseudo-random draw), as document_spans finds them.
std::vector<tessera::ops::DocumentSpan> packed_documents(std::int64_t batch, std::int64_t seq_len) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * seq_len), 3);
  const std::int64_t shortest = std::max<std::int64_t>(1, seq_len / 32), longest = std::max(shortest, seq_len / 4);
  std::uint64_t draw = 0;
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t t = 0; t < seq_len;) {
      ids[static_cast<std::size_t>(b * seq_len + t)] = 1;
      const auto spread = static_cast<std::uint64_t>(longest - shortest + 1);
      t += shortest + static_cast<std::int64_t>(tessera::mix64(++draw) % spread);
    }
  return tessera::ops::document_spans(ids, batch, seq_len, 1);
}

/// `documents`: over packed documents (their spans, staged for the call with the document
/// table as the model stages them).
template <class T>
AttentionResult run_attention(const std::string& flavor, const AttentionShape& shape, const TimingPolicy& policy,
                              bool cudnn = false, const std::vector<tessera::ops::DocumentSpan>& documents = {},
                              bool step_layout = false) {
  AttentionResult r;
  r.flavor = flavor;
  r.step_layout = step_layout;
  r.kernel = cudnn ? "cudnn" : "tessera";
  r.dtype = tessera::dtype_of<T>();
  r.s = shape;
  r.documents = documents;
  AttentionShape s = shape;
  Tensor<std::int32_t> staged;
  if (!documents.empty()) {
    const tessera::ops::DocumentTable table = tessera::ops::document_table(documents, s.batch, s.seq_len);
    const std::vector<std::int32_t> flat = tessera::ops::staged_documents(documents, table);
    staged = Cuda::empty<std::int32_t>(Shape{static_cast<std::int64_t>(flat.size())});
    Cuda::copy_from_host(flat.data(), staged.data(), staged.numel());
    const auto* spans = reinterpret_cast<const tessera::ops::DocumentSpan*>(staged.data());
    s.documents = spans;
    s.document_table = spans + documents.size();
    s.document_slots = table.slots;
  }
  const std::int64_t rows = s.rows(), qc = s.n_heads * s.head_dim, kc = s.n_kv_heads * s.head_dim;
  // Packed: q, k, v, dq, dk, dv each its own tensor. The step's layout: q, k and v the
  // column blocks of one (rows, qc + 2 kc) matrix, as the fused wq/wk/wv projection
  // writes them, and dq, dk, dv the blocks of one such matrix (nn/attention.hpp).
  const std::int64_t width = r.step_layout ? qc + 2 * kc : qc;
  const Tensor<T> in = random_tensor<T>(Shape{rows, width}, -1, 1), d_in = Cuda::zeros<T>(Shape{rows, width});
  const Tensor<T> k_own = r.step_layout ? Tensor<T>() : random_tensor<T>(Shape{rows, kc}, -1, 1),
                  v_own = r.step_layout ? Tensor<T>() : random_tensor<T>(Shape{rows, kc}, -1, 1),
                  dk_own = r.step_layout ? Tensor<T>() : Cuda::zeros<T>(Shape{rows, kc}),
                  dv_own = r.step_layout ? Tensor<T>() : Cuda::zeros<T>(Shape{rows, kc});
  const TensorView<const T> q = in.cview().slice_cols(0, qc),
                            k = r.step_layout ? in.cview().slice_cols(qc, qc + kc) : k_own.cview(),
                            v = r.step_layout ? in.cview().slice_cols(qc + kc, width) : v_own.cview();
  const TensorView<T> dq = d_in.view().slice_cols(0, qc),
                      dk = r.step_layout ? d_in.view().slice_cols(qc, qc + kc) : dk_own.view(),
                      dv = r.step_layout ? d_in.view().slice_cols(qc + kc, width) : dv_own.view();
  const Tensor<T> d_o = random_tensor<T>(Shape{rows, qc}, -1, 1), o = Cuda::empty<T>(Shape{rows, qc});
  const Tensor<float> lse = Cuda::empty<float>(Shape{s.batch * s.n_heads * s.seq_len});
  const Tensor<float> delta = Cuda::empty<float>(Shape{s.batch * s.n_heads * s.seq_len});

  r.forward = time_call(
      [&](std::int64_t) {
        if (cudnn)
          Cuda::attention_forward<T>(s, q, k, v, o.view(), lse.data());
        else
          tcuda::flash_attention_forward<T>(s, q, k, v, o.view(), lse.data(), Cuda::stream());
      },
      policy);
  // The backward reads the forward's o and lse (left by the calls above); dk and dv
  // accumulate over the calls, which changes nothing of the work.
  r.backward = time_call(
      [&](std::int64_t) {
        if (cudnn)
          Cuda::attention_backward<T>(s, q, k, v, o.cview(), lse.data(), d_o.cview(), dq, dk, dv);
        else
          tcuda::flash_attention_backward<T>(s, q, k, v, o.cview(), lse.data(), d_o.cview(), dq, dk, dv, delta.data(),
                                             Cuda::stream());
      },
      policy);
  r.nonfinite = count_nonfinite(o) + count_nonfinite(d_in) + count_nonfinite(lse) +
                (r.step_layout ? 0 : count_nonfinite(dk_own) + count_nonfinite(dv_own));
  return r;
}

void print_attention_header() {
  std::printf("\nattention: GQA, causal and (bf16) full (no mask: a context-parallel block off the diagonal) and "
              "docs (packed documents of T/32 to T/4 tokens), tessera's flash kernels (cuda::flash_attention_forward / "
              "_backward) and cuDNN's fused attention (bf16, the engine training installs; variable-length over docs); "
              "FLOPs: forward 4 B H T^2 hd / 2 causal (half the T x T scores), 4 B H T^2 hd full, 4 H hd sum(L^2) / 2 "
              "docs; [full T x T as torchtitan counts]; backward 2.5 x forward\n");
  std::printf("  %-12s %-7s %-7s %-10s %-12s %-6s %4s  %11s %8s %8s  %11s %8s %8s\n", "flavor", "kernel", "storage",
              "mask", "B x T", "H/KV", "hd", "forward ms", "TFLOP/s", "[full]", "backward ms", "TFLOP/s", "[full]");
  std::printf("  (mask \"causal qkv\": q, k, v and dq, dk, dv the column blocks of one matrix, as the fused wq/wk/wv "
              "projection gives them in the step; other rows each its own tensor)\n");
  std::fflush(stdout);
}

void print_attention(const AttentionResult& r) {
  std::string note;
  if (r.target_case()) note += r.pass() ? "  target forward >= 450: PASS" : "  target forward >= 450: MISS";
  note += host_note(r.forward) + host_note(r.backward);
  if (r.nonfinite > 0) note += " CHECK FAILED: " + fmt("%.0f", r.nonfinite) + " non-finite outputs";
  const std::string bt = std::to_string(r.s.batch) + " x " + std::to_string(r.s.seq_len);
  const std::string heads = std::to_string(r.s.n_heads) + "/" + std::to_string(r.s.n_kv_heads);
  const std::string mask = std::string(r.mask()) + (r.step_layout ? " qkv" : "");
  std::printf("  %-12s %-7s %-7s %-10s %-12s %-6s %4lld  %11.3f %8.1f %8.1f  %11.3f %8.1f %8.1f%s\n", r.flavor.c_str(),
              r.kernel.c_str(), dtype_label(r.dtype).c_str(), mask.c_str(), bt.c_str(), heads.c_str(),
              (long long)r.s.head_dim, 1e3 * r.forward.seconds, r.forward_tflops(), r.forward_tflops_full(),
              1e3 * r.backward.seconds, r.backward_tflops(), r.backward_tflops_full(), note.c_str());
  std::fflush(stdout);
}

/// The rates twice: over the FLOPs the call computes ("forward_tflops", ...; a causal row
/// also under the names earlier runs used, "forward_tflops_causal", ...) and with the
/// full matrix counted ("..._full").
json attention_json(const AttentionResult& r) {
  json j = {{"flavor", r.flavor},
            {"kernel", r.kernel},
            {"dtype", dtype_label(r.dtype)},
            {"mask", r.mask()},
            {"layout", r.layout()},
            {"batch", r.s.batch},
            {"seq_len", r.s.seq_len},
            {"n_heads", r.s.n_heads},
            {"n_kv_heads", r.s.n_kv_heads},
            {"head_dim", r.s.head_dim},
            {"documents", r.documents.empty() ? json(nullptr)
                                              : json(over_documents(r.documents, [](double) { return 1.0; }))},
            {"forward", r.forward.to_json()},
            {"backward", r.backward.to_json()},
            {"forward_flops", r.forward_flops()},
            {"forward_flops_full", r.forward_flops_full()},
            {"forward_tflops", r.forward_tflops()},
            {"forward_tflops_full", r.forward_tflops_full()},
            {"backward_tflops", r.backward_tflops()},
            {"backward_tflops_full", r.backward_tflops_full()},
            {"target_case", r.target_case()},
            {"target_forward_450_pass", r.target_case() ? json(r.pass()) : json(nullptr)},
            {"nonfinite_outputs", r.nonfinite}};
  if (r.s.causal) {
    j["forward_flops_causal"] = r.forward_flops();
    j["forward_tflops_causal"] = r.forward_tflops();
    j["backward_tflops_causal"] = r.backward_tflops();
  }
  return j;
}

// ---------------------------------------------------------------------------------------
// 3. Memory-bound ops.

struct MemoryResult {
  std::string op, tensors;
  double bytes = 0;       // the op's: each tensor read once + each output written once
  double copy_bytes = 0;  // the copy's bytes read + written
  std::int64_t sets = 1;
  Timing op_timing, copy_timing;
  double nonfinite = 0;

  double rate() const { return bytes / op_timing.seconds; }
  double copy_rate() const { return copy_bytes / copy_timing.seconds; }
};

void print_memory_header(const tessera::nn::ModelArgs& a, std::int64_t tokens) {
  std::printf("\nmemory-bound ops: %s shapes (dim %lld, ffn %lld, %lld heads x %lld), tokens %lld, float32, launched "
              "through Cuda::for_each; bytes = each tensor read once + each output written once; copy = "
              "cudaMemcpyAsync device to device of the same bytes (read + written), timed alongside\n",
              a.flavor.c_str(), (long long)a.dim, (long long)a.ffn_hidden_dim(), (long long)a.n_heads,
              (long long)a.head_dim(), (long long)tokens);
  std::printf("  %-16s %-48s %10s %10s %9s %10s %8s\n", "op", "tensors", "bytes", "ms", "GB/s", "copy GB/s",
              "of copy");
  std::fflush(stdout);
}

void print_memory(const MemoryResult& r) {
  std::string note = host_note(r.op_timing);
  if (r.nonfinite > 0) note += " CHECK FAILED: " + fmt("%.0f", r.nonfinite) + " non-finite outputs";
  std::printf("  %-16s %-48s %10s %10.3f %9.1f %10.1f %7.1f%%%s\n", r.op.c_str(), r.tensors.c_str(),
              decimal_bytes(r.bytes).c_str(), 1e3 * r.op_timing.seconds, r.rate() / 1e9, r.copy_rate() / 1e9,
              100 * r.rate() / r.copy_rate(), note.c_str());
  std::fflush(stdout);
}

json memory_json(const MemoryResult& r) {
  return {{"op", r.op},
          {"tensors", r.tensors},
          {"bytes", r.bytes},
          {"operand_sets", r.sets},
          {"time", r.op_timing.to_json()},
          {"gbps", r.rate() / 1e9},
          {"copy_bytes", r.copy_bytes},
          {"copy_time", r.copy_timing.to_json()},
          {"copy_gbps", r.copy_rate() / 1e9},
          {"fraction_of_copy", r.rate() / r.copy_rate()},
          {"nonfinite_outputs", r.nonfinite}};
}

/// Times `call` (rotating over `sets` operand sets) beside a device copy of the same
/// bytes, then counts the non-finite values of the outputs `outputs` returns.
MemoryResult measure_memory_op(std::string op, std::string tensors, double bytes, std::int64_t sets, const Call& call,
                               const std::function<double()>& outputs_nonfinite, const TimingPolicy& policy,
                               const DeviceInfo& dev) {
  MemoryResult r;
  r.op = std::move(op);
  r.tensors = std::move(tensors);
  r.bytes = bytes;
  r.sets = sets;
  const CopyBench copy(bytes / 2, dev.l2_bytes);
  r.copy_bytes = 2.0 * double(copy.bytes);
  const std::vector<Timing> t = time_calls({call, copy.call()}, policy);
  r.op_timing = t[0];
  r.copy_timing = t[1];
  r.nonfinite = outputs_nonfinite();
  return r;
}

std::string shape_text(std::int64_t r, std::int64_t c) {
  return "(" + std::to_string(r) + ", " + std::to_string(c) + ")";
}

std::vector<MemoryResult> run_memory(const tessera::nn::ModelArgs& a, std::int64_t tokens, const TimingPolicy& policy,
                                     const DeviceInfo& dev) {
  using tessera::ops::RmsNormBackwardInput;
  using tessera::ops::RmsNormBackwardWeight;
  using tessera::ops::RmsNormForward;
  using tessera::ops::RopeRotate;
  using tessera::ops::SwiGluBackward;
  using tessera::ops::SwiGluForward;
  const std::int64_t m = tokens, d = a.dim, f = a.ffn_hidden_dim(), hd = a.head_dim(), q = a.n_heads * hd;
  const double fb = sizeof(float);
  const auto eps = static_cast<float>(a.norm_eps);
  std::vector<MemoryResult> out;
  auto report = [&](MemoryResult r) {
    print_memory(r);
    out.push_back(std::move(r));
  };

  {  // RMSNorm forward: x, w -> y, rstd.
    const double bytes = fb * double(2 * m * d + d + m);
    const std::int64_t sets = rotation_sets(bytes, dev.l2_bytes);
    std::vector<Tensor<float>> x, w, y, rstd;
    for (std::int64_t s = 0; s < sets; ++s) {
      x.push_back(random_tensor<float>(Shape{m, d}, -1, 1));
      w.push_back(random_tensor<float>(Shape{d}, 0.5f, 1.5f));
      y.push_back(Cuda::empty<float>(Shape{m, d}));
      rstd.push_back(Cuda::empty<float>(Shape{m}));
    }
    report(measure_memory_op(
        "rmsnorm forward", "x " + shape_text(m, d) + ", w -> y, rstd", bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(m, RmsNormForward<float>{x[s].data(), d, w[s].data(), y[s].data(), d, rstd[s].data(), d, eps});
        },
        [&] { return count_nonfinite(y[0]) + count_nonfinite(rstd[0]); }, policy, dev));
  }
  {  // RMSNorm backward: x, w, rstd, dy -> dx; dw += (the layer's input and weight passes).
    const double bytes = fb * double(3 * m * d + m + d + 2 * d);
    const std::int64_t sets = rotation_sets(bytes, dev.l2_bytes);
    std::vector<Tensor<float>> x, w, rstd, dy, dx, dw;
    for (std::int64_t s = 0; s < sets; ++s) {
      x.push_back(random_tensor<float>(Shape{m, d}, -1, 1));
      w.push_back(random_tensor<float>(Shape{d}, 0.5f, 1.5f));
      rstd.push_back(random_tensor<float>(Shape{m}, 0.5f, 2.0f));
      dy.push_back(random_tensor<float>(Shape{m, d}, -1, 1));
      dx.push_back(Cuda::empty<float>(Shape{m, d}));
      dw.push_back(random_tensor<float>(Shape{d}, -1, 1));
    }
    report(measure_memory_op(
        "rmsnorm backward", "x, dy " + shape_text(m, d) + ", w, rstd -> dx; dw +=", bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          // Both passes in one launch, as the layer runs them (x and dy read once).
          Cuda::for_each(m + d, tessera::ops::RmsNormBackward<float>{
                                    RmsNormBackwardInput<float>{x[s].data(), d, w[s].data(), rstd[s].data(),
                                                                dy[s].data(), d, dx[s].data(), d, d},
                                    RmsNormBackwardWeight<float>{x[s].data(), d, rstd[s].data(), dy[s].data(), d,
                                                                 dw[s].data(), m}});
        },
        [&] { return count_nonfinite(dx[0]) + count_nonfinite(dw[0]); }, policy, dev));
  }
  {  // RoPE on q: forward rotates into a new tensor, backward rotates dq back in place.
    const std::int64_t seq = std::min(tokens, a.max_seq_len), half = hd / 2;
    const std::vector<double> inv_freq = tessera::ops::rope_inv_freq(hd, a.rope_theta, a.rope_scaling);
    Tensor<float> cos_host(Shape{seq, half}, tessera::Uninitialized{}), sin_host(Shape{seq, half}, tessera::Uninitialized{});
    for (std::int64_t p = 0; p < seq; ++p)
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = double(p) * inv_freq[static_cast<std::size_t>(i)];
        cos_host[p * half + i] = static_cast<float>(std::cos(angle));
        sin_host[p * half + i] = static_cast<float>(std::sin(angle));
      }
    const Tensor<float> cos_table = tessera::upload<Cuda>(cos_host), sin_table = tessera::upload<Cuda>(sin_host);
    const double bytes = fb * double(2 * m * q + 2 * seq * half);
    const std::int64_t sets = rotation_sets(bytes, dev.l2_bytes);
    std::vector<Tensor<float>> x, y;
    for (std::int64_t s = 0; s < sets; ++s) {
      x.push_back(random_tensor<float>(Shape{m, q}, -1, 1));
      y.push_back(Cuda::empty<float>(Shape{m, q}));
    }
    const std::string tables = "cos, sin " + shape_text(seq, half);
    report(measure_memory_op(
        "rope forward", "q " + shape_text(m, q) + ", " + tables + " -> q'", bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(m, RopeRotate<float>{y[s].data(), q, a.n_heads, hd, seq, cos_table.data(), sin_table.data(), false,
                                              x[s].data()});
        },
        [&] { return count_nonfinite(y[0]); }, policy, dev));
    report(measure_memory_op(
        "rope backward", "dq " + shape_text(m, q) + " in place, " + tables, bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(m, RopeRotate<float>{x[s].data(), q, a.n_heads, hd, seq, cos_table.data(), sin_table.data(), true});
        },
        [&] { return count_nonfinite(x[0]); }, policy, dev));
  }
  {  // SwiGLU forward: a, b -> g.
    const double bytes = fb * double(3 * m * f);
    const std::int64_t sets = rotation_sets(bytes, dev.l2_bytes);
    std::vector<Tensor<float>> av, bv, g;
    for (std::int64_t s = 0; s < sets; ++s) {
      av.push_back(random_tensor<float>(Shape{m, f}, -4, 4));
      bv.push_back(random_tensor<float>(Shape{m, f}, -4, 4));
      g.push_back(Cuda::empty<float>(Shape{m, f}));
    }
    report(measure_memory_op(
        "swiglu forward", "a, b " + shape_text(m, f) + " -> g", bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(m * f, SwiGluForward<float>{av[s].data(), bv[s].data(), g[s].data()});
        },
        [&] { return count_nonfinite(g[0]); }, policy, dev));
  }
  {  // SwiGLU backward: a, b, dg -> da, db.
    const double bytes = fb * double(5 * m * f);
    const std::int64_t sets = rotation_sets(bytes, dev.l2_bytes);
    std::vector<Tensor<float>> av, bv, dg, da, db;
    for (std::int64_t s = 0; s < sets; ++s) {
      av.push_back(random_tensor<float>(Shape{m, f}, -4, 4));
      bv.push_back(random_tensor<float>(Shape{m, f}, -4, 4));
      dg.push_back(random_tensor<float>(Shape{m, f}, -1, 1));
      da.push_back(Cuda::empty<float>(Shape{m, f}));
      db.push_back(Cuda::empty<float>(Shape{m, f}));
    }
    report(measure_memory_op(
        "swiglu backward", "a, b, dg " + shape_text(m, f) + " -> da, db", bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(m * f, SwiGluBackward<float>{av[s].data(), bv[s].data(), dg[s].data(), da[s].data(),
                                                     db[s].data()});
        },
        [&] { return count_nonfinite(da[0]) + count_nonfinite(db[0]); }, policy, dev));
  }
  {  // Cross-entropy on one chunk of the output head's logits: z, targets -> gradient in place, row losses.
    // (On sm_90 a row of 8193 to 131072 logits is read once by a cluster of blocks; other
    // rows are passed over three times: max, exp and sum, gradient.)
    const std::int64_t v = a.vocab_size, rows = gpu_loss_chunk_rows(v, tokens);
    const double bytes = fb * double(2 * rows * v) + double(rows) * double(sizeof(std::int32_t) + sizeof(double));
    const std::int64_t sets = rotation_sets(bytes, dev.l2_bytes);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
    for (std::size_t r = 0; r < ids.size(); ++r) ids[r] = static_cast<std::int32_t>((r * 7919) % std::size_t(v));
    const Tensor<std::int32_t> targets = tessera::upload<Cuda>(std::span<const std::int32_t>(ids));
    const Tensor<double> loss = Cuda::empty<double>(Shape{rows});
    const auto nonfinite_losses = [&] {
      const Tensor<double> l = tessera::download<Cuda>(loss);
      double bad = 0;
      for (std::int64_t r = 0; r < rows; ++r) bad += std::isfinite(l[r]) ? 0 : 1;
      return bad;
    };
    std::vector<Tensor<float>> z;
    for (std::int64_t s = 0; s < sets; ++s) z.push_back(random_tensor<float>(Shape{rows, v}, -8, 8));
    report(measure_memory_op(
        "cross-entropy", "logits " + shape_text(rows, v) + ", targets -> gradient in place, loss", bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(rows, tessera::ops::CrossEntropyRow<float>{z[s].data(), v, v, targets.data(),
                                                                    1.0f / float(tokens), true, loss.data()});
        },
        [&] { return count_nonfinite(z[0]) + nonfinite_losses(); },
        policy, dev));
    // The bf16 model's loss head: the float logits only read, the gradient written as bf16.
    const double head_bytes = double(rows * v) * (fb + sizeof(tessera::bf16)) +
                              double(rows) * double(sizeof(std::int32_t) + sizeof(double));
    std::vector<Tensor<tessera::bf16>> g;
    for (std::int64_t s = 0; s < sets; ++s) g.push_back(Cuda::empty<tessera::bf16>(Shape{rows, v}));
    report(measure_memory_op(
        "cross-entropy", "logits " + shape_text(rows, v) + ", targets -> bf16 gradient, loss", head_bytes, sets,
        [&](std::int64_t i) {
          const auto s = static_cast<std::size_t>(i % sets);
          Cuda::for_each(rows, tessera::ops::CrossEntropyRow<float, tessera::bf16>{
                                   z[s].data(), v, v, targets.data(), 1.0f / float(tokens), true, loss.data(),
                                   g[s].data(), v});
        },
        [&] { return count_nonfinite(g[0]) + nonfinite_losses(); },
        policy, dev));
  }
  return out;
}

// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// 5. GEMMs beside blocks that hold SMs: llama-plan's model of a GEMM that overlaps an NCCL
// collective between nodes (plan/cluster.hpp, collective_sms), checked. Each NCCL channel
// is a block resident for the whole collective, and llama-plan prices a GEMM beside `held`
// of them at sm / (sm - held) its time alone. Here `held` blocks that each take the most
// shared memory a block may have (so nothing else fits on their SMs) spin, bounded by the
// device's clock, while the same GEMM runs on the compute stream, after a one-block kernel
// has seen every holding block start (bounded too).

__global__ void hold_sms_kernel(unsigned long long ns, unsigned* started) {
  extern __shared__ unsigned char hold_pad[];
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (threadIdx.x == 0) {
    hold_pad[0] = 1;
    atomicAdd(started, 1u);
  }
  do {
    __nanosleep(2000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

__global__ void wait_started_kernel(const unsigned* started, unsigned want, unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (*static_cast<const volatile unsigned*>(started) < want && t - t0 < ns);
}

struct SmHoldResult {
  GemmCase c;
  double alone = kNaN;  // seconds a call
  struct Held {
    int sms = 0;
    double seconds = kNaN;  // a call, beside the holding blocks
    double predicted = kNaN;  // llama-plan's: alone x sm / (sm - held)
    unsigned resident = 0;    // holding blocks seen started
    bool covered = false;     // every block resident, and the hold outlasted the GEMMs
  };
  std::vector<Held> held;
};

std::vector<SmHoldResult> run_sm_hold(const std::vector<GemmCase>& cases, double trial_seconds,
                                      const std::vector<std::int64_t>& held_sms, const DeviceInfo& dev) {
  for (const std::int64_t h : held_sms)
    TESSERA_CHECK(h < dev.sms, "--held-sms: ", h, " SMs held leaves none of the device's ", dev.sms, " for the GEMMs");
  std::printf("\nGEMMs beside SMs held (bf16 into the step's C, %s's step; llama-plan prices a GEMM beside a collective "
              "between nodes at sm / (sm - held), %d SMs here)\n",
              cases.empty() ? "-" : cases.front().flavor.c_str(), dev.sms);
  std::printf("  %-14s %-14s %-16s %10s   %s\n", "where", "pass", "m x n x k", "alone",
              "held SMs: measured / alone (llama-plan's)");
  std::fflush(stdout);
  int smem = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev.index));
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(hold_sms_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // The holding blocks' stream, their start counter and the event after them, released on
  // every way out (a destructor cannot report).
  cudaStream_t side_stream = nullptr;
  TESSERA_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream, cudaStreamNonBlocking));
  const std::unique_ptr<CUstream_st, void (*)(cudaStream_t)> side_owner(
      side_stream, [](cudaStream_t s) { (void)cudaStreamDestroy(s); });
  unsigned* started_ptr = nullptr;
  TESSERA_CUDA_CHECK(cudaMalloc(&started_ptr, sizeof(unsigned)));
  const std::unique_ptr<unsigned, void (*)(unsigned*)> started_owner(started_ptr, [](unsigned* p) { (void)cudaFree(p); });
  cudaEvent_t end_event = nullptr;
  TESSERA_CUDA_CHECK(cudaEventCreate(&end_event));
  const std::unique_ptr<CUevent_st, void (*)(cudaEvent_t)> end_owner(
      end_event, [](cudaEvent_t e) { (void)cudaEventDestroy(e); });
  cudaStream_t side = side_owner.get();
  unsigned* started = started_owner.get();
  cudaEvent_t hold_end = end_owner.get();
  std::vector<SmHoldResult> out;
  for (const GemmCase& g : cases) {
    const Shape sa = g.ta == Trans::no ? Shape{g.m, g.k} : Shape{g.k, g.m};
    const Shape sb = g.tb == Trans::no ? Shape{g.k, g.n} : Shape{g.n, g.k};
    const Tensor<bf16> a = random_tensor<bf16>(sa, -1, 1), b = random_tensor<bf16>(sb, -1, 1);
    const float beta = g.beta_one ? 1.0f : 0.0f;
    // The GEMM into a C of the step's type, kept alive by the call.
    const std::function<void()> call = with_result(g, [&]<class C>() -> std::function<void()> {
      auto c = std::make_shared<Tensor<C>>(random_tensor<C>(Shape{g.m, g.n}, -1, 1));
      return [&a, &b, &g, beta, c] { Cuda::gemm<bf16, C>(g.ta, g.tb, 1.0f, a.cview(), b.cview(), beta, c->view()); };
    });
    const Event e0, e1;
    call();  // warm-up: the plan cached
    e0.record();
    call();
    e1.record();
    const std::int64_t reps =
        std::clamp<std::int64_t>(static_cast<std::int64_t>(trial_seconds / std::max(1e-7, elapsed(e0, e1))), 1, kMaxReps);
    SmHoldResult r;
    r.c = g;
    e0.record();
    for (std::int64_t i = 0; i < reps; ++i) call();
    e1.record();
    r.alone = elapsed(e0, e1) / double(reps);
    for (const std::int64_t held : held_sms) {
      const int h = static_cast<int>(held);
      SmHoldResult::Held x;
      x.sms = h;
      x.predicted = r.alone * dev.sms / double(dev.sms - h);
      // Held for three times the GEMMs' expected span and 20 ms more, at most two seconds.
      const double span = std::min(2.0, 3 * x.predicted * double(reps) + 0.02);
      // Zeroed before the waiting kernel can read it: it runs on the other stream.
      TESSERA_CUDA_CHECK(cudaMemsetAsync(started, 0, sizeof(unsigned), side));
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(side));
      hold_sms_kernel<<<h, 32, static_cast<std::size_t>(smem), side>>>(static_cast<unsigned long long>(span * 1e9), started);
      TESSERA_CUDA_CHECK(cudaGetLastError());
      TESSERA_CUDA_CHECK(cudaEventRecord(hold_end, side));
      wait_started_kernel<<<1, 32, 0, Cuda::stream()>>>(started, static_cast<unsigned>(h), 100'000'000ull);
      TESSERA_CUDA_CHECK(cudaGetLastError());
      e0.record();
      for (std::int64_t i = 0; i < reps; ++i) call();
      e1.record();
      x.seconds = elapsed(e0, e1) / double(reps);
      TESSERA_CUDA_CHECK(cudaEventSynchronize(hold_end));
      float gemms_ms = 0, hold_ms = 0;
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&gemms_ms, e0.get(), e1.get()));
      TESSERA_CUDA_CHECK(cudaEventElapsedTime(&hold_ms, e0.get(), hold_end));
      TESSERA_CUDA_CHECK(cudaMemcpy(&x.resident, started, sizeof(unsigned), cudaMemcpyDeviceToHost));
      x.covered = x.resident == static_cast<unsigned>(h) && hold_ms >= gemms_ms;
      r.held.push_back(x);
    }
    std::string cells;
    for (const auto& x : r.held)
      cells += "  " + std::to_string(x.sms) + ": " + fmt("%.3f", x.seconds / r.alone) +
               fmt(" (%.3f)", x.predicted / r.alone) + (x.covered ? "" : "!");
    std::printf("  %-14s %-14s %-16s %8.3f ms %s\n", g.layer_text().c_str(), g.pass.c_str(), g.mnk_text().c_str(),
                r.alone * 1e3, cells.c_str());
    std::fflush(stdout);
    out.push_back(std::move(r));
  }
  return out;
}

json sm_hold_json(const SmHoldResult& r) {
  json held = json::array();
  for (const auto& x : r.held)
    held.push_back({{"sms", x.sms},
                    {"seconds", x.seconds},
                    {"predicted_seconds", x.predicted},
                    {"resident_blocks", x.resident},
                    {"covered", x.covered}});
  json j = case_json(r.c);
  j.update({{"alone_seconds", r.alone}, {"held", held}});
  return j;
}

int run(const Options& o) {
  // Opened first, so a path that cannot be written fails before the runs, not after.
  std::ofstream json_out;
  if (!o.json_path.empty()) {
    json_out.open(o.json_path);
    TESSERA_CHECK(json_out.good(), o.json_path, ": cannot open for writing");
  }
  const DeviceInfo dev = read_device();
  const std::string date = utc_date();
  TimingPolicy policy;
  policy.trials = o.trials;
  policy.trial_seconds = o.trial_ms * 1e-3;

  std::printf("bench-kernels: tessera's GPU kernels on one device\n");
  std::printf("device: cuda:%d %s (PCI %s), compute capability %d.%d, %d SMs, L2 %.1f MiB, memory %.1f GiB\n",
              dev.index, dev.name.c_str(), dev.pci.c_str(), dev.cc_major, dev.cc_minor, dev.sms,
              dev.l2_bytes / double(1 << 20), dev.memory_bytes / double(1 << 30));
  std::printf("clocks: SM up to %d MHz; memory up to %d MHz on a %d-bit bus (%.0f GB/s by these attributes); "
              "current clocks are not read here (nvidia-smi shows them)\n",
              dev.sm_clock_khz / 1000, dev.memory_clock_khz / 1000, dev.bus_bits, dev.attribute_bandwidth() / 1e9);
  std::printf("software: driver supports CUDA %s; runtime %s; cuBLASLt %s\n", cuda_version_text(dev.driver).c_str(),
              cuda_version_text(dev.runtime).c_str(), cublaslt_version_text(dev.cublaslt).c_str());
  std::printf("date: %s; commit: %s\n", date.c_str(), o.commit.c_str());
  std::printf("method: CUDA events around N back-to-back calls (N so a trial lasts >= %.1f ms, at most 256), median of %lld "
              "trials after a warm-up call; uniform random inputs; operand sets rotated while one set is under 3x "
              "the L2; GEMM candidates screened for %.1f ms each, the fastest %lld timed in full\n",
              o.trial_ms, (long long)o.trials, o.screen_ms, (long long)o.finalists);
  std::fflush(stdout);

  json doc = {{"benchmark", "bench-kernels"},
              {"date", date},
              {"commit", o.commit},
              {"device",
               {{"index", dev.index},
                {"name", dev.name},
                {"pci_bus_id", dev.pci},
                {"compute_capability", std::to_string(dev.cc_major) + "." + std::to_string(dev.cc_minor)},
                {"sms", dev.sms},
                {"sm_clock_max_mhz", dev.sm_clock_khz / 1000},
                {"memory_clock_max_mhz", dev.memory_clock_khz / 1000},
                {"memory_bus_bits", dev.bus_bits},
                {"attribute_bandwidth_gbps", dev.attribute_bandwidth() / 1e9},
                {"l2_bytes", dev.l2_bytes},
                {"memory_bytes", dev.memory_bytes},
                {"cuda_driver", cuda_version_text(dev.driver)},
                {"cuda_runtime", cuda_version_text(dev.runtime)},
                {"cublaslt", cublaslt_version_text(dev.cublaslt)}}},
              {"options",
               {{"tokens", o.tokens},
                {"flavors", o.flavors},
                {"attention_seqs", o.attention_seqs},
                {"dtypes", [&] {
                   std::vector<std::string> names;
                   for (DType d : o.dtypes) names.push_back(dtype_label(d));
                   return names;
                 }()},
                {"sections",
                 {{"ceilings", o.ceilings}, {"gemm", o.gemm}, {"attention", o.attention}, {"memory", o.memory},
                  {"sm_hold", o.sm_hold}, {"float8", o.float8}}},
                {"memory_flavor", o.memory_flavor},
                {"trials", o.trials},
                {"trial_ms", o.trial_ms},
                {"screen_ms", o.screen_ms},
                {"candidates", o.candidates},
                {"finalists", o.finalists}}}};
  bool checks_ok = true;
  warm_up_device();

  if (o.ceilings) {
    const Ceilings c = measure_ceilings(policy, dev);
    std::printf("\nceilings (this run): bf16 GEMM %lld^3 %.1f TFLOP/s%s; fp32 GEMM %lld^3 (no TF32) %.1f TFLOP/s%s; "
                "device copy %s (read + written) %.0f GB/s\n",
                (long long)c.gemm_size, c.bf16_gemm / 1e12, host_note(c.bf16_timing).c_str(), (long long)c.gemm_size,
                c.fp32_gemm / 1e12, host_note(c.fp32_timing).c_str(), decimal_bytes(2 * c.copy_bytes).c_str(),
                c.copy / 1e9);
    std::fflush(stdout);
    doc["ceilings"] = {{"gemm_size", c.gemm_size},
                       {"bf16_gemm_tflops", c.bf16_gemm / 1e12},
                       {"bf16_gemm", c.bf16_timing.to_json()},
                       {"fp32_gemm_tflops", c.fp32_gemm / 1e12},
                       {"fp32_gemm", c.fp32_timing.to_json()},
                       {"copy_bytes_read_plus_written", 2 * c.copy_bytes},
                       {"copy_gbps", c.copy / 1e9},
                       {"copy", c.copy_timing.to_json()}};
  }

  std::vector<GemmResult> gemms;
  if (o.gemm) {
    json rows = json::array();
    for (DType dtype : o.dtypes) {
      print_gemm_header(dtype, o.tokens);
      for (const auto& flavor : o.flavors)
        for (const GemmCase& g : gemm_cases(flavor, o.tokens, device_bytes(o))) {
          GemmResult r = dtype == DType::f32 ? run_gemm<float, float>(g, o, policy, dev)
                                             : with_result(g, [&]<class C>() { return run_gemm<bf16, C>(g, o, policy, dev); });
          print_gemm(r);
          rows.push_back(gemm_json(r));
          checks_ok = checks_ok && r.check_ok;
          gemms.push_back(std::move(r));
        }
    }
    doc["gemm"] = rows;
  }

  if (o.float8) {
    print_float8_header(o.tokens);
    json rows = json::array();
    for (const auto& flavor : o.flavors)
      for (const GemmCase& g : gemm_cases(flavor, o.tokens, device_bytes(o), true)) {
        const Float8Result r = run_float8(g, policy);
        print_float8(r);
        rows.push_back(float8_json(r));
      }
    doc["float8"] = rows;
  }

  std::vector<AttentionResult> attention;
  if (o.attention) {
    print_attention_header();
    json rows = json::array();
    std::vector<std::array<std::int64_t, 3>> seen;  // (heads, kv heads, head dim) already run
    for (const auto& flavor : o.flavors) {
      const tessera::nn::ModelArgs a = tessera::nn::model_flavor(flavor);
      const std::array<std::int64_t, 3> heads = {a.n_heads, a.kv_heads(), a.head_dim()};
      if (std::find(seen.begin(), seen.end(), heads) != seen.end()) continue;
      seen.push_back(heads);
      if (a.head_dim() != 64 && a.head_dim() != 128) {
        std::printf("  %-12s head dim %lld: the flash kernels take 64 and 128; skipped\n", flavor.c_str(),
                    (long long)a.head_dim());
        continue;
      }
      for (std::int64_t seq : o.attention_seqs)
        for (DType dtype : o.dtypes)
          for (const char* mask : {"causal", "full", "docs"}) {
            // Full (no mask) and packed documents in bf16 only: the storage a run trains in.
            const bool causal = std::string(mask) != "full", packed = std::string(mask) == "docs";
            if (std::string(mask) != "causal" && dtype != DType::bf16) continue;
            AttentionShape s{std::max<std::int64_t>(1, o.tokens / seq), seq, a.n_heads, a.kv_heads(), a.head_dim(),
                             causal};
            const std::vector<tessera::ops::DocumentSpan> documents =
                packed ? packed_documents(s.batch, s.seq_len) : std::vector<tessera::ops::DocumentSpan>{};
            AttentionResult r = dtype == DType::bf16 ? run_attention<bf16>(flavor, s, policy, false, documents)
                                                     : run_attention<float>(flavor, s, policy);
            print_attention(r);
            rows.push_back(attention_json(r));
            checks_ok = checks_ok && r.nonfinite == 0;
            attention.push_back(std::move(r));
            if (dtype != DType::bf16) continue;
            // cuDNN, as training.attention = "cudnn" installs it for this shape.
            std::string why;
            try {
              (void)tessera::cuda::select_attention("cudnn", true, s, false, false, packed);
            } catch (const std::exception& e) {
              why = e.what();
            }
            if (!why.empty()) {
              std::printf("  %-12s cudnn   bf16    %-6s not run: %s\n", flavor.c_str(), mask, why.c_str());
              continue;
            }
            // Causal: also in the step's layout (q, k, v out of the fused projection).
            for (bool step_layout : {false, true}) {
              if (step_layout && !(causal && !packed)) continue;
              AttentionResult c = run_attention<bf16>(flavor, s, policy, true, documents, step_layout);
              print_attention(c);
              rows.push_back(attention_json(c));
              checks_ok = checks_ok && c.nonfinite == 0;
              attention.push_back(std::move(c));
            }
            tcuda::set_attention_engine(nullptr);
          }
    }
    doc["attention"] = rows;
  }

  if (o.memory) {
    const tessera::nn::ModelArgs a = tessera::nn::model_flavor(o.memory_flavor);
    print_memory_header(a, o.tokens);
    json rows = json::array();
    for (const MemoryResult& r : run_memory(a, o.tokens, policy, dev)) {
      rows.push_back(memory_json(r));
      checks_ok = checks_ok && r.nonfinite == 0;
    }
    doc["memory"] = rows;
  }

  if (o.sm_hold) {
    json rows = json::array();
    bool covered = true;
    for (const SmHoldResult& r :
         run_sm_hold(gemm_cases(o.memory_flavor, o.tokens, device_bytes(o)), o.trial_ms * 1e-3, o.held_sms, dev)) {
      rows.push_back(sm_hold_json(r));
      for (const auto& h : r.held) covered = covered && h.covered;
    }
    doc["sm_hold"] = rows;
    if (!covered)
      std::printf("  note: a hold ended before its GEMMs or not all its blocks became resident (the rows marked '!'): "
                  "those ratios are low bounds\n");
  }

  // Targets.
  std::printf("\ntargets:\n");
  json targets = json::object();
  if (o.attention) {
    // The attention a bf16 training run uses: cuDNN's rows where cuDNN ran, else tessera's.
    const bool cudnn_ran = std::any_of(attention.begin(), attention.end(),
                                       [](const AttentionResult& r) { return r.target_case() && r.kernel == "cudnn"; });
    const std::string counted = cudnn_ran ? "cudnn" : "tessera";
    std::string line;
    bool all = true, any = false;
    for (const auto& r : attention)
      if (r.target_case() && r.kernel == counted) {
        any = true;
        all = all && r.pass();
        line += (line.empty() ? "" : "; ") + r.flavor + " " + r.kernel + " (B " + std::to_string(r.s.batch) + ") " +
                fmt("%.1f TFLOP/s ", r.forward_tflops()) + (r.pass() ? "PASS" : "MISS");
      }
    std::printf("  causal attention forward >= 450 TFLOP/s at hd 128, T 8192, bf16: %s\n",
                any ? line.c_str() : "not measured (needs bf16, a flavor with head dim 128 and T 8192)");
    targets["attention_forward_450"] = any ? json(all) : json(nullptr);
  }
  if (o.gemm && !gemms.empty()) {
    std::int64_t passed = 0;
    const GemmResult* worst = &gemms.front();
    for (const auto& r : gemms) {
      passed += r.pass() ? 1 : 0;
      if (r.fraction < worst->fraction) worst = &r;
    }
    std::printf("  GEMM heuristic choice within 5%% of the best candidate: %lld of %zu shapes PASS; lowest: %s %s %s "
                "%s (%s) at %.1f%%\n",
                (long long)passed, gemms.size(), dtype_label(worst->dtype).c_str(), worst->c.flavor.c_str(),
                worst->c.layer_text().c_str(), worst->c.pass.c_str(), worst->c.mnk_text().c_str(),
                100 * worst->fraction);
    targets["gemm_within_5_percent"] = {{"passed", passed}, {"shapes", gemms.size()}};
  }
  if (!o.attention && !o.gemm) std::printf("  none in the sections run\n");
  doc["targets"] = targets;
  doc["checks_ok"] = checks_ok;
  std::string checked;
  if (o.gemm) checked += "every best GEMM candidate agrees with the heuristic's result";
  if (o.attention) checked += std::string(checked.empty() ? "" : "; ") + "attention outputs finite";
  if (o.memory) checked += std::string(checked.empty() ? "" : "; ") + "memory-op outputs finite";
  std::printf("checks: %s\n", !checks_ok ? "FAILED (see the lines marked CHECK FAILED)"
                               : checked.empty() ? "none in the sections run"
                                                 : checked.c_str());

  if (!o.json_path.empty()) {
    json_out << doc.dump(2) << '\n';
    json_out.flush();
    TESSERA_CHECK(json_out.good(), o.json_path, ": write failed");
  }
  return checks_ok ? 0 : 2;
}

}  // namespace

/// --list-gemms: the cases the GEMM sections would time, for each flavor; no device needed
/// when --device-memory-gib is given.
int list_gemms(const Options& o) {
  std::printf("the GEMMs of one training step, batch 1 x %lld tokens, no checkpointing, as llama-plan traces it "
              "(sized for %.1f GiB of device memory)\n",
              (long long)o.tokens, double(device_bytes(o)) / double(std::size_t{1} << 30));
  for (bool float8 : {false, true}) {
    if (float8 ? !o.float8 : !(o.gemm || o.sm_hold)) continue;
    std::printf("%s\n", float8 ? "float8 (tensorwise):" : "bf16:");
    for (const auto& flavor : o.flavors)
      for (const GemmCase& g : gemm_cases(flavor, o.tokens, device_bytes(o), float8))
        std::printf("  %-12s %-16s %-22s %-22s %s%s, %s -> %s\n", g.flavor.c_str(), g.layer_text().c_str(),
                    g.pass.c_str(), g.mnk_text().c_str(), tessera::trace::trans_name(g.ta, g.tb).c_str(),
                    g.beta_one ? " beta 1" : "", std::string(tessera::name_of(g.operands)).c_str(),
                    std::string(tessera::name_of(g.result)).c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    const Options o = parse_options(argc, argv);
    if (o.list_gemms) return list_gemms(o);
    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    if (status != cudaSuccess || devices <= 0) {
      if (status != cudaSuccess)
        std::fprintf(stderr, "bench-kernels: no CUDA device is visible (cudaGetDeviceCount: %s: %s)\n",
                     cudaGetErrorName(status), cudaGetErrorString(status));
      else
        std::fprintf(stderr, "bench-kernels: no CUDA device is visible (cudaGetDeviceCount: 0 devices)\n");
      return 1;
    }
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-kernels: %s\n", e.what());
    return 1;
  }
}
