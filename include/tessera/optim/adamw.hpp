// AdamW over a model's parameters, with fp32 or bf16 moments and optional bf16
// parameters.
//
// Under data-parallel sharding the optimizer sees the model's local parameters (the
// flat FSDP/HSDP shards), so moments and master copies are sharded with them.
//
// Moments live in the gradients' type, accum_t<T> (fp32 for fp32 and bf16 models, fp64
// for fp64), or with state_dtype = bf16 in bf16: 2 bytes each instead of 4, updated in
// fp32 arithmetic and stored rounded to nearest even (ops::AdamWMultiStep<T, bf16>;
// docs/optimizer.md says why not stochastically). With bf16 parameters — a bf16 model (T = bf16), or an fp32 model with
// mixed_precision_param = "bfloat16" — the optimizer keeps an fp32 master copy of
// each parameter, updates the master, and writes back its bf16 rounding: forward and
// backward then see bf16 values while updates accumulate in fp32, as FSDP2's mixed
// precision does. A bf16 model's masters start from its bf16 values. The arithmetic
// is ops::AdamWMultiStep: one launch updates every
// tensor (the master and the bf16 rounding in the same pass), from tables of the
// tensors' addresses kept in the backend's memory and uploaded again only when a
// tensor moves.
//
// A parameter in the host memory beside B's (an FSDP shard under CPU offload,
// parallel/sharding.hpp) gets its moments and master there too, and its update is the
// same launch run by B's host backend on the host's cores (backend/host.hpp): AdamW's
// arithmetic, element for element, wherever the parameter lives.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/host.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/layer/layer.hpp"
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
  /// The parameters' values between steps. Unset: the model's own element type, nothing
  /// rounded. bf16 on a float32 model: every step updates float32 masters and writes
  /// their bf16 rounding back (bf16 training emulated in float32 arithmetic).
  std::optional<DType> param_dtype;
  DType state_dtype = DType::f32;  // bf16: moments stored as bf16 (f32: the gradients' type)
};

template <class T, Backend B>
class AdamW {
  using A = accum_t<T>;  // gradients, moments and masters

 public:
  template <class Model>
  AdamW(Model& model, AdamWOptions options) : options_(options) {
    TESSERA_CHECK(options.lr >= 0, "AdamW: lr must not be negative, got ", options.lr);
    TESSERA_CHECK(options.eps > 0, "AdamW: eps must be positive, got ", options.eps);
    TESSERA_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
                  "AdamW: beta1 and beta2 must lie in [0, 1), got ", options.beta1, " and ", options.beta2);
    TESSERA_CHECK((options.param_dtype != DType::f64 || std::is_same_v<T, double>),
                  "AdamW: float64 parameters need a float64 model, this one is ", name_of(dtype_of<T>()));
    TESSERA_CHECK((options.param_dtype != DType::bf16 || std::is_same_v<T, float> || std::is_same_v<T, bf16>),
                  "AdamW: bfloat16 parameters need a float32 or bfloat16 model, this one is ", name_of(dtype_of<T>()));
    TESSERA_CHECK((!options.param_dtype || options.param_dtype == DType::bf16 || !std::is_same_v<T, bf16>),
                  "AdamW: a bfloat16 model has bfloat16 parameters: param_dtype ",
                  name_of(options.param_dtype.value_or(DType::bf16)), " contradicts it (leave it unset)");
    TESSERA_CHECK(options.state_dtype == DType::f32 || options.state_dtype == DType::bf16,
                  "AdamW: state_dtype ", name_of(options.state_dtype), ": the moments are stored as float32 or bfloat16");
    TESSERA_CHECK((options.state_dtype == DType::f32 || std::is_same_v<A, float>),
                  "AdamW: bfloat16 moments need a float32 or bfloat16 model (they are updated in float32)");
    staged_ = B::template empty<ops::AdamWScalars<A>>(Shape{1});  // a step's, counted as such
    MemoryUseScope use(MemoryUse::optimizer);  // moments and masters
    auto add = [&](nn::Parameter<T>& p) {
      if (p.frozen) return;  // nothing to update: no state
      State s{&p, {}, {}};
      const bool host = on_host(p.value);
      with_backend<B>(host, [&]<class X>() {
        if (bf16_states())
          s.moments = Moments<bf16>{X::template zeros<bf16>(p.shape()), X::template zeros<bf16>(p.shape())};
        else
          s.moments = Moments<A>{X::template zeros<A>(p.shape()), X::template zeros<A>(p.shape())};
        if (has_masters()) {
          s.master = X::template empty<A>(p.shape());
          X::for_each(p.numel(), ops::Convert<T, A>{p.value.data(), s.master.data()});
          round_into<X>(s.master, p.value);
        }
      });
      on_host_ = on_host_ || host;
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
    stage(lr, grad_scale);
    apply();
  }

