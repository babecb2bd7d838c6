// bench-train-step: one full CPU training step of torchtitan's debug model shape.
//
// A step is what the trainer does between two batches: zero_grad, forward_backward over
// one micro-batch of real tokens (the embedded synthetic corpus through data::DataLoader),
// the global gradient norm and its clipping coefficient, and one AdamW update. The
// benchmark runs --warmup untimed steps, then --steps timed ones, and reports:
//
//   1. tokens/s and the median step time;
//   2. the step's FLOP rate by torchtitan's formula (tokens x ModelArgs::flops_per_token,
//      no causal halving) against the rate OpenBLAS sgemm reaches, in this run, on the
//      largest forward GEMM shape of the model (target: >= 50%);
//   3. the peak of tracked host memory during a step against the analytic count
//      parameters + gradients + AdamW moments + saved activations (target: <= 1.5x); the
//      saved-activation formula is checked against what the layers stored, and the run
//      fails if they differ by more than 1%;
//   4. where the time goes: a TimedCpu backend (the Cpu backend with gemm, attention and
//      for_each shadowed by timed versions) splits the step into top-level GEMMs, the
//      attention core, element-wise/row kernels, and the rest;
//   5. the machine, the date (UTC) and the commit given with --commit.
//
// The default shape is batch 8 x seq 1024, which keeps the default run near two minutes
// on two cores; torchtitan's debug runs use seq 2048 (--seq 2048). Targets are reported
// as PASS/MISS; only a wrong activation formula or an error makes the exit status
// non-zero.
#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/units.hpp"
#include "tessera/data/loader.hpp"
#include "tessera/data/synthetic.hpp"
#include "tessera/io/tokenizer.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/nn/output.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/optim/adamw.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/train/metrics.hpp"

#include "machine.hpp"

namespace {

using namespace tessera::bench;

using tessera::Cpu;
using tessera::memory_bytes;
using tessera::Shape;
using tessera::Tensor;
using tessera::TensorView;
using tessera::Trans;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Seconds and FLOPs accumulated by TimedCpu since the last reset.
struct StepTimers {
  double gemm_seconds = 0;
  double gemm_flops = 0;
  std::int64_t gemm_calls = 0;
  double attention_seconds = 0;
  double for_each_seconds = 0;

  void reset() { *this = StepTimers{}; }
};

StepTimers timers;

/// The Cpu backend with its GEMMs, attention core and element-wise loops timed. Only
/// calls made outside an OpenMP parallel region are timed (those are the ones that use
/// every core); the attention core runs its own GEMMs and loops on the plain Cpu
/// backend inside its parallel loop, so they land in the attention bucket alone.
struct TimedCpu : Cpu {
  template <class T>
  static void gemm(Trans ta, Trans tb, T alpha, TensorView<const T> a, TensorView<const T> b, T beta,
                   TensorView<T> c) {
    if (omp_in_parallel()) {
      Cpu::gemm(ta, tb, alpha, a, b, beta, c);
      return;
    }
    const auto t0 = clock_type::now();
    Cpu::gemm(ta, tb, alpha, a, b, beta, c);
    timers.gemm_seconds += seconds_since(t0);
    const double k = static_cast<double>(ta == Trans::no ? a.cols() : a.rows());
    timers.gemm_flops += 2.0 * static_cast<double>(c.rows()) * static_cast<double>(c.cols()) * k;
    ++timers.gemm_calls;
  }

  template <class F>
  static void for_each(std::int64_t n, const F& f) {
    if (omp_in_parallel()) {
      Cpu::for_each(n, f);
      return;
    }
    const auto t0 = clock_type::now();
    Cpu::for_each(n, f);
    timers.for_each_seconds += seconds_since(t0);
  }

  template <class T>
  static void attention_forward(const tessera::AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                TensorView<const T> v, TensorView<T> o, T* lse) {
    const auto t0 = clock_type::now();
    tessera::detail::cpu_attention_forward<Cpu>(s, q, k, v, o, lse);
    timers.attention_seconds += seconds_since(t0);
  }

