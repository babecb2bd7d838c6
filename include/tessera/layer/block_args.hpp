// What a model hands each block it builds, and what a block says of itself: the seam
// between the model (nn/transformer.hpp), the policies that wrap its blocks (parallel/)
// and a user's own block type. It names the run-time layout and the tensor-parallel
// group by declaration only, so the policies can wrap a block without knowing the model
// and a block can be written without including the policies.
//
// A block may also carry settings of its own (a hidden width, a residual scale): it
// declares `using options_type = MyOptions;`, the model takes a MyOptions beside its
// ModelArgs and hands it to every block it makes, and the block reads it from BlockArgs
// (`b.options<MyOptions>()`). And a block may describe itself where the model cannot
// see in: its attention term of the FLOP count (DescribesAttentionFlops) and what a
// tensor-parallel degree must divide in it (ChecksTensorParallel), both static, so the
// model asks them on every rank, also on a pipeline rank that holds no block.
#pragma once

#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>

#include "tessera/backend/backend.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/type_name.hpp"
#include "tessera/layer/args.hpp"
#include "tessera/layer/layer.hpp"

namespace tessera::parallel {
struct Plan;                 // parallel/plan.hpp: what the parallel policies read at run time
class TensorParallelGroup;   // parallel/tensor_parallel.hpp: the ranks a block splits over
class ContextParallelGroup;  // parallel/context_parallel.hpp: the ranks that share each sequence
}  // namespace tessera::parallel

namespace tessera::nn {

template <class T, Backend B>
class RopeTable;  // nn/rope.hpp: the rotary angles every block of a model shares

/// A layer that splits its heads and hidden units over BlockArgs::tp and takes its
/// input as that group's rows (parallel/tensor_parallel.hpp).
template <class L>
concept TensorParallelLayer = Layer<L> && requires {
  { L::tensor_parallel } -> std::convertible_to<bool>;
  requires L::tensor_parallel;
};

/// A layer that runs on a context-parallel rank's share of each sequence (two chunks,
/// chunk-major rows: ops/positions.hpp): what it does across positions it does over
/// BlockArgs::cp (parallel::attention_forward / attention_backward), and it places
/// each row by Geometry::positions(). A layer that works row by row may say so as it
/// is. Without it a model refuses a context-parallel degree above 1.
template <class L>
concept ContextParallelLayer = Layer<L> && requires {
  { L::context_parallel } -> std::convertible_to<bool>;
  requires L::context_parallel;
};

/// A layer whose every attention reads and extends Context::kv_cache when the forward
/// carries one (nn::Attention does), so that a model of it decodes one new row at a time
/// (layer/kv_cache.hpp). It says so with `static constexpr bool decodes_with_kv_cache =
/// true`; a model of any other block runs the whole window again for each token.
template <class L>
concept KvCacheLayer = Layer<L> && requires {
  { L::decodes_with_kv_cache } -> std::convertible_to<bool>;
  requires L::decodes_with_kv_cache;
};

/// The settings of a block that declares none of its own.
struct NoBlockOptions {};

namespace detail {
template <class Block>
struct block_options {
  using type = NoBlockOptions;
};
template <class Block>
  requires requires { typename Block::options_type; }
struct block_options<Block> {
  using type = typename Block::options_type;
};

template <class Block>
struct bare_block {
  using type = Block;
};
template <class Block>
  requires requires { typename Block::block_type; }
struct bare_block<Block> {
  using type = typename Block::block_type;
};
}  // namespace detail

/// A block's own settings type: `Block::options_type` when it declares one, else
/// NoBlockOptions. tessera::Parallel declares the one of the block it wraps.
template <class Block>
using block_options_t = typename detail::block_options<Block>::type;

/// The block a policy wrapper wraps (tessera::Parallel's block_type); a bare block itself.
template <class Block>
using bare_block_t = typename detail::bare_block<Block>::type;

/// A reference to a block's own settings, whatever their type: BlockArgs is not a template
/// of the block, so it carries them this way, and BlockArgs::options<O>() reads them back
/// as the type they were given as, or throws.
class BlockOptionsRef {
 public:
  BlockOptionsRef() = default;
  template <class O>
  explicit BlockOptionsRef(const O& options) : value_(&options), type_(&typeid(O)) {}
  template <class O>
  explicit BlockOptionsRef(const O&&) = delete;  // it would outlive a temporary

