// The CPU's profile, measured: how fast this machine runs what a traced step asks.
//
// A GPU's rates come from a file; the CPU's are measured on the machine at hand, in a
// few seconds, on the very work the trace holds:
//
//   GEMMs       every distinct GEMM of the trace (shape, transposes, dtypes, accumulation)
//               timed through Cpu::gemm: the median of repeated runs. One above
//               kMaxGemmFlops, or with an operand above kMaxOperandBytes, is timed on
//               fewer rows and columns (m and n halved in turn, k kept) and its time
//               scaled by the FLOPs: a step of a model too large for this machine is
//               still priced in seconds, at the rate its shape reaches here
//   attention   every distinct attention call, forward and backward, through the CPU
//               backend's attention; past kMaxGemmFlops on fewer batch rows and heads
//               (keeping enough parallel tasks to fill the threads as the call does),
//               then on a shorter sequence, its time scaled by the FLOPs
//   bandwidth   a copy through Cpu::for_each at working sets from 64 KiB to 256 MiB (a
//               kernel over a small tensor runs from cache)
//   arithmetic  exp, and multiply-adds, per second through Cpu::for_each
//   launches    the fork and join of one Cpu::for_each over a few indices
//
// CpuPricer prices a kernel as its launch plus the longer of its bytes at the bandwidth
// of its working set and its arithmetic at the measured rates; a GEMM or an attention
// call as measured; a fill as a memset of its bytes; a transfer from the host as a copy
// (to the host, nothing: the CPU backend's memory is the host's, download() returns the
// tensor itself); a synchronisation as nothing. The peak for MFU is the fastest GEMM
// measured, the model's own shapes and a 1024^3 product among them: the model's GEMM
// FLOPs (6 N per token) cannot run faster than that, so its MFU stays below 100%.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/macros.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/plan/cost.hpp"

namespace tessera::plan {

namespace detail {
using GemmKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, int, int, int, int, bool>;
using AttentionKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, int, bool>;

inline GemmKey key_of(const trace::Gemm& g) {
  return {g.m, g.n, g.k, static_cast<int>(g.ta), static_cast<int>(g.tb), static_cast<int>(g.operands),
          static_cast<int>(g.result), g.accumulate};
}
inline AttentionKey key_of(const trace::Attention& a) {
  return {a.shape.batch, a.shape.seq_len, a.shape.n_heads, a.shape.n_kv_heads, a.shape.head_dim,
          static_cast<int>(a.dtype), a.backward};
}

/// Seconds one call of f takes: the median of runs after a warm-up, repeated until
/// `budget` seconds have passed (at least 3 runs, at most 200); `before` runs ahead of
/// each run, untimed.
template <class F, class G>
double time_median(F&& f, double budget, G&& before) {
  before();
  f();
  std::vector<double> runs;
  const auto start = std::chrono::steady_clock::now();
  while (runs.size() < 3 || (runs.size() < 200 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < budget)) {
    before();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(runs.begin(), runs.begin() + static_cast<std::ptrdiff_t>(runs.size() / 2), runs.end());
  return runs[runs.size() / 2];
}
template <class F>
double time_median(F&& f, double budget) {
  return time_median(std::forward<F>(f), budget, [] {});
}

/// Bytes of the last-level cache (sysfs), or 32 MiB where it does not say.
inline std::size_t last_level_cache_bytes() {
  std::size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::size_t n = 0;
    char unit = 0;
    if (!(in >> n)) continue;
    in >> unit;
    best = std::max(best, n * (unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1));
  }
  return best > 0 ? best : std::size_t{32} << 20;
}

/// Writes twice the last-level cache through every thread: what the next call reads
/// comes from memory, as a step's operands do (its working set is far larger than the
/// caches, and the kernels between two GEMMs walk other tensors).
/// Host memory, not a tensor: it stays out of the tracked memory a run reports.
class CacheEvictor {
 public:
  CacheEvictor() : junk_(2 * last_level_cache_bytes() / sizeof(float)) {}
  void operator()() {
    value_ += 1.0f;
    Cpu::for_each(static_cast<std::int64_t>(junk_.size()), ops::Fill<float>{value_, junk_.data()});
  }

