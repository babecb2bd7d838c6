// The model on the GPU against the CPU backend: Cuda::memory_access() (copies and
// reductions over device, host, pinned and managed memory, and thread-rank collectives
// on device buffers); one forward_backward and three Trainer steps of
// nn::Transformer<float, Cuda> and of the binaries' block type under every activation
// checkpointing mode; FSDP, TP, PP and FSDP x TP on virtual ranks sharing the GPU
// (float8 under TP among them); a checkpoint saved from the GPU and loaded on either
// backend; out of device memory as an error. The CUDA side runs in model_launchers.cpp;
// the suite's main (main.cpp) skips everything without a device.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "../parallel/harness.hpp"
#include "../support/errors.hpp"
#include "../support/temp_dir.hpp"
#include "cudnn_launchers.hpp"
#include "model_launchers.hpp"
#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/checkpoint/model.hpp"
#include "tessera/comm/reduce.hpp"
#include "tessera/nn/transformer.hpp"
#include "tessera/train/config.hpp"

namespace test_gpu_model {  // unity build: this file's names stay in here (tests/meson.build)

using namespace tessera;
using namespace tessera::gpu_test;

namespace {

using CpuModel = nn::Transformer<float, Cpu>;

/// The model of the single-rank checks: the debug model shrunk to 2 layers of dim 256
/// with 4 heads over 2 kv heads (head dim 64, which the CUDA flash kernels take), a
/// batch of 2 x 32 byte tokens, 3 steps at the default warmup.
train::JobConfig small_job(const std::vector<std::string>& overrides = {}) {
  return train::parse_config(R"(
    [model]
    flavor = "debugmodel"
    dim = 256
    n_layers = 2
    n_heads = 4
    n_kv_heads = 2
    multiple_of = 32
    [training]
    local_batch_size = 2
    seq_len = 32
    steps = 3
    mixed_precision_param = "float32"
    synthetic_documents = 200
    [optimizer]
    lr = 3e-3
  )",
                             "test_gpu_model", overrides);
}

/// The parity jobs of tests/parallel (test::debug_job) with head dim 64 (4 heads over 2
/// kv heads of dim 256: a head dim the flash kernels take) and 2 layers, for layouts of
/// virtual ranks on the GPU.
train::JobConfig layout_job(std::int64_t local_batch, int steps, const std::vector<std::string>& keys) {
  return test::debug_job(
      local_batch, test::kParityBatch, steps,
      test::with({"--model.dim", "256", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.n_layers", "2"},
                 keys));
}

double relative(double a, double b) {
  const double d = std::abs(a - b) / std::abs(b);
  return std::isfinite(d) ? d : INFINITY;
}

// Tolerances, GPU against CPU in float32. The GPU sums GEMMs in cuBLASLt's order and
// attention in the flash kernels' (online softmax), so values differ in the last bits;
// a wrong kernel or a lost update is off by orders of magnitude more.
constexpr double kLossBar = 1e-5;      // relative, each step's loss (the parity bar)
constexpr double kGradNormBar = 1e-4;  // relative, each step's gradient norm
constexpr double kGradientBar = 1e-4;  // max |difference| over a gradient / its max |value|
constexpr double kParameterBar = 1e-4;  // |difference| <= bar * (1 + |value|), each parameter element
// The change the optimizer made to each tensor, ||gpu - cpu|| / ||cpu||. AdamW divides
// each gradient by its own root mean square, so an element whose gradient is near eps
// (1e-8) moves by an amount its last bits decide; a few such elements stay far inside this.
constexpr double kUpdateBar = 1e-2;

/// Every tensor of `gpu` within kGradientBar of `cpu`'s (relative to its largest value).
void check_gradients(const NamedValues& gpu, const NamedValues& cpu) {
  REQUIRE(gpu.size() == cpu.size());
  for (const auto& [name, ref] : cpu) {
    CAPTURE(name);
    REQUIRE(gpu.count(name) == 1);
    const std::vector<float>& got = gpu.at(name);
    REQUIRE(got.size() == ref.size());
    double scale = 0, worst = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      scale = std::max(scale, static_cast<double>(std::abs(ref[i])));
      const double d = std::abs(static_cast<double>(got[i]) - ref[i]);
      worst = std::max(worst, std::isfinite(d) ? d : INFINITY);
    }
    CAPTURE(worst);
    CAPTURE(scale);
    CHECK(scale > 0);  // every parameter has a gradient: the comparison means something
    CHECK(worst <= kGradientBar * scale);
  }
}

/// Losses within kLossBar and gradient norms within kGradNormBar, step by step.
void check_steps(const std::vector<double>& gpu_losses, const std::vector<double>& cpu_losses,
                 const std::vector<double>& gpu_norms, const std::vector<double>& cpu_norms) {
  REQUIRE(gpu_losses.size() == cpu_losses.size());
  REQUIRE(gpu_norms.size() == cpu_norms.size());
  for (std::size_t s = 0; s < cpu_losses.size(); ++s) {
    CAPTURE(s);
    CAPTURE(gpu_losses[s]);
    CAPTURE(cpu_losses[s]);
    CHECK(relative(gpu_losses[s], cpu_losses[s]) <= kLossBar);
    CAPTURE(gpu_norms[s]);
    CAPTURE(cpu_norms[s]);
    CHECK(relative(gpu_norms[s], cpu_norms[s]) <= kGradNormBar);
  }
}

/// The parameters after training, element by element, and the change training made to
/// each tensor, against the CPU's. Both runs start from the same (host-drawn) values.
void check_parameters(const TrainRun& gpu, const TrainRun& cpu) {
  CHECK(gpu.before == cpu.before);
  REQUIRE(gpu.after.size() == cpu.after.size());
  for (const auto& [name, ref] : cpu.after) {
    CAPTURE(name);
    REQUIRE(gpu.after.count(name) == 1);
    const std::vector<float>& got = gpu.after.at(name);
    const std::vector<float>& start = cpu.before.at(name);
    REQUIRE(got.size() == ref.size());
    REQUIRE(start.size() == ref.size());
    double worst = 0, update_diff = 0, update = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double d = std::abs(static_cast<double>(got[i]) - ref[i]) / (1.0 + std::abs(ref[i]));
      worst = std::max(worst, std::isfinite(d) ? d : INFINITY);
      const double u_cpu = static_cast<double>(ref[i]) - start[i], u_gpu = static_cast<double>(got[i]) - start[i];
      update_diff += (u_gpu - u_cpu) * (u_gpu - u_cpu);
      update += u_cpu * u_cpu;
    }
    CAPTURE(worst);
    CHECK(worst <= kParameterBar);
    CHECK(update > 0);  // training moved every tensor
    const double update_gap = std::sqrt(update_diff / update);
    CAPTURE(update_gap);
    CHECK(update_gap <= kUpdateBar);
  }
}