  template <class T>
  static void attention_backward(const tessera::AttentionShape& s, TensorView<const T> q, TensorView<const T> k,
                                 TensorView<const T> v, TensorView<const T> o, const T* lse,
                                 TensorView<const T> d_o, TensorView<T> dq, TensorView<T> dk, TensorView<T> dv) {
    const auto t0 = clock_type::now();
    tessera::detail::cpu_attention_backward<Cpu>(s, q, k, v, o, lse, d_o, dq, dk, dv);
    timers.attention_seconds += seconds_since(t0);
  }
};

static_assert(tessera::Backend<TimedCpu>, "bench: TimedCpu must satisfy the Backend concept");

using Model = tessera::nn::Transformer<float, TimedCpu>;
using Optimizer = tessera::optim::AdamW<float, TimedCpu>;

struct Options {
  std::int64_t batch = 8;
  std::int64_t seq = 1024;
  std::int64_t steps = 3;
  std::int64_t warmup = 1;
  bool markdown = false;
  std::string commit = "-";
};

constexpr const char* usage =
    "usage: bench-train-step [--batch N] [--seq N] [--steps N] [--warmup N] [--markdown] [--commit HASH]\n"
    "  one CPU training step of the debugmodel flavor (fp32); defaults: --batch 8 --seq 1024 --steps 3 --warmup 1\n";

Options parse_options(int argc, char** argv) {
  Options o;
  for (Flags f(argc, argv); f.next();) {
    const std::string_view flag = f.flag();
    if (flag == "--batch") o.batch = parse_count(flag, f.value(), 1);
    else if (flag == "--seq") o.seq = parse_count(flag, f.value(), 1);
    else if (flag == "--steps") o.steps = parse_count(flag, f.value(), 1);
    else if (flag == "--warmup") o.warmup = parse_count(flag, f.value(), 0);
    else if (flag == "--commit") o.commit = std::string(f.value());
    else if (flag == "--markdown") o.markdown = true;
    else if (flag == "--help" || flag == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else {
      f.unknown();
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------
// The machine.

/// Whether /proc/cpuinfo lists `flag` among the CPU's flags.
bool cpu_has_flag(std::string_view flag) {
  const std::string flags = " " + cpuinfo_field("flags") + " ";
  return flags.find(" " + std::string(flag) + " ") != std::string::npos;
}

/// Whether OpenBLAS's kernel set `core` uses SSE only (its fallbacks for CPUs it does not know).
bool sse_only_kernels(std::string_view core) {
  for (std::string_view c : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Katmai", "Coppermine",
                             "Northwood", "Banias"})
    if (core == c) return true;
  return false;
}

/// The 1-minute load average, or -1 where /proc/loadavg cannot be read.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double v = -1;
  if (!(in >> v)) return -1;
  return v;
}


// ---------------------------------------------------------------------------------------
// GEMM shapes of the model's forward pass, and what sgemm reaches on each.

struct GemmShape {
  std::string name;
  std::int64_t m, n, k;  // C (m, n) = A (m, k) x W (n, k)^T, as nn::Linear calls it
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
};

std::vector<GemmShape> forward_gemm_shapes(const tessera::nn::ModelArgs& a, std::int64_t rows) {
  const std::int64_t q = a.n_heads * a.head_dim(), kv = a.kv_heads() * a.head_dim(), hidden = a.ffn_hidden_dim();
  const std::int64_t head_rows =
      tessera::nn::loss_chunk_rows(a.vocab_size, rows);  // one chunk of the head (an fp32 model on the host)
  std::vector<GemmShape> s = {
      {"attention.wq", rows, q, a.dim},   {"attention.wk/wv", rows, kv, a.dim},
      {"attention.wo", rows, a.dim, q},   {"feed_forward.w1/w3", rows, hidden, a.dim},
      {"feed_forward.w2", rows, a.dim, hidden}, {"output (one chunk)", head_rows, a.vocab_size, a.dim},
  };
  if (kv == q) {  // wq and wk/wv are the same product: time it once
    s.erase(s.begin() + 1);
    s.front().name = "attention.wq/wk/wv";
  }
  return s;
}

/// The best sgemm rate of `repeats` runs (after one warm-up) on shape s.
double sgemm_rate(const GemmShape& s, int repeats = 5) {
  Tensor<float> x(Shape{s.m, s.k}), w(Shape{s.n, s.k}), y(Shape{s.m, s.n});
  for (std::int64_t i = 0; i < x.numel(); ++i) x[i] = float(i % 17) * 0.01f - 0.08f;
  for (std::int64_t i = 0; i < w.numel(); ++i) w[i] = float(i % 13) * 0.01f - 0.06f;
  double best = 0;
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = clock_type::now();
    Cpu::gemm(Trans::no, Trans::yes, 1.0f, x.cview(), w.cview(), 0.0f, y.view());
    const double sec = seconds_since(t0);
    if (r > 0) best = std::max(best, s.flops() / sec);
  }
  return best;
}

// ---------------------------------------------------------------------------------------
// Analytic memory.

/// Bytes of activations the blocks save for backward, from what each layer saves:
/// per block the block input x, attention_norm's rstd and output (the input wq, wk and wv
/// save, one tensor), the rotated q and k, v, the attention output o (also wo's input),
/// lse (batch, heads, seq), h (ffn_norm's input), ffn_norm's rstd and output (w1 and
/// w3's input), a = w1 x and b = w3 x, and g = silu(a) * b (w2's input); and the final
/// norm's input and rstd.
double analytic_saved_activation_bytes(const tessera::nn::ModelArgs& a, std::int64_t batch, std::int64_t seq) {
  const double rows = double(batch) * double(seq);
  const double dim = double(a.dim), q = double(a.n_heads * a.head_dim()), kv = double(a.kv_heads() * a.head_dim()),
               hidden = double(a.ffn_hidden_dim());
  const double per_block = rows * dim            // x
                           + rows                // attention_norm rstd
                           + rows * dim          // attention_norm output
                           + rows * q            // q
                           + 2 * rows * kv       // k, v
                           + rows * q            // o
                           + double(batch) * double(a.n_heads) * double(seq)  // lse
                           + rows * dim          // h
                           + rows                // ffn_norm rstd
                           + rows * dim          // ffn_norm output
                           + 2 * rows * hidden   // a, b
                           + rows * hidden;      // g
  const double final_norm = rows * dim + rows;  // the final norm's input and rstd
  return (double(a.n_layers) * per_block + final_norm) * sizeof(float);
}

int run(const Options& opt) {
  tessera::nn::ModelArgs args = tessera::nn::model_flavor("debugmodel");
  args.max_seq_len = std::max(args.max_seq_len, opt.seq);  // only sizes the RoPE table
  const std::int64_t rows = opt.batch * opt.seq;

  // Data: enough real tokens that the timed steps never wrap.
  const std::int64_t needed = (opt.warmup + opt.steps) * opt.batch * (opt.seq + 1);
  std::vector<std::uint32_t> tokens;
  for (std::int64_t docs = 512; std::int64_t(tokens.size()) < needed; docs *= 2)
    tokens = tessera::data::pack_documents(tessera::data::synthetic_corpus(1234, docs), tessera::io::ByteTokenizer{});
  tessera::data::DataLoader loader(std::move(tokens), opt.seq, opt.batch);

  // Machine.
  const std::string machine = cpuinfo_field("model name") + " (family " + cpuinfo_field("cpu family") + " model " +
                              cpuinfo_field("model") + ")";
  const std::string blas_core = openblas_get_corename();
  const unsigned hw_threads = std::thread::hardware_concurrency();
  const int omp_threads = omp_get_max_threads();
  const std::string date = utc_date();

  std::printf("bench-train-step: debugmodel (dim %lld, n_layers %lld, n_heads %lld, vocab %lld, ffn hidden %lld), fp32\n",
              (long long)args.dim, (long long)args.n_layers, (long long)args.n_heads, (long long)args.vocab_size,
              (long long)args.ffn_hidden_dim());
  std::printf("batch %lld x seq %lld = %lld tokens/step; %lld warm-up + %lld timed steps\n", (long long)opt.batch,
              (long long)opt.seq, (long long)rows, (long long)opt.warmup, (long long)opt.steps);
  std::printf("machine: %s; %u hardware threads; %d OpenMP threads\n", machine.c_str(), hw_threads, omp_threads);
  std::printf("OpenBLAS: %s; kernels: %s\n", openblas_get_config(), blas_core.c_str());
  if (sse_only_kernels(blas_core) && cpu_has_flag("avx2")) {
    std::printf("warning: this CPU has AVX2%s but OpenBLAS runs its SSE-only %s kernels (it did not recognise the "
                "CPU model): sgemm, and every ratio against it, is far below what the machine can do; set "
                "OPENBLAS_CORETYPE=%s to measure against the kernels the hardware supports\n",
                cpu_has_flag("avx512f") ? " and AVX-512" : "", blas_core.c_str(),
                cpu_has_flag("avx512f") ? "SkylakeX" : "Haswell");
  }
  std::printf("date: %s; commit: %s\n\n", date.c_str(), opt.commit.c_str());

  // sgemm on every forward GEMM shape; the reference is the one with the most FLOPs
  // (ties: the faster one, the stricter reference).
  std::printf("sgemm on the model's forward GEMM shapes (C = A W^T, best of 5):\n");
  GemmShape largest{};
  double largest_rate = 0;
  for (const auto& s : forward_gemm_shapes(args, rows)) {
    const double rate = sgemm_rate(s);
    std::printf("  %-20s (%6lld x %4lld) x (%4lld x %4lld)^T  %7.2f GFLOP  %7.1f GFLOP/s\n", s.name.c_str(),
                (long long)s.m, (long long)s.k, (long long)s.n, (long long)s.k, s.flops() / 1e9, rate / 1e9);
    if (s.flops() > largest.flops() || (s.flops() == largest.flops() && rate > largest_rate)) {
      largest = s;
      largest_rate = rate;
    }
  }
  const double square_rate = tessera::train::measure_gemm_flops<Cpu>(1024);
  std::printf("  largest: %s at %.1f GFLOP/s; 1024^3 square sgemm (the trainer's default MFU peak): %.1f GFLOP/s\n\n",
              largest.name.c_str(), largest_rate / 1e9, square_rate / 1e9);

  // Model and optimizer: parameters, gradients and moments are allocated here, before
  // any step, and stay.
  Model model(args);
  model.init_weights(0);
  Optimizer optimizer(model, tessera::optim::AdamWOptions{});
  const std::int64_t n_params = model.num_params();
  TESSERA_CHECK(n_params == args.num_params(), "bench: model has ", n_params, " parameters, ModelArgs counts ",
                args.num_params());
  const double param_bytes = double(n_params) * sizeof(float);
  TESSERA_CHECK(double(optimizer.state_bytes()) == 2 * param_bytes, "bench: AdamW holds ", optimizer.state_bytes(),
                " bytes of state, expected 2 x parameters = ", 2 * param_bytes);

  const double flops_per_token = args.flops_per_token(opt.seq);
  const double flops_per_token_causal = args.flops_per_token(opt.seq, true);
  // The attention core's FLOPs as torchtitan's formula counts them (full T x T, no causal
  // halving); the blocked CPU kernel computes a little over half of that.
  const double attention_flops_per_step =
      12.0 * double(args.n_layers * args.n_heads * args.head_dim()) * double(opt.seq) * double(rows);

  std::vector<double> step_seconds;
  std::vector<StepTimers> step_timers;
  std::size_t peak = 0, held_before = 0, saved_measured = 0;
  double timed_cpu_seconds = 0;    // CPU time this process used during the timed steps
  double timed_other_seconds = 0;  // CPU time every other process used meanwhile
  const double load_before = load_average();
  const double max_norm = 1.0;
  for (std::int64_t i = 0; i < opt.warmup + opt.steps; ++i) {
    const tessera::data::Batch batch = loader.next();
    TESSERA_CHECK(batch.n_targets > 0, "bench: batch without targets");
    auto& stats = tessera::memory_stats(tessera::Device::cpu);
    stats.reset_peak();
    const std::size_t before = stats.current();
    timers.reset();

    const double cpu0 = cpu_seconds(), busy0 = machine_busy_seconds();
    const auto t0 = clock_type::now();
    model.zero_grad();
    const double loss_sum = model.forward_backward(batch.inputs, batch.targets,
                                                   tessera::nn::Geometry{batch.batch, batch.seq_len},
                                                   1.0 / double(batch.n_targets));
    const double norm = tessera::optim::grad_norm<TimedCpu>(model);
    optimizer.step(8e-4, tessera::optim::clip_coefficient(norm, max_norm));
    TimedCpu::synchronize();
    const double sec = seconds_since(t0);
    const double cpu_used = cpu_seconds() - cpu0;
    const double other_used = std::max(0.0, machine_busy_seconds() - busy0 - cpu_used);

    const double loss = loss_sum / double(batch.n_targets);
    TESSERA_CHECK(std::isfinite(loss) && std::isfinite(norm), "bench: step ", i + 1, ": loss ", loss,
                  " or grad norm ", norm, " is not finite");
    const bool timed = i >= opt.warmup;
    std::printf("step %lld%s: %.3f s  loss %.4f  grad_norm %.3f  gemm %.2f s  attention %.2f s  loops %.2f s\n",
                (long long)(i + 1), timed ? "" : " (warm-up)", sec, loss, norm, timers.gemm_seconds,
                timers.attention_seconds, timers.for_each_seconds);
    std::fflush(stdout);
    if (timed) {
      step_seconds.push_back(sec);
      timed_cpu_seconds += cpu_used;
      timed_other_seconds += other_used;
      step_timers.push_back(timers);
      peak = std::max(peak, stats.peak());
      held_before = before;
      saved_measured = model.saved_activation_bytes();
    }
  }

  const double load_after = load_average();

  // 1-2. Throughput and FLOP rate.
  const double step_time = median(step_seconds);
  const double tokens_per_sec = double(rows) / step_time;
  const double step_rate = tokens_per_sec * flops_per_token;
  const double step_rate_causal = tokens_per_sec * flops_per_token_causal;
  const double vs_sgemm = step_rate / largest_rate;
  const bool flops_pass = vs_sgemm >= 0.5;

  // 3. Memory.
  const double saved_analytic = analytic_saved_activation_bytes(args, opt.batch, opt.seq);
  const double saved_gap = std::abs(double(saved_measured) - saved_analytic) / saved_analytic;
  const double analytic = 4 * param_bytes + saved_analytic;  // params + grads + 2 moments + activations
  const double mem_ratio = double(peak) / analytic;
  const bool mem_pass = mem_ratio <= 1.5;
  // Not tracked by memory_stats: the attention kernel's per-thread (T, T) score tiles.
  // Per thread: the backward's two (block, seq) score tiles and its block of row sums.
  const double block = double(std::min<std::int64_t>(tessera::detail::kAttentionBlock, opt.seq));
  const double scratch = double(omp_threads) * (2.0 * block * double(opt.seq) + block) * 4;

  // 4. Where the time goes, summed over the timed steps.
  double total = 0, gemm = 0, gemm_flops = 0, attention = 0, loops = 0;
  std::int64_t gemm_calls = 0;
  for (std::size_t i = 0; i < step_seconds.size(); ++i) {
    total += step_seconds[i];
    gemm += step_timers[i].gemm_seconds;
    gemm_flops += step_timers[i].gemm_flops;
    gemm_calls += step_timers[i].gemm_calls;
    attention += step_timers[i].attention_seconds;
    loops += step_timers[i].for_each_seconds;
  }
  const double rest = total - gemm - attention - loops;
  const double gemm_share = gemm / total, attention_share = attention / total, loops_share = loops / total,
               rest_share = rest / total;
  const double gemm_rate = gemm_flops / gemm;
  // This process's CPU time over wall x threads (below 100%: serial code left threads
  // idle, or other processes took the cores), and the share of the machine's cores other
  // processes used meanwhile (above ~10%: the figures understate this machine).
  const double cpu_share = timed_cpu_seconds / (total * double(omp_threads));
  const double other_share = timed_other_seconds / (total * double(std::max(1u, hw_threads)));
  const double attention_rate = attention_flops_per_step * double(step_seconds.size()) / attention;

  std::printf("\nthroughput: %.0f tokens/s; step time %.3f s (median of %zu)\n", tokens_per_sec, step_time,
              step_seconds.size());
  std::printf("step FLOP rate: %.1f GFLOP/s (%.3e FLOP/token x %lld tokens; causally halved: %.1f GFLOP/s)\n",
              step_rate / 1e9, flops_per_token, (long long)rows, step_rate_causal / 1e9);
  std::printf("  vs sgemm on the largest GEMM (%s, %.1f GFLOP/s): %.1f%% -> %s (target >= 50%%)\n",
              largest.name.c_str(), largest_rate / 1e9, 100 * vs_sgemm, flops_pass ? "PASS" : "MISS");
  std::printf("  vs 1024^3 square sgemm (%.1f GFLOP/s): %.1f%%\n", square_rate / 1e9, 100 * step_rate / square_rate);
  std::printf("memory: peak %s during a step (held before it: %s)\n", memory_bytes(double(peak)).c_str(),
              memory_bytes(double(held_before)).c_str());
  std::printf("  analytic %s = parameters %s + gradients %s + AdamW moments %s + saved activations %s\n",
              memory_bytes(analytic).c_str(), memory_bytes(param_bytes).c_str(), memory_bytes(param_bytes).c_str(),
              memory_bytes(2 * param_bytes).c_str(), memory_bytes(saved_analytic).c_str());
  std::printf("  saved activations: analytic %.0f B, measured from the stores %zu B (%.3f%% apart)\n", saved_analytic,
              saved_measured, 100 * saved_gap);
  std::printf("  peak / analytic = %.3fx -> %s (target <= 1.5x); untracked attention scratch: %s\n", mem_ratio,
              mem_pass ? "PASS" : "MISS", memory_bytes(scratch).c_str());
  std::printf("time: GEMM %.1f%% (%lld calls/step, %.1f GFLOP/s), attention %.1f%% (%.1f GFLOP/s counting full T x T "
              "products), element-wise/norm/loss/optimizer loops %.1f%%, rest (allocation and zeroing, serial code) "
              "%.1f%%\n",
              100 * gemm_share, (long long)(gemm_calls / std::int64_t(step_seconds.size())), gemm_rate / 1e9,
              100 * attention_share, attention_rate / 1e9, 100 * loops_share, 100 * rest_share);

  std::printf("machine load: 1-minute load average %.2f before, %.2f after; during the timed steps this process used "
              "%.0f%% of wall x %d threads and other processes %.0f%% of the machine's %u hardware threads%s\n",
              load_before, load_after, 100 * cpu_share, omp_threads, 100 * other_share, hw_threads,
              other_share > 0.1 ? " (they competed for the cores: the figures understate this machine)" : "");

  if (opt.markdown) {
    const double remainder_share = loops_share + rest_share;
    std::printf("\n| date | commit | machine | threads | batch x seq | tokens/s | step time | step GFLOP/s | "
                "largest-GEMM sgemm GFLOP/s | step / sgemm (target >= 50%%) | peak memory | analytic memory | "
                "peak / analytic (target <= 1.5x) | GEMM | attention | other (loops / rest) | other processes |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::printf("| %s | %s | %s, OpenBLAS %s kernels | %u hw / %d OpenMP | %lld x %lld | %.0f | %.2f s | %.1f | %.1f (%s %lldx%lldx%lld) | "
                "%.1f%% %s | %s | %s | %.2fx %s | %.1f%% | %.1f%% | %.1f%% (%.1f%% / %.1f%%) | %.0f%% |\n",
                date.c_str(), opt.commit.c_str(), machine.c_str(), blas_core.c_str(), hw_threads, omp_threads, (long long)opt.batch,
                (long long)opt.seq, tokens_per_sec, step_time, step_rate / 1e9, largest_rate / 1e9,
                largest.name.c_str(), (long long)largest.m, (long long)largest.n, (long long)largest.k, 100 * vs_sgemm,
                flops_pass ? "PASS" : "MISS", memory_bytes(double(peak)).c_str(), memory_bytes(analytic).c_str(),
                mem_ratio, mem_pass ? "PASS" : "MISS", 100 * gemm_share, 100 * attention_share, 100 * remainder_share,
                100 * loops_share, 100 * rest_share, 100 * other_share);
  }

  if (saved_gap > 0.01) {
    std::fprintf(stderr,
                 "bench-train-step: the analytic saved-activation count (%.0f B) differs from the stores (%zu B) by "
                 "%.2f%% (> 1%%): the formula no longer matches what the layers save\n",
                 saved_analytic, saved_measured, 100 * saved_gap);
    return 2;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_options(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench-train-step: %s\n", e.what());
    return 1;
  }
}
