// AdamW over a model's parameters, with fp32 moments and optional bf16 parameters.
//
// Under data-parallel sharding the optimizer sees the model's local parameters (the
// flat FSDP/HSDP shards), so moments and master copies are sharded with them.
//
// Moments live in the gradients' type, accum_t<T> (fp32 for fp32 and bf16 models, fp64
// for fp64). With bf16 parameters — a bf16 model (T = bf16), or an fp32 model with
// mixed_precision_param = "bfloat16" — the optimizer keeps an fp32 master copy of
// each parameter, updates the master, and writes back its bf16 rounding: forward and
// backward then see bf16 values while updates accumulate in fp32, as FSDP2's mixed
// precision does. A bf16 model's masters start from its bf16 values. The arithmetic
// is ops::AdamWMultiStep: one launch updates every
// tensor (the master and the bf16 rounding in the same pass), from tables of the
// tensors' addresses kept in the backend's memory and uploaded again only when a
// tensor moves.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/nn/layer.hpp"
#include "tessera/ops/adamw.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/traffic.hpp"

namespace tessera::optim {

namespace detail {
struct RoundToBf16 {
  const float* src;
  float* dst;
  TESSERA_HD void operator()(std::int64_t i) const { dst[i] = round_to_bf16(src[i]); }
  // A rounding on the bits: no arithmetic counted.
  ops::Traffic traffic(std::int64_t n) const {
    const double e = static_cast<double>(n);
    return {e * sizeof(float), e * sizeof(float), 0, 0};
  }
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
  using A = accum_t<T>;  // gradients, moments and masters

 public:
  template <class Model>
  AdamW(Model& model, AdamWOptions options) : options_(options) {
    TESSERA_CHECK(options.lr >= 0, "optimizer.lr must not be negative, got ", options.lr);
    TESSERA_CHECK(options.eps > 0, "optimizer.eps must be positive, got ", options.eps);
    TESSERA_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
                  "optimizer: beta1 and beta2 must lie in [0, 1)");
    TESSERA_CHECK((options.param_dtype != DType::bf16 || std::is_same_v<T, float> || std::is_same_v<T, bf16>),
                  "optimizer: bfloat16 parameters need a float32 or bfloat16 model");
    TESSERA_CHECK((options.param_dtype == DType::bf16 || !std::is_same_v<T, bf16>),
                  "optimizer: a bfloat16 model has bfloat16 parameters: mixed_precision_param = \"",
                  name_of(options.param_dtype), "\" contradicts it (set it to \"bfloat16\")");
    MemoryUseScope use(MemoryUse::optimizer);  // moments and masters
    auto add = [&](nn::Parameter<T>& p) {
      State s{&p, B::template zeros<A>(p.shape()), B::template zeros<A>(p.shape()), {}};
      if (has_masters()) {
        s.master = B::template empty<A>(p.shape());
        B::for_each(p.numel(), ops::Convert<T, A>{p.value.data(), s.master.data()});
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

  /// One update at learning rate `lr`, gradients multiplied by `grad_scale`: every
  /// parameter in one launch (ops::AdamWMultiStep).
  void step(double lr, double grad_scale = 1.0) {
    ++step_;
    const double bc1 = 1 - std::pow(options_.beta1, static_cast<double>(step_));
    const double bc2 = 1 - std::pow(options_.beta2, static_cast<double>(step_));
    refresh_tables();
    if (launch_size_ == 0) return;
    B::for_each(launch_size_,
                ops::AdamWMultiStep<T>{tensors_.data(), block_tensor_.data(),
                                       ops::AdamWScalars<A>{static_cast<A>(lr), static_cast<A>(options_.beta1),
                                                            static_cast<A>(options_.beta2), static_cast<A>(options_.eps),
                                                            static_cast<A>(options_.weight_decay), static_cast<A>(bc1),
                                                            static_cast<A>(bc2), static_cast<A>(grad_scale)},
                                       elements_, static_cast<std::int64_t>(host_table_.size()), has_masters()});
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
    Tensor<A> exp_avg, exp_avg_sq;
    Tensor<A> master;  // fp32 master weights when parameters are bf16
  };

  /// Whether the update goes to fp32 masters: bf16 parameters, stored as such or not.
  bool has_masters() const { return options_.param_dtype == DType::bf16; }

  /// The launch's tables in B's memory, uploaded again only when a tensor moved (a
  /// parameter's value or gradient replaced, as loading a checkpoint may do).
  void refresh_tables() {
    std::vector<ops::AdamWTensor<T>> table;
    table.reserve(states_.size());
    std::int64_t begin = 0;
    for (auto& s : states_) {
      if (s.param->numel() == 0) continue;
      TESSERA_CHECK(s.param->grad.numel() == s.param->numel(), "optimizer: parameter ", s.param->name, " has ",
                    s.param->numel(), " elements but its gradient ", s.param->grad.numel());
      table.push_back({s.param->value.data(), s.param->grad.data(), s.exp_avg.data(), s.exp_avg_sq.data(),
                       has_masters() ? s.master.data() : nullptr, s.param->numel(), begin});
      begin += (s.param->numel() + ops::kAdamWBlock - 1) / ops::kAdamWBlock * ops::kAdamWBlock;
    }
    if (table == host_table_ && launch_size_ == begin) return;
    std::vector<std::int32_t> blocks(static_cast<std::size_t>(begin / ops::kAdamWBlock));
    for (std::size_t t = 0; t < table.size(); ++t) {
      const std::int64_t first = table[t].begin / ops::kAdamWBlock;
      const std::int64_t count = (table[t].numel + ops::kAdamWBlock - 1) / ops::kAdamWBlock;
      for (std::int64_t b = first; b < first + count; ++b) blocks[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(t);
    }
    tensors_ = upload<B>(std::span<const ops::AdamWTensor<T>>(table));
    block_tensor_ = upload<B>(std::span<const std::int32_t>(blocks));
    elements_ = 0;
    for (const auto& t : table) elements_ += t.numel;
    host_table_ = std::move(table);
    launch_size_ = begin;
  }

  /// The parameter gets the master's bf16 rounding (an fp32 model; a bf16 model's
  /// parameter already holds it).
  static void round_into(const Tensor<A>& from, const Tensor<T>& to) {
    if constexpr (std::is_same_v<T, float>) B::for_each(from.numel(), detail::RoundToBf16{from.data(), to.data()});
  }

  AdamWOptions options_;
  std::vector<State> states_;
  std::int64_t step_ = 0;
  std::vector<ops::AdamWTensor<T>> host_table_;  // what tensors_ holds
  Tensor<ops::AdamWTensor<T>> tensors_;
  Tensor<std::int32_t> block_tensor_;
  std::int64_t launch_size_ = 0;
  std::int64_t elements_ = 0;  // the tensors' numel summed: launch_size_ less the padding
};

}  // namespace tessera::optim
