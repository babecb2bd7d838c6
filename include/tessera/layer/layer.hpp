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

#include <algorithm>
#include <cmath>
#include <concepts>
#include <initializer_list>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/backend/host.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/float8.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/memory.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/core/tensor.hpp"
#include "tessera/layer/kv_cache.hpp"
#include "tessera/ops/elementwise.hpp"
#include "tessera/ops/init.hpp"
#include "tessera/ops/positions.hpp"

namespace tessera::nn {

/// How a parameter starts: torchtitan's initialisers.
struct Init {
  enum class Kind : std::uint8_t { ones, zeros, normal, truncated_normal, uniform } kind = Kind::zeros;
  double std = 0.0;
  double lo = -2.0;  // truncation bounds, absolute (as torch.nn.init.trunc_normal_)
  double hi = 2.0;

  static Init ones() { return {Kind::ones}; }
  static Init normal(double std) { return {Kind::normal, std}; }
  static Init truncated_normal(double std, double lo = -2.0, double hi = 2.0) {
    return {Kind::truncated_normal, std, lo, hi};
  }
  /// Uniform on (lo, hi).
  static Init uniform(double lo, double hi) { return {Kind::uniform, 0.0, lo, hi}; }
  /// torch.nn.Linear's default (kaiming_uniform_ with a = sqrt(5)): uniform on
  /// (-1/sqrt(fan_in), 1/sqrt(fan_in)).
  static Init linear_default(std::int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return uniform(-bound, bound);
  }
};

/// How a parameter is laid over the tensor-parallel ranks. A parameter is whole
/// (`parts` 1, every rank holds all of it) or cut into `parts` equal pieces along
/// `dim`, of which this rank holds the `index`-th. `holders` ranks hold each piece:
/// 1 for an even split, the degree for a whole parameter, and degree / parts for
/// key/value heads when the degree exceeds their count. Where several ranks hold a
/// piece, each computes part of its gradient (they see different rows or heads), so
/// its layer sums that over the holders; the first holder (`owner`) counts the piece
/// once in the gradient norm.
struct TensorSplit {
  int dim = 0;
  int parts = 1;
  int index = 0;
  int holders = 1;
  bool owner = true;
  bool split() const { return parts > 1; }
  /// This rank's piece of a parameter of shape `whole`: cut along dim into parts.
  Shape piece_of(Shape whole) const {
    if (split()) whole.dims[dim] /= parts;
    return whole;
  }
};

/// While one is alive on this thread, Parameter::on makes parameters without storage
/// (a name, a whole shape, an initialiser): how a model on a parallel plan waits until
/// it knows which share of each parameter this rank holds, so that it allocates and
/// initialises that share only (nn::Transformer). Scopes nest.
class DeferParameterStorage {
 public:
  explicit DeferParameterStorage(bool defer = true) : previous_(flag()) { flag() = previous_ || defer; }
  ~DeferParameterStorage() { flag() = previous_; }
  DeferParameterStorage(const DeferParameterStorage&) = delete;
  DeferParameterStorage& operator=(const DeferParameterStorage&) = delete;

  /// Whether parameters made on this thread now are made without storage.
  static bool active() { return flag(); }

 private:
  static bool& flag() {
    static thread_local bool defer = false;
    return defer;
  }
  bool previous_;
};

/// While one is alive on this thread, Parameter::on makes frozen parameters (or, given
/// false, trainable ones: scopes nest, the innermost decides): a frozen parameter keeps
/// its value, has no gradient (none is ever allocated for it, and its layer skips the
/// GEMM or kernel that would write one), and the optimizer holds nothing for it. How a
/// model with LoRA adapters freezes everything but them (layer/lora.hpp, nn::Transformer).
class FreezeParameters {
 public:
  explicit FreezeParameters(bool frozen = true) : previous_(flag()) { flag() = frozen; }
  ~FreezeParameters() { flag() = previous_; }
  FreezeParameters(const FreezeParameters&) = delete;
  FreezeParameters& operator=(const FreezeParameters&) = delete;

  /// Whether parameters made on this thread now are frozen.
  static bool active() { return flag(); }

