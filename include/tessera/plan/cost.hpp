// Pricing a traced step: each recorded operation's time on a machine, summed by class,
// and the step's throughput, MFU and memory against the device.
//
// The trace (backend/trace.hpp) says what the step asks of the device, in issue order;
// a Pricer says how long one operation takes there. The step's time is their replay on
// two clocks (HostDeviceClock): the device's stream runs each operation after the one
// before, as the CUDA backend issues them (and the CPU backend runs them), and the host
// thread runs the host backend's loops (CPU offload's); the device starts what comes
// after a host loop once the host has issued it, and the host catches up with the device
// at a synchronisation, or with a fence's point at its wait. Without host loops that is
// the sum of the prices. What is priced, on a GPU (GpuPricer, from a machine file):
//
//   GEMM        max(2mnk / (peak x efficiency(size)), bytes / stream bandwidth), the
//               efficiency curve of the operands' dtype (bf16 tensor cores; fp32 on CUDA
//               cores, tessera's fp32 GEMMs run without TF32; float8, cuBLASLt's float8
//               matmul, at the profile's float8 peak and curve: refused on a profile
//               without them, never priced at another dtype's rate); the bytes are each
//               operand's own (a float8 element is one byte)
//   attention   cuDNN's flash attention (training.attention = cudnn, or auto on a bf16
//               model where the profile gives its rates): the call's FLOPs at the
//               profile's measured TFLOP/s for its head dim, direction and sequence
//               length ([attention] in the machine file, plan/machine.hpp; measured
//               causal, and a full call is priced at the same rate). Otherwise
//               tessera's portable flash kernel (backend/cuda/flash_attention.cuh), by
//               what it does: one thread per query (or key) row, fp32 multiply-adds on
//               CUDA cores, each reading its K, V (or Q, dO) operand from shared memory.
//               Every multiply-add waits on a 4-byte shared load that the warp's threads
//               share (a broadcast), and an SM issues one shared-memory load per clock
//               against four warp-wide fp32 multiply-adds: the kernel runs at the fp32
//               rate times (shared bytes per clock / 4) / (fp32 lanes per SM), a quarter
//               on every profile here. The forward makes 2 hd multiply-adds per (query,
//               key) pair it computes (at or below the diagonal causal, every pair
//               full: AttentionShape::pairs), the backward 7 hd (the key pass
//               recomputes s and dp and accumulates dk and dv; the query pass recomputes
//               s and dp and accumulates dq). Spills at head dim 128 are not priced.
//   kernels     the functor's bytes (ops::Traffic) at the stream bandwidth when the
//               kernel coalesces: every kernel of its own (backend/kernel_class.hpp) and
//               a per-index kernel whose indices touch neighbouring elements; a
//               per-index kernel whose every index walks a run of its own (Traffic::
//               walk_bytes: a row, a chunk) loads one element per L1 wavefront, one
//               wavefront per SM per clock; transcendentals at 16 per SM per clock (the
//               SFU rate of compute capability 8.x and 9.0, CUDA C++ Programming Guide,
//               "Arithmetic Instructions"); the larger of the three
//   host loop   a loop of the host backend (trace::Kernel::on_host: CPU offload's
//               optimizer step, gradient norm and gradient sums, backend/host.hpp): its
//               bytes (the functor's ops::Traffic) at the host memory rate of one rank
//               (host.memory_gbs), on the host's clock (it runs once the host has waited
//               for the gradients it reads, beside whatever the device was given before
//               that wait); no launch interval
//   fence       nothing: recording one is an event on the stream, and what its wait
//               costs is the device's work before it, which the replay counts
//   fill        its bytes written at the stream bandwidth (cudaMemsetAsync)
//   transfer    its bytes over the host link, plus a host synchronisation when it
//               waits for the device (Transfer::synchronizes: every copy to the host; a
//               copy from the host is staged in pinned memory and issued on the stream,
//               so it waits for nothing)
//   synchronize a host synchronisation
//
// and every operation takes at least the launch interval (host.launch_us): the GPU
// cannot run kernels faster than the host issues them (a pass run inside the launch of
// the kernel before it, trace::Kernel::own_launch false, takes its work alone). Not
// priced: the host's own work between launches (it overlaps with the device's, except
// after a synchronisation, which sync_us covers), allocator calls (cached blocks), and the
// first step's one-time uploads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tessera/backend/cuda/attention_choice.hpp"
#include "tessera/backend/trace.hpp"
#include "tessera/layer/lora.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/region.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/plan/classes.hpp"
#include "tessera/plan/machine.hpp"