const char* place_name(Place p) {
  switch (p) {
    case Place::device: return "device";
    case Place::host: return "host";
    case Place::pinned_host: return "pinned host";
    case Place::managed: return "managed";
  }
  return "?";
}

constexpr Place kPlaces[] = {Place::device, Place::host, Place::pinned_host, Place::managed};

/// n values of T: full float mantissas, negative and positive integers, int64s past 2^32.
template <class T>
std::vector<T> values_of(std::size_t n, int seed) {
  std::vector<float> f = collective_input(seed, n);
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, std::int64_t>)
      v[i] = static_cast<std::int64_t>(f[i] * 1e6f) * (std::int64_t{1} << 20);
    else if constexpr (std::is_integral_v<T>)
      v[i] = static_cast<T>(f[i] * 1e6f);
    else
      v[i] = static_cast<T>(f[i]) / static_cast<T>(3);
  }
  return v;
}

/// memory_access_reduce for every op and every pair of places, against comm::reduce_into
/// on the host, bit for bit; n = 1 (a host scalar such as a loss sum) and n > one block.
template <class T>
void check_reduce() {
  for (std::size_t n : {std::size_t{1}, std::size_t{5000}}) {
    const std::vector<T> dst = values_of<T>(n, 1), src = values_of<T>(n, 2);
    for (comm::ReduceOp op : {comm::ReduceOp::sum, comm::ReduceOp::max, comm::ReduceOp::min}) {
      std::vector<T> want = dst;
      comm::reduce_into(want.data(), src.data(), n, comm::data_type_of<T>(), op);
      for (Place d : kPlaces)
        for (Place s : kPlaces) {
          CAPTURE(n);
          CAPTURE(static_cast<int>(op));
          CAPTURE(place_name(d));
          CAPTURE(place_name(s));
          CHECK(memory_access_reduce<T>(dst, src, op, d, s) == want);
        }
    }
  }
}

}  // namespace

TEST_CASE("Cuda::memory_access copies between device, host, pinned and managed memory") {
  const std::vector<float> v = collective_input(3, 3001);
  for (Place from : kPlaces)
    for (Place to : kPlaces) {
      CAPTURE(place_name(from));
      CAPTURE(place_name(to));
      CHECK(memory_access_copy(v, from, to) == v);
    }
  // Overlapping ranges in one device buffer: the source as it was before the copy.
  for (std::size_t shift : {std::size_t{1}, std::size_t{1000}}) {
    CAPTURE(shift);
    std::vector<float> want = v;
    const auto k = static_cast<std::ptrdiff_t>(shift);
    std::copy(v.begin(), v.end() - k, want.begin() + k);
    CHECK(memory_access_overlapping_copy(v, shift) == want);
  }
}

TEST_CASE("Cuda::memory_access reduces f32, f64, i32 and i64 as the host does, host operands staged") {
  check_reduce<float>();
  check_reduce<double>();
  check_reduce<std::int32_t>();
  check_reduce<std::int64_t>();
}

TEST_CASE("Cuda::memory_access refuses u8 and u16 reductions by name") {
  CHECK_ERROR_CONTAINS(memory_access_reduce_type(comm::DataType::u8, 16),
                       "reduction over u8 elements is not supported");
  CHECK_ERROR_CONTAINS(memory_access_reduce_type(comm::DataType::u16, 16),
                       "reduction over u16 elements is not supported");
}

TEST_CASE("Thread ranks on one GPU: every collective on device buffers gives the host engine's values") {
  constexpr int kRanks = 4;
  constexpr std::size_t kN = 4096;
  const std::vector<CollectiveResults> gpu = cuda_thread_collectives(kRanks, kN);
  const std::vector<CollectiveResults> cpu = thread_collectives<Cpu>(kRanks, kN, comm::MemoryAccess{});
  // The sum in rank order and the maximum, computed here: the host engine's reference.
  std::vector<float> sum = collective_input(0, kN), max = sum;
  for (int r = 1; r < kRanks; ++r) {
    const std::vector<float> in = collective_input(r, kN);
    for (std::size_t i = 0; i < kN; ++i) {
      sum[i] += in[i];
      max[i] = std::max(max[i], in[i]);
    }
  }
  const std::size_t part = kN / kRanks;
  REQUIRE(gpu.size() == static_cast<std::size_t>(kRanks));
  REQUIRE(cpu.size() == gpu.size());
  for (int r = 0; r < kRanks; ++r) {
    CAPTURE(r);
    const CollectiveResults& g = gpu[static_cast<std::size_t>(r)];
    const CollectiveResults& c = cpu[static_cast<std::size_t>(r)];
    CHECK(c.all_reduce_sum == sum);
    CHECK(c.all_reduce_max == max);
    CHECK(g.all_reduce_sum == c.all_reduce_sum);
    CHECK(g.all_reduce_max == c.all_reduce_max);
    CHECK(g.reduce_scatter == std::vector<float>(sum.begin() + static_cast<std::ptrdiff_t>(r * part),
                                                 sum.begin() + static_cast<std::ptrdiff_t>((r + 1) * part)));
    CHECK(g.reduce_scatter == c.reduce_scatter);
    CHECK(g.all_gather == c.all_gather);
    CHECK(g.broadcast == collective_input(1, kN));
    CHECK(g.host_sum == c.host_sum);
    CHECK(g.host_count == 4000 + 7 * (0 + 1 + 2 + 3));
  }
  std::vector<float> gathered;
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<float> in = collective_input(r, kN);
    gathered.insert(gathered.end(), in.begin(), in.begin() + static_cast<std::ptrdiff_t>(part));
  }
  CHECK(gpu.front().all_gather == gathered);
}

