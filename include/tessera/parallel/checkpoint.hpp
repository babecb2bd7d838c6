// Activation checkpointing of one block, through the Context's recording modes.
//
//   none           block.forward with the caller's context: every save kept.
//   full           forward keeps only the block's input (saves discarded); before the
//                  backward the block runs forward again from that input, saving all.
//   selective_op   forward keeps the input and, in a stash, copies of the outputs of
//                  the ops torchtitan's op policy keeps (attention, and every other
//                  matmul); the recompute replays those and recomputes the rest.
//   selective_layer  full on every K-th block (the K-th, 2K-th, ... counting from 1,
//                  as torchtitan counts), none on the others.
//
// The recompute runs the same arithmetic on the same inputs (stashed outputs are
// exact copies of what the first forward made), so every mode gives bitwise the
// gradients of none. The stash and the recompute's saves live under the block's own store, so the
// model's ActivationMeter sees every byte they hold.
#pragma once

#include "tessera/backend/backend.hpp"
#include "tessera/core/region.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera::parallel {

/// The mode one block runs under: selective_layer resolved to full or none.
inline CheckpointMode checkpoint_for_layer(CheckpointMode mode, std::int64_t layer_id) {
  using K = CheckpointMode::Kind;
  if (mode.kind != K::selective_layer) return mode;
  return (layer_id + 1) % mode.every == 0 ? CheckpointMode{K::full, 0} : CheckpointMode{K::none, 0};
}

/// A copy of x on backend B.
template <class U, Backend B>
Tensor<U> copy_on(const Tensor<U>& x) {
  Tensor<U> y = B::template empty<U>(x.shape());
  B::for_each(x.numel(), ops::Copy<U>{x.data(), y.data()});
  return y;
}

/// What torchtitan's op policy keeps: attention outputs and every other matmul
/// output, copied on backend B.
template <class T, Backend B>
nn::StashRule<T> selective_op_rule() {
  nn::StashRule<T> rule;
  rule.kinds = nn::SaveKinds{nn::SaveKind::matmul, nn::SaveKind::attention};
  rule.alternate_matmuls = true;
  rule.copy = &copy_on<T, B>;
  rule.copy_statistic = &copy_on<accum_t<T>, B>;
  return rule;
}

template <class Block, class T>
Tensor<T> checkpointed_forward(Block& block, CheckpointMode mode, const nn::Context<T>& ctx, const Tensor<T>& x) {
  using K = CheckpointMode::Kind;
  nn::ActivationStore<T>* store = ctx.store();
  if (mode.kind == K::none || store == nullptr) return block.forward(ctx, x);
  store->save("checkpoint.input", nn::SaveKind::input, x);
  if (mode.kind == K::full) return block.forward(nn::Context<T>(ctx.geometry(), nn::Recording::discard, nullptr), x);
  nn::StashRule<T> rule = selective_op_rule<T, typename Block::backend_type>();
  return block.forward(
      nn::Context<T>(ctx.geometry(), nn::Recording::stash, nullptr, &store->child("checkpoint.stash"), &rule), x);
}

template <class Block, class T>
Tensor<T> checkpointed_backward(Block& block, CheckpointMode mode, const nn::Context<T>& ctx, const Tensor<T>& dy) {
  using K = CheckpointMode::Kind;
  if (mode.kind == K::none) return block.backward(ctx, dy);
  nn::ActivationStore<T>* store = ctx.store();
  TESSERA_CHECK(store != nullptr, "checkpointed backward without a store: the forward kept nothing");
  const Tensor<T> x = store->load("checkpoint.input");
  nn::ActivationStore<T>& saves = store->child("checkpoint.recompute");
  nn::Context<T> recompute = (mode.kind == K::full ? nn::Context<T>(ctx.geometry(), nn::Recording::keep, &saves)
                                                    : nn::Context<T>(ctx.geometry(), nn::Recording::replay, &saves,
                                                                     &store->child("checkpoint.stash")))
                                 .deferring_weight_grads(ctx.weight_grad_queue());
  {
    Region r(region::kRecompute);
    block.forward(recompute, x).release();
  }
  Tensor<T> dx = block.backward(recompute, dy);
  store->clear();
  return dx;
}

}  // namespace tessera::parallel