namespace tessera::plan {

/// How long one traced operation takes on a machine.
class Pricer {
 public:
  virtual ~Pricer() = default;
  virtual double seconds(const trace::Op& op) const = 0;
  /// The FLOP rate MFU is measured against, for a model whose parameters are `dtype`.
  virtual double peak_flops(DType dtype) const = 0;
  /// Bytes tensors may take on the device.
  virtual double usable_bytes() const = 0;
  virtual std::string name() const = 0;
  /// Whether the host's own thread does the device's work (a CPU backend): then host loops
  /// and device work never run beside each other, and a step's operations take their sum.
  virtual bool host_runs_device_work() const { return false; }
  /// The SMs GEMMs and attention run on, which a collective beside them shares
  /// (plan/timeline.hpp); 0 where the device has none.
  virtual double sm_count() const { return 0; }
  /// How many times as long a GEMM (`gemm`) or an attention kernel takes while
  /// collectives hold `held` SMs (plan/timeline.hpp): its work spread over the SMs left,
  /// sm / (sm - held), where nothing measured says otherwise.
  virtual double beside_held_sms(int held, bool gemm) const {
    (void)gemm;
    const double sms = sm_count();
    return sms > 0 && held > 0 ? sms / std::max(1.0, sms - held) : 1.0;
  }
  /// Refuses float8 GEMMs (`what` asked for them) where this machine has no rate for
  /// them, before anything is traced; a GPU profile with float8 rates prices them.
  virtual void require_float8(std::string_view what) const {
    fail(name(), ": ", what, " cannot be priced: this machine has no float8 GEMM rate (float8.emulate = true "
         "prices the emulation)");
  }
};

/// Multiply-adds of tessera's portable flash kernel for one attention call (see above).
inline double flash_kernel_fmas(const trace::Attention& a) {
  return a.shape.pairs() * static_cast<double>(a.shape.head_dim) * (a.backward ? 7.0 : 2.0);
}

/// Bytes a GEMM must move at least: A and B read once, C written (and read when accumulating).
inline double gemm_bytes(const trace::Gemm& g) {
  const double ab = static_cast<double>(size_of(g.operands)), c = static_cast<double>(size_of(g.result));
  return (static_cast<double>(g.m) * g.k + static_cast<double>(g.k) * g.n) * ab +
         static_cast<double>(g.m) * g.n * c * (g.accumulate ? 2 : 1);
}

/// Whether a GEMM's operands are float8 (cuBLASLt's float8 matmul on a GPU).
inline bool is_float8(DType t) { return t == DType::f8e4m3 || t == DType::f8e5m2; }

/// Which attention kernels a GPU step runs.
enum class AttentionKernel { tessera, cudnn };

inline const char* attention_name(AttentionKernel k) { return k == AttentionKernel::cudnn ? "cudnn" : "tessera"; }

/// What `training.attention` (auto | cudnn | tessera) runs on `m` for a model whose
/// parameters are `dtype` and whose heads are `head_dim` wide: llama-train's own rule
/// (backend/cuda/attention_choice.hpp), for a GPU build that has cuDNN's frontend and a machine
/// that has a current library (cuDNN 9.19), on the profile's compute capability (sm_80's
/// rules where it gives none): head dims a multiple of 8 up to 128 or 256, and packed
/// documents (`documents`, training.document_mask) on cuDNN's variable-length attention
/// on sm_90 and sm_100, except in a context-parallel ring (`context_parallel`). And cuDNN
/// is priced only where the profile gives its rates.
struct AttentionChoice {
  AttentionKernel kernel = AttentionKernel::tessera;
  std::string why;
};
inline AttentionChoice choose_attention(const std::string& key, DType dtype, std::int64_t head_dim, const Machine& m,
                                        bool documents = false, bool context_parallel = false) {
  cuda::AttentionFacts f;
  f.on_gpu = true;
  f.bf16_model = dtype == DType::bf16;
  f.frontend = "assumed";
  f.library = "cuDNN";
  f.library_version = 91900;
  f.cc_major = m.cc_major > 0 ? m.cc_major : 8;
  f.cc_minor = m.cc_major > 0 ? m.cc_minor : 0;
  f.head_dim = head_dim;
  f.documents = documents;
  f.context_parallel = context_parallel;
  const cuda::AttentionChoice run = cuda::choose_attention(key, f, nullptr);
  if (!run.cudnn) return {AttentionKernel::tessera, run.text};
  if (m.cudnn_attention_bf16.empty()) {
    const std::string why = tessera::detail::concat("the machine profile ", m.origin,
                                                    " gives no cuDNN attention rates ([attention.cudnn_bf16_hd<D>_*])");
    TESSERA_CHECK(key != "cudnn", "training.attention = \"cudnn\": ", why);
    return {AttentionKernel::tessera, tessera::detail::concat("tessera (auto: ", why, ")")};
  }
  return {AttentionKernel::cudnn, tessera::detail::concat("cudnn (training.attention = ", key, ")")};
}

class GpuPricer : public Pricer {
 public:
  /// SFU transcendentals per SM per clock for compute capability 8.x and 9.0.
  static constexpr double kSfuPerClock = 16;
  /// Bytes of useful data an uncoalesced warp access brings per L1 wavefront (one element).
  static constexpr double kWalkBytesPerWavefront = 4;

