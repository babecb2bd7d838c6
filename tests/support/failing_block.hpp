// A user's own block type that fails on purpose in the middle of a training step:
// the Llama block, except that on world rank kRank the backward of layer kLayer
// throws at step kStep — after the forward's gathers, while the other ranks are in
// that step's collectives. The library knows nothing of it: it is a layer like any
// other (nn::Layer, constructible from BlockArgs), wrapped in Sharding like any other.
// Used with MPI ranks (tests/mpi/fail_mid_step.cpp) and thread ranks
// (tests/parallel/test_failure.cpp).
#pragma once

#include <cstdint>

#include "tessera/core/error.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/nn/block.hpp"
#include "tessera/parallel/plan.hpp"

namespace tessera::test {

template <class T, Backend B>
class FailingBlock {
 public:
  using scalar_type = T;
  using backend_type = B;
  static constexpr int kRank = 1;
  static constexpr std::int64_t kLayer = 3;
  static constexpr std::int64_t kStep = 2;

  explicit FailingBlock(const nn::BlockArgs<T, B>& b)
      : block_(b), layer_id_(b.layer_id), rank_(b.plan && b.plan->mesh ? b.plan->mesh->rank() : 0) {}

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) { return block_.forward(ctx, x); }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy) {
    ++backward_calls_;  // one per step: no gradient accumulation in the runs that use it
    if (rank_ == kRank && layer_id_ == kLayer && backward_calls_ == kStep)
      fail("injected failure in the backward of layers.", kLayer, " at step ", kStep);
    return block_.backward(ctx, dy);
  }

  template <class F>
  void for_each_parameter(F&& f) {
    block_.for_each_parameter(f);
  }

 private:
  nn::LlamaBlock<T, B> block_;
  std::int64_t layer_id_;
  int rank_;
  std::int64_t backward_calls_ = 0;
};

}  // namespace tessera::test