 private:
  std::vector<float> junk_;
  float value_ = 0;
};

/// A host tensor of small values (so products stay finite).
template <class T>
Tensor<T> filled(Shape s) {
  Tensor<T> t(s, Uninitialized{});
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = T(static_cast<float>(i % 7) * 0.01f);
  return t;
}

/// Above these, an item is timed on a smaller instance of itself and scaled (see above).
inline constexpr double kMaxGemmFlops = 2e9;
inline constexpr double kMaxOperandBytes = 64.0 * 1024 * 1024;

/// The GEMM measure_cpu times for `g`: m and n halved in turn until it is within the
/// limits (k kept: it sets the rate), and the factor its FLOPs are short of g's by.
inline std::pair<trace::Gemm, double> timed_instance(const trace::Gemm& g) {
  trace::Gemm t = g;
  const double elem = static_cast<double>(std::max(size_of(g.operands), size_of(g.result)));
  auto too_big = [&] {
    const double m = static_cast<double>(t.m), n = static_cast<double>(t.n), k = static_cast<double>(t.k);
    return t.flops() > kMaxGemmFlops || std::max({m * k, k * n, m * n}) * elem > kMaxOperandBytes;
  };
  while (too_big() && (t.m > 64 || t.n > 64)) {
    if (t.m >= t.n) t.m = (t.m + 1) / 2;
    else t.n = (t.n + 1) / 2;
  }
  return {t, g.flops() / t.flops()};
}

template <class T, class C>
double time_gemm(const trace::Gemm& g, double budget, CacheEvictor& evict) {
  const Tensor<T> a = filled<T>(g.ta == Trans::no ? Shape{g.m, g.k} : Shape{g.k, g.m});
  const Tensor<T> b = filled<T>(g.tb == Trans::no ? Shape{g.k, g.n} : Shape{g.n, g.k});
  Tensor<C> c = filled<C>(Shape{g.m, g.n});
  const accum_t<T> beta = g.accumulate ? accum_t<T>(1) : accum_t<T>(0);
  return time_median([&] { Cpu::gemm<T, C>(g.ta, g.tb, accum_t<T>(1), a.cview(), b.cview(), beta, c.view()); }, budget,
                     evict);
}

/// The attention call measure_cpu times for `a`, and the factor its FLOPs are short of
/// a's by. The CPU backend runs one task per (batch row, head) forward and per (batch
/// row, kv head) backward, in parallel when there are Cpu::kMinParallel or more: so the
/// instance keeps a's tasks, or enough of them to keep every thread busy the same way
/// (at least max(kMinParallel, 4 threads)), halving the batch, then the kv heads with
/// their groups, then the sequence, only while it is above kMaxGemmFlops.
inline std::pair<trace::Attention, double> timed_instance(const trace::Attention& a, int threads) {
  trace::Attention t = a;
  auto tasks = [&](const trace::Attention& x) {
    return x.shape.batch * (x.backward ? x.shape.n_kv_heads : x.shape.n_heads);
  };
  const std::int64_t keep = std::min(tasks(a), std::max<std::int64_t>(Cpu::kMinParallel, 4 * std::int64_t{threads}));
  auto halve_batch = [](trace::Attention x) {
    x.shape.batch /= 2;
    return x;
  };
  auto halve_heads = [](trace::Attention x) {  // whole groups: the kv heads and their query heads
    if (x.shape.n_kv_heads % 2 == 0) {
      x.shape.n_kv_heads /= 2;
      x.shape.n_heads /= 2;
    }
    return x;
  };
  while (t.flops() > kMaxGemmFlops) {
    if (const auto b = halve_batch(t); b.shape.batch >= 1 && tasks(b) >= keep) t = b;
    else if (const auto h = halve_heads(t); h.shape.n_kv_heads < t.shape.n_kv_heads && tasks(h) >= keep) t = h;
    else if (t.shape.seq_len > 256) t.shape.seq_len = (t.shape.seq_len + 1) / 2;
    else break;
  }
  return {t, a.flops() / t.flops()};
}

template <class T>
double time_attention(const trace::Attention& at, double budget) {
  const AttentionShape& s = at.shape;
  const std::int64_t rows = s.rows();
  const Tensor<T> q = filled<T>({rows, s.n_heads * s.head_dim});
  const Tensor<T> k = filled<T>({rows, s.n_kv_heads * s.head_dim}), v = filled<T>({rows, s.n_kv_heads * s.head_dim});
  Tensor<T> o = filled<T>({rows, s.n_heads * s.head_dim});
  Tensor<accum_t<T>> lse(Shape{s.batch, s.n_heads, s.seq_len});
  Cpu::attention_forward<T>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data());
  if (!at.backward)
    return time_median([&] { Cpu::attention_forward<T>(s, q.cview(), k.cview(), v.cview(), o.view(), lse.data()); },
                       budget);
  const Tensor<T> d_o = filled<T>({rows, s.n_heads * s.head_dim});
  Tensor<T> dq(q.shape()), dk(k.shape()), dv(v.shape());
  return time_median(
      [&] {
        Cpu::attention_backward<T>(s, q.cview(), k.cview(), v.cview(), o.cview(), lse.data(), d_o.cview(), dq.view(),
                                   dk.view(), dv.view());
      },
      budget);
}

/// exp(x) for each element, in place.
struct ExpInPlace {
  float* x;
  TESSERA_HD void operator()(std::int64_t i) const { x[i] = std::exp(x[i] * 1e-3f); }
};
/// Eight dependent multiply-adds for each element, in place.
struct MultiplyAdds {
  float* x;
  TESSERA_HD void operator()(std::int64_t i) const {
    float v = x[i];
    for (int r = 0; r < 8; ++r) v = v * 0.999f + 1e-3f;
    x[i] = v;
  }
};
struct Nothing {
  TESSERA_HD void operator()(std::int64_t) const {}
};

inline double host_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key >> kib) {
    if (key == "MemTotal:") return kib * 1024;
    in.ignore(256, '\n');
  }
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}
}  // namespace detail

