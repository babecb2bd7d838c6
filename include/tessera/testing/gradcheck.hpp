// Checking a hand-written backward: central finite differences in float64 against the
// gradients a layer's backward gives, for its input and for every parameter.
//
// There is no autograd: a layer's backward is its author's to get right. Made in double
// on the CPU, any layer (a block of one's own, or a part of it) is checked on
//   f(x) = sum(c * layer(x))        x, c fixed normal values drawn from a seed
// whose gradient its backward gives from dy = c: df/dx and df/dp for each parameter p.
// Each is compared with (f(v + h) - f(v - h)) / 2h over every element v of x and of p;
// a gradient passes when ||analytic - numeric|| / ||numeric|| stays under the tolerance
// (a gradient whose numeric norm is zero fails: nothing would have been checked).
//
//   MyBlock<double, tessera::Cpu> block(nn::BlockArgs<double, tessera::Cpu>{args, 0, "layers.0", rope});
//   block.for_each_parameter([](auto& p) { tessera::testing::fill_normal(p.value, 1, p.name, 0.5); });
//   const tessera::testing::GradientReport r = tessera::testing::check_gradients(block, {2, 8}, args.dim);
//   std::fputs(r.str().c_str(), stdout);   // one line per gradient
//   if (!r.passed()) return 1;
//
// A layer made alone holds zeros (a model's init_weights draws its values), so give its
// parameters values first: fill_normal at a larger scale than the init (0.3 to 0.5)
// makes every path carry gradient well above the noise of the differences. A zero
// gradient everywhere fails, saying so.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/backend/cpu/cpu.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/layer/layer.hpp"

namespace tessera::testing {

/// One gradient against its finite differences.
struct GradientCheck {
  std::string name;              ///< "input", or the parameter's name
  std::int64_t elements = 0;
  double relative_error = 0;     ///< ||analytic - numeric|| / ||numeric||
  double norm = 0;               ///< ||numeric||
  std::int64_t worst_index = 0;  ///< the element whose analytic value is farthest off
  double worst_analytic = 0, worst_numeric = 0;
  bool passed = false;
};

/// Every gradient of a layer, checked.
struct GradientReport {
  std::vector<GradientCheck> checks;
  double tolerance = 0;

  bool passed() const {
    return !checks.empty() && std::all_of(checks.begin(), checks.end(), [](const auto& c) { return c.passed; });
  }

  /// One line per gradient: "ok" or "FAIL", its relative error and norm, and for a
  /// failing one the worst element's analytic and numeric values.
  std::string str() const {
    std::string out;
    char line[320];
    for (const GradientCheck& c : checks) {
      std::snprintf(line, sizeof line, "%-4s %s: relative error %.3g (tolerance %.3g), |grad| %.3g over %lld elements",
                    c.passed ? "ok" : "FAIL", c.name.c_str(), c.relative_error, tolerance, c.norm,
                    static_cast<long long>(c.elements));
      out += line;
      if (!c.passed && c.norm > 0) {
        std::snprintf(line, sizeof line, "; element %lld: backward %.6g, finite differences %.6g",
                      static_cast<long long>(c.worst_index), c.worst_analytic, c.worst_numeric);
        out += line;
      }
      if (c.norm == 0) out += "; the finite differences are all zero: nothing reaches it";
      out += '\n';
    }
    return out;
  }
};

struct GradientCheckOptions {
  std::uint64_t seed = 1;   ///< x and c are drawn from (seed, "x") and (seed, "c")
  double tolerance = 1e-6;  ///< on each gradient's relative error
  double step = 1e-5;       ///< h of the central differences
};

/// Fills t with normal(0, std) values drawn from (seed, name): values for a layer's
/// parameters before a check (a layer made alone holds zeros), the same on every run.
inline void fill_normal(const Tensor<double>& t, std::uint64_t seed, const std::string& name, double std = 1.0) {
  auto rng = parameter_rng(seed, name);
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = normal(rng, static_cast<std::uint64_t>(i), 0.0, std);
}

/// Compares `analytic` (one value per element of `x`) with central differences of f over
/// every element of `x`; `x` is restored after each.
inline GradientCheck compare_gradient(std::string name, const Tensor<double>& x, std::span<const double> analytic,
                                      const std::function<double()>& f, double tolerance = 1e-6,
                                      double step = 1e-5) {
  TESSERA_CHECK(static_cast<std::int64_t>(analytic.size()) == x.numel(), "gradient check of ", name, ": ",
                analytic.size(), " analytic values for ", x.numel(), " elements");
  GradientCheck c;
  c.name = std::move(name);
  c.elements = x.numel();
  double diff2 = 0, ref2 = 0, worst = -1;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x[i];
    x[i] = saved + step;
    const double fp = f();
    x[i] = saved - step;
    const double fm = f();
    x[i] = saved;
    const double numeric = (fp - fm) / (2 * step);
    const double a = analytic[static_cast<std::size_t>(i)];
    const double d = std::abs(numeric - a);
    diff2 += d * d;
    ref2 += numeric * numeric;
    if (d > worst) {
      worst = d;
      c.worst_index = i;
      c.worst_analytic = a;
      c.worst_numeric = numeric;
    }
  }
  c.norm = std::sqrt(ref2);
  c.relative_error = std::sqrt(diff2) / std::max(c.norm, 1e-300);
  c.passed = ref2 > 0 && c.relative_error < tolerance;
  return c;
}

/// Checks a layer's backward for its input (rows g.rows() x in_dim) and every
/// trainable parameter against finite differences of f(x) = sum(c * layer(x)). The layer's
/// parameter gradients are overwritten; its values are left as they were.
template <class L>
  requires nn::Layer<L> && std::same_as<typename L::scalar_type, double> &&
           std::same_as<typename L::backend_type, Cpu>
GradientReport check_gradients(L& layer, nn::Geometry g, std::int64_t in_dim, GradientCheckOptions o = {}) {
  const Tensor<double> x(Shape{g.rows(), in_dim});
  fill_normal(x, o.seed, "x");
  nn::ActivationStore<double> store;
  const Tensor<double> y = layer.forward(nn::Context<double>(g, &store), x);
  const Tensor<double> c(y.shape());
  fill_normal(c, o.seed, "c");
  layer.for_each_parameter([](nn::Parameter<double>& p) {
    if (p.frozen) return;  // no gradient
    for (std::int64_t i = 0; i < p.numel(); ++i) p.grad[i] = 0;
  });
  const Tensor<double> dx = layer.backward(nn::Context<double>(g, &store), c);
  auto f = [&] {
    const Tensor<double> out = layer.forward(nn::Context<double>(g, nullptr), x);
    double s = 0;
    for (std::int64_t i = 0; i < out.numel(); ++i) s += c[i] * out[i];
    return s;
  };
  auto values = [](const Tensor<double>& t) { return std::vector<double>(t.data(), t.data() + t.numel()); };
  GradientReport report;
  report.tolerance = o.tolerance;
  report.checks.push_back(compare_gradient("input", x, values(dx), f, o.tolerance, o.step));
  layer.for_each_parameter([&](nn::Parameter<double>& p) {
    if (!p.frozen) report.checks.push_back(compare_gradient(p.name, p.value, values(p.grad), f, o.tolerance, o.step));
  });
  return report;
}

}  // namespace tessera::testing