TEST_CASE("Transformer<float, Cuda>: one forward_backward gives the CPU backend's loss and gradients") {
  const train::JobConfig c = small_job();
  REQUIRE(c.model.args.head_dim() == 64);
  const ForwardBackward cpu = forward_backward_once<CpuModel>(c);
  const ForwardBackward gpu = cuda_forward_backward(c);
  CHECK(gpu.n_targets == cpu.n_targets);
  CAPTURE(gpu.loss_sum);
  CAPTURE(cpu.loss_sum);
  CHECK(relative(gpu.loss_sum, cpu.loss_sum) <= kLossBar);
  check_gradients(gpu.gradients, cpu.gradients);
}

TEST_CASE("Transformer<float, Cuda>: three Trainer steps give the CPU backend's losses, norms and parameters") {
  const train::JobConfig c = small_job();
  const TrainRun cpu = train_steps<CpuModel>(c);
  const TrainRun gpu = cuda_train_steps(c);
  CHECK(gpu.before == cpu.before);  // initialised on the device: the CPU's values, bit for bit
  REQUIRE(cpu.losses.size() == 3);
  check_steps(gpu.losses, cpu.losses, gpu.grad_norms, cpu.grad_norms);
  check_parameters(gpu, cpu);
}

TEST_CASE("The binaries' block type on Cuda, every activation checkpoint mode: the CPU's run, recomputation exact") {
  // Parallel<LlamaBlock<float, Cuda>, Sharding<Dynamic>, TensorParallel<dynamic>,
  // Pipeline<dynamic>, Checkpoint<Dynamic>>, the choices from the plan of one rank.
  std::vector<double> none_losses, none_norms;
  NamedValues none_gradients;
  for (const test::AcMode& mode : test::kAcModes) {
    CAPTURE(mode.name);
    const train::JobConfig c = small_job(mode.keys);
    const ForwardBackward cpu = forward_backward_once<test::CpuDynamicModel>(c);
    const ForwardBackward gpu = cuda_dynamic_forward_backward(c);
    CHECK(relative(gpu.loss_sum, cpu.loss_sum) <= kLossBar);
    check_gradients(gpu.gradients, cpu.gradients);
    const TrainRun cpu_run = train_steps<test::CpuDynamicModel>(c);
    const TrainRun gpu_run = cuda_dynamic_train_steps(c);
    check_steps(gpu_run.losses, cpu_run.losses, gpu_run.grad_norms, cpu_run.grad_norms);
    check_parameters(gpu_run, cpu_run);
    // Recomputing a block runs the same kernels on the same values: the gradients,
    // losses and norms of every mode are those without checkpointing, bit for bit.
    if (none_losses.empty()) {
      none_gradients = gpu.gradients;
      none_losses = gpu_run.losses;
      none_norms = gpu_run.grad_norms;
    } else {
      CHECK(gpu.gradients == none_gradients);
      CHECK(gpu_run.losses == none_losses);
      CHECK(gpu_run.grad_norms == none_norms);
    }
  }
}

namespace {
using CpuBf16Block = Parallel<nn::LlamaBlock<bf16, Cpu>, Sharding<Dynamic>, TensorParallel<dynamic>, Pipeline<dynamic>,
                              Checkpoint<Dynamic>>;
using CpuBf16Model = nn::Transformer<bf16, Cpu, CpuBf16Block>;

/// ||gpu - cpu|| / ||cpu|| of each tensor, the worst of them.
double worst_relative_l2(const NamedValues& gpu, const NamedValues& cpu) {
  double worst = 0;
  for (const auto& [name, ref] : cpu) {
    const std::vector<float>& got = gpu.at(name);
    double d = 0, r = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      d += (static_cast<double>(got[i]) - ref[i]) * (static_cast<double>(got[i]) - ref[i]);
      r += static_cast<double>(ref[i]) * ref[i];
    }
    const double e = std::sqrt(d / r);
    worst = std::max(worst, std::isfinite(e) ? e : INFINITY);
  }
  return worst;
}
}  // namespace