 private:
  static bool& flag() {
    static thread_local bool frozen = false;
    return frozen;
  }
  bool previous_;
};

template <class T>
class ParameterStack;

/// A named trainable tensor and its gradient. Names follow torchtitan
/// ("layers.0.attention.wq.weight"). The gradient is accumulated in accum_t<T>: fp32
/// for a bf16 parameter (FSDP2's semantics: bf16 compute, fp32 gradient reduction).
///
/// The first write. A model's zero_grad() zeroes nothing: it marks each gradient
/// unwritten (PyTorch's zero_grad(set_to_none=True)), and the step's first writer
/// overwrites it (a GEMM with beta 0, a copy) where later writers add (beta 1). A
/// writer of the whole gradient asks grad_write_beta(); one that adds to part of it (a
/// scatter, a kernel that only accumulates) calls zero_grad_if_unwritten<B>() first.
/// What nothing wrote is zeroed when the backward ends, so after a forward_backward
/// every gradient holds its sum.
template <class T>
struct Parameter {
  using grad_type = accum_t<T>;
  std::string name;
  Tensor<T> value;
  Tensor<grad_type> grad;
  Init init;
  /// Its tensor-parallel layout; value and grad hold this rank's piece once the
  /// model is sharded (parallel/tensor_parallel.hpp), the whole shape is `whole`.
  TensorSplit split{};
  Shape whole{};
  /// Whether `grad` holds this step's gradient so far (false: its memory is stale, and
  /// the step's first writer overwrites it). A gradient allocated zeroed is written.
  bool grad_written = true;
  /// FSDP's float8 all-gather (float8.enable_fsdp_float8_all_gather): set by the layer
  /// that multiplies this weight in float8 with one scale (nn::Linear, tensorwise). While
  /// its sharding unit holds it gathered that way, `float8_value` holds its float8 values
  /// (e4m3, its piece's shape), `float8_inverse` the one inverse scale, and `value` is
  /// empty; otherwise both are empty.
  bool gathers_float8 = false;
  Tensor<float8_e4m3> float8_value;
  Tensor<float> float8_inverse;
  /// The parameters this one is stored beside (ParameterStack), and its place among
  /// them; none: stored on its own.
  std::shared_ptr<ParameterStack<T>> stack;
  std::size_t stack_index = 0;
  /// Frozen (FreezeParameters): no gradient, no optimizer state; its value is the model's
  /// as loaded or initialised, and is saved and loaded as any other.
  bool frozen = false;
  bool trainable() const { return !frozen; }

  /// Marks the gradient unwritten: the next writer overwrites it. No kernel runs.
  void forget_grad() { grad_written = false; }

  /// The beta of a writer of the whole gradient (grad = beta * grad + this write): 0
  /// for the step's first write, 1 after; marks the gradient written.
  grad_type grad_write_beta() { return std::exchange(grad_written, true) ? grad_type(1) : grad_type(0); }

  /// For a writer that adds to the gradient (or to part of it): zeroes the gradient
  /// if nothing wrote it yet this step, and marks it written.
  /// B's loops, or its host backend's for a gradient in host memory (an offloaded
  /// shard's, backend/host.hpp).
  template <Backend B>
  void zero_grad_if_unwritten() {
    if (std::exchange(grad_written, true) || grad.empty()) return;
    with_backend<B>(on_host(grad), [&]<class X>() {
      X::for_each(grad.numel(), ops::Fill<grad_type>{grad_type(0), grad.data()});
    });
  }

  Parameter() = default;
  /// Value and gradient zeroed in host memory (the CPU backend's).
  Parameter(std::string n, Shape shape, Init how)
      : name(std::move(n)), value(shape), grad(shape), init(how), whole(shape) {}

  /// Value and gradient zeroed in backend B's memory: how layers make their
  /// parameters. Inside a DeferParameterStorage scope, without storage (allocate<B>).
  /// `stack`: the ParameterStack it is member `index` of (stored beside the others).
  template <Backend B>
  static Parameter on(std::string n, Shape shape, Init how, std::shared_ptr<ParameterStack<T>> stack = {},
                      std::size_t index = 0) {
    Parameter p;
    p.name = std::move(n);
    p.init = how;
    p.whole = shape;
    p.stack = std::move(stack);
    p.stack_index = index;
    p.frozen = FreezeParameters::active();
    if (!DeferParameterStorage::active()) p.template allocate<B>(shape);
    return p;
  }

