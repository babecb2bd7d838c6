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
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/elementwise.hpp"
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
}  // namespace detail

template <class T, Backend B>
class ShardedUnit {
  using G = typename nn::Parameter<T>::grad_type;  // gradients: fp32 for bf16 parameters

 public:
  /// `reshard_after_forward`: free the gathered parameters after the forward.
  ShardedUnit(std::string name, ShardingMode mode, const Plan& plan, bool reshard_after_forward)
      : name_(std::move(name)), mode_(mode), reshard_after_forward_(reshard_after_forward) {
    TESSERA_CHECK(mode == ShardingMode::none || plan.mesh != nullptr, name_, ": ", name_of(mode),
                  " needs a DeviceMesh in the Plan");
    if (plan.mesh) {
      auto& mesh = *plan.mesh;
      switch (mode) {
        case ShardingMode::none:
          TESSERA_CHECK(mesh.dp_degree() == 1, name_, ": ", mesh.dp_degree(),
                        " data-parallel ranks need a Sharding policy (FSDP, HSDP or DDP): without one "
                        "their gradients would never be combined");
          break;
        case ShardingMode::fsdp:
          TESSERA_CHECK(mesh.shape().dp_replicate == 1, name_, ": Sharding<FSDP> on a mesh with data_parallel_replicate_degree ",
                        mesh.shape().dp_replicate, ": use HSDP to replicate shards, or set the degree to 1");
          shard_comm_ = &mesh.dp_shard();
          break;
        case ShardingMode::hsdp:
          shard_comm_ = &mesh.dp_shard();
          replicate_comm_ = &mesh.dp_replicate();
          break;
        case ShardingMode::ddp: replicate_comm_ = &mesh.dp(); break;
      }
    }
    gather_bf16_ = plan.param_dtype == DType::bf16 && std::is_same_v<T, float>;
  }
  ShardedUnit(const ShardedUnit&) = delete;
  ShardedUnit& operator=(const ShardedUnit&) = delete;

  /// Adds a parameter (in a fixed order, before shard()). Its place in the flat
  /// vector is fixed by shard(), from its tensor-parallel piece's shape.
  void add(nn::Parameter<T>& p) {
    TESSERA_CHECK(!sharded_, name_, ": parameter ", p.name, " added after the unit was sharded");
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

  /// Moves to this rank's share: the FSDP/HSDP shard, or (DDP) the gradient bucket.
  /// Parameters with values (their pieces, as initialised or loaded, the same on every
  /// rank) give the shard its values and are released under FSDP/HSDP. Parameters
  /// without storage (made in a DeferParameterStorage scope) are never allocated whole:
  /// the shard starts zeroed (under DDP, each piece), for the caller to initialise
  /// through for_each_held_stretch.
  void shard() {
    if (sharded_) return;
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
      const std::int64_t begin = shard_numel_ * shard_comm_->rank();
      local_.name = name_ + ".flat_shard";
      local_.whole = Shape{shard_numel_};
      local_.template allocate<B>(local_.whole);
      for (auto& s : params_) {
        const std::int64_t lo = std::max(begin, s.offset), hi = std::min(begin + shard_numel_, s.offset + s.shape.numel());
        if (lo < hi && !s.p->value.empty())
          B::for_each(hi - lo, ops::Copy<T>{s.p->value.data() + (lo - s.offset), local_.value.data() + (lo - begin)});
        s.p->value.release();
        s.p->grad.release();
      }
    } else {
      shard_numel_ = numel_;
      if (mode_ == ShardingMode::ddp) {
        MemoryUseScope use(MemoryUse::gradients);
        bucket_ = B::template zeros<G>(Shape{numel_});
      }
      for (auto& s : params_) {
        if (s.p->value.empty()) {
          MemoryUseScope use(MemoryUse::parameters);
          s.p->value = B::template zeros<T>(s.shape);
        }
        if (mode_ != ShardingMode::ddp) {
          MemoryUseScope use(MemoryUse::gradients);
          if (s.p->grad.empty()) s.p->grad = B::template zeros<G>(s.shape);
          continue;
        }
        Tensor<G> view = bucket_.slice(s.offset, s.shape);  // the gradient lives in the bucket
        if (!s.p->grad.empty()) B::for_each(view.numel(), ops::Copy<G>{s.p->grad.data(), view.data()});
        s.p->grad = view;
      }
    }
  }

  /// Issues the all-gather of this unit's parameters, unless they are gathered or on their way.
  void prefetch() {
    check_sharded();
    if (!shards() || gathered_ || gather_.pending()) return;
    const std::int64_t np = padded_numel();
    MemoryUseScope use(MemoryUse::parameters);  // the gathered parameters and their staging
    if constexpr (std::is_same_v<T, float>) {
      if (gather_bf16_) {
        packed_shard_ = B::template empty<std::uint16_t>(Shape{shard_numel_});
        B::for_each(shard_numel_, detail::PackBf16{local_.value.data(), packed_shard_.data()});
        packed_full_ = B::template empty<std::uint16_t>(Shape{np});
        gather_ = shard_comm_->all_gather_async(std::span<const std::uint16_t>(packed_shard_.data(), shard_numel_),
                                                std::span<std::uint16_t>(packed_full_.data(), np));
        return;
      }
    }
    {
      full_ = B::template empty<T>(Shape{np});
      gather_ = shard_comm_->all_gather_async(std::span<const T>(local_.value.data(), shard_numel_),
                                              std::span<T>(full_.data(), np));
    }
  }

