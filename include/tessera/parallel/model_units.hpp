// FSDP's order over a model's parts: the data-parallel units of a model that walks an
// embedding, its blocks and a head (final norm + output), and what each does at each
// point of the walk (layer/runtime.hpp names the points).
//
// The embedding and the head are units of the blocks' sharding mode; each block wrapped
// in tessera::Parallel brings its own (Parallel::unit()). In a step each unit is gathered
// before it runs and the next unit's gather is prefetched while the current one
// computes, forward and backward; each unit's gradient reduction is issued when its
// backward ends and completed while the next unit's backward runs (freeing its whole
// gradient). In a pipeline every unit stays gathered through the pass and is reduced
// once after it (reduce_after_pass).
//
// The early step (Plan::early_step, optimizer.early_step_in_backward): in a step's last
// micro-batch each unit's gradient is final once its reduction completes, and the unit
// is handed to the update given to update_in_backward() right then (the head's after the
// last block's backward, each block's after the backward of the block before it, the
// first block's and the embedding's at the walk's end); its gradient's norm is taken
// first and the gradient freed after, so a step holds the gradient shards of the units
// whose reductions are in flight, not the model's. Under CPU offload each unit's update
// waits one hand-off more, for its gradient's copy to the host, and then runs on the
// host's cores beside the backward the device was given meanwhile.
//
// A model hands its parts through: embedding(), final_norm(), for_each_output_parameter() (or
// nullptr when the output is the embedding), layer(i) and n_layers(), args().
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/region.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/runtime.hpp"
#include "tessera/ops/norm.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/sharding.hpp"

namespace tessera::parallel {

template <class T, Backend B>
class ModelUnits {
 public:
  using Unit = ShardedUnit<T, B>;

  /// Makes the embedding's and the head's units (those this rank holds) once the
  /// model's parts exist; none without sharding on a mesh of one data-parallel rank.
  /// `pipelined`: units stay gathered through a pass.
  template <class Model>
  void attach(Model& m, ShardingMode mode, const Plan& plan, bool pipelined, bool has_embedding, bool has_head) {
    active_ = mode != ShardingMode::none || plan.dp_degree() > 1 || plan.cp_degree() > 1;
    prefetch_ = plan.prefetch;
    if (!active_) return;
    const bool tied = m.args().tie_embeddings;
    // Tied weights: the head needs the embedding's parameters, so that unit stays
    // gathered from its forward to its backward.
    const bool reshard_embedding = !pipelined && plan.reshard != Reshard::never && !tied;
    if (has_embedding) {
      embedding_ = std::make_unique<Unit>("tok_embeddings", mode, plan, reshard_embedding);
      m.embedding().for_each_parameter([&](nn::Parameter<T>& p) { embedding_->add(p); });
    }
    if (has_head) {
      head_ = std::make_unique<Unit>("norm+output", mode, plan, !pipelined && plan.reshard == Reshard::always);
      m.final_norm().for_each_parameter([&](nn::Parameter<T>& p) { head_->add(p); });
      m.for_each_output_parameter([&](nn::Parameter<T>& p) { head_->add(p); });
    }
  }

  /// Whether the model's parameters belong to units (then every one does).
  bool active() const { return active_; }
  Unit* embedding() { return embedding_.get(); }
  Unit* head() { return head_.get(); }

  /// Calls f(Unit&) for every unit this rank holds, in the model's order.
  template <class Model, class F>
  void for_each(Model& m, F&& f) {
    if (!active_) return;
    if (embedding_) f(*embedding_);
    for (std::size_t i = 0; i < m.n_layers(); ++i)
      if (Unit* u = of(m.layer(i))) f(*u);
    if (head_) f(*head_);
  }

  // ---- the early step --------------------------------------------------------------

  /// `update(params, group)`: updates the local parameters `params` of one unit (`group`
  /// names it, the same every step), whose gradients are final. Called in each step's
  /// last micro-batch as the units' reductions complete (see the header comment); an
  /// empty function turns it off.
  using Update = nn::UnitUpdate<T>;
  void update_in_backward(Update update) { update_ = std::move(update); }
  bool updates_in_backward() const { return static_cast<bool>(update_); }