  /// Gives the parameter a zeroed value and gradient of `shape` in B's memory (its
  /// whole shape, or its piece's).
  /// `with_grad` false: the value only (a DDP unit keeps the gradients in its bucket). A
  /// frozen parameter never has a gradient.
  template <Backend B>
  void allocate(const Shape& shape, bool with_grad = true) {
    with_grad = with_grad && !frozen;
    if (stack && stack->template place<B>(stack_index, shape, value, grad, with_grad)) return;
    {
      MemoryUseScope use(MemoryUse::parameters);
      value = B::template zeros<T>(shape);
    }
    if (!with_grad) return;
    MemoryUseScope use(MemoryUse::gradients);
    grad = B::template zeros<grad_type>(shape);
  }

  /// The shape of the value held: whole, this rank's piece, or empty (no storage yet,
  /// or sharded away).
  const Shape& shape() const { return value.shape(); }
  std::int64_t numel() const { return value.numel(); }
  /// The shape of this rank's tensor-parallel piece: `whole` cut along split.dim into
  /// split.parts (whole when not split).
  Shape piece_shape() const { return split.piece_of(whole); }
};

/// Parameters stored side by side. A layer that multiplies several weights as one matrix
/// (nn::Attention's wq, wk and wv; nn::FeedForward's w1 and w3: one GEMM each way where
/// there was one a weight) makes them a stack: whenever its members are given storage
/// (Parameter::allocate: whole when they are made or the runtime makes them, or this
/// rank's tensor-parallel pieces), the first member to ask allocates one value buffer and
/// one gradient buffer for all of them, in the stack's order, and each member takes its
/// slice of both. The members stay parameters of their own everywhere else: names,
/// initialisation, checkpoints, optimizers. FSDP's units lay their parameters side by
/// side in visiting order anyway, and a DDP bucket their gradients. Whether the members
/// are side by side is checked where they are multiplied (nn::side_by_side, and the
/// gradients where they are written): storage that puts them apart is still right,
/// multiplied a weight at a time.
template <class T>
class ParameterStack {
 public:
  using G = accum_t<T>;
  /// Each member's whole shape and tensor-parallel split, in the stack's order.
  ParameterStack(std::vector<Shape> whole, std::vector<TensorSplit> splits)
      : whole_(std::move(whole)), splits_(std::move(splits)) {
    TESSERA_CHECK(whole_.size() == splits_.size() && !whole_.empty(), "ParameterStack: ", whole_.size(),
                  " shapes and ", splits_.size(), " splits");
  }
  ParameterStack(const ParameterStack&) = delete;
  ParameterStack& operator=(const ParameterStack&) = delete;

  std::size_t size() const { return whole_.size(); }
  const TensorSplit& split(std::size_t i) const { return splits_.at(i); }

  /// Member i's storage of `shape` (its whole shape or its piece's): its slices of the
  /// stack's buffers, allocated zeroed by the first member to ask for this round (a member
  /// asking again starts the next); the gradient's only `with_grad`. False, allocating
  /// nothing, for any other shape.
  template <Backend B>
  bool place(std::size_t i, const Shape& shape, Tensor<T>& value, Tensor<G>& grad, bool with_grad = true) {
    if (i >= size()) return false;
    const bool whole = shape == whole_[i];
    if (!whole && shape != piece(i)) return false;
    if (!round_ || round_->whole != whole || round_->with_grad != with_grad || round_->served[i])
      start<B>(whole, with_grad);
    Round& r = *round_;
    value = r.value.slice(r.offset[i], shape);
    if (with_grad) grad = r.grad.slice(r.offset[i], shape);
    r.served[i] = true;
    if (--r.left == 0) round_.reset();  // every member holds its slice: the buffers are theirs
    return true;
  }

 private:
  struct Round {
    bool whole = true, with_grad = true;
    Tensor<T> value;
    Tensor<G> grad;
    std::vector<std::int64_t> offset;
    std::vector<bool> served;
    std::size_t left = 0;
  };

  Shape piece(std::size_t i) const { return splits_[i].piece_of(whole_[i]); }

  template <Backend B>
  void start(bool whole, bool with_grad) {
    auto r = std::make_unique<Round>();
    r->whole = whole;
    r->with_grad = with_grad;
    std::int64_t n = 0;
    for (std::size_t i = 0; i < size(); ++i) {
      r->offset.push_back(n);
      n += (whole ? whole_[i] : piece(i)).numel();
    }
    {
      MemoryUseScope use(MemoryUse::parameters);
      r->value = B::template zeros<T>(Shape{n});
    }
    if (with_grad) {
      MemoryUseScope use(MemoryUse::gradients);
      r->grad = B::template zeros<G>(Shape{n});
    }
    r->served.assign(size(), false);
    r->left = size();
    round_ = std::move(r);
  }

