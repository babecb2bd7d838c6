// AdamW over a model's parameters, with fp32 moments and optional bf16 parameters.
//
// Under data-parallel sharding the optimizer sees the model's local parameters (the
// flat FSDP/HSDP shards), so moments and master copies are sharded with them.
//
// Moments live in the parameters' scalar type (fp32 or fp64). With bf16 parameters
// (mixed_precision_param = "bfloat16"), the optimizer keeps an fp32 master copy of
// each parameter, updates the master, and writes back its bf16 rounding: forward and
// backward then see bf16 values while updates accumulate in fp32, as FSDP2's mixed
// precision does. The arithmetic is ops::AdamWStep.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/adamw.hpp"
#include "tessera/ops/elementwise.hpp"

namespace tessera::optim {

namespace detail {
struct RoundToBf16 {
  const float* src;
  float* dst;
  TESSERA_HD void operator()(std::int64_t i) const { dst[i] = round_to_bf16(src[i]); }
};
}  // namespace detail

struct AdamWOptions {
  double lr = 8e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  DType param_dtype = DType::f32;  // bf16: parameters rounded to bf16 after every step
};

template <class T, Backend B>
class AdamW {
 public:
  template <class Model>
  AdamW(Model& model, AdamWOptions options) : options_(options) {
    TESSERA_CHECK(options.lr >= 0, "optimizer.lr must not be negative, got ", options.lr);
    TESSERA_CHECK(options.eps > 0, "optimizer.eps must be positive, got ", options.eps);
    TESSERA_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
                  "optimizer: beta1 and beta2 must lie in [0, 1)");
    TESSERA_CHECK((options.param_dtype != DType::bf16 || std::is_same_v<T, float>),
                  "optimizer: bfloat16 parameters need a float32 model");
    auto add = [&](nn::Parameter<T>& p) {
      State s{&p, B::template zeros<T>(p.shape()), B::template zeros<T>(p.shape()), {}};
      if (rounds_to_bf16()) {
        s.master = B::template empty<T>(p.shape());
        B::for_each(p.numel(), ops::Copy<T>{p.value.data(), s.master.data()});
        round_into(s.master, p.value);
      }
      states_.push_back(std::move(s));
    };
    // A sharded model hands out the parameters this rank updates (its flat shards).
    if constexpr (requires { model.for_each_local_parameter(add); })
      model.for_each_local_parameter(add);
    else
      model.for_each_parameter(add);
  }

  /// One update at learning rate `lr`, gradients multiplied by `grad_scale`.
  void step(double lr, double grad_scale = 1.0) {
    ++step_;
    const double bc1 = 1 - std::pow(options_.beta1, static_cast<double>(step_));
    const double bc2 = 1 - std::pow(options_.beta2, static_cast<double>(step_));
    for (auto& s : states_) {
      Tensor<T>& target = rounds_to_bf16() ? s.master : s.param->value;
      B::for_each(target.numel(),
                  ops::AdamWStep<T>{target.data(), s.param->grad.data(), s.exp_avg.data(), s.exp_avg_sq.data(),
                                    static_cast<T>(lr), static_cast<T>(options_.beta1), static_cast<T>(options_.beta2),
                                    static_cast<T>(options_.eps), static_cast<T>(options_.weight_decay),
                                    static_cast<T>(bc1), static_cast<T>(bc2), static_cast<T>(grad_scale)});
      if (rounds_to_bf16()) round_into(s.master, s.param->value);
    }
  }

  std::int64_t steps_taken() const { return step_; }
  const AdamWOptions& options() const { return options_; }

  /// Bytes of optimizer state (moments and master copies).
  std::size_t state_bytes() const {
    std::size_t n = 0;
    for (const auto& s : states_) n += s.exp_avg.bytes() + s.exp_avg_sq.bytes() + s.master.bytes();
    return n;
  }

 private:
  struct State {
    nn::Parameter<T>* param;
    Tensor<T> exp_avg, exp_avg_sq;
    Tensor<T> master;  // fp32 master weights when parameters are bf16
  };

  bool rounds_to_bf16() const { return options_.param_dtype == DType::bf16; }

  static void round_into(const Tensor<T>& from, const Tensor<T>& to) {
    if constexpr (std::is_same_v<T, float>) B::for_each(from.numel(), detail::RoundToBf16{from.data(), to.data()});
  }

  AdamWOptions options_;
  std::vector<State> states_;
  std::int64_t step_ = 0;
};

}  // namespace tessera::optim