/// This machine's CPU, measured on the work of a trace.
struct CpuProfile {
  std::map<detail::GemmKey, double> gemm_seconds;
  std::map<detail::AttentionKey, double> attention_seconds;
  int scaled = 0;  // GEMMs and attention calls timed on a smaller instance and scaled
  std::vector<std::pair<double, double>> bandwidth;  // (working-set bytes, bytes per second), increasing
  double exp_per_second = 0;
  double flops_per_second = 0;  // multiply-adds counted as two
  double launch_seconds = 0;
  double peak_gemm_flops = 0;  // the fastest GEMM measured
  double memory_bytes = 0;     // the host's memory (MemTotal)
  int threads = 1;
  std::string blas_kernels;
  double seconds = 0;  // how long measuring took

  /// Bytes per second at a working set of `bytes`: the measured point at or above it.
  double bandwidth_at(double bytes) const {
    for (const auto& [size, rate] : bandwidth)
      if (bytes <= size) return rate;
    return bandwidth.back().second;
  }
};

/// Times every distinct GEMM of `trace` (the median of runs, `budget` seconds at most
/// each) into p.gemm_seconds, and sets p.peak_gemm_flops to the fastest rate measured,
/// a 1024^3 product among them. That is llama-train's peak for MFU on the CPU: the
/// model's FLOPs are its GEMMs (6 N per token) and attention, and its step does more
/// besides, so the step cannot reach it and MFU stays below 100%, where the best of a
/// few short samples of one shape can be beaten by the step itself.
inline void measure_gemms(const trace::Trace& trace, double budget, CpuProfile& p) {
  detail::CacheEvictor evict;
  for (const auto& g : trace.all<trace::Gemm>()) {
    const auto key = detail::key_of(g);
    if (p.gemm_seconds.count(key)) continue;
    // The CPU backend has no float8 GEMM to time: a trace of float8 GEMMs is a GPU's
    // (float8.emulate = false), and timing nothing would price them as free.
    TESSERA_CHECK(!is_float8(g.operands), "the CPU profile: a float8 GEMM (", g.m, "x", g.n, "x", g.k, " ",
                  name_of(g.operands), ") has no rate here: the CPU backend runs float8 GEMMs emulated (float8.emulate = true)");
    const auto [timed, scale] = detail::timed_instance(g);
    double s = 0;
    if (g.operands == DType::f32 && g.result == DType::f32) s = detail::time_gemm<float, float>(timed, budget, evict);
    else if (g.operands == DType::bf16 && g.result == DType::bf16) s = detail::time_gemm<bf16, bf16>(timed, budget, evict);
    else if (g.operands == DType::bf16 && g.result == DType::f32) s = detail::time_gemm<bf16, float>(timed, budget, evict);
    else if (g.operands == DType::f64) s = detail::time_gemm<double, double>(timed, budget, evict);
    p.gemm_seconds[key] = s * scale;
    p.scaled += scale > 1;
    if (s > 0) p.peak_gemm_flops = std::max(p.peak_gemm_flops, timed.flops() / s);
  }
  // The ceiling a large square product reaches, whatever the model's shapes.
  const trace::Gemm square{1024, 1024, 1024, Trans::no, Trans::no, DType::f32, DType::f32, false};
  p.peak_gemm_flops = std::max(p.peak_gemm_flops, square.flops() / detail::time_gemm<float, float>(square, 4 * budget, evict));
}