  std::vector<Shape> whole_;
  std::vector<TensorSplit> splits_;
  std::unique_ptr<Round> round_;
};

/// Whether the values of `first` and `rest`... are stored side by side in that order (a
/// ParameterStack's round, or an FSDP unit's gathered buffer): together one matrix of
/// their rows, each with the same columns. (Their gradients may live elsewhere, or not
/// yet at all, FSDP's outside the backward: a writer checks them when it writes.)
template <class T, class... Ps>
bool side_by_side(const Parameter<T>& first, const Ps&... rest) {
  const T* v = first.value.data();
  if (v == nullptr || first.value.shape().rank != 2) return false;
  const std::int64_t cols = first.value.size(1);
  std::int64_t before = first.value.numel();  // elements from v to where the next must start
  const auto follows = [&](const Parameter<T>& p) {
    const bool ok = p.value.shape().rank == 2 && p.value.size(1) == cols && p.value.data() == v + before;
    before += p.value.numel();
    return ok;
  };
  return (follows(rest) && ...);
}

/// What an activation is, for the checkpoint policies: torchtitan's selective policy
/// keeps matmul and attention outputs and recomputes the rest.
enum class SaveKind : std::uint8_t {
  input,      // a layer's input, held by its caller anyway
  matmul,     // a GEMM's output
  attention,  // the attention core's output and statistics
  norm,       // normalisation statistics
  pointwise,  // the output of element-wise math
  scale,      // a float8 cast's scale and its inverse (one float each)
};

/// Bytes of distinct saved tensors across a tree of stores, now and at the peak: the
/// activation memory a checkpoint policy leaves. Storage shared by several saves
/// counts once.
class ActivationMeter {
 public:
  void add(const void* data, std::size_t bytes, Device device) {
    auto& e = live_[data];
    if (e.count++ == 0) {
      e.bytes = bytes;
      e.device = device;
      current_ += bytes;
      peak_ = std::max(peak_, current_);
      memory_stats(device).on_saved(static_cast<std::int64_t>(bytes));  // the peak's breakdown tells them apart
    }
  }
  void remove(const void* data) {
    auto it = live_.find(data);
    if (it == live_.end()) return;
    if (--it->second.count == 0) {
      current_ -= it->second.bytes;
      memory_stats(it->second.device).on_saved(-static_cast<std::int64_t>(it->second.bytes));
      live_.erase(it);
    }
  }
  std::size_t current() const { return current_; }
  std::size_t peak() const { return peak_; }
  void reset_peak() { peak_ = current_; }

 private:
  struct Entry {
    std::size_t count = 0, bytes = 0;
    Device device = Device::cpu;
  };
  std::unordered_map<const void*, Entry> live_;
  std::size_t current_ = 0, peak_ = 0;
};

/// What a store holds under one key: an activation (a Tensor<T>), a statistic kept in
/// the accumulation type (a Tensor<accum_t<T>>: RMSNorm's rstd, attention's
/// log-sum-exp), or an activation kept as float8 values (a Tensor<float8_e4m3>: a
/// linear layer's input gathered in float8 over sequence-parallel ranks, nn/linear.hpp).
/// For float and double the first two are the same type.
template <class T>
class Saved {
 public:
  using stat_type = accum_t<T>;
  static constexpr bool kDistinct = !std::is_same_v<T, stat_type>;

  Saved() = default;
  Saved(Tensor<T> t) : activation_(std::move(t)) {}  // NOLINT: implicit, each kind converts
  template <class U = stat_type>
    requires(kDistinct && std::is_same_v<U, stat_type>)
  Saved(Tensor<U> t) : statistic_(std::move(t)), kind_(Kind::statistic) {}  // NOLINT
  Saved(Tensor<float8_e4m3> t) : float8_(std::move(t)), kind_(Kind::float8) {}  // NOLINT

