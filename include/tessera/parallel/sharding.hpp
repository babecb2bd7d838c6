// ShardedUnit: the parameters of one unit (the embedding, a block, norm + output) as
// the data-parallel sharding keeps them, and the collectives that move them.
//
// A unit's parameters are laid end to end in one flat vector of N elements, padded
// with zeros to Np = S * ceil(N / S) for a shard degree S; rank s holds elements
// [s * Np / S, (s + 1) * Np / S). That flat shard (value and gradient) is what the
// optimizer updates, so AdamW's moments are sharded with it.
//
//   FSDP  (S = dp_shard)  forward:  all-gather → compute → free (reshard_after_forward)
//                         backward: all-gather → compute → reduce-scatter → free
//   HSDP  as FSDP over dp_shard, then the reduced shard all-reduced over dp_replicate
//   DDP   (S = 1)         parameters whole on every rank; gradients live in one flat
//                         bucket per unit, all-reduced over dp once per step, issued
//                         as soon as the unit's backward of the last micro-batch ends
//   none  one rank: nothing moves
//
// Gathers and reductions are asynchronous: prefetch() issues the next unit's gather
// while the current one computes; reduce_grads() issues a reduction that
// finish_grads() completes at the end of the step. With bfloat16 parameters (a bf16
// model, or an fp32 one with mixed_precision_param = "bfloat16") the gather sends
// bfloat16 (half the bytes); gradients are reduced in float32 either way.
//
// FSDP's float8 all-gather (float8.enable_fsdp_float8_all_gather; the weights a float8
// layer marks, Parameter::gathers_float8): each such weight's scale is agreed before the
// gather, from its largest magnitude over every shard (each rank's part, then one
// all-reduce of the maxima over the shard group, and one over the tensor-parallel group
// where the unit holds pieces of the weights: exact, so it is the amax of the whole
// weight, as one rank's cast takes it); each rank casts its part of the weight to
// float8_e4m3 by it (from the values the plain gather would send: rounded to bf16 first
// where it sends bf16) and the unit's flat vector is gathered as one byte an element. The unit's other parameters (the
// norms' weights) go in a second, small gather of their own elements. The layer then
// multiplies the gathered float8 values as they are (Parameter::float8_value,
// float8_inverse): the same scale and the same elementwise cast as gathering the weight
// and casting it after, so the same bytes, in a quarter (fp32 masters) or half (bf16) of
// the gather's bytes. In a step's walk (ModelUnits::begin_step) every unit's weights
// agree their scales in one all-reduce before the first gather, as torchtitan's
// precompute_float8_dynamic_scale_for_fsdp does after the optimizer: a small all-reduce
// per gather would queue on the collective stream behind the step's large gathers and
// reductions, and the compute stream would wait for it (llama-plan: 79 ms of an 8B FSDP 8
// step exposed, against 11). Scales so agreed serve the step's gathers until the walk
// ends; outside one (inference, a pipeline's walk) each gather agrees its own.
//
// CPU offload (Plan::cpu_offload, training.enable_cpu_offload; FSDP and HSDP only): the
// flat shard — its values, its gradient, and so the optimizer's moments and masters —
// lives in the host memory beside B's (backend/host.hpp), and the optimizer, the
// gradient norm and initialisation run there on the host's cores. Each gather first
// copies this rank's shard into B's memory (in the compute stream's order; released once
// gathered); each reduced gradient shard is copied back to the host and, on a later
// micro-batch, added there. The device then holds a unit's parameters only while they
// are gathered, and its gradients only from its backward to their reduction: the shards
// and the optimizer's state leave it, for two crossings of the host link a step (values
// down, gradients up). A gradient's copy up is followed by a fence, and the host's loops
// over it wait for that fence alone (wait_landed), not for the device's later work: under
// the early step a unit's update runs on the host while the device runs the backward
// issued after it (parallel/model_units.hpp). The arithmetic is every backend's, so an
// offloaded run trains the very model the same run without it does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/host.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/float8.hpp"
#include "tessera/ops/traffic.hpp"
#include "tessera/optim/clip.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera::parallel {

namespace detail {
struct PackBf16 {
  const float* src;
  std::uint16_t* dst;
  TESSERA_HD void operator()(std::int64_t i) const { dst[i] = bf16(src[i]).bits; }
  // A rounding on the bits: no arithmetic counted.
  ops::Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(float), e * sizeof(std::uint16_t), 0, 0};
  }
};
struct UnpackBf16 {
  const std::uint16_t* src;
  float* dst;
  TESSERA_HD void operator()(std::int64_t i) const { dst[i] = bf16::from_bits_to_float(src[i]); }
  ops::Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(std::uint16_t), e * sizeof(float), 0, 0};
  }
};

