// Global gradient norm and clipping (torch.nn.utils.clip_grad_norm_'s arithmetic):
// norm = sqrt(sum of squares of every gradient); coefficient min(1, max_norm / (norm + 1e-6)).
// The sum runs in double over fixed chunks in a fixed order: the same result for any
// thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/elementwise.hpp"

namespace tessera::optim {

/// Sum of squares of one tensor's elements.
template <Backend B, class T>
double squared_norm(const Tensor<T>& t) {
  constexpr std::int64_t chunk = 1 << 14;
  const std::int64_t n = t.numel(), chunks = (n + chunk - 1) / chunk;
  if (chunks == 0) return 0;
  Tensor<double> partial = B::template empty<double>(Shape{chunks});
  B::for_each(chunks, ops::SquaredNormPartial<T>{t.data(), n, chunk, partial.data()});
  const Tensor<double> host = download<B>(partial);
  double s = 0;
  for (std::int64_t c = 0; c < chunks; ++c) s += host[c];
  return s;
}

/// The clipping coefficient for a gradient norm; max_norm <= 0 disables clipping.
inline double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

/// The global L2 norm of every parameter's gradient.
template <Backend B, class Model>
double grad_norm(Model& model) {
  using T = typename Model::scalar_type;
  double s = 0;
  model.for_each_parameter([&](nn::Parameter<T>& p) { s += squared_norm<B>(p.grad); });
  return std::sqrt(s);
}

}  // namespace tessera::optim