  /// The tensor as U (T, accum_t<T> or float8_e4m3), or nullptr when it holds another kind.
  template <class U>
  const Tensor<U>* get() const {
    if constexpr (std::is_same_v<U, float8_e4m3>) {
      return kind_ == Kind::float8 ? &float8_ : nullptr;
    } else if constexpr (std::is_same_v<U, T>) {
      return kind_ == Kind::activation ? &activation_ : nullptr;
    } else {
      static_assert(std::is_same_v<U, stat_type>, "tessera: a store holds T, accum_t<T> or float8_e4m3 tensors");
      return kind_ == Kind::statistic ? &statistic_ : nullptr;
    }
  }
  const void* data() const {
    switch (kind_) {
      case Kind::statistic: return statistic_.data();
      case Kind::float8: return float8_.data();
      default: return activation_.data();
    }
  }
  std::size_t bytes() const {
    switch (kind_) {
      case Kind::statistic: return statistic_.bytes();
      case Kind::float8: return float8_.bytes();
      default: return activation_.bytes();
    }
  }
  Device device() const {
    switch (kind_) {
      case Kind::statistic: return statistic_.device();
      case Kind::float8: return float8_.device();
      default: return activation_.device();
    }
  }

 private:
  enum class Kind : std::uint8_t { activation, statistic, float8 };
  Tensor<T> activation_;
  Tensor<stat_type> statistic_;  // empty unless kDistinct and it holds a statistic
  Tensor<float8_e4m3> float8_;
  Kind kind_ = Kind::activation;
};

/// Activations one layer call saved for its backward, in named scopes that mirror
/// the layer tree ("attention" / "wq" / "x"). A store may report to an
/// ActivationMeter (its children report to the same one). Each entry is a Tensor<T>
/// or a statistic in accum_t<T> (Saved<T>).
template <class T>
class ActivationStore {
 public:
  explicit ActivationStore(std::string scope = "", ActivationMeter* meter = nullptr)
      : scope_(std::move(scope)), meter_(meter) {}
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;
  ActivationStore(ActivationStore&& o) noexcept
      : scope_(std::move(o.scope_)),
        meter_(o.meter_),
        entries_(std::move(o.entries_)),
        children_(std::move(o.children_)) {
    o.entries_.clear();
    o.children_.clear();
  }
  ~ActivationStore() { clear(); }

  /// Reports this store's saves (and its children's, made from now on) to `meter`.
  void attach(ActivationMeter* meter) {
    TESSERA_CHECK(entries_.empty() && children_.empty(), "ActivationStore: attach a meter to an empty store");
    meter_ = meter;
  }

  void save(std::string_view key, SaveKind kind, Saved<T> tensor) {
    if (meter_ && tensor.data()) meter_->add(tensor.data(), tensor.bytes(), tensor.device());
    for (auto& e : entries_) {
      if (e.key == key) {
        if (meter_ && e.tensor.data()) meter_->remove(e.tensor.data());
        e = Entry{std::string(key), kind, std::move(tensor)};
        return;
      }
    }
    entries_.push_back(Entry{std::string(key), kind, std::move(tensor)});
  }

  /// The tensor of element type U (T, accum_t<T> for a statistic, or float8_e4m3) saved
  /// under `key`, or nullptr.
  template <class U = T>
  const Tensor<U>* find(std::string_view key) const {
    for (const auto& e : entries_)
      if (e.key == key) return e.tensor.template get<U>();
    return nullptr;
  }

  template <class U = T>
  const Tensor<U>& load(std::string_view key) const {
    if (const Tensor<U>* t = find<U>(key)) return *t;
    const bool present = std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
    fail("activation '", scope_.empty() ? "" : scope_ + ".", key,
         present ? "' was saved with another element type than the one its backward reads"
                 : "' was not saved: backward called without its forward");
  }

  /// The nested store for a sub-layer, created on first use.
  ActivationStore& child(std::string_view name) {
    for (auto& c : children_)
      if (c.first == name) return *c.second;
    children_.emplace_back(std::string(name),
                           std::make_unique<ActivationStore>(
                               scope_.empty() ? std::string(name) : scope_ + "." + std::string(name), meter_));
    return *children_.back().second;
  }

  /// Bytes of the distinct tensors saved here and below (shared storage counted once).
  std::size_t bytes() const {
    std::unordered_set<const void*> seen;
    return bytes_into(seen);
  }

  void clear() {
    if (meter_)
      for (const auto& e : entries_)
        if (e.tensor.data()) meter_->remove(e.tensor.data());
    entries_.clear();
    children_.clear();  // each child's destructor clears it
  }

  const std::string& scope() const { return scope_; }

 private:
  struct Entry {
    std::string key;
    SaveKind kind;
    Saved<T> tensor;
  };

