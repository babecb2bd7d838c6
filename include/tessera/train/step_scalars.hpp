// A training step's scalars, kept in the backend's memory until the step ends: the sum
// of token losses the loss head adds each micro-batch's to, the squared gradient norm,
// and the gradient scale AdamW reads (the clip coefficient, ops::ClipScale).
//
// A step then launches everything, forward to optimizer, without the host reading a
// value back: the host keeps enqueuing ahead of the device, and nothing in the step
// stands in the way of capturing it whole. read() is the step's one synchronisation,
// after the optimizer's launch. A loss or norm that is not finite makes the scale NaN,
// AdamW changes nothing (ops::AdamWMultiStep), and the caller, reading both, stops.
#pragma once

#include <cmath>
#include <span>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/ops/norm.hpp"

namespace tessera::train {

template <Backend B, class A>
class StepScalars {
 public:
  StepScalars() : values_(B::template empty<double>(Shape{2})), scale_(B::template empty<A>(Shape{1})) {}

  /// The sum of token losses, in B's memory: the loss head adds to it.
  double* loss_sum() { return values_.data(); }
  /// The squared gradient norm over every rank, in B's memory.
  double* squared_norm() { return values_.data() + 1; }
  /// The gradient scale AdamW reads, in B's memory (clip() writes it).
  const A* grad_scale() const { return scale_.data(); }

  /// Zeroes the loss sum (a launch): before the step's first micro-batch.
  void begin() { B::for_each(1, ops::LaneSum{nullptr, 0, loss_sum(), false}); }

  /// The loss sum over the ranks of `dp` (a collective on the device; none for one rank).
  void sum_loss_over(comm::Communicator& dp) {
    if (dp.size() > 1) dp.all_reduce(std::span<double>(loss_sum(), 1));
  }

  /// Writes the gradient scale from the squared norm and the loss sum (ops::ClipScale):
  /// the clip coefficient for `max_norm` (<= 0: no clipping), NaN where either is not finite.
  void clip(double max_norm) {
    B::for_each(1, ops::ClipScale<A>{squared_norm(), loss_sum(), max_norm, scale_.data()});
  }

  struct Values {
    double loss_sum;
    double grad_norm;
    bool finite() const { return std::isfinite(loss_sum) && std::isfinite(grad_norm); }
  };
  /// The loss sum and the gradient norm: one copy to the host, which waits for the step.
  Values read() const {
    const Tensor<double> v = download<B>(values_);
    return {v[0], std::sqrt(v[1])};
  }

 private:
  Tensor<double> values_;  // the loss sum, the squared norm
  Tensor<A> scale_;
};

}  // namespace tessera::train
