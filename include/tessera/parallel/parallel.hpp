// Parallel<Block, Policies...>: a layer wrapped in parallelism policies.
//
//   using Block = tessera::Parallel<tessera::nn::LlamaBlock<float, tessera::Cpu>,
//                                   tessera::Sharding<tessera::FSDP>,
//                                   tessera::Checkpoint<tessera::Selective<tessera::Op>>>;
//   tessera::nn::Transformer<float, tessera::Cpu, Block> model(args, plan);
//
// Block is any type satisfying nn::Layer and constructible from nn::BlockArgs: the
// Llama block or a user's own. The wrapper is itself such a layer. TensorParallel
// needs a block that splits itself over BlockArgs::tp (nn::TensorParallelLayer). Around the block's
// forward and backward it runs the sharding unit's collectives (gather before, free
// after, reduce the gradients) and the checkpoint policy's recording; the block
// computes exactly as it would alone. Policies come in any order; a family given
// twice, or something that is not a policy, stops compilation with a message naming
// it (tests/compile_fail pins the messages). A model of such blocks runs under
// parallel::ModelRuntime (nn::RuntimeOf below): the policies lay the model out. The
// wrapper's options_type is its block's, so a block's own settings (layer/block_args.hpp)
// pass through it unchanged.
#pragma once

#include <memory>
#include <type_traits>

#include "tessera/layer/block_args.hpp"
#include "tessera/layer/layer.hpp"
#include "tessera/layer/runtime.hpp"
#include "tessera/parallel/checkpoint.hpp"
#include "tessera/parallel/model_runtime.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/policies.hpp"
#include "tessera/parallel/sharding.hpp"
#include "tessera/parallel/tensor_parallel.hpp"

namespace tessera {

namespace parallel::detail {
/// Instantiated once per policy, so a diagnostic names the offending type.
template <class P>
struct check_policy {
  static_assert(is_policy<P>,
                "tessera::Parallel<Block, Policies...>: every policy must be a tessera::Sharding<...>, a "
                "tessera::TensorParallel<...>, a tessera::Pipeline<...> or a tessera::Checkpoint<...> (this one is "
                "none of them)");
  // Instantiates the policy, so the checks of its choice fire with the wrapper itself.
  static constexpr bool value = sizeof(P) > 0;
};
}  // namespace parallel::detail

template <class Block, class... Policies>
class Parallel {
  static_assert(nn::Layer<Block>,
                "tessera::Parallel<Block, Policies...>: Block must satisfy tessera::nn::Layer (forward, backward "
                "over a Context, for_each_parameter)");
  static_assert((parallel::detail::check_policy<Policies>::value && ...));
  static_assert(parallel::count_of<parallel::is_sharding, Policies...> <= 1,
                "tessera::Parallel: tessera::Sharding<...> is given more than once; give each policy family once");
  static_assert(parallel::count_of<parallel::is_checkpoint, Policies...> <= 1,
                "tessera::Parallel: tessera::Checkpoint<...> is given more than once; give each policy family once");
  static_assert(parallel::count_of<parallel::is_tensor_parallel, Policies...> <= 1,
                "tessera::Parallel: tessera::TensorParallel<...> is given more than once; give each policy family once");
  static_assert(parallel::count_of<parallel::is_pipeline, Policies...> <= 1,
                "tessera::Parallel: tessera::Pipeline<...> is given more than once; give each policy family once");
  static constexpr bool splits_over_tp = parallel::count_of<parallel::is_tensor_parallel, Policies...> == 1;
  static constexpr bool pipelined = parallel::count_of<parallel::is_pipeline, Policies...> == 1;
  static_assert(!splits_over_tp || nn::TensorParallelLayer<Block>,
                "tessera::Parallel<Block, TensorParallel<...>>: Block does not split over tensor-parallel ranks: it "
                "must declare `static constexpr bool tensor_parallel = true` and split its heads and hidden units "
                "over nn::BlockArgs::tp, as nn::LlamaBlock does");

 public:
  using scalar_type = typename Block::scalar_type;
  using backend_type = typename Block::backend_type;
  using block_type = Block;
  /// The wrapped block's gradients follow layer.hpp's first-write rule: the wrapper
  /// zeroes them before a block that does not declare it runs its backward.
  static constexpr bool writes_gradients_first = true;
  /// The block's own settings: the model hands them through to the block (BlockArgs).
  using options_type = nn::block_options_t<Block>;
  /// Runs on a context-parallel rank's share of each sequence when its block does.
  static constexpr bool context_parallel = nn::ContextParallelLayer<Block>;
  /// Decodes through a KV cache when its block does.
  static constexpr bool decodes_with_kv_cache = nn::KvCacheLayer<Block>;
  using sharding_policy = typename parallel::find_policy<parallel::is_sharding, Sharding<None>, Policies...>::type;
  using checkpoint_policy =
      typename parallel::find_policy<parallel::is_checkpoint, Checkpoint<None>, Policies...>::type;
  using tensor_parallel_policy =
      typename parallel::find_policy<parallel::is_tensor_parallel, TensorParallel<1>, Policies...>::type;
  using pipeline_policy = typename parallel::find_policy<parallel::is_pipeline, Pipeline<1>, Policies...>::type;
  using T = scalar_type;
  using B = backend_type;

  /// The sharding this wrapper's type and a Plan give: the model applies the same
  /// to its outer units (the embedding; norm + output).
  static parallel::ShardingMode sharding_mode(const parallel::Plan& plan) {
    return parallel::sharding_mode<typename sharding_policy::mode>(plan);
  }