  /// The squared norm of the gradients the last step's units had when they were updated,
  /// summed over the world's ranks by the caller: each unit's (this rank's owned elements,
  /// as add_owned_gradient counts them) added in the model's order, to *out in B's memory.
  template <class Model>
  void updated_squared_norm(Model& m, double* out) {
    early_slots(m);
    B::for_each(1, ops::LaneSum{early_norm_.data(), early_norm_.numel(), out, false});
  }

  // ---- a step's walk (one stage: no pipeline) -------------------------------------

  template <class Model>
  void begin_step(Model& m, bool last_micro_batch) {
    last_micro_batch_ = last_micro_batch;
    for (std::size_t i = 0; i < m.n_layers(); ++i)
      if constexpr (requires { m.layer(i).set_last_micro_batch(true); })
        m.layer(i).set_last_micro_batch(last_micro_batch);
    agree_float8_scales(m);
    if (embedding_) embedding_->unshard();
    prefetch(m.n_layers() == 0 ? head_.get() : of(m.layer(0)));
  }

  /// FSDP's float8 all-gather: every unit's float8 weights agree their scales in one
  /// all-reduce of amaxes (and one more over the tensor-parallel group, whose ranks hold
  /// pieces of each weight) before the walk's first gather (sharding.hpp), which the
  /// walk's gathers use until it ends (embedding_backward_done).
  template <class Model>
  void agree_float8_scales(Model& m) {
    std::int64_t total = 0;
    comm::Communicator *group = nullptr, *pieces = nullptr;
    for_each(m, [&](Unit& u) {
      total += u.float8_weights();
      if (u.float8_weights() == 0) return;
      group = u.shard_comm();
      pieces = u.float8_piece_comm();
    });
    if (total == 0) return;
    Tensor<float> amax;
    {
      MemoryUseScope use(MemoryUse::parameters);
      amax = B::template empty<float>(Shape{total});
    }
    std::int64_t at = 0;
    for_each(m, [&](Unit& u) {
      if (u.float8_weights() == 0) return;
      u.float8_local_amaxes(amax.data() + at);
      at += u.float8_weights();
    });
    group->all_reduce(std::span<float>(amax.data(), static_cast<std::size_t>(total)), comm::ReduceOp::max);
    if (pieces != nullptr)  // tensor-parallel pieces: the whole weight's amax
      pieces->all_reduce(std::span<float>(amax.data(), static_cast<std::size_t>(total)), comm::ReduceOp::max);
    at = 0;
    for_each(m, [&](Unit& u) {
      if (u.float8_weights() == 0) return;
      u.take_float8_amaxes(amax.data() + at);
      at += u.float8_weights();
    });
  }
  void embedding_forward_done() {
    if (embedding_ && embedding_->reshard_after_forward()) embedding_->reshard();
  }
  template <class Model>
  void before_block_forward(Model& m, std::size_t i) {
    prefetch(i + 1 < m.n_layers() ? of(m.layer(i + 1)) : head_.get());
  }
  void before_head(bool tied) {
    if (!head_) return;
    head_->unshard();
    head_->begin_grads();
    if (tied) embedding_->begin_grads();
  }
  void head_backward_done(bool last_micro_batch) {
    if (head_) {
      head_->reduce_grads(last_micro_batch);
      head_->reshard();
    }
    // One reduction in flight: each unit's completes (and frees its whole gradient)
    // while the next unit's backward runs.
    reducing_ = head_.get();
  }
  template <class Model>
  void before_block_backward(Model& m, std::size_t i) {
    prefetch(i > 0 ? of(m.layer(i - 1)) : embedding_.get());
  }
  template <class Model>
  void block_backward_done(Model& m, std::size_t i) {
    if (reducing_) {
      reducing_->finish_grads();
      gradient_final(m, reducing_);
    }
    reducing_ = of(m.layer(i));
  }
  void before_embedding_backward() {
    if (!embedding_) return;
    embedding_->unshard();
    embedding_->begin_grads();
  }
  template <class Model>
  void embedding_backward_done(Model& m, bool last_micro_batch) {
    Unit* const last_reducing = std::exchange(reducing_, nullptr);
    if (!embedding_) return;
    embedding_->reduce_grads(last_micro_batch);
    embedding_->reshard();
    for_each(m, [](Unit& u) {
      u.finish_grads();
      u.forget_float8_scales();  // the walk is over: the optimizer may change the values
    });
    if (last_reducing) gradient_final(m, last_reducing);
    gradient_final(m, embedding_.get());
    if (Unit* u = std::exchange(deferred_, nullptr)) update_unit(m, u);
    // The host's loops after the walk (the norm, the optimizer) read the offloaded
    // gradients: each one's copy must have landed.
    if (!update_) for_each(m, [](Unit& u) { u.wait_landed(); });
  }