  std::size_t bytes_into(std::unordered_set<const void*>& seen) const {
    std::size_t n = 0;
    for (const auto& e : entries_)
      if (e.tensor.data() != nullptr && seen.insert(e.tensor.data()).second) n += e.tensor.bytes();
    for (const auto& c : children_) n += c.second->bytes_into(seen);
    return n;
  }

  std::string scope_;
  ActivationMeter* meter_ = nullptr;
  std::vector<Entry> entries_;
  std::vector<std::pair<std::string, std::unique_ptr<ActivationStore>>> children_;
};

/// The shape of the token batch a call works on: activations are (batch * seq_len, ...).
/// Under context parallelism seq_len is this rank's share of each sequence (two chunks,
/// chunk-major rows: ops/positions.hpp) and `context` says which share it is.
///
/// Packed documents: a caller sets `document_start_id` (a BOS id) and the model finds
/// each row's document in the input ids when it takes the batch, staging the spans in
/// the backend's memory (`documents`): positions then restart at each document and
/// attention stays inside it. Layers read `documents` only through positions() and the
/// attention shape.
struct Geometry {
  std::int64_t batch = 0;
  std::int64_t seq_len = 0;
  ops::ContextShard context{};
  std::int32_t document_start_id = -1;          // a document starts at each input of this id; -1: none do
  const ops::DocumentSpan* documents = nullptr;  // (rows()), the model's: each row's document; nullptr: none
  const ops::DocumentSpan* document_table = nullptr;  // (batch x document_slots), whole sequences only: each
  std::int64_t document_slots = 0;                    // sequence's documents (ops/ragged_documents.hpp)
  std::int64_t past = 0;  // decoding: the tokens of each sequence already in the KV cache (Context::kv_cache);
                          // these rows are the next seq_len, at positions past, past + 1, ...
  std::int64_t rows() const { return batch * seq_len; }
  /// The length of the whole sequences the rows come from.
  std::int64_t whole_seq_len() const { return seq_len * context.degree; }
  /// Each row's position in its sequence, or in its document (what RoPE rotates by).
  ops::RowPositions positions() const {
    ops::RowPositions p(batch, seq_len, context, documents);
    p.past = past;
    return p;
  }
  /// The same geometry over `batch_` sequences from sequence `first` on (a microbatch).
  Geometry sequences(std::int64_t first, std::int64_t batch_) const {
    Geometry g = *this;
    g.batch = batch_;
    if (documents) g.documents = documents + first * seq_len;
    if (document_table) g.document_table = document_table + first * document_slots;
    return g;
  }
};

/// What a context does with saves and op outputs: the lever the checkpoint
/// policies pull without the layer knowing.
enum class Recording : std::uint8_t {
  keep,     // saves are stored: no checkpointing, or the recompute before a backward
  discard,  // saves are dropped: inference, or a fully checkpointed forward
  stash,    // saves are dropped; outputs of ops of the stashed kinds are kept (selective forward)
  replay,   // saves are stored; ops whose outputs were stashed return them instead of recomputing
};

/// A set of SaveKinds.
struct SaveKinds {
  std::uint8_t bits = 0;
  constexpr SaveKinds() = default;
  constexpr SaveKinds(std::initializer_list<SaveKind> kinds) {
    for (SaveKind k : kinds) bits = static_cast<std::uint8_t>(bits | (1u << static_cast<unsigned>(k)));
  }
  constexpr bool contains(SaveKind k) const { return (bits >> static_cast<unsigned>(k)) & 1u; }
};

/// Which op outputs a selective forward keeps: those of `kinds`; of matmuls, only
/// every other one when `alternate_matmuls` (the 1st, 3rd, ... of the block, as
/// torchtitan's op policy does to halve what matmuls keep). What is kept is a copy
/// made by `copy` (the backend's; `copy_statistic` for an op whose output is a
/// statistic in accum_t<T>), so a layer that later changes an op's output in place
/// cannot change what the recompute replays.
template <class T>
struct StashRule {
  SaveKinds kinds;
  bool alternate_matmuls = false;
  Tensor<T> (*copy)(const Tensor<T>&) = nullptr;
  Tensor<accum_t<T>> (*copy_statistic)(const Tensor<accum_t<T>>&) = nullptr;
  int matmuls_seen = 0;  // counted through one forward