  explicit GpuPricer(Machine m, AttentionKernel attention = AttentionKernel::tessera)
      : m_(std::move(m)), attention_(attention) {}

  double seconds(const trace::Op& op) const override {
    // A pass inside the launch before it (trace::Kernel::own_launch) waits for no launch,
    // nor does a host loop.
    if (const auto* k = std::get_if<trace::Kernel>(&op); k != nullptr && (!k->own_launch || k->on_host)) return work(*k);
    // A fence is an event recorded on the stream, its wait the host's: neither a launch.
    if (std::holds_alternative<trace::Fence>(op) || std::holds_alternative<trace::FenceWait>(op)) return 0;
    return std::max(launch(), std::visit([&](const auto& o) { return work(o); }, op));
  }
  /// The peak MFU is measured against, for a model of `dtype` parameters: a bf16 model's
  /// is the bf16 tensor-core peak even when its linear layers run float8 GEMMs (MFU stays
  /// against the bf16 peak, as torchtitan reports a float8 run's, and llama-plan labels it
  /// so), else the fp32 rate.
  double peak_flops(DType dtype) const override {
    return (dtype == DType::bf16 ? m_.bf16_tflops.value : m_.fp32_tflops.value) * 1e12;
  }
  double usable_bytes() const override { return m_.usable_bytes(); }
  double sm_count() const override { return m_.sm_count.value; }
  /// A GEMM beside held SMs as the profile measured it (gemm.slowdown_beside_held_sms);
  /// attention, and a profile without the measurement, as the SMs' share. The measurement
  /// is of bf16 GEMMs and stands for every GEMM, float8 ones included: what a held SM
  /// costs is the tile waves of cuBLASLt's persistent Hopper kernels spread over fewer
  /// SMs, which a float8 kernel has as a bf16 one does (its tiles take half as long, and
  /// the waves are as many); nothing measured says otherwise.
  double beside_held_sms(int held, bool gemm) const override {
    const double spread = Pricer::beside_held_sms(held, gemm);
    return gemm && m_.gemm_beside_held_sms ? m_.gemm_beside_held_sms->at(held, spread) : spread;
  }
  std::string name() const override { return m_.name; }
  const Machine& machine() const { return m_; }

  /// Refuses float8 GEMMs where the profile has no float8 rates, naming the profile and
  /// the key; `what` says what asked for them.
  void require_float8(std::string_view what) const override {
    TESSERA_CHECK(m_.has_float8(), m_.origin, ": machine profile: compute.fp8_tflops is missing, so ", what,
                  " cannot be priced on ", m_.name,
                  " (a GPU without float8 tensor cores; float8.emulate = true prices the emulation there)");
  }
  AttentionKernel attention() const { return attention_; }

  /// The fraction of the fp32 rate the portable flash kernel reaches (a quarter here).
  double flash_efficiency() const {
    const double lanes = m_.fp32_tflops.value * 1e12 / (2 * m_.sm_count.value * m_.boost_clock_ghz.value * 1e9);
    return std::min(1.0, m_.shared_memory_bytes_per_clock_per_sm.value / 4 / lanes);
  }