  /// One update at learning rate `lr`, gradients multiplied by the scale at `grad_scale`
  /// in B's memory (the clip scale ops::ClipScale wrote, read by the kernel, not the
  /// host); a NaN there skips the update on the device (train::StepScalars).
  void step(double lr, const A* grad_scale) {
    stage(lr);
    apply(grad_scale);
  }

  /// An update in two halves, for a step a graph replays (train/trainer.hpp): stage()
  /// counts the update and writes its scalars (learning rate `lr`, bias corrections,
  /// gradient scale) to one place in B's memory, a copy from the host; apply() is the
  /// launch, which reads them there and so is the same launch every step. Each stage()
  /// is followed by one apply(), or by the replay of a graph that captured one.
  void stage(double lr, double grad_scale = 1.0) {
    ++step_;
    const double bc1 = 1 - std::pow(options_.beta1, static_cast<double>(step_));
    const double bc2 = 1 - std::pow(options_.beta2, static_cast<double>(step_));
    const ops::AdamWScalars<A> scalars{static_cast<A>(lr),
                                       static_cast<A>(options_.beta1),
                                       static_cast<A>(options_.beta2),
                                       static_cast<A>(options_.eps),
                                       static_cast<A>(options_.weight_decay),
                                       static_cast<A>(bc1),
                                       static_cast<A>(bc2),
                                       static_cast<A>(grad_scale)};
    B::copy_from_host(&scalars, staged_.data(), 1);
    if constexpr (HasHostBackend<B>) {
      if (on_host_) {  // the parameters in host memory read their scalars there
        using H = host_backend_t<B>;
        if (host_staged_.empty()) host_staged_ = H::template empty<ops::AdamWScalars<A>>(Shape{1});
        H::copy_from_host(&scalars, host_staged_.data(), 1);
      }
    }
  }

  /// The staged update of every parameter in one launch; the gradients multiplied by the
  /// scale at `grad_scale` in B's memory when that is set (in place of the staged one).
  void apply(const A* grad_scale = nullptr) {
    if constexpr (std::is_same_v<A, float>)
      if (bf16_states()) return launch_both(launch_bf16_, host_bf16_, grad_scale);
    launch_both(launch_accum_, host_accum_, grad_scale);
  }

  /// The staged update of `params` alone, in a launch of their own: some of the
  /// parameters for_each_local_parameter handed out (a sharding unit's, whose gradients
  /// are final), without a gradient scale. `group` names the set, the same parameters
  /// each time it is given; its tables are kept apart from the whole model's and from
  /// other groups'. The early step (optimizer.early_step_in_backward) updates each unit
  /// this way as its gradient is reduced; a parameter's update is the same arithmetic as
  /// apply()'s, element for element.
  void apply_to(const void* group, std::span<nn::Parameter<T>* const> params) {
    Group& g = group_of(group, params);
    if constexpr (std::is_same_v<A, float>)
      if (bf16_states()) {
        refresh_tables(g.bf16_moments, g.index);
        return run(g.bf16_moments, nullptr);
      }
    refresh_tables(g.accum, g.index);
    run(g.accum, nullptr);
  }

  /// The first step's one-time work without the step: uploads the launch's tables of
  /// tensors (again only if a tensor moved since), so that a step() after it does what
  /// every later one does (Trainer::prepare).
  void prepare() {
    if constexpr (std::is_same_v<A, float>)
      if (bf16_states()) {
        refresh_tables(launch_bf16_);
        if (on_host_) refresh_tables(host_bf16_);
        return;
      }
    refresh_tables(launch_accum_);
    if (on_host_) refresh_tables(host_accum_);
  }

  std::int64_t steps_taken() const { return step_; }
  /// Sets the update count (bias correction goes on from it): a resumed run's.
  void set_steps_taken(std::int64_t steps) {
    TESSERA_CHECK(steps >= 0, "optimizer: a step count of ", steps);
    step_ = steps;
  }
  const AdamWOptions& options() const { return options_; }

  /// The names for_each_state_tensor gives each parameter's state tensors, in order.
  std::vector<std::string_view> state_names() const {
    std::vector<std::string_view> names = {"exp_avg", "exp_avg_sq"};
    if (has_masters()) names.emplace_back("master");
    return names;
  }

  /// Calls f(name, tensor) for each state tensor of local parameter `p` (one that
  /// for_each_local_parameter handed out; each tensor has p's shape): "exp_avg" and
  /// "exp_avg_sq" (Tensor<accum_t<T>>, or Tensor<bf16> with state_dtype = bf16) and,
  /// with bf16 parameters, "master" (Tensor<accum_t<T>>). For checkpoints.
  /// A frozen parameter has none: f is not called.
  template <class F>
  void for_each_state_tensor(const nn::Parameter<T>& p, F&& f) {
    if (p.frozen) return;
    for (auto& s : states_) {
      if (s.param != &p) continue;
      std::visit(
          [&](auto& m) {
            f(std::string_view("exp_avg"), m.exp_avg);
            f(std::string_view("exp_avg_sq"), m.exp_avg_sq);
          },
          s.moments);
      if (has_masters()) f(std::string_view("master"), s.master);
      return;
    }
    fail("optimizer: parameter ", p.name, " is not one this optimizer updates");
  }