TEST_CASE("Transformer<bf16, Cuda>: the CPU backend's bf16 model, to bf16 accuracy, every checkpoint mode") {
  // Both backends round the same activations to bf16, but after sums in different
  // orders (cuBLASLt, the flash kernels, the row kernels), so a rounding flips now and
  // then: the bars are the bf16 layouts' of tests/parallel/test_bf16_training.cpp.
  std::vector<double> none_losses;
  for (const test::AcMode& mode : test::kAcModes) {
    CAPTURE(mode.name);
    const train::JobConfig c = small_job(test::with({"--training.mixed_precision_param", "bfloat16"}, mode.keys));
    const ForwardBackward cpu = forward_backward_once<CpuBf16Model>(c);
    const ForwardBackward gpu = cuda_bf16_forward_backward(c);
    CAPTURE(gpu.loss_sum);
    CAPTURE(cpu.loss_sum);
    CHECK(relative(gpu.loss_sum, cpu.loss_sum) <= 1e-3);
    REQUIRE(gpu.gradients.size() == cpu.gradients.size());
    const double grad_gap = worst_relative_l2(gpu.gradients, cpu.gradients);
    CAPTURE(grad_gap);
    CHECK(grad_gap <= 2e-2);
    const TrainRun cpu_run = train_steps<CpuBf16Model>(c);
    const TrainRun gpu_run = cuda_bf16_train_steps(c);
    CHECK(gpu_run.before == cpu_run.before);
    REQUIRE(gpu_run.losses.size() == cpu_run.losses.size());
    for (std::size_t s = 0; s < cpu_run.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(relative(gpu_run.losses[s], cpu_run.losses[s]) <= 1e-3);
      CHECK(relative(gpu_run.grad_norms[s], cpu_run.grad_norms[s]) <= 5e-3);
    }
    // Recomputation runs the same kernels on the same bf16 values: bitwise the losses of none.
    if (none_losses.empty())
      none_losses = gpu_run.losses;
    else
      CHECK(gpu_run.losses == none_losses);
  }
}

namespace {
/// The largest difference between two rows of logits, against the larger magnitude.
double logits_gap(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double gap = 0, scale = 1;
  for (std::size_t i = 0; i < want.size(); ++i) {
    gap = std::max(gap, std::abs(double(got[i]) - double(want[i])));
    scale = std::max(scale, std::abs(double(want[i])));
  }
  return gap / scale;
}

/// Each run's cached logits within `tolerance` of the whole prefix's, and 40 tokens generated.
void check_decoded(const DecodeRun& run, double tolerance) {
  REQUIRE(run.decodes);
  for (std::size_t i = 0; i < run.cached.size(); ++i) {
    CAPTURE(i);
    CHECK(logits_gap(run.cached[i], run.whole[i]) <= tolerance);
  }
  CHECK(run.with_cache.size() == 40);
}
}  // namespace

TEST_CASE("Transformer on Cuda decodes through a KV cache: the whole prefix's logits, and the CPU's text") {
  // 40 tokens through one cache in runs (a prompt, single tokens, longer runs); then 40
  // tokens generated after a prompt of 5 in a window of 24, so the window moves on and
  // the cache is filled again, greedy and sampled.
  const std::vector<std::int32_t> ids = [] {
    std::vector<std::int32_t> v(40);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>((i * 37 + 11) % 200);
    return v;
  }();
  const std::vector<std::size_t> steps = {7, 1, 1, 5, 1, 3, 1, 1, 10, 1, 1, 8};
  const std::vector<std::int32_t> prompt = {1, 2, 3, 4, 5};
  for (const double temperature : {0.0, 0.8}) {
    CAPTURE(temperature);
    nn::SampleOptions o;
    o.max_new_tokens = 40;
    o.context = 24;
    o.temperature = temperature;
    o.top_k = 8;
    o.seed = 3;
    {
      const train::JobConfig c = small_job();
      const DecodeRun gpu = cuda_decode(c, ids, steps, prompt, o);
      check_decoded(gpu, 1e-5);
      CHECK(gpu.with_cache == gpu.without_cache);
      const DecodeRun cpu = decode_run<CpuModel>(c, ids, steps, prompt, o);
      CHECK(gpu.with_cache == cpu.with_cache);
    }
    {  // the binaries' block type over bf16: the attention after the cache's keys on tessera's kernels
      const train::JobConfig c = small_job({"--training.mixed_precision_param", "bfloat16"});
      check_decoded(cuda_bf16_decode(c, ids, steps, prompt, o), 2e-2);
    }
  }
}