  /// The settings, if they were given as an O; else nullptr.
  template <class O>
  const O* get() const {
    return type_ != nullptr && *type_ == typeid(O) ? static_cast<const O*>(value_) : nullptr;
  }
  /// Their type, or nullptr when none were given.
  const std::type_info* type() const { return type_; }

 private:
  const void* value_ = nullptr;
  const std::type_info* type_ = nullptr;
};

/// A tensor-parallel degree as a refusal names it: by its config key when a config set it
/// ("parallelism.tensor_parallel_degree = 4"), in words when a program made the mesh in
/// code ("the mesh's tensor-parallel degree 4"), or as the static policy that fixes it
/// ("tessera::TensorParallel<4>"). What a block's own check (ChecksTensorParallel) is
/// handed, so its message names the degree the way the user gave it.
struct TensorParallelDegree {
  std::int64_t degree = 1;
  std::string named;

  /// Throws "<named> does not divide <what> <n>" (and ": <why>") unless the degree divides n.
  void check_divides(std::int64_t n, std::string_view what, std::string_view why = {}) const {
    TESSERA_CHECK(n % degree == 0, named, " does not divide ", what, " ", n, why.empty() ? "" : ": ", why);
  }
};

/// A block that states its attention term of the FLOP count itself: the training FLOPs per
/// token, of one block, of its matmuls between activations (those 6 x parameters does not
/// count), over the whole T x T square (the model halves it on request). Without it a
/// block counts as having the model's attention, torchtitan's 12 H hd T
/// (ModelArgs::attention_flops_per_token): a block without attention, or with another
/// shape of it, says so here.
template <class Block>
concept DescribesAttentionFlops =
    requires(const ModelArgs& model, const block_options_t<Block>& options, std::int64_t seq_len) {
      { Block::attention_flops_per_token(model, options, seq_len) } -> std::convertible_to<double>;
    };

/// A block that states what a tensor-parallel degree must divide in it (a hidden width),
/// throwing one line that names it (TensorParallelDegree::check_divides). The model runs
/// it on every rank before it makes anything, after its own parts' checks (the head
/// counts, the vocabulary). Without it each split layer checks itself as it is made
/// (nn::Linear: its weight's split).
template <class Block>
concept ChecksTensorParallel = requires(const ModelArgs& model, const block_options_t<Block>& options,
                                        const TensorParallelDegree& tp) {
  Block::check_tensor_parallel(model, options, tp);
};

/// torchtitan's init std for a block's output projections (wo, w2, w3).
inline double output_init_std(const ModelArgs& a, std::int64_t layer_id) {
  double depth = a.depth_init ? 2.0 * static_cast<double>(layer_id + 1) : 2.0 * static_cast<double>(a.n_layers);
  return 0.02 / std::sqrt(depth);
}

/// What the model hands each block's constructor; a user block takes the same.
template <class T, Backend B>
struct BlockArgs {
  const ModelArgs& model;
  std::int64_t layer_id;
  std::string name;  // "layers.<layer_id>"
  std::shared_ptr<RopeTable<T, B>> rope;
  const parallel::Plan* plan = nullptr;  // the run-time layout; nullptr: one rank, no checkpointing
  /// The tensor-parallel group the block splits its heads and hidden units over, and
  /// whose ranks each hold some of the rows x has (nullptr: degree 1). A block that
  /// can split says so with `static constexpr bool tensor_parallel = true`.
  parallel::TensorParallelGroup* tp = nullptr;
  /// The block's own settings, as the model was given them: read with options<O>().
  BlockOptionsRef options_ref{};
  /// The ranks that hold the other parts of each sequence (nullptr: degree 1): what a
  /// block that says `static constexpr bool context_parallel = true` attends across.
  parallel::ContextParallelGroup* cp = nullptr;

  /// The block's own settings as its `options_type` O (nn::Transformer's third
  /// argument); they live as long as the model. Throws naming both types when the model
  /// was given none, or settings of another type.
  template <class O>
  const O& options() const {
    if (const O* o = options_ref.get<O>()) return *o;
    const std::type_info* given = options_ref.type();
    const bool none = given == nullptr || *given == typeid(NoBlockOptions);
    fail(name, ": the block reads its options as ", type_name<O>(), ", but the model was given ",
         none ? std::string("none") : readable_type_name(given->name()), " (a block declares `using options_type = ",
         type_name<O>(), ";` and the model takes them: nn::Transformer<T, B, Block>(args, plan, options))");
  }
};

}  // namespace tessera::nn