  /// The tensor-parallel degree this wrapper's type and a Plan give (1: no TensorParallel).
  static int tensor_parallel_degree(const parallel::Plan& plan) {
    if constexpr (splits_over_tp)
      return parallel::tensor_parallel_degree<tensor_parallel_policy>(plan);
    else
      return 1;
  }

  /// The pipeline degree and schedule this wrapper's type and a Plan give (degree 1: no Pipeline).
  static int pipeline_degree(const parallel::Plan& plan) {
    if constexpr (pipelined)
      return parallel::pipeline_degree<pipeline_policy>(plan);
    else
      return 1;
  }
  static parallel::ScheduleKind pipeline_schedule(const parallel::Plan& plan) {
    return parallel::pipeline_schedule<pipeline_policy>(plan);
  }

  explicit Parallel(const nn::BlockArgs<T, B>& args) : block_(block_args(args)) {
    static const parallel::Plan kOneRank{};
    const parallel::Plan& plan = args.plan ? *args.plan : kOneRank;
    checkpoint_ = parallel::checkpoint_for_layer(
        parallel::checkpoint_mode<typename checkpoint_policy::mode>(plan), args.layer_id);
    const parallel::ShardingMode mode = sharding_mode(plan);
    pipelined_ = pipeline_degree(plan) > 1;
    if (mode != parallel::ShardingMode::none || plan.dp_degree() > 1 || plan.cp_degree() > 1) {
      // torchtitan's default keeps the last block gathered: its backward comes next.
      // In a pipeline every block runs again for the next microbatch: it stays gathered
      // through the pass, and the model reduces and frees it after its last backward.
      const bool last = args.layer_id + 1 == args.model.n_layers;
      const bool reshard = !pipelined_ && (plan.reshard == parallel::Reshard::always ||
                                           (plan.reshard == parallel::Reshard::default_policy && !last));
      unit_ = std::make_unique<parallel::ShardedUnit<T, B>>(args.name, mode, plan, reshard);
      block_.for_each_parameter([&](nn::Parameter<T>& p) { unit_->add(p); });
    }
  }
  Parallel(const Parallel&) = delete;  // the unit points into the block
  Parallel& operator=(const Parallel&) = delete;

  Tensor<T> forward(const nn::Context<T>& ctx, const Tensor<T>& x) {
    if (unit_) unit_->unshard();
    Tensor<T> y = parallel::checkpointed_forward(block_, checkpoint_, ctx, x);
    // Without a backward to come (no store: inference), always free.
    if (unit_ && (unit_->reshard_after_forward() || !ctx.saving())) unit_->reshard();
    return y;
  }

  Tensor<T> backward(const nn::Context<T>& ctx, const Tensor<T>& dy) {
    if (unit_) {
      unit_->unshard();
      unit_->begin_grads();
    }
    nn::prepare_gradients(block_);  // zeros for a block that only adds into its gradients
    Tensor<T> dx = parallel::checkpointed_backward(block_, checkpoint_, ctx, dy);
    if (unit_ && !pipelined_) {
      unit_->reduce_grads(last_micro_batch_);
      unit_->reshard();
    }
    return dx;
  }

  template <class F>
  void for_each_parameter(F&& f) {
    block_.for_each_parameter(f);
  }

  /// The sharding unit, or nullptr on one rank without sharding.
  parallel::ShardedUnit<T, B>* unit() { return unit_.get(); }
  /// Whether the backward about to run is the step's last micro-batch (DDP reduces then).
  void set_last_micro_batch(bool last) { last_micro_batch_ = last; }
  const parallel::CheckpointMode& checkpoint() const { return checkpoint_; }
  Block& block() { return block_; }

 private:
  /// The block's arguments: the tensor-parallel group only under a TensorParallel
  /// policy, whose degree and head counts must match the run-time model and mesh.
  static nn::BlockArgs<T, B> block_args(nn::BlockArgs<T, B> args) {
    const int have = args.tp ? args.tp->degree() : 1;
    const parallel::Wording w = args.plan ? args.plan->wording() : parallel::code_words;
    if constexpr (splits_over_tp) {
      using P = tensor_parallel_policy;
      if constexpr (!P::dynamic_degree)
        TESSERA_CHECK(have == P::degree, args.name, ": tessera::TensorParallel<", P::degree, "> on a mesh whose ",
                      w.pick("tensor_parallel_degree", "tensor-parallel degree"), " is ", have);
      if constexpr (P::heads_given)
        TESSERA_CHECK(args.model.n_heads == P::heads::n_heads && args.model.kv_heads() == P::heads::n_kv_heads,
                      args.name, ": tessera::TensorParallel<N, Heads<", P::heads::n_heads, ", ", P::heads::n_kv_heads,
                      ">> on a model with ", args.model.n_heads, " heads and ", args.model.kv_heads(), " kv heads");
    } else {
      TESSERA_CHECK(have == 1, args.name, ": ", w(parallel::settings::tensor_parallel_degree, have),
                    " needs a tessera::TensorParallel<...> policy on the block");
      args.tp = nullptr;
    }
    return args;
  }

  Block block_;
  parallel::CheckpointMode checkpoint_{};
  bool pipelined_ = false;
  std::unique_ptr<parallel::ShardedUnit<T, B>> unit_;
  bool last_micro_batch_ = true;
};

/// A model of Parallel blocks runs under parallel::ModelRuntime: the policies lay it out.
template <class Block, class... Policies>
struct nn::RuntimeOf<Parallel<Block, Policies...>> {
  using type = parallel::ModelRuntime<Parallel<Block, Policies...>>;
};

}  // namespace tessera