  // ---- inference: gathered while used, freed after --------------------------------

  void gather_embedding() {
    if (embedding_) embedding_->unshard();
  }
  void embedding_done(bool tied) {
    if (embedding_ && !tied) embedding_->reshard();
  }
  void gather_head() {
    if (head_) head_->unshard();
  }
  void head_done(bool tied) {
    if (!head_) return;
    head_->reshard();
    if (tied) embedding_->reshard();
  }

  /// After a pipelined pass: every unit ran its last backward; reduce its gradients
  /// and free it.
  template <class Model>
  void reduce_after_pass(Model& m, bool last_micro_batch) {
    for_each(m, [&](Unit& u) {
      u.reduce_grads(last_micro_batch);
      u.reshard();
    });
    for_each(m, [](Unit& u) {
      u.finish_grads();
      u.wait_landed();
    });
  }

 private:
  template <class Layer>
  static Unit* of(Layer& l) {
    if constexpr (requires { l.unit(); })
      return l.unit();
    else
      return nullptr;
  }
  void prefetch(Unit* u) {
    if (u && prefetch_) u->prefetch();
  }

  /// The early step's slots: each unit's index in the model's order, its norm's table,
  /// and the norms' place in B's memory; made on first use.
  template <class Model>
  void early_slots(Model& m) {
    if (!early_units_.empty()) return;
    for_each(m, [&](Unit& u) { early_units_.push_back(&u); });
    early_norms_.resize(early_units_.size());
    MemoryUseScope use(MemoryUse::optimizer);
    early_norm_ = B::template zeros<double>(Shape{static_cast<std::int64_t>(early_units_.size())});
  }

  /// Unit u's gradient is final (its reduction complete): in the last micro-batch under
  /// the early step, its norm is taken, its parameters updated and its gradient freed.
  /// An offloaded unit's gradient is still on its way to the host: it is updated at the
  /// next unit's hand-off (or the walk's end), after the backward issued meanwhile, so
  /// that its update on the host's cores runs beside that backward on the device.
  template <class Model>
  void gradient_final(Model& m, Unit* u) {
    if (!update_ || !last_micro_batch_) return;
    if (u->offloaded()) {
      if (Unit* before = std::exchange(deferred_, u)) update_unit(m, before);
      return;
    }
    update_unit(m, u);
  }

  template <class Model>
  void update_unit(Model& m, Unit* u) {
    early_slots(m);
    u->wait_landed();
    const auto k = static_cast<std::size_t>(std::find(early_units_.begin(), early_units_.end(), u) - early_units_.begin());
    TESSERA_CHECK(k < early_units_.size(), u->name(), ": a unit the model did not list");
    const Region optimizer(region::kOptimizer);  // the dry run files its kernels as the optimizer's
    u->add_owned_gradient(early_norms_[k]);
    early_norms_[k].sum_into(early_norm_.data() + k);
    std::vector<nn::Parameter<T>*> params;  // a frozen unit (LoRA's embedding) has none to update
    u->for_each_local_parameter([&](nn::Parameter<T>& p) {
      if (!p.frozen) params.push_back(&p);
    });
    if (!params.empty()) update_(params, u);
    u->release_grad();
  }

  std::unique_ptr<Unit> embedding_, head_;
  Unit* reducing_ = nullptr;  // the unit whose gradient reduction is in flight
  bool active_ = false;
  bool prefetch_ = true;
  bool last_micro_batch_ = true;  // the walk under way is the step's last micro-batch's
  // The early step: the update, the units in the model's order, each one's norm table and
  // their norms in B's memory (early_slots).
  Update update_;
  Unit* deferred_ = nullptr;  // an offloaded unit whose update waits for the next hand-off
  std::vector<Unit*> early_units_;
  std::vector<optim::SquaredNorms<B, typename Unit::grad_type>> early_norms_;
  Tensor<double> early_norm_;
};

}  // namespace tessera::parallel