 private:
  double launch() const { return m_.launch_us.value * 1e-6; }
  double sync() const { return m_.sync_us.value * 1e-6; }
  double clock() const { return m_.boost_clock_ghz.value * 1e9; }

  double work(const trace::Gemm& g) const {
    const double gflop = g.flops() / 1e9;
    double rate = 0;  // FLOP/s
    if (is_float8(g.operands)) {
      require_float8(tessera::detail::concat("a float8 GEMM (", g.m, "x", g.n, "x", g.k, " ", name_of(g.operands), ")"));
      rate = m_.fp8_tflops->value * 1e12 * m_.gemm_fp8->at(gflop);
    } else if (g.operands == DType::bf16) {
      rate = m_.bf16_tflops.value * 1e12 * m_.gemm_bf16.at(gflop);
    } else {
      rate = m_.fp32_tflops.value * 1e12 * m_.gemm_fp32.at(gflop);
    }
    return std::max(g.flops() / rate, gemm_bytes(g) / m_.stream_bandwidth());
  }
  double work(const trace::Attention& a) const {
    if (attention_ == AttentionKernel::cudnn && a.dtype == DType::bf16)
      if (const AttentionRates* r = m_.cudnn_attention_rates(a.shape.head_dim)) {
        // The curves were measured causal. A full call (a context-parallel block off the
        // diagonal) takes its own FLOPs, all T^2 pairs (a.flops()), at the causal rate for
        // the same seq_len: conservative, as a block without a mask runs at least as
        // efficiently as a causal one (no diagonal tiles to mask).
        const double tflops = (a.backward ? r->backward : r->forward).at(static_cast<double>(a.shape.seq_len));
        return a.flops() / (tflops * 1e12);
      }
    return 2 * flash_kernel_fmas(a) / (m_.fp32_tflops.value * 1e12 * flash_efficiency());
  }
  double work(const trace::Kernel& k) const {
    if (k.on_host) {
      TESSERA_CHECK(m_.host_memory_gbs.has_value(), m_.origin, ": machine profile: host.memory_gbs is missing, so ",
                    "the host's loops of CPU offload (", k.functor, ", training.enable_cpu_offload) cannot be priced on ",
                    m_.name);
      return k.traffic.bytes() / (m_.host_memory_gbs->value * 1e9);
    }
    const ops::Traffic& t = k.cuda_traffic ? *k.cuda_traffic : k.traffic;
    double memory = t.bytes() / m_.stream_bandwidth();
    if (k.cuda_class == KernelClass::per_index && t.walk_bytes > 0) {
      const double walking = std::min(t.walk_bytes, t.bytes());
      const double walk_rate = std::min(m_.sm_count.value * clock() * kWalkBytesPerWavefront, m_.stream_bandwidth());
      memory = walking / walk_rate + (t.bytes() - walking) / m_.stream_bandwidth();
    }
    const double sfu = t.transcendentals / (m_.sm_count.value * kSfuPerClock * clock());
    const double alu = t.flops / (m_.fp32_tflops.value * 1e12);
    return std::max({memory, sfu, alu});
  }
  double work(const trace::Fill& f) const { return static_cast<double>(f.bytes) / m_.stream_bandwidth(); }
  double work(const trace::Transfer& t) const {
    return (t.synchronizes ? sync() : 0.0) + static_cast<double>(t.bytes) / (m_.host_link_gbs.value * 1e9);
  }
  double work(const trace::Synchronize&) const { return sync(); }
  // The host's wait for a fence is what the device has left before it: the step's replay
  // (HostDeviceClock) counts it, nothing here.
  double work(const trace::Fence&) const { return 0; }
  double work(const trace::FenceWait&) const { return 0; }
  double work(const trace::Memory&) const { return 0; }
  // Communication is priced on the cluster's links, beside the compute (plan/cluster.hpp).
  double work(const trace::Collective&) const { return 0; }
  double work(const trace::CommWait&) const { return 0; }