TEST_CASE("Float8 casts on the GPU are the CPU's bit for bit, and every recipe's GEMMs agree with the CPU's") {
  // The casts are integer arithmetic on the same bf16 values (core/float8.hpp), the scales
  // the same double division: bitwise. The GEMMs sum exact products in float in two
  // orders (cuBLASLt's, OpenBLAS's).
  const std::int64_t M = 48, K = 64, N = 32;
  auto matrix = [](std::int64_t rows, std::int64_t cols, int seed) {
    Tensor<float> t(Shape{rows, cols});
    for (std::int64_t i = 0; i < t.numel(); ++i)
      t[i] = std::sin(static_cast<float>(i * 7 + seed)) * std::pow(4.0f, static_cast<float>((i / cols) % 5) - 2.0f);
    return t;
  };
  const Tensor<float> x = matrix(M, K, 1), w = matrix(N, K, 2), dy = matrix(M, N, 3);
  for (const auto recipe : {ops::Float8Recipe::tensorwise, ops::Float8Recipe::rowwise,
                            ops::Float8Recipe::rowwise_with_gw_hp}) {
    const std::string name(ops::name_of(recipe));
    CAPTURE(name);
    const ops::Float8LinearCasts c = ops::float8_casts(recipe);
    for (const ops::Float8Cast cast : {c.input, c.weight_for_grad_input, c.grad_output_for_grad_weight}) {
      const gpu_test::Float8CastValues gpu = gpu_test::cuda_float8_cast(x, cast);
      const gpu_test::Float8CastValues cpu = gpu_test::float8_cast_on<Cpu>(x, cast);
      CHECK(gpu.scales == cpu.scales);
      CHECK(gpu.values == cpu.values);
    }
    auto gap = [](const std::vector<float>& gpu, const std::vector<float>& cpu) {
      REQUIRE(gpu.size() == cpu.size());
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < gpu.size(); ++i) {
        diff += (gpu[i] - cpu[i]) * static_cast<double>(gpu[i] - cpu[i]);
        norm += cpu[i] * static_cast<double>(cpu[i]);
      }
      return std::sqrt(diff / norm);
    };
    // Emulated on the GPU (its float GEMM), and on cuBLASLt's float8 matmul. Hopper's
    // float8 tensor cores add inside an MMA chain with fewer bits than float32 (about 14
    // of mantissa); cuBLASLt without fast accumulation moves the sums into float32
    // registers every few chains, with it only at the end. At these depths (K = 32 to 64,
    // under one promotion interval) the two modes gave the same result on an H200,
    // 4.4e-5 to 2.0e-4 from the float32 sums (2026-12-04): a wrong scale or a wrongly
    // rounded operand is orders of magnitude above the bar.
    auto agree = [&](Trans ta, Trans tb, const Tensor<float>& a, ops::Float8Cast ca, const Tensor<float>& b,
                     ops::Float8Cast cb, std::int64_t m, std::int64_t n) {
      const std::vector<float> cpu = gpu_test::float8_gemm_on<Cpu>(ta, tb, a, ca, b, cb, m, n);
      CHECK(gap(gpu_test::cuda_float8_gemm(ta, tb, a, ca, b, cb, m, n), cpu) < 1e-6);
      const double exact = gap(gpu_test::cuda_float8_gemm(ta, tb, a, ca, b, cb, m, n, {false, false}), cpu);  // promoted
      const double fast = gap(gpu_test::cuda_float8_gemm(ta, tb, a, ca, b, cb, m, n, {false, true}), cpu);
      MESSAGE(name, ": cuBLASLt float8 matmul against the CPU's emulation ", exact, ", with fast accumulation ", fast);
      CHECK(exact < 1e-3);
      CHECK(fast < 2e-3);
    };
    agree(Trans::no, Trans::yes, x, c.input, w, c.weight, M, N);
    {
      // The forward with a residual read apart from its output (cuBLASLt's out-of-place
      // float8 matmul, C and D bf16 in the model, float here), against the CPU's emulation.
      const Tensor<float> residual = matrix(M, N, 4);
      const std::vector<float> cpu = gpu_test::float8_gemm_on<Cpu>(Trans::no, Trans::yes, x, c.input, w, c.weight, M, N,
                                                                   {}, &residual);
      const double apart = gap(gpu_test::cuda_float8_gemm(Trans::no, Trans::yes, x, c.input, w, c.weight, M, N,
                                                          {false, true}, &residual), cpu);
      MESSAGE(name, ": the forward with a residual read apart, against the CPU's emulation ", apart);
      CHECK(apart < 2e-3);
    }
    agree(Trans::no, Trans::no, dy, c.grad_output, w, c.weight_for_grad_input, M, K);
    agree(Trans::yes, Trans::no, dy, c.grad_output_for_grad_weight, x, c.input_for_grad_weight, N, K);
  }
}

TEST_CASE("Float8 casts' own kernels (amax by rows, their max, rows of vectors, transposing tiles, a cast by rows in "
          "one pass, both layouts in one pass) and Float8Transpose's tiles are the CPU's bit for bit") {
  // backend/cuda/float8_kernels.cuh: shapes with whole and partial 64 x 64 tiles, rows of
  // vectors (8 | cols) and the per-element fallback (37 columns), a long MaxOf (5000 rows);
  // a cast by rows (CastRowsFloat8) a row a warp (up to 1024 columns) and a row a block
  // (2056 columns in vectors, 1031 one at a time), its amaxes taken or kept.
  struct Shape2 {
    std::int64_t rows, cols;
  };
  // The tiles' four kernels: runs loaded as vectors where 8 | cols, words stored where 4 | rows.
  for (const Shape2 sh : {Shape2{64, 128}, Shape2{100, 72}, Shape2{33, 37}, Shape2{5000, 24}, Shape2{36, 37},
                          Shape2{33, 40}, Shape2{130, 200}, Shape2{20, 2056}, Shape2{9, 1031}}) {
    Tensor<float> x(Shape{sh.rows, sh.cols});
    for (std::int64_t i = 0; i < x.numel(); ++i)
      x[i] = std::sin(static_cast<float>(i) * 0.37f) * std::pow(8.0f, static_cast<float>((i / sh.cols) % 7) - 3.0f);
    for (const DType format : {DType::f8e4m3, DType::f8e5m2})
      for (const ops::Float8Axis axis : {ops::Float8Axis::tensor, ops::Float8Axis::rows, ops::Float8Axis::columns})
        for (const bool transpose : {false, true}) {
          CAPTURE(sh.rows);
          CAPTURE(sh.cols);
          CAPTURE(static_cast<int>(format));
          CAPTURE(static_cast<int>(axis));
          CAPTURE(transpose);
          const ops::Float8Cast cast{format, axis, axis != ops::Float8Axis::tensor};
          const gpu_test::Float8CastValues gpu = gpu_test::cuda_float8_cast(x, cast, transpose);
          const gpu_test::Float8CastValues cpu = gpu_test::float8_cast_on<Cpu>(x, cast, transpose);
          CHECK(gpu.scales == cpu.scales);
          CHECK(gpu.values == cpu.values);
          if (axis == ops::Float8Axis::rows && !transpose) {  // the amaxes a kernel that wrote x kept
            const gpu_test::Float8CastValues kept = gpu_test::cuda_float8_cast(x, cast, false, true);
            CHECK(kept.scales == cpu.scales);
            CHECK(kept.values == cpu.values);
          }
          if (axis == ops::Float8Axis::tensor && transpose) {
            // Float8Transpose's tiles (its four kernels, as the cast's): the cast's bytes
            // moved are the transposed cast's.
            const gpu_test::Float8CastValues moved = gpu_test::cuda_float8_transposed(x, cast);
            CHECK(moved.scales == cpu.scales);
            CHECK(moved.values == cpu.values);
            // Both layouts in one pass (the tiles storing each run as x lies too): the
            // transposed values and the straight ones the two casts' on the CPU.
            const std::array<gpu_test::Float8CastValues, 2> both = gpu_test::cuda_float8_both_layouts(x, cast);
            const gpu_test::Float8CastValues straight = gpu_test::float8_cast_on<Cpu>(x, cast, false);
            CHECK(both[0].scales == straight.scales);
            CHECK(both[0].values == straight.values);
            CHECK(both[1].scales == cpu.scales);
            CHECK(both[1].values == cpu.values);
          }
        }
  }
}