  /// Makes every parameter's value whole: waits for a prefetch, or gathers now.
  void unshard() {
    check_sharded();
    if (!shards() || gathered_) return;
    prefetch();
    gather_.wait();
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

  /// Frees the gathered parameters (FSDP/HSDP); their values become empty.
  void reshard() {
    if (!shards()) return;
    gather_.wait();
    for (auto& s : params_) s.p->value.release();
    full_.release();
    packed_full_.release();
    packed_shard_.release();
    gathered_ = false;
  }

  /// Gives every parameter a whole gradient for the backward about to run (FSDP/HSDP),
  /// unwritten: the backward's first write of each overwrites it (layer.hpp's
  /// first-write rule), so nothing is zero-filled but the padding past the last one.
  void begin_grads() {
    check_sharded();
    if (!shards() || grads_open_) return;
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
    if (shards()) {
      TESSERA_CHECK(grads_open_, name_, ": reduce_grads without begin_grads");
      zero_unwritten_grads();
      finish_grads();  // one reduction in flight per unit: a previous micro-batch's completes first
      MemoryUseScope use(MemoryUse::gradients);
      reduced_ = B::template empty<G>(Shape{shard_numel_});
      reduce_ = shard_comm_->reduce_scatter_async(std::span<const G>(full_grad_.data(), padded_numel()),
                                                  std::span<G>(reduced_.data(), shard_numel_));
      reducing_grad_ = std::move(full_grad_);  // alive until the reduction completes
      full_grad_.release();
      for (auto& s : params_) s.p->grad.release();
      grads_open_ = false;
    } else if (mode_ == ShardingMode::ddp && last_micro_batch) {
      zero_unwritten_grads();
      reduce_ = replicate_comm_->all_reduce_async(std::span<G>(bucket_.data(), numel_));
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
      if (local_.grad_write_beta() == G(0))
        B::for_each(shard_numel_, ops::Copy<G>{reduced_.data(), local_.grad.data()});
      else
        B::for_each(shard_numel_, ops::Axpy<G>{G(1), reduced_.data(), local_.grad.data()});
      reduced_.release();
      reducing_grad_.release();
    }
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
    if (!shards()) {
      for (auto& s : params_) f(*s.p, std::int64_t{0}, s.p->numel(), *s.p, std::int64_t{0});
      return;
    }
    const std::int64_t begin = shard_numel_ * shard_comm_->rank(), end = begin + shard_numel_;
    for (auto& s : params_) {
      const std::int64_t lo = std::max(begin, s.offset), hi = std::min(end, s.offset + s.shape.numel());
      if (lo < hi) f(*s.p, lo - s.offset, hi - lo, local_, lo - begin);
    }
  }

  /// Whether this rank is the first of those holding the same shard or parameters (HSDP's
  /// dp_replicate, DDP's dp): the one that counts them once (gradient norm, saving).
  bool first_replica() const { return !replicate_comm_ || replicate_comm_->rank() == 0; }

  /// The parameters this rank updates: the flat shard (FSDP/HSDP), else the parameters.
  template <class F>
  void for_each_local_parameter(F&& f) {
    check_sharded();
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
    if (!first_replica()) return;
    if (shards()) {
      const std::int64_t begin = shard_numel_ * shard_comm_->rank(), end = begin + shard_numel_;
      for (const auto& slot : params_) {
        if (!slot.p->split.owner) continue;
        const std::int64_t lo = std::max(begin, slot.offset), hi = std::min(end, slot.offset + slot.shape.numel());
        if (lo < hi) norms.add(local_.grad.data() + (lo - begin), hi - lo);
      }
    } else {
      for (const auto& slot : params_)
        if (slot.p->split.owner) norms.add(slot.p->grad);
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
  };

  void check_sharded() const {
    TESSERA_CHECK(sharded_, name_, ": used before shard(): call the model's shard() after initialising or loading it");
  }

  std::string name_;
  ShardingMode mode_;
  bool reshard_after_forward_;
  bool gather_bf16_ = false;
  comm::Communicator* shard_comm_ = nullptr;
  comm::Communicator* replicate_comm_ = nullptr;
  std::vector<Slot> params_;
  std::int64_t numel_ = 0, shard_numel_ = 0;
  bool sharded_ = false, gathered_ = false, grads_open_ = false;
  nn::Parameter<T> local_;  // the flat shard (FSDP/HSDP)
  Tensor<T> full_;          // the gathered flat parameters
  Tensor<std::uint16_t> packed_shard_, packed_full_;
  Tensor<G> full_grad_, reducing_grad_, reduced_;
  Tensor<G> bucket_;  // DDP: the flat gradient every parameter's grad views
  comm::Handle gather_, reduce_;
};

}  // namespace tessera::parallel