  bool keep(SaveKind kind) {
    if (!kinds.contains(kind)) return false;
    if (kind != SaveKind::matmul || !alternate_matmuls) return true;
    return (++matmuls_seen % 2) == 1;
  }
};

/// Weight-gradient work a backward left for later: a zero-bubble pipeline schedule
/// runs a backward's input-gradient part first (the previous stage waits for it) and
/// its weight-gradient part when the pipeline would otherwise idle.
using WeightGradQueue = std::vector<std::function<void()>>;

/// What a layer call sees: the batch geometry and where to save activations. A
/// context without a store (inference) drops every save.
///
/// A layer declares its expensive ops through op(key, kind, compute): normally that
/// just runs compute(); a selective checkpoint policy keeps the outputs of some kinds
/// during the forward (stash) and hands them back during the recompute (replay),
/// so the recompute skips those ops. The stash holds copies: a layer may go on to
/// change an op's output in place.
template <class T>
class Context {
 public:
  Context(Geometry geometry, ActivationStore<T>* store) : geometry_(geometry), store_(store) {
    recording_ = store ? Recording::keep : Recording::discard;
  }
  /// A checkpoint policy's context: `store` receives saves (keep, replay); `stash`
  /// receives the op outputs `rule` keeps (stash) or gives them back (replay).
  Context(Geometry geometry, Recording recording, ActivationStore<T>* store, ActivationStore<T>* stash = nullptr,
          StashRule<T>* rule = nullptr)
      : geometry_(geometry), store_(store), stash_(stash), recording_(recording), rule_(rule) {
    TESSERA_CHECK((recording != Recording::keep && recording != Recording::replay) || store != nullptr,
                  "Context: a recording that keeps saves needs a store");
    TESSERA_CHECK((recording != Recording::stash && recording != Recording::replay) || stash != nullptr,
                  "Context: stash and replay need a stash store");
    TESSERA_CHECK(recording != Recording::stash ||
                      (rule != nullptr && rule->copy != nullptr && rule->copy_statistic != nullptr),
                  "Context: stash needs a StashRule with copy functions");
  }

  /// Where this context's saves go (nullptr when it keeps none): for checkpoint policies.
  ActivationStore<T>* store() const { return saving() ? store_ : nullptr; }

  const Geometry& geometry() const { return geometry_; }
  bool saving() const { return recording_ == Recording::keep || recording_ == Recording::replay; }
  Recording recording() const { return recording_; }
  /// Whether op outputs are stashed or replayed (an op policy): an op's output is then
  /// kept or taken whole, so its computation cannot be split across other work.
  bool stashes_ops() const { return recording_ == Recording::stash || recording_ == Recording::replay; }

  /// The context of the sub-layer `name`.
  Context child(std::string_view name) const {
    Context c = *this;
    c.store_ = store_ ? &store_->child(name) : nullptr;
    c.stash_ = stash_ ? &stash_->child(name) : nullptr;
    return c;
  }

  /// Saves an activation (U = T), a statistic (U = accum_t<T>) or float8 values (U =
  /// float8_e4m3) for the backward.
  template <class U>
  void save(std::string_view key, SaveKind kind, const Tensor<U>& tensor) const {
    if (saving()) store_->save(key, kind, Saved<T>(tensor));
  }

  /// What the forward saved under `key`, or nullptr where it saved nothing by that name
  /// (or this context saves nothing).
  template <class U = T>
  const Tensor<U>* saved_if(std::string_view key) const {
    return saving() ? store_->template find<U>(key) : nullptr;
  }

  /// What the forward saved under `key`, as a Tensor<U> (T, or accum_t<T> for a statistic).
  template <class U = T>
  const Tensor<U>& saved(std::string_view key) const {
    TESSERA_CHECK(saving(), "activation '", key, "' requested from a context that saves nothing");
    return store_->template load<U>(key);
  }

  /// A copy of this context whose backward defers weight-gradient work to `queue`
  /// (nullptr: runs it at once).
  Context deferring_weight_grads(WeightGradQueue* queue) const {
    Context c = *this;
    c.weight_grads_ = queue;
    return c;
  }
  WeightGradQueue* weight_grad_queue() const { return weight_grads_; }

  /// A copy of this context that decodes through `cache` (layer/kv_cache.hpp): the
  /// geometry's rows are one sequence's next tokens after geometry().past cached ones.
  Context with_kv_cache(KvCache<T>* cache) const {
    Context c = *this;
    c.kv_cache_ = cache;
    return c;
  }
  /// The KV cache this forward decodes through, or nullptr (no cache: the rows are whole).
  KvCache<T>* kv_cache() const { return kv_cache_; }