  Machine m_;
  AttentionKernel attention_;
};

/// What the step is, for throughput and MFU.
struct StepShape {
  nn::ModelArgs args;
  std::int64_t tokens = 0;   // per step, over the data-parallel ranks
  std::int64_t seq_len = 0;
  DType dtype = DType::f32;  // the parameters' (bf16 for a bf16 model)
  int devices = 1;
  nn::LoraPolicy lora{};  // LoRA's adapters, where the model has them (its FLOPs per token)
};

/// One rank's host thread and device stream, as its trace issues work (see the header
/// comment): device work starts once the stream is free and the host has issued it; the
/// host's loops run on the host's clock; the host catches up with the stream at a
/// synchronisation (and a copy to the host), and with a fence's point at its wait.
class HostDeviceClock {
 public:
  /// `serial`: the host thread does the device's work too (Pricer::host_runs_device_work),
  /// so the host is never ahead of it.
  explicit HostDeviceClock(bool serial = false) : serial_(serial) {}

  /// When device work issued now starts: once the stream is free and the host has issued it.
  double next_start() const { return std::max(device_, host_); }
  /// The stream busy until `t` (what was issued ends then, or it waits until then).
  void device_until(double t) {
    device_ = t;
    if (serial_) host_ = device_;
  }
  /// Device work of `s` seconds, issued now. Returns when it starts.
  double device_work(double s) {
    const double start = next_start();
    device_until(start + s);
    return start;
  }
  /// A host loop of `s` seconds: beside the device's work where the device has work left.
  void host_work(double s) {
    hidden_host_ += std::clamp(device_ - host_, 0.0, s);
    host_ += s;
    host_seconds_ += s;
  }
  /// The host waits for everything issued, then `s` seconds more (the synchronisation's own).
  void synchronize(double s) { host_ = std::max(host_, device_) + s; }
  /// A fence at the stream's present end; the host's wait for it.
  void fence(std::uint64_t id) { fences_[id] = device_; }
  void wait_fence(std::uint64_t id) {
    const auto it = fences_.find(id);
    TESSERA_CHECK(it != fences_.end(), "step replay: a wait for fence ", id, ", which was never recorded");
    host_ = std::max(host_, it->second);
  }
  /// Replays one priced operation (`s`: the pricer's seconds for it). Memory events and
  /// communication are the caller's.
  void replay(const trace::Op& op, double s) {
    if (const auto* k = std::get_if<trace::Kernel>(&op); k && k->on_host) return host_work(s);
    if (const auto* f = std::get_if<trace::Fence>(&op)) return fence(f->id);
    if (const auto* w = std::get_if<trace::FenceWait>(&op)) return wait_fence(w->id);
    if (std::holds_alternative<trace::Synchronize>(op)) return synchronize(s);
    if (const auto* t = std::get_if<trace::Transfer>(&op); t && t->synchronizes) {
      device_work(s);  // the copy, then the host has it
      host_ = std::max(host_, device_);
      return;
    }
    device_work(s);
  }

  double device() const { return device_; }
  double host() const { return host_; }
  /// When both have finished what they were given.
  double end() const { return std::max(device_, host_); }
  double host_seconds() const { return host_seconds_; }
  /// The host loops' seconds while the device still had work: how much shorter the step
  /// is than its operations' sum.
  double hidden_host_seconds() const { return hidden_host_; }