  /// Bytes of optimizer state (moments and master copies).
  std::size_t state_bytes() const {
    std::size_t n = 0;
    for (const auto& s : states_) {
      std::visit([&](const auto& m) { n += m.exp_avg.bytes() + m.exp_avg_sq.bytes(); }, s.moments);
      n += s.master.bytes();
    }
    return n;
  }

  /// The parameters' dtype between steps: AdamWOptions::param_dtype, or the model's.
  DType param_dtype() const { return options_.param_dtype.value_or(dtype_of<T>()); }

 private:
  template <class M>
  struct Moments {
    Tensor<M> exp_avg, exp_avg_sq;  // the parameter's shape (its shard's, when sharded)
  };
  struct State {
    nn::Parameter<T>* param;
    std::variant<Moments<A>, Moments<bf16>> moments;  // Moments<bf16> with state_dtype = bf16
    Tensor<A> master;  // fp32 master weights when parameters are bf16
    int group = -1;    // the apply_to group it belongs to (index into groups_), -1 for none
  };

  /// One launch's tables for moments stored as M: the table of tensors in B's memory,
  /// what it holds on the host, and the block -> tensor map.
  template <class M>
  struct Launch {
    explicit Launch(bool on_host = false) : host(on_host) {}
    bool host;  // the parameters in host memory, run by B's host backend
    std::vector<ops::AdamWTensor<T, M>> host_table;  // what tensors holds
    Tensor<ops::AdamWTensor<T, M>> tensors;
    Tensor<std::int32_t> block_tensor;
    std::int64_t size = 0;      // indices of the launch, each tensor padded to whole blocks
    std::int64_t elements = 0;  // the tensors' numel summed: size less the padding
  };

  /// An apply_to group: its parameters' states (State::group) and its launch's tables.
  struct Group {
    Group(const void* k, int i, bool host) : key(k), index(i), accum(host), bf16_moments(host) {}
    const void* key;
    int index;
    Launch<A> accum;
    Launch<bf16> bf16_moments;
  };

  /// The group named `key`, made on its first use from `params` (each a parameter this
  /// optimizer updates and no other group holds, all in B's memory or all in the host's).
  Group& group_of(const void* key, std::span<nn::Parameter<T>* const> params) {
    for (auto& g : groups_)
      if (g->key == key) return *g;
    const int index = static_cast<int>(groups_.size());
    std::optional<bool> host;
    for (nn::Parameter<T>* p : params) {
      auto it = std::find_if(states_.begin(), states_.end(), [&](const State& s) { return s.param == p; });
      TESSERA_CHECK(it != states_.end(), "optimizer: parameter ", p->name, " is not one this optimizer updates");
      TESSERA_CHECK(it->group < 0, "optimizer: parameter ", p->name, " is in two update groups");
      TESSERA_CHECK(!host || *host == on_host(p->value), "optimizer: an update group with parameters in host memory ",
                    "and in the device's (", p->name, ")");
      host = on_host(p->value);
      it->group = index;
    }
    groups_.push_back(std::make_unique<Group>(key, index, host.value_or(false)));
    return *groups_.back();
  }

  /// Whether the update goes to fp32 masters: bf16 parameters, stored as such or not.
  bool has_masters() const { return param_dtype() == DType::bf16; }

  bool bf16_states() const { return options_.state_dtype == DType::bf16; }

  /// The update of the parameters in B's memory, then of those in the host's: for them
  /// the scale at `grad_scale` (B's memory) is first read into host memory.
  template <class M>
  void launch_both(Launch<M>& device, Launch<M>& host, const A* grad_scale) {
    refresh_tables(device);
    run(device, grad_scale);
    if constexpr (HasHostBackend<B>) {
      if (!on_host_) return;
      refresh_tables(host);
      if (host.size == 0) return;
      if (grad_scale != nullptr) {
        if (host_scale_.empty()) host_scale_ = host_backend_t<B>::template empty<A>(Shape{1});
        copy_to_host_memory<B>(grad_scale, host_scale_.data(), 1);
        B::synchronize();
        grad_scale = host_scale_.data();
      }
      run(host, grad_scale);
    }
  }