TEST_CASE("Transformer<bf16, Cuda> on cuBLASLt's float8 matmul trains as its emulated float8 GEMMs do, each recipe") {
  // The same float8 operands either way; the sums differ in order, and the forward's in
  // cuBLASLt's fast accumulation. Dimensions 256, 704 and 128, and 64 tokens: multiples of 16.
  for (const std::string recipe : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    CAPTURE(recipe);
    const train::JobConfig emulated = small_job({"--training.mixed_precision_param", "bfloat16", "--training.steps",
                                                 "4", "--model.converters", "float8", "--float8.recipe_name", recipe,
                                                 "--float8.emulate", "true"});
    train::JobConfig real = emulated;
    real.float8.emulate = false;
    const TrainRun e = cuda_bf16_train_steps(emulated), r = cuda_bf16_train_steps(real);
    REQUIRE(e.losses.size() == r.losses.size());
    for (std::size_t s = 0; s < e.losses.size(); ++s) {
      CAPTURE(s);
      REQUIRE(std::isfinite(r.losses[s]));
      CHECK(std::fabs(r.losses[s] - e.losses[s]) <= 2e-3 * e.losses[s]);
    }
    MESSAGE(recipe, ": last loss ", r.losses.back(), " on cuBLASLt, ", e.losses.back(), " emulated");
  }
}

TEST_CASE("Transformer<bf16, Cuda>: steps replayed from a captured CUDA graph are the eager steps, bit for bit") {
  // training.cuda_graph: the first step eager, the second captured and replayed, the rest
  // replayed; the learning rate, the bias corrections and the loss scale change every step
  // and are read on the device. Every kernel is deterministic, so the runs agree exactly.
  for (const std::string global : {"2", "4"}) {
    CAPTURE(global);
    const train::JobConfig eager = small_job({"--training.mixed_precision_param", "bfloat16", "--training.steps", "5",
                                              "--training.global_batch_size", global, "--activation_checkpoint.mode",
                                              "selective", "--activation_checkpoint.selective_ac_option", "op"});
    train::JobConfig graphed = eager;
    graphed.training.cuda_graph = true;
    const TrainRun e = cuda_bf16_train_steps(eager), g = cuda_bf16_train_steps(graphed);
    REQUIRE(e.losses.size() == 5);
    CHECK(g.losses == e.losses);
    CHECK(g.grad_norms == e.grad_norms);
    CHECK(g.after == e.after);
    // The steps trained (each step's loss is on its own batch, so the losses of five small
    // steps need not fall: on an H200 the fifth was above the first, 2026-12-04).
    CHECK(g.before == e.before);
    CHECK(e.after != e.before);
  }
}

TEST_CASE("Transformer<bf16, Cuda> with cuDNN attention: tessera's kernels' loss, gradients and steps, packed documents too") {
  const std::string why = gpu_test::cudnn_unavailable();
  if (!why.empty()) {
    MESSAGE("cuDNN attention not checked: " << why);
    return;
  }
  // The small job: head dim 64, 4 heads over 2 kv heads, a batch of 2 x 32; and with
  // packed documents masked apart (cuDNN's variable-length attention), windows of 128.
  for (const char* documents : {"false", "true"}) {
    CAPTURE(documents);
    const train::JobConfig c = small_job({"--training.mixed_precision_param", "bfloat16", "--training.document_mask",
                                          documents, "--training.seq_len", documents[0] == 't' ? "128" : "32"});
    const ForwardBackward own = cuda_bf16_forward_backward(c);
    const TrainRun own_run = cuda_bf16_train_steps(c);
    gpu_test::AttentionScope scope(gpu_test::GpuAttention::cudnn);
    const ForwardBackward got = cuda_bf16_forward_backward(c);
    const TrainRun got_run = cuda_bf16_train_steps(c);
    CAPTURE(got.loss_sum);
    CAPTURE(own.loss_sum);
    CHECK(relative(got.loss_sum, own.loss_sum) <= 1e-3);
    REQUIRE(got.gradients.size() == own.gradients.size());
    const double grad_gap = worst_relative_l2(got.gradients, own.gradients);
    CAPTURE(grad_gap);
    CHECK(grad_gap <= 2e-2);
    REQUIRE(got_run.losses.size() == own_run.losses.size());
    for (std::size_t s = 0; s < own_run.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(relative(got_run.losses[s], own_run.losses[s]) <= 1e-3);
      CHECK(relative(got_run.grad_norms[s], own_run.grad_norms[s]) <= 5e-3);
    }
  }
}