/// out[0] = the largest magnitude of x[0..n) (NaN wins): rows of kFlatAbsMaxRow elements
/// in parallel, then their maxima. Exact: any split of x gives the same value.
inline constexpr std::int64_t kFlatAbsMaxRow = 4096;
template <Backend B, class T>
void flat_abs_max(const T* x, std::int64_t n, float* out) {
  const std::int64_t full = n / kFlatAbsMaxRow, tail = n - full * kFlatAbsMaxRow, rows = full + (tail > 0 ? 1 : 0);
  if (rows == 0) {
    B::for_each(1, ops::Fill<float>{0.0f, out});
    return;
  }
  Tensor<float> partial = B::template empty<float>(Shape{rows});
  if (full > 0) B::for_each(full, ops::RowAbsMax<T>{x, kFlatAbsMaxRow, kFlatAbsMaxRow, partial.data()});
  if (tail > 0) B::for_each(1, ops::RowAbsMax<T>{x + full * kFlatAbsMaxRow, tail, tail, partial.data() + full});
  B::for_each(1, ops::MaxOf{partial.data(), rows, out});
}

/// The bytes of float8 storage, as a collective moves them.
inline const std::uint8_t* float8_bytes(const float8_e4m3* p) { return reinterpret_cast<const std::uint8_t*>(p); }
inline std::uint8_t* float8_bytes(float8_e4m3* p) { return reinterpret_cast<std::uint8_t*>(p); }

}  // namespace detail

template <class T, Backend B>
class ShardedUnit {
  using G = typename nn::Parameter<T>::grad_type;  // gradients: fp32 for bf16 parameters

 public:
  using grad_type = G;
  /// `reshard_after_forward`: free the gathered parameters after the forward.
  /// `frozen_only`: the unit's frozen parameters' companion (see add()).
  ShardedUnit(std::string name, ShardingMode mode, const Plan& plan, bool reshard_after_forward,
              bool frozen_only = false)
      : name_(std::move(name)), mode_(mode), reshard_after_forward_(reshard_after_forward) {
    TESSERA_CHECK(mode == ShardingMode::none || plan.mesh != nullptr || (plan.units_over_self() && mode == ShardingMode::fsdp),
                  name_, ": ", name_of(mode), " needs a DeviceMesh in the Plan");
    if (plan.mesh) {
      auto& mesh = *plan.mesh;
      // A tensor-parallel piece's float8 scale is the whole weight's: agreed over the
      // shards, then over the pieces (the float8 all-gather).
      if (mesh.shape().tp > 1) tp_comm_ = &mesh.tp();
      // Context-parallel ranks hold the same parameters and each a part of every
      // sequence's gradient: FSDP and HSDP shard over them too (dp_shard x cp).
      TESSERA_CHECK(mesh.shape().cp == 1 || mode == ShardingMode::fsdp || mode == ShardingMode::hsdp, name_, ": ",
                    plan.wording()(settings::context_parallel_degree, mesh.shape().cp), " needs Sharding<FSDP> or ",
                    "Sharding<HSDP> (its ranks' gradients are summed as FSDP's shards), not ",
                    mode == ShardingMode::none ? "no sharding" : name_of(mode));
      switch (mode) {
        case ShardingMode::none:
          TESSERA_CHECK(mesh.dp_degree() == 1, name_, ": ", mesh.dp_degree(),
                        " data-parallel ranks need a Sharding policy (FSDP, HSDP or DDP): without one "
                        "their gradients would never be combined");
          break;
        case ShardingMode::fsdp:
          TESSERA_CHECK(mesh.shape().dp_replicate == 1, name_, ": Sharding<FSDP> on a mesh with data_parallel_replicate_degree ",
                        mesh.shape().dp_replicate, ": use HSDP to replicate shards, or set the degree to 1");
          shard_comm_ = &mesh.dp_shard_cp();
          break;
        case ShardingMode::hsdp:
          shard_comm_ = &mesh.dp_shard_cp();
          replicate_comm_ = &mesh.dp_replicate();
          break;
        case ShardingMode::ddp: replicate_comm_ = &mesh.dp(); break;
      }
    } else if (mode == ShardingMode::fsdp) {
      // CPU offload or the early step on one rank without a mesh (llama-train on one
      // GPU): FSDP over the rank alone, its shard the whole unit, its gather a view of the
      // shard (shard_is_whole; a copy from the host when offloaded).
      if constexpr (requires { B::memory_access(); })
        alone_ = std::make_unique<comm::Communicator>(comm::SelfEngine(B::memory_access()));
      else
        alone_ = std::make_unique<comm::Communicator>();
      shard_comm_ = alone_.get();
    }
    gather_bf16_ = plan.param_dtype == DType::bf16 && std::is_same_v<T, float>;
    early_step_ = plan.early_step;
    if (plan.cpu_offload) {
      TESSERA_CHECK(shards(), name_, ": ", plan.wording()(settings::cpu_offload), " offloads FSDP's and HSDP's shards, ",
                    "and this layout is ", mode == ShardingMode::none ? "unsharded" : name_of(mode), ": ",
                    plan.wording().pick("give parallelism.data_parallel_shard_degree x context_parallel_degree above 1 "
                                        "(data_parallel_replicate_degree alone is DDP)",
                                        "use Sharding<FSDP> or Sharding<HSDP>"));
      if constexpr (HasHostBackend<B>) offload_ = true;
      else fail(name_, ": CPU offload on a backend that names no host backend (B::Host)");
    }
    // Frozen parameters (LoRA) in shards of their own: gathered, never reduced or updated.
    if (shards() && plan.lora.enabled && !frozen_only)
      frozen_ = std::make_unique<ShardedUnit>(name_ + " (frozen)", mode, plan, reshard_after_forward, true);
    frozen_only_ = frozen_only;
    local_.frozen = frozen_only;
  }
  ShardedUnit(const ShardedUnit&) = delete;
  ShardedUnit& operator=(const ShardedUnit&) = delete;