/// Measures the CPU on every GEMM and attention call of `trace`, plus bandwidth and
/// arithmetic rates; `budget` seconds at most per item timed.
inline CpuProfile measure_cpu(const trace::Trace& trace, double budget = 0.04) {
  const auto t0 = std::chrono::steady_clock::now();
  CpuProfile p;
  p.threads = Cpu::threads();
  p.blas_kernels = Cpu::blas_kernels();
  p.memory_bytes = detail::host_memory_bytes();
  measure_gemms(trace, budget, p);
  for (const auto& a : trace.all<trace::Attention>()) {
    const auto key = detail::key_of(a);
    if (p.attention_seconds.count(key)) continue;
    const auto [timed, scale] = detail::timed_instance(a, p.threads);
    p.attention_seconds[key] = scale * (a.dtype == DType::bf16 ? detail::time_attention<bf16>(timed, budget)
                                                               : detail::time_attention<float>(timed, budget));
    p.scaled += scale > 1;
  }
  for (double bytes = 64.0 * 1024; bytes <= 256.0 * 1024 * 1024; bytes *= 4) {
    const auto n = static_cast<std::int64_t>(bytes / 8);  // two float arrays of n elements
    Tensor<float> x = detail::filled<float>({n}), y(Shape{n});
    const double s = detail::time_median([&] { Cpu::for_each(n, ops::Copy<float>{x.data(), y.data()}); }, budget);
    p.bandwidth.push_back({bytes, bytes / s});
  }
  {
    const std::int64_t n = 1 << 20;
    Tensor<float> x = detail::filled<float>({n});
    p.exp_per_second = static_cast<double>(n) / detail::time_median([&] { Cpu::for_each(n, detail::ExpInPlace{x.data()}); }, budget);
    p.flops_per_second =
        16.0 * static_cast<double>(n) / detail::time_median([&] { Cpu::for_each(n, detail::MultiplyAdds{x.data()}); }, budget);
    p.launch_seconds = detail::time_median([] { Cpu::for_each(Cpu::kMinParallel, detail::Nothing{}); }, budget / 4);
  }
  p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

class CpuPricer : public Pricer {
 public:
  explicit CpuPricer(CpuProfile p) : p_(std::move(p)) {}

  double seconds(const trace::Op& op) const override {
    return std::visit([&](const auto& o) { return work(o); }, op);
  }
  double peak_flops(DType) const override { return p_.peak_gemm_flops; }
  double usable_bytes() const override { return p_.memory_bytes; }
  bool host_runs_device_work() const override { return true; }  // the cores run both
  std::string name() const override {
    return tessera::detail::concat("cpu (", p_.threads, " thread", p_.threads == 1 ? "" : "s", ", OpenBLAS ",
                                   p_.blas_kernels, " kernels, measured)");
  }
  const CpuProfile& profile() const { return p_; }

 private:
  double work(const trace::Gemm& g) const {
    auto it = p_.gemm_seconds.find(detail::key_of(g));
    TESSERA_CHECK(it != p_.gemm_seconds.end(), "CpuPricer: gemm ", g.m, "x", g.n, "x", g.k,
                  " was not measured (measure_cpu on the trace that holds it)");
    return it->second;
  }
  double work(const trace::Attention& a) const {
    auto it = p_.attention_seconds.find(detail::key_of(a));
    TESSERA_CHECK(it != p_.attention_seconds.end(), "CpuPricer: an attention call was not measured");
    return it->second;
  }
  double work(const trace::Kernel& k) const {
    const ops::Traffic& t = k.traffic;
    const double memory = t.bytes() / p_.bandwidth_at(t.bytes());
    const double arithmetic = t.flops / p_.flops_per_second + t.transcendentals / p_.exp_per_second;
    return (k.n >= Cpu::kMinParallel ? p_.launch_seconds : 0) + std::max(memory, arithmetic);
  }
  double work(const trace::Fill& f) const {
    return static_cast<double>(f.bytes) / p_.bandwidth_at(static_cast<double>(f.bytes));
  }
  double work(const trace::Transfer& t) const {
    return t.to_host ? 0 : static_cast<double>(t.bytes) / p_.bandwidth_at(static_cast<double>(t.bytes));
  }
  double work(const trace::Synchronize&) const { return 0; }
  double work(const trace::Fence&) const { return 0; }
  double work(const trace::FenceWait&) const { return 0; }
  double work(const trace::Memory&) const { return 0; }
  // Communication is priced on the cluster's links, beside the compute (plan/cluster.hpp).
  double work(const trace::Collective&) const { return 0; }
  double work(const trace::CommWait&) const { return 0; }

  CpuProfile p_;
};

}  // namespace tessera::plan