namespace {
constexpr int kLayoutSteps = 3;

/// `shape` on thread ranks sharing the GPU against one GPU rank and one CPU rank, with
/// the parity bars of tests/parallel; every rank reports the same losses.
void check_virtual_ranks(const std::string& layout, comm::MeshShape shape, const std::vector<std::string>& keys) {
  CAPTURE(layout);
  const std::vector<test::RunResult> per_rank =
      cuda_thread_ranks(shape, layout_job(test::kParityBatch / shape.dp(), kLayoutSteps, keys));
  const train::JobConfig one = layout_job(test::kParityBatch, kLayoutSteps, keys);
  const test::RunResult gpu = cuda_one_rank(one);
  const test::RunResult cpu = test::train_layout(comm::Communicator(), comm::MeshShape{}, one);
  REQUIRE(per_rank.size() == static_cast<std::size_t>(shape.world()));
  for (const test::RunResult& r : per_rank) {
    CHECK(r.losses == per_rank.front().losses);
    CHECK(r.grad_norms == per_rank.front().grad_norms);
  }
  const auto steps = [](const test::RunResult& r) {
    std::string out;
    for (std::size_t i = 0; i < r.losses.size(); ++i)
      out += " " + std::to_string(r.losses[i]) + "/" + std::to_string(r.grad_norms[i]);
    return out;
  };
  INFO("loss/grad norm per step: ranks", steps(per_rank.front()), "; one GPU rank", steps(gpu), "; one CPU rank",
       steps(cpu));
  const test::RunGap to_gpu = test::run_gap(per_rank.front(), gpu);
  CAPTURE(to_gpu.loss);
  CAPTURE(to_gpu.grad_norm);
  CHECK(to_gpu.loss <= 1e-5);
  CHECK(to_gpu.grad_norm <= 1e-4);
  const test::RunGap gpu_to_cpu = test::run_gap(gpu, cpu);
  CAPTURE(gpu_to_cpu.loss);
  CAPTURE(gpu_to_cpu.grad_norm);
  CHECK(gpu_to_cpu.loss <= 1e-5);
  CHECK(gpu_to_cpu.grad_norm <= 1e-4);
}
}  // namespace

TEST_CASE("Virtual ranks on one GPU: FSDP, TP, PP and FSDP x TP give one rank's losses") {
  check_virtual_ranks("FSDP 2, full checkpointing", {1, 1, 2, 1}, test::kAcModes[1].keys);
  check_virtual_ranks("TP 2 with loss parallelism, selective op checkpointing", {1, 1, 1, 2},
                      test::kAcModes[2].keys);
  check_virtual_ranks("PP 2, 1F1B", {2, 1, 1, 1},
                      {"--parallelism.pipeline_parallel_schedule", "1F1B",
                       "--parallelism.pipeline_parallel_microbatch_size", "1"});
  check_virtual_ranks("FSDP 2 x TP 2", {1, 1, 2, 2}, {});
}

TEST_CASE("Virtual ranks on one GPU: asynchronous TP (cuBLASLt's GEMMs by blocks of rows beside send/recv) gives one rank's losses") {
  // parallelism.enable_async_tensor_parallel: each gather and reduce-scatter of the
  // stacked projections and the output projections cut by peer, the GEMMs run on row
  // slices of the gathered matrix, the pieces summed by ops::SumOfPieces on the device.
  const std::vector<std::string> async = {"--parallelism.enable_async_tensor_parallel", "true"};
  check_virtual_ranks("TP 2, asynchronous", {1, 1, 1, 2}, async);
  check_virtual_ranks("FSDP 2 x TP 2, asynchronous, full checkpointing", {1, 1, 2, 2},
                      test::with(async, test::kAcModes[1].keys));
}

TEST_CASE("Virtual ranks on one GPU: context parallelism (the ring's full blocks on the device) gives one rank's losses") {
  check_virtual_ranks("CP 2", {1, 1, 1, 1, 2}, {});
  check_virtual_ranks("CP 2 x FSDP 2, full checkpointing", {1, 1, 2, 1, 2}, test::kAcModes[1].keys);
}

TEST_CASE("CPU offload on one GPU: shards in page-locked memory, AdamW on the host, one rank's losses") {
  // The thread ranks and the one GPU rank offload (the one rank as FSDP over itself, its
  // copies through Cuda::copy_from_pinned and copy_to_pinned); the CPU rank too.
  check_virtual_ranks("FSDP 2 offloaded", {1, 1, 2, 1}, {"--training.enable_cpu_offload", "true"});
  check_virtual_ranks("FSDP 2 offloaded, full checkpointing", {1, 1, 2, 1},
                      test::with({"--training.enable_cpu_offload", "true"}, test::kAcModes[1].keys));
}

TEST_CASE("The early step on one GPU: each unit updated in the backward, one rank's losses") {
  // The thread ranks, the one GPU rank (FSDP over itself: gathers that are views of the
  // shards, the gradient its own reduction) and the CPU rank all step early.
  const std::vector<std::string> early = {"--training.max_norm", "0", "--optimizer.early_step_in_backward", "true"};
  check_virtual_ranks("FSDP 2, early step", {1, 1, 2, 1}, early);
  check_virtual_ranks("TP 2, early step, full checkpointing", {1, 1, 1, 2}, test::with(early, test::kAcModes[1].keys));
  // Offloaded: each unit's gradient copied up behind a fence (Cuda::fence), its update on
  // the host while the device runs the next block's backward.
  check_virtual_ranks("FSDP 2 offloaded, early step", {1, 1, 2, 1},
                      test::with(early, {"--training.enable_cpu_offload", "true"}));
}

TEST_CASE("LoRA on one GPU: the adapters' GEMMs (into a fused projection's columns, the loss head's chunks) give one rank's losses") {
  // The thread ranks, the one GPU rank and the CPU rank all train adapters beside frozen
  // weights: cuBLASLt's GEMMs with beta 1 into column slices, alpha = alpha / rank.
  const std::vector<std::string> lora = {"--model.converters", "lora", "--lora.rank", "4", "--optimizer.lr", "1e-2"};
  check_virtual_ranks("TP 2, LoRA", {1, 1, 1, 2}, lora);
  check_virtual_ranks("FSDP 2, LoRA (the frozen weights in shards of their own), full checkpointing", {1, 1, 2, 1},
                      test::with(lora, test::kAcModes[1].keys));
}