  /// Adds a parameter (in a fixed order, before shard()). Its place in the flat
  /// vector is fixed by shard(), from its tensor-parallel piece's shape.
  /// Under FSDP and HSDP a frozen parameter (LoRA) goes to the unit's frozen companion, a
  /// flat vector of its own that is gathered with the unit's and never reduced or updated:
  /// a flat shard is updated whole. A unit with no trainable parameter becomes the frozen
  /// one itself (shard()).
  void add(nn::Parameter<T>& p) {
    TESSERA_CHECK(!sharded_, name_, ": parameter ", p.name, " added after the unit was sharded");
    if (frozen_ && p.frozen) return frozen_->add(p);
    TESSERA_CHECK(!shards() || !p.frozen || frozen_only_, name_, ": ", p.name, " is frozen, and a plan without "
                  "LoRA (Plan::lora) gives the unit no frozen shards");
    params_.push_back(Slot{&p, 0, {}});
  }

  ShardingMode mode() const { return mode_; }
  bool shards() const { return mode_ == ShardingMode::fsdp || mode_ == ShardingMode::hsdp; }
  const std::string& name() const { return name_; }
  std::int64_t numel() const { return numel_; }
  std::int64_t padded_numel() const { return shard_numel_ * degree(); }
  std::int64_t shard_numel() const { return shard_numel_; }
  int degree() const { return shard_comm_ ? shard_comm_->size() : 1; }
  bool sharded() const { return sharded_; }
  bool gathered() const { return gathered_; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  /// Whether the shard lives in host memory (CPU offload; see the header comment).
  bool offloaded() const { return offload_; }

  /// Moves to this rank's share: the FSDP/HSDP shard, or (DDP) the gradient bucket.
  /// Parameters with values (their pieces, as initialised or loaded, the same on every
  /// rank) give the shard its values and are released under FSDP/HSDP. Parameters
  /// without storage (made in a DeferParameterStorage scope) are never allocated whole:
  /// the shard starts zeroed (under DDP, each piece), for the caller to initialise
  /// through for_each_held_stretch.
  void shard() {
    if (sharded_) return;
    if (frozen_ && frozen_->params_.empty()) frozen_.reset();  // nothing frozen here
    if (frozen_ && params_.empty()) {  // nothing trains: this unit is the frozen one
      params_ = std::move(frozen_->params_);
      frozen_.reset();
      frozen_only_ = true;
      local_.frozen = true;
    }
    if (frozen_) frozen_->shard();
    sharded_ = true;
    numel_ = 0;
    for (auto& s : params_) {
      s.offset = numel_;
      s.shape = s.p->piece_shape();
      TESSERA_CHECK(s.p->value.empty() || s.p->value.shape() == s.shape, name_, ": parameter ", s.p->name,
                    " holds a value of shape ", s.p->value.shape().str(), ", not its piece's ", s.shape.str());
      numel_ += s.shape.numel();
    }
    if (shards()) {
      const int S = degree();
      shard_numel_ = (numel_ + S - 1) / S;
      const std::int64_t begin = shard_begin();
      local_.name = name_ + ".flat_shard";
      local_.whole = Shape{shard_numel_};
      // Under the early step (in B's memory) the gradient is made by the first reduction.
      with_backend<B>(offload_, [&]<class X>() { local_.template allocate<X>(local_.whole, offload_ || !early_step_); });
      for (auto& s : params_) {
        const auto [lo, hi] = held_range(s);
        if (lo < hi && !s.p->value.empty()) {
          const T* from = s.p->value.data() + (lo - s.offset);
          T* to = local_.value.data() + (lo - begin);
          if (offload_) copy_to_host_memory<B>(from, to, hi - lo);
          else B::for_each(hi - lo, ops::Copy<T>{from, to});
        }
        if (offload_) B::synchronize();  // the values are on the host before the whole goes
        s.p->value.release();
        s.p->grad.release();
      }
      plan_float8_gather();
    } else {
      shard_numel_ = numel_;
      if (mode_ == ShardingMode::ddp) {
        // The trainable parameters' gradients, end to end (a frozen one has none).
        bucket_numel_ = 0;
        for (auto& s : params_) {
          s.grad_offset = bucket_numel_;
          if (!s.p->frozen) bucket_numel_ += s.shape.numel();
        }
        MemoryUseScope use(MemoryUse::gradients);
        bucket_ = B::template zeros<G>(Shape{bucket_numel_});
      }
      for (auto& s : params_) {
        if (s.p->value.empty() && s.p->grad.empty()) {
          // Beside the rest of its ParameterStack, where it has one; under DDP the gradient
          // lives in the bucket.
          s.p->template allocate<B>(s.shape, mode_ != ShardingMode::ddp);
        } else if (s.p->value.empty()) {
          MemoryUseScope use(MemoryUse::parameters);
          s.p->value = B::template zeros<T>(s.shape);
        }
        if (s.p->frozen) continue;
        if (mode_ != ShardingMode::ddp) {
          MemoryUseScope use(MemoryUse::gradients);
          if (s.p->grad.empty()) s.p->grad = B::template zeros<G>(s.shape);
          continue;
        }
        Tensor<G> view = bucket_.slice(s.grad_offset, s.shape);  // the gradient lives in the bucket
        if (!s.p->grad.empty()) B::for_each(view.numel(), ops::Copy<G>{s.p->grad.data(), view.data()});
        s.p->grad = view;
      }
    }
  }

  /// Issues the all-gather of this unit's parameters, unless they are gathered or on their way.
  void prefetch() {
    check_sharded();
    if (frozen_) frozen_->prefetch();
    if (!shards() || gathered_ || gather_.pending()) return;
    const std::int64_t np = padded_numel();
    MemoryUseScope use(MemoryUse::parameters);  // the gathered parameters and their staging
    gathering_float8_ = !float8_slots_.empty() && !whole_values_;
    if (gathering_float8_) {
      prefetch_float8();
      return;
    }
    if (shard_is_whole()) {  // FSDP over one rank: the shard is the unit, gathered as it is
      full_ = local_.value;
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (gather_bf16_) {
        packed_shard_ = B::template empty<std::uint16_t>(Shape{shard_numel_});
        B::for_each(shard_numel_, detail::PackBf16{shard_values(), packed_shard_.data()});
        packed_full_ = B::template empty<std::uint16_t>(Shape{np});
        gather_ = shard_comm_->all_gather_async(std::span<const std::uint16_t>(packed_shard_.data(), shard_numel_),
                                                std::span<std::uint16_t>(packed_full_.data(), np));
        return;
      }
    }
    {
      full_ = B::template empty<T>(Shape{np});
      gather_ = shard_comm_->all_gather_async(std::span<const T>(shard_values(), shard_numel_),
                                              std::span<T>(full_.data(), np));
    }
  }

  /// Makes every parameter's value whole: waits for a prefetch, or gathers now.
  void unshard() {
    check_sharded();
    if (frozen_) frozen_->unshard();
    if (!shards() || gathered_) return;
    prefetch();
    gather_.wait();
    staged_.release();  // the gather has read it
    if (gathering_float8_) {
      unshard_float8();
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      if (gather_bf16_) {
        MemoryUseScope use(MemoryUse::parameters);
        full_ = B::template empty<T>(Shape{padded_numel()});
        B::for_each(padded_numel(), detail::UnpackBf16{packed_full_.data(), full_.data()});
        packed_full_.release();
        packed_shard_.release();
      }
    }
    for (auto& s : params_) s.p->value = full_.slice(s.offset, s.shape);
    gathered_ = true;
  }

  /// The weights this unit gathers in float8 (0 without the float8 all-gather), its frozen
  /// companion's after its own.
  std::int64_t float8_weights() const { return own_float8_weights() + (frozen_ ? frozen_->float8_weights() : 0); }
  /// The communicators the float8 weights' amaxes are agreed over: the shard group, then
  /// the tensor-parallel group where the weights are pieces of it (else none).
  comm::Communicator* shard_comm() const { return shard_comm_; }
  comm::Communicator* float8_piece_comm() const { return tp_comm_; }

  /// Writes, at `amax`, the largest magnitude of each float8 weight's part on this rank
  /// (float8_weights() values, 0 for a weight it holds none of): the first half of
  /// agreeing the scales of several units in one all-reduce.
  void float8_local_amaxes(float* amax) {
    check_sharded();
    if (own_float8_weights() > 0) {
      MemoryUseScope use(MemoryUse::parameters);
      float8_local_amaxes_from(float8_source(), amax);
      rounded_shard_.release();
      packed_shard_.release();
      staged_.release();
    }
    if (frozen_) frozen_->float8_local_amaxes(amax + own_float8_weights());
  }

  /// The second half: the scales from the amaxes agreed over the shard group (at
  /// `amax`, float8_weights() values), used by this unit's float8 gathers until
  /// forget_float8_scales().
  void take_float8_amaxes(const float* amax) {
    const auto nf = own_float8_weights();
    if (nf > 0) {
      MemoryUseScope use(MemoryUse::parameters);
      agreed_scale_ = B::template empty<float>(Shape{nf});
      agreed_inverse_ = B::template empty<float>(Shape{nf});
      B::for_each(nf, ops::Float8ScaleFromAmax{amax, agreed_scale_.data(), agreed_inverse_.data(), float8_e4m3::max(),
                                               false});
    }
    if (frozen_) frozen_->take_float8_amaxes(amax + nf);
  }

  /// Drops scales taken by take_float8_amaxes: later gathers agree their own.
  void forget_float8_scales() {
    agreed_scale_.release();
    agreed_inverse_.release();
    if (frozen_) frozen_->forget_float8_scales();
  }

  /// Makes every parameter's value whole in its own precision, the weights FSDP gathers
  /// in float8 too (what saving, exporting and with_whole_parameters read): a gather in
  /// float8, done or on its way, is dropped and the values gathered instead.
  void unshard_values() {
    check_sharded();
    if (frozen_) frozen_->unshard_values();
    if (!shards()) return;
    if (gathering_float8_ && (gathered_ || gather_.pending())) reshard();
    whole_values_ = true;
    try {
      unshard();
    } catch (...) {
      whole_values_ = false;
      throw;
    }
    whole_values_ = false;
  }

  /// Frees the gathered parameters (FSDP/HSDP); their values become empty.
  void reshard() {
    if (!shards()) return;
    if (frozen_) frozen_->reshard();
    gather_.wait();
    rest_gather_.wait();
    for (auto& s : params_) {
      s.p->value.release();
      s.p->float8_value.release();
      s.p->float8_inverse.release();
    }
    full_.release();
    packed_full_.release();
    packed_shard_.release();
    staged_.release();
    release_float8_staging();
    f8_full_.release();
    f8_inverse_.release();
    rest_all_.release();
    gathered_ = false;
  }

  /// Gives every parameter a whole gradient for the backward about to run (FSDP/HSDP),
  /// unwritten: the backward's first write of each overwrites it (layer.hpp's
  /// first-write rule), so nothing is zero-filled but the padding past the last one.
  void begin_grads() {
    check_sharded();
    if (!shards() || grads_open_ || frozen_only_) return;
    MemoryUseScope use(MemoryUse::gradients);
    full_grad_ = B::template empty<G>(Shape{padded_numel()});
    if (padded_numel() > numel_)
      B::for_each(padded_numel() - numel_, ops::Fill<G>{G(0), full_grad_.data() + numel_});
    for (auto& s : params_) {
      s.p->grad = full_grad_.slice(s.offset, s.shape);
      s.p->forget_grad();
    }
    grads_open_ = true;
  }

  /// Issues the reduction of the gradients the backward produced. `last_micro_batch`:
  /// DDP accumulates locally and reduces once, after the last micro-batch.
  void reduce_grads(bool last_micro_batch) {
    check_sharded();
    if (frozen_only_) return;
    if (shards()) {
      TESSERA_CHECK(grads_open_, name_, ": reduce_grads without begin_grads");
      zero_unwritten_grads();
      finish_grads();  // one reduction in flight per unit: a previous micro-batch's completes first
      MemoryUseScope use(MemoryUse::gradients);
      if (degree() == 1) {
        reduced_ = full_grad_;  // a reduce-scatter over one rank: the gradient is its own shard
      } else {
        reduced_ = B::template empty<G>(Shape{shard_numel_});
        reduce_ = shard_comm_->reduce_scatter_async(std::span<const G>(full_grad_.data(), padded_numel()),
                                                    std::span<G>(reduced_.data(), shard_numel_));
      }
      reducing_grad_ = std::move(full_grad_);  // alive until the reduction completes
      full_grad_.release();
      for (auto& s : params_) s.p->grad.release();
      grads_open_ = false;
    } else if (mode_ == ShardingMode::ddp && last_micro_batch) {
      zero_unwritten_grads();
      if (bucket_numel_ > 0) reduce_ = replicate_comm_->all_reduce_async(std::span<G>(bucket_.data(), bucket_numel_));
    }
  }

  /// Completes this unit's gradient reduction: the local gradient holds the sum over
  /// every data-parallel rank.
  void finish_grads() {
    if (!reduce_.pending() && reduced_.empty()) return;
    reduce_.wait();
    if (shards() && !reduced_.empty()) {
      if (replicate_comm_) replicate_comm_->all_reduce(std::span<G>(reduced_.data(), shard_numel_));
      // The step's first reduction is copied into the shard's gradient, later ones added.
      // Under the early step the shard's gradient lives only from its first reduction to
      // its update (release_grad): the first reduction becomes it, with no copy.
      if (offload_) land_reduced_on_host();
      else if (local_.grad_write_beta() == G(0)) {
        if (early_step_) local_.grad = std::move(reduced_);
        else B::for_each(shard_numel_, ops::Copy<G>{reduced_.data(), local_.grad.data()});
      } else
        B::for_each(shard_numel_, ops::Axpy<G>{G(1), reduced_.data(), local_.grad.data()});
      reduced_.release();
      reducing_grad_.release();
    }
  }

  /// Waits until the offloaded shard's gradient has reached the host (the copy
  /// finish_grads issued): what the host's loops over it wait for, and only for that
  /// copy and the device's work before it. Nothing for a shard in B's memory.
  void wait_landed() { landing_.wait(); }

  /// Under the early step, after the shard's update: frees its gradient in B's memory
  /// (the next step's first reduction becomes the gradient again). An offloaded shard's
  /// gradient stays in host memory; DDP's bucket stays (every parameter's gradient views it).
  void release_grad() {
    if (!early_step_ || !shards() || offload_) return;
    local_.grad.release();
  }

  /// Calls f(p, first, n, local, offset) for every stretch of a parameter's piece this
  /// rank holds: n elements from the piece's element `first`, at `offset` of the local
  /// parameter `local` (what for_each_local_parameter hands the optimizer: the flat
  /// shard under FSDP/HSDP, else p itself), so in its value, gradient and optimizer
  /// state alike. Under FSDP/HSDP, the parts of each parameter inside this rank's shard;
  /// else each parameter's piece, whole. What initialises, saves and loads a unit in place.
  template <class F>
  void for_each_held_stretch(F&& f) {
    check_sharded();
    forget_float8_scales();  // the values may change
    if (!shards()) {
      for (auto& s : params_) f(*s.p, std::int64_t{0}, s.p->numel(), *s.p, std::int64_t{0});
      return;
    }
    const std::int64_t begin = shard_begin();
    for (auto& s : params_) {
      const auto [lo, hi] = held_range(s);
      if (lo < hi) f(*s.p, lo - s.offset, hi - lo, local_, lo - begin);
    }
    if (frozen_) frozen_->for_each_held_stretch(f);
  }

  /// Whether this rank is the first of those holding the same shard or parameters (HSDP's
  /// dp_replicate, DDP's dp): the one that counts them once (gradient norm, saving).
  bool first_replica() const { return !replicate_comm_ || replicate_comm_->rank() == 0; }

  /// The parameters this rank updates: the flat shard (FSDP/HSDP), else the parameters.
  template <class F>
  void for_each_local_parameter(F&& f) {
    check_sharded();
    forget_float8_scales();  // the values may change
    if (shards())
      f(local_);
    else
      for (auto& s : params_) f(*s.p);
  }

  /// Adds to `norms` the gradient elements this rank counts in the global norm: those
  /// of its shard (disjoint over dp_shard), on the first replica only (HSDP's
  /// dp_replicate, DDP's dp), of parameters whose tensor-parallel piece it owns.
  /// Summed over every rank of the world, their squares make the squared norm of the
  /// whole gradient.
  void add_owned_gradient(optim::SquaredNorms<B, G>& norms) {
    check_sharded();
    if (!first_replica() || frozen_only_) return;
    if (shards()) {
      if (local_.grad.empty()) return;  // released by the early step, its norm taken before its update
      const std::int64_t begin = shard_begin();
      for (const auto& slot : params_) {
        if (!slot.p->split.owner) continue;
        const auto [lo, hi] = held_range(slot);
        if (lo < hi) norms.add(local_.grad.data() + (lo - begin), hi - lo, offload_);
      }
    } else {
      for (const auto& slot : params_)
        if (slot.p->split.owner && !slot.p->frozen) norms.add(slot.p->grad);
    }
  }

  /// Zeroes the gradients of this unit's parameters that the backward did not write.
  void zero_unwritten_grads() {
    for (auto& s : params_) s.p->template zero_grad_if_unwritten<B>();
  }

 private:
  struct Slot {
    nn::Parameter<T>* p;
    std::int64_t offset;
    Shape shape;  // the parameter's (its value is empty while sharded)
    std::int64_t grad_offset = 0;  // DDP: where its gradient lies in the bucket
  };

  /// The float8 all-gather's layout (shard()): which slots gather as float8, and where the
  /// others' elements lie in the rest's compact vector (their own order, end to end).
  /// Rank r's elements of the rest are a run [rest_begin_[r], rest_begin_[r + 1]) of it,
  /// gathered in slabs of the longest run.
  void plan_float8_gather() {
    float8_slots_.clear();
    rest_slots_.clear();
    for (std::size_t i = 0; i < params_.size(); ++i) (params_[i].p->gathers_float8 ? float8_slots_ : rest_slots_).push_back(i);
    if (float8_slots_.empty()) return;
    rest_offset_.assign(params_.size(), 0);
    rest_numel_ = 0;
    for (std::size_t i : rest_slots_) {
      rest_offset_[i] = rest_numel_;
      rest_numel_ += params_[i].shape.numel();
    }
    // Elements of the rest at flat positions below `pos`.
    auto before = [&](std::int64_t pos) {
      std::int64_t n = 0;
      for (std::size_t i : rest_slots_)
        n += std::clamp<std::int64_t>(pos - params_[i].offset, 0, params_[i].shape.numel());
      return n;
    };
    const int S = degree();
    rest_begin_.assign(static_cast<std::size_t>(S) + 1, 0);
    rest_slab_ = 0;
    for (int r = 0; r <= S; ++r) rest_begin_[static_cast<std::size_t>(r)] = before(shard_numel_ * r);
    for (int r = 0; r < S; ++r)
      rest_slab_ = std::max(rest_slab_, rest_begin_[static_cast<std::size_t>(r) + 1] - rest_begin_[static_cast<std::size_t>(r)]);
  }

  /// The shard's values in B's memory, for a gather to send: the shard itself, or
  /// (offloaded) its copy from the host, made once per gather (staged_, released when
  /// gathered).
  const T* shard_values() {
    if (!offload_) return local_.value.data();
    if (staged_.empty()) {
      MemoryUseScope use(MemoryUse::parameters);
      staged_ = B::template empty<T>(Shape{shard_numel_});
      copy_from_host_memory<B>(local_.value.data(), staged_.data(), shard_numel_);
    }
    return staged_.data();
  }

  /// An offloaded shard's reduced gradient (reduced_, B's memory) copied to the host:
  /// into the shard's gradient on the step's first reduction, in the stream's order with
  /// a fence after it (wait_landed()), else added to it there. reduced_ may go as soon as
  /// the copy is issued: B's memory is reused in stream order (backend/cuda/memory.hpp).
  void land_reduced_on_host() {
    if constexpr (HasHostBackend<B>) {
      using H = host_backend_t<B>;
      if (local_.grad_write_beta() == G(0)) {
        copy_to_host_memory<B>(reduced_.data(), local_.grad.data(), shard_numel_);
        landing_ = FenceOf<B>::now();
        return;
      }
      MemoryUseScope use(MemoryUse::gradients);
      Tensor<G> landed = H::template empty<G>(Shape{shard_numel_});
      copy_to_host_memory<B>(reduced_.data(), landed.data(), shard_numel_);
      B::synchronize();
      H::for_each(shard_numel_, ops::Axpy<G>{G(1), landed.data(), local_.grad.data()});
    }
  }

  /// The shard's values as the plain gather would send them: bf16-rounded (into
  /// rounded_shard_) where it sends bf16, else the shard itself.
  const T* float8_source() {
    if constexpr (std::is_same_v<T, float>) {
      if (gather_bf16_) {
        packed_shard_ = B::template empty<std::uint16_t>(Shape{shard_numel_});
        B::for_each(shard_numel_, detail::PackBf16{shard_values(), packed_shard_.data()});
        rounded_shard_ = B::template empty<float>(Shape{shard_numel_});
        B::for_each(shard_numel_, detail::UnpackBf16{packed_shard_.data(), rounded_shard_.data()});
        return rounded_shard_.data();
      }
    }
    return shard_values();
  }

  /// Each float8 weight's amax over this rank's part of `src` (the shard's values), at
  /// amax[i]; 0 for a weight this rank holds none of.
  void float8_local_amaxes_from(const T* src, float* amax) {
    const std::int64_t begin = shard_begin();
    for (std::size_t i = 0; i < float8_slots_.size(); ++i) {
      const Slot& s = params_[float8_slots_[i]];
      const auto [lo, hi] = held_range(s);
      if (lo < hi) detail::flat_abs_max<B>(src + (lo - begin), hi - lo, amax + i);
      else B::for_each(1, ops::Fill<float>{0.0f, amax + i});
    }
  }

  /// The float8 all-gather's first half: the scales agreed, this rank's part cast and
  /// sent, the rest's elements sent (see the header comment).
  void prefetch_float8() {
    const int S = degree(), rank = shard_comm_->rank();
    const std::int64_t begin = shard_numel_ * rank, np = padded_numel();
    const T* src = float8_source();
    // The scales: agreed for the step already, or each float8 weight's amax over this
    // rank's part (0 where it holds none), the maxima over the shard group.
    const auto nf = static_cast<std::int64_t>(float8_slots_.size());
    if (!agreed_scale_.empty()) {
      f8_scale_ = agreed_scale_;
      f8_inverse_ = agreed_inverse_;
    } else {
      f8_amax_ = B::template empty<float>(Shape{nf});
      float8_local_amaxes_from(src, f8_amax_.data());
      shard_comm_->all_reduce(std::span<float>(f8_amax_.data(), static_cast<std::size_t>(nf)), comm::ReduceOp::max);
      if (tp_comm_ != nullptr)
        tp_comm_->all_reduce(std::span<float>(f8_amax_.data(), static_cast<std::size_t>(nf)), comm::ReduceOp::max);
      f8_scale_ = B::template empty<float>(Shape{nf});
      f8_inverse_ = B::template empty<float>(Shape{nf});
      B::for_each(nf, ops::Float8ScaleFromAmax{f8_amax_.data(), f8_scale_.data(), f8_inverse_.data(),
                                               float8_e4m3::max(), false});
    }
    // This rank's bytes: each float8 weight's part cast by its scale, the rest zero.
    f8_shard_ = B::template zeros<float8_e4m3>(Shape{shard_numel_});
    for (std::int64_t i = 0; i < nf; ++i) {
      const Slot& s = params_[float8_slots_[static_cast<std::size_t>(i)]];
      const auto [lo, hi] = held_range(s);
      if (lo < hi)
        B::for_each(hi - lo, ops::QuantizeFloat8<T, float8_e4m3>{src + (lo - begin), hi - lo, 1, hi - lo,
                                                                 f8_scale_.data() + i, ops::Float8Axis::tensor, false,
                                                                 f8_shard_.data() + (lo - begin)});
    }
    f8_full_ = B::template empty<float8_e4m3>(Shape{np});
    gather_ = shard_comm_->all_gather_async(
        std::span<const std::uint8_t>(detail::float8_bytes(f8_shard_.data()), static_cast<std::size_t>(shard_numel_)),
        std::span<std::uint8_t>(detail::float8_bytes(f8_full_.data()), static_cast<std::size_t>(np)));
    // The rest: this rank's run of it, in a slab.
    if (rest_slab_ == 0) return;
    rest_shard_ = B::template zeros<T>(Shape{rest_slab_});
    const std::int64_t run = rest_begin_[static_cast<std::size_t>(rank)];
    for (std::size_t i : rest_slots_) {
      const Slot& s = params_[i];
      const auto [lo, hi] = held_range(s);
      if (lo < hi)
        B::for_each(hi - lo, ops::Copy<T>{src + (lo - begin), rest_shard_.data() + (rest_offset_[i] + (lo - s.offset) - run)});
    }
    rest_full_ = B::template empty<T>(Shape{rest_slab_ * S});
    rest_gather_ = shard_comm_->all_gather_async(std::span<const T>(rest_shard_.data(), static_cast<std::size_t>(rest_slab_)),
                                                 std::span<T>(rest_full_.data(), static_cast<std::size_t>(rest_slab_ * S)));
  }

  /// The float8 all-gather's second half: the float8 weights as views of the gathered
  /// bytes and their inverse scales, the rest's runs laid end to end.
  void unshard_float8() {
    rest_gather_.wait();
    for (std::size_t i = 0; i < float8_slots_.size(); ++i) {
      Slot& s = params_[float8_slots_[i]];
      s.p->float8_value = f8_full_.slice(s.offset, s.shape);
      s.p->float8_inverse = f8_inverse_.slice(static_cast<std::int64_t>(i), Shape{1});
    }
    if (rest_numel_ > 0) {
      MemoryUseScope use(MemoryUse::parameters);
      rest_all_ = B::template empty<T>(Shape{rest_numel_});
      for (int r = 0; r < degree(); ++r) {
        const std::int64_t from = rest_begin_[static_cast<std::size_t>(r)], n = rest_begin_[static_cast<std::size_t>(r) + 1] - from;
        if (n > 0) B::for_each(n, ops::Copy<T>{rest_full_.data() + rest_slab_ * r, rest_all_.data() + from});
      }
      for (std::size_t i : rest_slots_) params_[i].p->value = rest_all_.slice(rest_offset_[i], params_[i].shape);
    }
    release_float8_staging();
    gathered_ = true;
  }

  void release_float8_staging() {
    packed_shard_.release();
    rounded_shard_.release();
    f8_amax_.release();
    f8_scale_.release();
    f8_shard_.release();
    rest_shard_.release();
    rest_full_.release();
  }

  /// Whether the gathered unit is this rank's shard itself, so that a gather is a view
  /// of it: FSDP over one rank (units over the rank alone, or a shard group of one),
  /// the shard in B's memory and gathered in its own precision.
  bool shard_is_whole() const { return degree() == 1 && !offload_ && !gather_bf16_; }

  /// The flat position of this rank's shard's first element.
  std::int64_t shard_begin() const { return shard_numel_ * shard_comm_->rank(); }

  /// The flat positions [lo, hi) of slot s's elements that lie in this rank's shard
  /// (none when lo >= hi).
  std::pair<std::int64_t, std::int64_t> held_range(const Slot& s) const {
    const std::int64_t begin = shard_begin();
    return {std::max(begin, s.offset), std::min(begin + shard_numel_, s.offset + s.shape.numel())};
  }

  std::int64_t own_float8_weights() const { return static_cast<std::int64_t>(float8_slots_.size()); }

  void check_sharded() const {
    TESSERA_CHECK(sharded_, name_, ": used before shard(): call the model's shard() after initialising or loading it");
  }

  std::string name_;
  ShardingMode mode_;
  bool reshard_after_forward_;
  bool gather_bf16_ = false;
  bool offload_ = false;  // the shard lives in host memory (Plan::cpu_offload)
  bool early_step_ = false;  // the shard's gradient lives from its first reduction to its update (Plan::early_step)
  std::unique_ptr<comm::Communicator> alone_;  // FSDP over one rank without a mesh (CPU offload)
  std::unique_ptr<ShardedUnit> frozen_;  // LoRA: the frozen parameters' shards (add())
  bool frozen_only_ = false;             // this unit's parameters are all frozen
  comm::Communicator* shard_comm_ = nullptr;
  comm::Communicator* replicate_comm_ = nullptr;
  comm::Communicator* tp_comm_ = nullptr;  // the float8 all-gather's second agreement (tensor-parallel pieces)
  std::vector<Slot> params_;
  std::int64_t numel_ = 0, shard_numel_ = 0;
  bool sharded_ = false, gathered_ = false, grads_open_ = false;
  nn::Parameter<T> local_;  // the flat shard (FSDP/HSDP)
  Tensor<T> full_;          // the gathered flat parameters
  Tensor<T> staged_;        // offloaded: the shard's values copied to B for a gather
  Tensor<std::uint16_t> packed_shard_, packed_full_;
  // FSDP's float8 all-gather: its layout, and what it holds while gathering and gathered.
  std::vector<std::size_t> float8_slots_, rest_slots_;
  std::vector<std::int64_t> rest_offset_, rest_begin_;
  std::int64_t rest_numel_ = 0, rest_slab_ = 0;
  Tensor<float> rounded_shard_, f8_amax_, f8_scale_, f8_inverse_;
  Tensor<float> agreed_scale_, agreed_inverse_;  // take_float8_amaxes's, until forgotten
  Tensor<float8_e4m3> f8_shard_, f8_full_;
  Tensor<T> rest_shard_, rest_full_, rest_all_;
  comm::Handle rest_gather_;
  bool whole_values_ = false;      // unshard_values() under way: gather values, not float8
  bool gathering_float8_ = false;  // the gather done or on its way is the float8 one
  Tensor<G> full_grad_, reducing_grad_, reduced_;
  Tensor<G> bucket_;  // DDP: the flat gradient every trainable parameter's grad views
  std::int64_t bucket_numel_ = 0;
  comm::Handle gather_, reduce_;
  FenceOf<B> landing_;  // offloaded: the reduced gradient's copy to the host, until waited for
};

}  // namespace tessera::parallel
