// The layer concept, parameters, and the context activations are saved through.
//
// A layer owns its forward and backward (there is no autograd). Forward reads an
// activation and returns one; whatever its backward needs it saves through the
// Context under a key and an op kind. Backward receives the gradient of its output,
// accumulates its parameters' gradients and returns the gradient of its input.
//
// The Context is the seam the parallel policies use without the layer knowing: an
// activation-checkpoint policy decides which saves are kept and recomputes the rest;
// sharding policies reach parameters through for_each_parameter.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/tensor.hpp"

namespace tessera::nn {

/// How a parameter starts: torchtitan's initialisers.
struct Init {
  enum class Kind : std::uint8_t { ones, zeros, normal, truncated_normal } kind = Kind::zeros;
  double std = 0.0;
  double lo = -2.0;  // truncation bounds, absolute (as torch.nn.init.trunc_normal_)
  double hi = 2.0;

  static Init ones() { return {Kind::ones}; }
  static Init normal(double std) { return {Kind::normal, std}; }
  static Init truncated_normal(double std, double lo = -2.0, double hi = 2.0) {
    return {Kind::truncated_normal, std, lo, hi};
  }
};

/// A named trainable tensor and its gradient. Names follow torchtitan
/// ("layers.0.attention.wq.weight").
template <class T>
struct Parameter {
  std::string name;
  Tensor<T> value;
  Tensor<T> grad;
  Init init;

  Parameter() = default;
  Parameter(std::string n, Shape shape, Init how)
      : name(std::move(n)), value(shape), grad(shape), init(how) {}
  const Shape& shape() const { return value.shape(); }
  std::int64_t numel() const { return value.numel(); }
};

/// What an activation is, for the checkpoint policies: torchtitan's selective policy
/// keeps matmul and attention outputs and recomputes the rest.
enum class SaveKind : std::uint8_t {
  input,      // a layer's input, held by its caller anyway
  matmul,     // a GEMM's output
  attention,  // the attention core's output and statistics
  norm,       // normalisation statistics
  pointwise,  // the output of element-wise math
};

/// Activations one layer call saved for its backward, in named scopes that mirror
/// the layer tree ("attention" / "wq" / "x").
template <class T>
class ActivationStore {
 public:
  explicit ActivationStore(std::string scope = "") : scope_(std::move(scope)) {}

  void save(std::string_view key, SaveKind kind, Tensor<T> tensor) {
    for (auto& e : entries_) {
      if (e.key == key) {
        e = Entry{std::string(key), kind, std::move(tensor)};
        return;
      }
    }
    entries_.push_back(Entry{std::string(key), kind, std::move(tensor)});
  }

  const Tensor<T>& load(std::string_view key) const {
    for (const auto& e : entries_)
      if (e.key == key) return e.tensor;
    fail("activation '", scope_.empty() ? "" : scope_ + ".", key,
         "' was not saved: backward called without its forward");
  }

  /// The nested store for a sub-layer, created on first use.
  ActivationStore& child(std::string_view name) {
    for (auto& c : children_)
      if (c.first == name) return *c.second;
    children_.emplace_back(std::string(name),
                           std::make_unique<ActivationStore>(scope_.empty() ? std::string(name)
                                                                             : scope_ + "." + std::string(name)));
    return *children_.back().second;
  }

  /// Bytes of the distinct tensors saved here and below (shared storage counted once).
  std::size_t bytes() const {
    std::unordered_set<const void*> seen;
    return bytes_into(seen);
  }

  void clear() {
    entries_.clear();
    children_.clear();
  }

  const std::string& scope() const { return scope_; }

 private:
  struct Entry {
    std::string key;
    SaveKind kind;
    Tensor<T> tensor;
  };

  std::size_t bytes_into(std::unordered_set<const void*>& seen) const {
    std::size_t n = 0;
    for (const auto& e : entries_)
      if (e.tensor.data() != nullptr && seen.insert(e.tensor.data()).second) n += e.tensor.bytes();
    for (const auto& c : children_) n += c.second->bytes_into(seen);
    return n;
  }

  std::string scope_;
  std::vector<Entry> entries_;
  std::vector<std::pair<std::string, std::unique_ptr<ActivationStore>>> children_;
};

/// The shape of the token batch a call works on: activations are (batch * seq_len, ...).
struct Geometry {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  std::int64_t rows() const { return batch * seq_len; }
};

/// What a layer call sees: the batch geometry and where to save activations. A
/// context without a store (inference) drops every save.
template <class T>
class Context {
 public:
  Context(Geometry geometry, ActivationStore<T>* store) : geometry_(geometry), store_(store) {}

  const Geometry& geometry() const { return geometry_; }
  bool saving() const { return store_ != nullptr; }

  /// The context of the sub-layer `name`.
  Context child(std::string_view name) const {
    return Context(geometry_, store_ ? &store_->child(name) : nullptr);
  }

  void save(std::string_view key, SaveKind kind, const Tensor<T>& tensor) const {
    if (store_) store_->save(key, kind, tensor);
  }

  const Tensor<T>& saved(std::string_view key) const {
    TESSERA_CHECK(store_ != nullptr, "activation '", key, "' requested from a context that saves nothing");
    return store_->load(key);
  }

 private:
  Geometry geometry_;
  ActivationStore<T>* store_;
};

namespace detail {
template <class T>
struct ParameterProbe {
  void operator()(Parameter<T>&) const {}
};
}  // namespace detail

/// A layer: scalar and backend types, forward and backward over a Context, and its
/// named parameters.
template <class L>
concept Layer = requires(L& layer, const Context<typename L::scalar_type>& ctx,
                         const Tensor<typename L::scalar_type>& x,
                         detail::ParameterProbe<typename L::scalar_type> visit) {
  typename L::scalar_type;
  typename L::backend_type;
  { layer.forward(ctx, x) } -> std::same_as<Tensor<typename L::scalar_type>>;
  { layer.backward(ctx, x) } -> std::same_as<Tensor<typename L::scalar_type>>;
  layer.for_each_parameter(visit);
};

}  // namespace tessera::nn