  /// Runs `accumulate` (a parameter's gradient accumulation), now or, when this
  /// context defers weight gradients, later. It must capture by value every tensor it
  /// reads (tensors share their storage), and those tensors must not change after.
  template <class F>
  void weight_grad(F&& accumulate) const {
    if (weight_grads_)
      weight_grads_->emplace_back(std::forward<F>(accumulate));
    else
      accumulate();
  }

  /// The output of the op `key`, of kind `kind`: compute(), or its stashed output.
  /// compute() returns a Tensor<T>, or a Tensor<accum_t<T>> for a statistic.
  template <class F>
  auto op(std::string_view key, SaveKind kind, F&& compute) const -> decltype(compute()) {
    using Out = decltype(compute());
    using U = typename Out::value_type;
    static_assert(std::is_same_v<Out, Tensor<T>> || std::is_same_v<Out, Tensor<accum_t<T>>>,
                  "tessera: Context::op computes a Tensor<T> or a Tensor<accum_t<T>>");
    if (recording_ == Recording::replay) {
      if (const Tensor<U>* kept = stash_->template find<U>(key)) return *kept;
    }
    Out y = compute();
    if (recording_ == Recording::stash && rule_->keep(kind)) {
      if constexpr (std::is_same_v<U, T>)
        stash_->save(key, kind, Saved<T>(rule_->copy(y)));
      else
        stash_->save(key, kind, Saved<T>(rule_->copy_statistic(y)));
    }
    return y;
  }

 private:
  Geometry geometry_;
  ActivationStore<T>* store_ = nullptr;
  ActivationStore<T>* stash_ = nullptr;
  Recording recording_ = Recording::discard;
  StashRule<T>* rule_ = nullptr;
  WeightGradQueue* weight_grads_ = nullptr;
  KvCache<T>* kv_cache_ = nullptr;
};

namespace detail {
template <class T>
struct ParameterProbe {
  void operator()(Parameter<T>&) const {}
};
}  // namespace detail

/// The element type and backend a layer is made of (L::scalar_type, L::backend_type:
/// what the Layer concept and the policies read); a layer type derives from it.
template <class T, Backend B>
struct LayerTypes {
  using scalar_type = T;
  using backend_type = B;
};

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

/// Whether a layer writes its parameters' gradients by Parameter's first-write rule
/// (grad_write_beta, zero_grad_if_unwritten), which it says by declaring
/// `static constexpr bool writes_gradients_first = true`. Every layer of tessera's does.
template <class L>
inline constexpr bool writes_gradients_first = requires { requires L::writes_gradients_first; };

/// Before a layer's backward: zeroes its parameters' unwritten gradients, unless the
/// layer writes them by the first-write rule. A layer that only adds into p.grad (as
/// docs/layers.md's first examples do) so sees zeros on the step's first backward.
template <Layer L>
void prepare_gradients(L& layer) {
  if constexpr (!writes_gradients_first<L>)
    layer.for_each_parameter([](Parameter<typename L::scalar_type>& p) {
      p.template zero_grad_if_unwritten<typename L::backend_type>();
    });
}

/// Fills `n` values at `out` (in B's memory) with elements where(0), ..., where(n - 1)
/// of parameter p as its Init makes them from (seed, p.name, element index in the
/// whole) only: one launch of ops::InitValues on B, so the values are made where they
/// live and are bitwise the same on every backend and in every layout.
template <Backend B, class T>
void init_parameter(const Parameter<T>& p, std::uint64_t seed, T* out, std::int64_t n, ops::PieceIndex where = {}) {
  const Init& in = p.init;
  ops::InitKind kind = ops::InitKind::zeros;
  switch (in.kind) {
    case Init::Kind::ones: kind = ops::InitKind::ones; break;
    case Init::Kind::zeros: kind = ops::InitKind::zeros; break;
    case Init::Kind::normal: kind = ops::InitKind::normal; break;
    case Init::Kind::truncated_normal: kind = ops::InitKind::truncated_normal; break;
    case Init::Kind::uniform: kind = ops::InitKind::uniform; break;
  }
  B::for_each(n, ops::InitValues<T>{out, parameter_key(seed, p.name), kind, in.std, in.lo, in.hi, where});
}

}  // namespace tessera::nn
