// AdamW with decoupled weight decay, one element per call (torch.optim.AdamW's
// arithmetic): p <- p (1 - lr wd); m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2;
// p <- p - lr (m / c1) / (sqrt(v / c2) + eps), with c1 = 1 - b1^t, c2 = 1 - b2^t.
// g is the gradient times grad_scale (the clipping coefficient).
#pragma once

#include <cstdint>

#include "tessera/core/macros.hpp"
#include "tessera/ops/math.hpp"

namespace tessera::ops {

template <class T>
struct AdamWStep {
  T* param;
  const T* grad;
  T* exp_avg;
  T* exp_avg_sq;
  T lr;
  T beta1;
  T beta2;
  T eps;
  T weight_decay;
  T bias_correction1;
  T bias_correction2;
  T grad_scale;
  TESSERA_HD void operator()(std::int64_t i) const {
    T g = grad[i] * grad_scale;
    T p = param[i] * (T(1) - lr * weight_decay);
    T m = beta1 * exp_avg[i] + (T(1) - beta1) * g;
    T v = beta2 * exp_avg_sq[i] + (T(1) - beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    T denom = sqrt_(v / bias_correction2) + eps;
    param[i] = p - lr * (m / bias_correction1) / denom;
  }
};

}  // namespace tessera::ops