TEST_CASE("Float8 under TP on virtual ranks (cuBLASLt's float8 matmul, the gathers in float8) gives one GPU rank's run") {
  // Each piece cast by the whole tensor's scale, the sequence-parallel gathers of the norms'
  // outputs and of wo's and w2's gradients as float8 values; one GPU rank runs the same
  // micro-batches (a cast's amax is its micro-batch's). The bf16 model's bars
  // (tests/parallel/test_tensor_parallel.cpp): a row-parallel layer's partial sums are
  // rounded to bf16 before they are summed. The gathers in bf16 give the same float8
  // operands, so the same run bit for bit.
  struct Layout {
    const char* name;
    comm::MeshShape shape;
  };
  for (const Layout& l : {Layout{"TP 2", {1, 1, 1, 2}}, Layout{"FSDP 2 x TP 2, weights gathered in float8", {1, 1, 2, 2}}}) {
    const std::string layout = l.name;
    CAPTURE(layout);
    std::vector<std::string> keys = {"--training.mixed_precision_param", "bfloat16", "--model.converters", "float8",
                                     "--float8.recipe_name", "tensorwise", "--float8.emulate", "false"};
    if (l.shape.dp_shard > 1) keys = test::with(keys, {"--float8.enable_fsdp_float8_all_gather", "true"});
    const std::int64_t local = test::kParityBatch / l.shape.dp();
    const std::vector<test::RunResult> per_rank = cuda_thread_ranks(l.shape, layout_job(local, kLayoutSteps, keys));
    const test::RunResult one = cuda_one_rank(layout_job(local, kLayoutSteps, keys));
    REQUIRE(per_rank.size() == static_cast<std::size_t>(l.shape.world()));
    for (const test::RunResult& r : per_rank) {
      CHECK(r.losses == per_rank.front().losses);
      CHECK(r.grad_norms == per_rank.front().grad_norms);
    }
    const test::RunGap gap = test::run_gap(per_rank.front(), one);
    CAPTURE(gap.loss);
    CAPTURE(gap.grad_norm);
    CHECK(gap.loss <= 1e-3);
    CHECK(gap.grad_norm <= 5e-3);
    const std::vector<test::RunResult> bf16_gathers = cuda_thread_ranks(
        l.shape, layout_job(local, kLayoutSteps, test::with(keys, {"--float8.enable_tp_float8_all_gather", "false"})));
    CHECK(bf16_gathers.front().losses == per_rank.front().losses);
    CHECK(bf16_gathers.front().grad_norms == per_rank.front().grad_norms);
    CHECK(per_rank.front().comm_bytes < bf16_gathers.front().comm_bytes);
  }
}

TEST_CASE("Float8 under asynchronous TP on virtual ranks (float8 GEMMs by blocks of rows) gives one GPU rank's run") {
  // The gathers in float8 multiplied a block of rows at a time as they arrive, the output
  // projections' and the input gradients' operands cast once and multiplied by blocks
  // (cuBLASLt's float8 matmul on row slices); the float8 model's bars against one GPU rank.
  for (const char* recipe : {"tensorwise", "rowwise"}) {
    CAPTURE(recipe);
    const std::vector<std::string> keys = {"--training.mixed_precision_param", "bfloat16", "--model.converters",
                                           "float8", "--float8.recipe_name", recipe, "--float8.emulate", "false",
                                           "--parallelism.enable_async_tensor_parallel", "true"};
    const comm::MeshShape shape{1, 1, 1, 2};
    const std::vector<test::RunResult> per_rank =
        cuda_thread_ranks(shape, layout_job(test::kParityBatch, kLayoutSteps, keys));
    const test::RunResult one = cuda_one_rank(layout_job(test::kParityBatch, kLayoutSteps, keys));
    REQUIRE(per_rank.size() == 2);
    CHECK(per_rank[1].losses == per_rank[0].losses);
    const test::RunGap gap = test::run_gap(per_rank.front(), one);
    CAPTURE(gap.loss);
    CAPTURE(gap.grad_norm);
    CHECK(gap.loss <= 1e-3);
    CHECK(gap.grad_norm <= 5e-3);
    CHECK(per_rank.front().peer_bytes > 0);
  }
}

TEST_CASE("A checkpoint saved from the GPU loads on the CPU and on the GPU with every value") {
  test::TempDir dir("tessera_gpu_model");
  const train::JobConfig c = small_job();
  const std::string path = (dir.path / "model.safetensors").string();
  const NamedValues saved = cuda_save_model(c, path);
  REQUIRE(!saved.empty());
  // The values were drawn on the host from the seed: the CPU model's own are the same.
  CpuModel fresh(c.model.args);
  fresh.init_weights(static_cast<std::uint64_t>(c.training.seed));
  CHECK(parameter_values(fresh) == saved);
  CpuModel on_cpu(c.model.args);
  train::load_model(on_cpu, path);
  CHECK(parameter_values(on_cpu) == saved);
  CHECK(cuda_load_model(c, path) == saved);
}

TEST_CASE("An allocation larger than the device is an out-of-memory error naming its size; the device works on") {
  const std::size_t bytes = 1'000'000'000'000'000;  // 10^15 bytes: no device holds that
  CHECK_ERROR_CONTAINS(cuda_allocate(bytes), "out of device memory");
  CHECK_ERROR_CONTAINS(cuda_allocate(bytes), "allocating 1000000000000000 bytes");
  CHECK_ERROR_CONTAINS(cuda_allocate(bytes), "Cuda::empty<float32>(250000000000000)");
  const std::vector<float> v = collective_input(5, 1000);
  CHECK(cuda_round_trip(v) == v);
}

}  // namespace test_gpu_model
