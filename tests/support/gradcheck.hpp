// Central finite differences in float64 for checking layers' backward passes, and the
// relative difference the GPU tests compare results with.
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

namespace tessera::testing {

/// Fills t with normal(0, std) values drawn from (seed, name).
inline void fill_normal(const Tensor<double>& t, std::uint64_t seed, const std::string& name, double std = 1.0) {
  auto rng = parameter_rng(seed, name);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = normal(rng, static_cast<std::uint64_t>(i), 0.0, std);
}

/// max |a - b| / max |b|; a NaN in `a` counts as an infinite difference.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::isnan(a[i]) ? std::numeric_limits<double>::infinity()
                                           : std::abs(static_cast<double>(a[i]) - b[i]));
    ref = std::max(ref, std::abs(static_cast<double>(b[i])));
  }
  return diff / ref;
}

/// Compares an analytic gradient with central differences of f over every element
/// of `x`: ||analytic - numeric|| / ||numeric|| must stay under `tol`.
inline void check_gradient(const std::string& what, const Tensor<double>& x, const std::vector<double>& analytic,
                           const std::function<double()>& f, double tol = 1e-6, double h = 1e-5) {
  REQUIRE(static_cast<std::int64_t>(analytic.size()) == x.numel());
  double diff2 = 0, ref2 = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double fp = f();
    x[i] = saved - h;
    const double fm = f();
    x[i] = saved;
    const double numeric = (fp - fm) / (2 * h);
    diff2 += (numeric - analytic[static_cast<std::size_t>(i)]) * (numeric - analytic[static_cast<std::size_t>(i)]);
    ref2 += numeric * numeric;
  }
  const double rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-300);
  INFO(what << ": relative error " << rel << " (|grad| = " << std::sqrt(ref2) << ")");
  CHECK(ref2 > 0);
  CHECK(rel < tol);
}

inline std::vector<double> to_vector(const Tensor<double>& t) { return {t.data(), t.data() + t.numel()}; }

}  // namespace tessera::testing