  /// The launch of tables refresh_tables made current.
  template <class M>
  void run(Launch<M>& l, const A* grad_scale) {
    if (l.size == 0) return;
    with_backend<B>(l.host, [&]<class X>() {
      X::for_each(l.size, ops::AdamWMultiStep<T, M>{l.tensors.data(), l.block_tensor.data(), {}, l.elements,
                                                    static_cast<std::int64_t>(l.host_table.size()), has_masters(),
                                                    grad_scale, l.host ? host_staged_.data() : staged_.data()});
    });
  }

  /// The launch's tables in B's memory, uploaded again only when a tensor moved (a
  /// parameter's value or gradient replaced, as loading a checkpoint may do, or a
  /// gradient made afresh each step, as the early step's are): the block -> tensor map
  /// only when the tensors' sizes changed too. `group`: the states of that apply_to
  /// group, -1 for every state on l's side (B's memory or the host's).
  template <class M>
  void refresh_tables(Launch<M>& l, int group = -1) {
    std::vector<ops::AdamWTensor<T, M>> table;
    table.reserve(states_.size());
    std::int64_t begin = 0;
    for (auto& s : states_) {
      if (s.param->numel() == 0 || on_host(s.param->value) != l.host || (group >= 0 && s.group != group)) continue;
      TESSERA_CHECK(s.param->grad.numel() == s.param->numel(), "optimizer: parameter ", s.param->name, " has ",
                    s.param->numel(), " elements but its gradient ", s.param->grad.numel());
      Moments<M>& m = std::get<Moments<M>>(s.moments);
      table.push_back({s.param->value.data(), s.param->grad.data(), m.exp_avg.data(), m.exp_avg_sq.data(),
                       has_masters() ? s.master.data() : nullptr, s.param->numel(), begin});
      begin += (s.param->numel() + ops::kAdamWBlock - 1) / ops::kAdamWBlock * ops::kAdamWBlock;
    }
    if (table == l.host_table && l.size == begin) return;
    const bool same_sizes = l.size == begin && table.size() == l.host_table.size() &&
                            std::equal(table.begin(), table.end(), l.host_table.begin(), [](const auto& a, const auto& b) {
                              return a.numel == b.numel && a.begin == b.begin;
                            });
    if (same_sizes) {  // the tensors moved, the blocks did not
      with_backend<B>(l.host, [&]<class X>() { l.tensors = upload<X>(std::span<const ops::AdamWTensor<T, M>>(table)); });
      l.host_table = std::move(table);
      return;
    }
    // The block -> tensor map, 4 bytes per 2048 elements (8 MiB for a 4B-parameter
    // stage). A dry run (the Meta backend) uploads its bytes but never reads them: the
    // map is left as allocated, untouched, which was a fifth of a pipelined layout's plan.
    const auto n_blocks = static_cast<std::size_t>(begin / ops::kAdamWBlock);
    const auto blocks = std::make_unique_for_overwrite<std::int32_t[]>(n_blocks);
    if constexpr (B::device != Device::meta)
      for (std::size_t t = 0; t < table.size(); ++t) {
        const std::int64_t first = table[t].begin / ops::kAdamWBlock;
        const std::int64_t count = (table[t].numel + ops::kAdamWBlock - 1) / ops::kAdamWBlock;
        for (std::int64_t b = first; b < first + count; ++b) blocks[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(t);
      }
    with_backend<B>(l.host, [&]<class X>() {
      l.tensors = upload<X>(std::span<const ops::AdamWTensor<T, M>>(table));
      l.block_tensor = upload<X>(std::span<const std::int32_t>(blocks.get(), n_blocks));
    });
    l.elements = 0;
    for (const auto& t : table) l.elements += t.numel;
    l.host_table = std::move(table);
    l.size = begin;
  }

  /// The parameter gets the master's bf16 rounding (an fp32 model; a bf16 model's
  /// parameter already holds it).
  template <class X>
  static void round_into(const Tensor<A>& from, const Tensor<T>& to) {
    if constexpr (std::is_same_v<T, float>) X::for_each(from.numel(), detail::RoundToBf16{from.data(), to.data()});
  }

  AdamWOptions options_;
  std::vector<State> states_;
  std::int64_t step_ = 0;
  Launch<A> launch_accum_;    // state_dtype f32: moments in accum_t<T>
  Launch<bf16> launch_bf16_;  // state_dtype bf16 (float arithmetic only)
  Launch<A> host_accum_{true};  // the same for the parameters in host memory
  Launch<bf16> host_bf16_{true};
  Tensor<ops::AdamWScalars<A>> staged_;  // the next update's scalars (stage())
  bool on_host_ = false;  // some parameters live in host memory (CPU offload)
  Tensor<ops::AdamWScalars<A>> host_staged_;  // the same, in host memory (B::Host's)
  Tensor<A> host_scale_;  // a gradient scale read from B's memory for the host's update
  std::vector<std::unique_ptr<Group>> groups_;  // apply_to's, in the order first given
};

}  // namespace tessera::optim