 private:
  bool serial_ = false;
  double device_ = 0, host_ = 0;
  double host_seconds_ = 0, hidden_host_ = 0;
  std::map<std::uint64_t, double> fences_;
};

struct Prediction {
  std::string machine;
  double step_seconds = 0;
  double host_seconds = 0;         // the host backend's loops (CPU offload), in the classes
  double hidden_host_seconds = 0;  // of which beside the device's work: the classes' sum less the step
  /// By class, in this order: GEMMs, attention, memory-bound kernels, loss head,
  /// optimizer, host synchronisations (the loss head and optimizer regions take their
  /// GEMMs and kernels; every host transfer and synchronisation is the last class).
  ClassTimes by_class;
  std::vector<OpTotal> top;  // the costliest kinds of operation, costliest first
  double tokens_per_sec = 0;
  double mfu_pct = 0, mfu_causal_pct = 0;  // against peak_flops
  double peak_flops = 0;                   // the parameters' dtype's peak: bf16's for a float8 run
  std::size_t peak_memory_bytes = 0;      // live bytes at the peak
  std::size_t reserved_memory_bytes = 0;  // what the allocator holds at its peak (>= the live peak)
  MemoryBreakdown memory{};
  double usable_bytes = 0;
  bool fits = false;                      // reserved_memory_bytes within usable_bytes
  std::int64_t host_reads = 0;        // transfers to the host: each a synchronisation on a GPU
  std::int64_t unpriced_kernels = 0;  // launches of functors without traffic() (priced as nothing)
  std::int64_t float8_gemms = 0;      // GEMMs of float8 operands (their MFU is still against peak_flops)
};


/// A collective or a wait for one: work on the cluster's links, not the device's.
inline bool is_communication(const trace::Op& op) {
  return std::holds_alternative<trace::Collective>(op) || std::holds_alternative<trace::CommWait>(op);
}

namespace detail {
/// trace::describe (kept under this name for the plan's callers).
inline std::string describe(const trace::Op& op) { return trace::describe(op); }
inline const char* class_of(const trace::Event& e) {
  if (std::holds_alternative<trace::Transfer>(e.op) || std::holds_alternative<trace::Synchronize>(e.op) ||
      std::holds_alternative<trace::Fence>(e.op) || std::holds_alternative<trace::FenceWait>(e.op))
    return kClassHost;
  const std::string_view r = e.region;
  if (r == region::kLossHead) return kClassLossHead;
  if (r == region::kOptimizer) return kClassOptimizer;
  if (std::holds_alternative<trace::Gemm>(e.op)) return kClassGemm;
  if (std::holds_alternative<trace::Attention>(e.op)) return kClassAttention;
  return kClassKernels;
}
}  // namespace detail

/// The step's time by class, throughput, MFU (torchtitan's formula and the causally
/// halved one) and memory against the device. `peak` and `at_peak`: the step's memory
/// peak on the device and what it held then; `reserved`: what the allocator holds at
/// its peak (0: the peak itself), which decides the fit. `top`: how many of the
/// costliest kinds of operation to list (0: none, and no operation is described: a
/// search's pricing).
inline Prediction predict(const trace::Trace& trace, const Pricer& pricer, const StepShape& shape, std::size_t peak,
                          const MemoryBreakdown& at_peak, std::size_t top = 12, std::size_t reserved = 0) {
  Prediction p;
  p.machine = pricer.name();
  p.by_class = zero_class_times();
  std::map<std::string, OpTotal> kinds;
  HostDeviceClock clock(pricer.host_runs_device_work());
  for (const auto& e : trace.events()) {
    if (std::holds_alternative<trace::Memory>(e.op) || is_communication(e.op)) continue;
    if (const auto* k = std::get_if<trace::Kernel>(&e.op); k && !k->priced) ++p.unpriced_kernels;
    if (const auto* t = std::get_if<trace::Transfer>(&e.op); t && t->to_host) ++p.host_reads;
    if (const auto* g = std::get_if<trace::Gemm>(&e.op); g && is_float8(g->operands)) ++p.float8_gemms;
    const double s = pricer.seconds(e.op);
    const char* cls = detail::class_of(e);
    add_to_class(p.by_class, cls, s);
    clock.replay(e.op, s);
    if (top == 0) continue;
    const std::string what = detail::describe(e.op);
    OpTotal& kind = kinds[what + "|" + cls];
    if (kind.what.empty()) {
      kind.what = what;
      kind.cls = cls;
    }
    kind.seconds += s;
    ++kind.count;
  }
  p.top = costliest(kinds, top);
  p.step_seconds = clock.end();
  p.host_seconds = clock.host_seconds();
  p.hidden_host_seconds = clock.hidden_host_seconds();

  p.tokens_per_sec = p.step_seconds > 0 ? static_cast<double>(shape.tokens) / p.step_seconds : 0;
  p.peak_flops = pricer.peak_flops(shape.dtype);
  const double per_device = p.tokens_per_sec / std::max(1, shape.devices);
  p.mfu_pct = 100 * per_device * nn::training_flops_per_token(shape.args, shape.lora, shape.seq_len) / p.peak_flops;
  p.mfu_causal_pct =
      100 * per_device * nn::training_flops_per_token(shape.args, shape.lora, shape.seq_len, true) / p.peak_flops;
  p.peak_memory_bytes = peak;
  p.reserved_memory_bytes = std::max(reserved, peak);
  p.memory = at_peak;
  p.usable_bytes = pricer.usable_bytes();
  p.fits = static_cast<double>(p.reserved_memory_bytes) <= p.usable_bytes;
  return p;
}

}  // namespace tessera::plan
