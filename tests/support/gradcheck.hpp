// The tests' side of the gradient checker (tessera/testing/gradcheck.hpp) as doctest
// checks, and the relative difference the GPU tests compare results with.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tessera/core/rng.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/testing/gradcheck.hpp"

namespace tessera::testing {

/// A model of a few small heads, for checking layers and blocks in double.
inline nn::ModelArgs tiny_args() {
  nn::ModelArgs a;
  a.flavor = "tiny";
  a.dim = 16;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 11;
  a.multiple_of = 8;
  a.rope_theta = 10000;
  a.max_seq_len = 16;
  return a;
}

/// max |a - b| / max |b|; a NaN in `a` counts as an infinite difference.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // infinities too: the -inf lse of an attention row that sees no key
    diff = std::max(diff, std::isnan(a[i]) ? std::numeric_limits<double>::infinity()
                                           : std::abs(static_cast<double>(a[i]) - b[i]));
    if (std::isfinite(b[i])) ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  return diff == 0 ? 0 : diff / ref;
}

/// Compares an analytic gradient with central differences of f over every element
/// of `x` (the library's testing::compare_gradient): ||analytic - numeric|| / ||numeric||
/// must stay under `tol`.
inline void check_gradient(const std::string& what, const Tensor<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& f, double tol = 1e-6, double h = 1e-5) {
  REQUIRE(static_cast<std::int64_t>(analytic.size()) == x.numel());
  const GradientCheck c = compare_gradient(what, x, analytic, f, tol, h);
  INFO(what << ": relative error " << c.relative_error << " (|grad| = " << c.norm << ")");
  CHECK(c.norm > 0);
  CHECK(c.relative_error < tol);
}

inline std::vector<double> to_vector(const Tensor<double>& t) { return {t.data(), t.data() + t.numel()}; }

}  // namespace tessera::testing
