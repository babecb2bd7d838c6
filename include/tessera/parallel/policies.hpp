// The policy types and the rules for combining them.
//
//   tessera::Parallel<Block, tessera::Sharding<tessera::FSDP>, tessera::TensorParallel<2>,
//                     tessera::Checkpoint<tessera::Full>>
//
// A policy is an empty tag type; a policy family (Sharding, Checkpoint,
// TensorParallel, Pipeline) is a template over its choice. A degree is static
// (TensorParallel<2>) or tessera::dynamic, read from the mesh, as std::extent and
// std::dynamic_extent. Policies may be given in any order. Giving a family twice, or a
// choice a family does not know, is a static_assert whose message names the policy and
// the rule (tests/compile_fail pins the messages). Dynamic defers the choice to the
// run-time Plan (parallel/plan.hpp), as std::dynamic_extent defers an extent.
#pragma once

#include <cstddef>
#include <type_traits>

#include "tessera/parallel/plan.hpp"

namespace tessera {

/// The choice is read from the run-time Plan (the binaries' configs).
struct Dynamic {};
/// No sharding, or no checkpointing.
struct None {};

// Sharding choices.
struct FSDP {};  // parameters, gradients and optimizer states sharded over dp_shard
struct HSDP {};  // sharded over dp_shard, replicated over dp_replicate
struct DDP {};   // replicated; gradients all-reduced in per-unit buckets

// Checkpoint choices.
struct Full {};  // recompute the whole block from its input
struct Op {};    // keep matmul and attention outputs, recompute the rest
struct EveryNthBlock {};  // with Selective<EveryNthBlock, K>: every K-th block as Full
/// Selective<Op>, or Selective<EveryNthBlock, K>: every K-th block fully checkpointed.
/// (Not `Layer`: tessera::nn::Layer is the layer concept, and a user with both
/// namespaces in use would have the two names collide.)
template <class What, int K = 0>
struct Selective {
  static_assert(std::is_same_v<What, Op> || std::is_same_v<What, EveryNthBlock>,
                "tessera::Selective<What, K>: What must be tessera::Op or tessera::EveryNthBlock");
  static_assert(!std::is_same_v<What, EveryNthBlock> || K >= 1,
                "tessera::Selective<EveryNthBlock, K>: K (checkpoint every K-th block) must be at least 1");
  static_assert(!std::is_same_v<What, Op> || K == 0, "tessera::Selective<Op>: takes no K");
};

/// A degree read from the mesh at run time: TensorParallel<tessera::dynamic>.
inline constexpr Dynamic dynamic{};

/// Head counts a static TensorParallel<N, Heads<H, KV>> is checked against at compile
/// time (and the model's against them at run time).
template <int H, int KV = H>
struct Heads {
  static_assert(H >= 1 && KV >= 1 && H % KV == 0,
                "tessera::Heads<H, KV>: H query heads and KV key/value heads, KV dividing H");
  static constexpr int n_heads = H;
  static constexpr int n_kv_heads = KV;
};
/// No head counts given: a static degree is checked against the model at run time only.
struct AnyHeads {};

/// Tensor parallelism over N ranks (parallel/tensor_parallel.hpp), or over the mesh's
/// tp degree with N = tessera::dynamic.
template <auto N, class H = AnyHeads>
struct TensorParallel {
  static constexpr bool dynamic_degree = std::is_same_v<std::remove_cvref_t<decltype(N)>, Dynamic>;
  static_assert(dynamic_degree || std::is_integral_v<std::remove_cvref_t<decltype(N)>>,
                "tessera::TensorParallel<N>: N must be a degree (an integer) or tessera::dynamic");
  static constexpr int degree = [] {
    if constexpr (dynamic_degree)
      return 0;
    else if constexpr (std::is_integral_v<std::remove_cvref_t<decltype(N)>>)
      return static_cast<int>(N);
    else
      return 1;  // refused above; 1 keeps the checks below quiet
  }();
  static_assert(dynamic_degree || degree >= 1, "tessera::TensorParallel<N>: the degree N must be at least 1");
  static constexpr bool heads_given = !std::is_same_v<H, AnyHeads>;
  static constexpr bool heads_divide = [] {
    if constexpr (heads_given && !dynamic_degree)
      return degree < 1 || H::n_heads % degree == 0;
    return true;
  }();
  static_assert(heads_divide, "tessera::TensorParallel<N, Heads<H, KV>>: N does not divide the query head count H "
                              "(each rank computes H / N heads)");
  static_assert(!heads_divide || [] {
    if constexpr (heads_given && !dynamic_degree)
      return degree < 1 || H::n_kv_heads % degree == 0 || degree % H::n_kv_heads == 0;
    return true;
  }(), "tessera::TensorParallel<N, Heads<H, KV>>: N and the key/value head count KV must divide one another "
       "(with more ranks than kv heads each kv head is replicated over the ranks that read it)");
  using heads = H;
};

// Pipeline schedules (parallel/schedule.hpp), each the run-time schedule it fixes.
template <parallel::ScheduleKind K>
struct ScheduleTag {
  static constexpr parallel::ScheduleKind kind = K;
};
struct GPipe : ScheduleTag<parallel::ScheduleKind::gpipe> {};
struct OneFOneB : ScheduleTag<parallel::ScheduleKind::one_f_one_b> {};  // "1F1B"
// several stages per rank
struct Interleaved1F1B : ScheduleTag<parallel::ScheduleKind::interleaved_1f1b> {};
// backward split into input and weight gradients
struct InterleavedZeroBubble : ScheduleTag<parallel::ScheduleKind::interleaved_zero_bubble> {};
// several stages per rank, breadth first
struct LoopedBFS : ScheduleTag<parallel::ScheduleKind::looped_bfs> {};
// two stages per rank down and back up, split backwards
struct ZBVZeroBubble : ScheduleTag<parallel::ScheduleKind::zbv_zero_bubble> {};
// the same placement, forwards paired with whole backwards
struct DualPipeV : ScheduleTag<parallel::ScheduleKind::dual_pipe_v> {};

namespace detail {
/// One of the schedule tags above (a type with no `kind`, such as a checkpoint choice, is not).
template <class S>
concept schedule_tag = requires { S::kind; } && std::is_base_of_v<ScheduleTag<S::kind>, S>;
}  // namespace detail

/// Pipeline parallelism over Stages ranks (or the mesh's pp degree with
/// tessera::dynamic), run by Schedule (Dynamic: the Plan's pipeline_parallel_schedule).
/// The model's runtime cuts its blocks into stages and runs them by the schedule
/// (parallel/model_pipeline.hpp); every block of the model carries the same policy.
template <auto Stages, class Schedule = Dynamic>
struct Pipeline {
  static constexpr bool dynamic_degree = std::is_same_v<std::remove_cvref_t<decltype(Stages)>, Dynamic>;
  static_assert(dynamic_degree || std::is_integral_v<std::remove_cvref_t<decltype(Stages)>>,
                "tessera::Pipeline<Stages, Schedule>: Stages must be a degree (an integer) or tessera::dynamic");
  static constexpr int degree = [] {
    if constexpr (dynamic_degree)
      return 0;
    else
      return static_cast<int>(Stages);
  }();
  static_assert(dynamic_degree || degree >= 1, "tessera::Pipeline<Stages, Schedule>: Stages must be at least 1");
  static_assert(std::is_same_v<Schedule, Dynamic> || detail::schedule_tag<Schedule>,
                "tessera::Pipeline<Stages, Schedule>: Schedule must be tessera::GPipe, tessera::OneFOneB, "
                "tessera::Interleaved1F1B, tessera::InterleavedZeroBubble, tessera::LoopedBFS, "
                "tessera::ZBVZeroBubble, tessera::DualPipeV or tessera::Dynamic");
  using schedule = Schedule;
};

namespace detail {
template <class T>
inline constexpr bool is_sharding_choice = std::is_same_v<T, None> || std::is_same_v<T, FSDP> ||
                                           std::is_same_v<T, HSDP> || std::is_same_v<T, DDP> ||
                                           std::is_same_v<T, Dynamic>;
template <class T>
struct is_selective : std::false_type {};
template <class W, int K>
struct is_selective<Selective<W, K>> : std::true_type {};
template <class T>
struct is_selective_layer : std::false_type {};
template <int K>
struct is_selective_layer<Selective<EveryNthBlock, K>> : std::true_type {};
template <class T>
inline constexpr bool is_checkpoint_choice = std::is_same_v<T, None> || std::is_same_v<T, Full> ||
                                             std::is_same_v<T, Dynamic> || is_selective<T>::value;
}  // namespace detail

template <class Mode>
struct Sharding {
  static_assert(detail::is_sharding_choice<Mode>,
                "tessera::Sharding<Mode>: Mode must be tessera::FSDP, tessera::HSDP, tessera::DDP, tessera::None "
                "or tessera::Dynamic");
  using mode = Mode;
};

template <class Mode>
struct Checkpoint {
  static_assert(detail::is_checkpoint_choice<Mode>,
                "tessera::Checkpoint<Mode>: Mode must be tessera::None, tessera::Full, tessera::Selective<tessera::Op>, "
                "tessera::Selective<tessera::EveryNthBlock, K> or tessera::Dynamic (tessera::Op and "
                "tessera::EveryNthBlock go inside tessera::Selective<...>)");
  // Instantiates Selective<What, K>, so its own checks fire here too.
  static_assert(!detail::is_selective<Mode>::value || sizeof(Mode) > 0);
  using mode = Mode;
};

namespace parallel {

template <class P>
struct is_sharding : std::false_type {};
template <class M>
struct is_sharding<Sharding<M>> : std::true_type {};
template <class P>
struct is_checkpoint : std::false_type {};
template <class M>
struct is_checkpoint<Checkpoint<M>> : std::true_type {};

template <class P>
struct is_tensor_parallel : std::false_type {};
template <auto N, class H>
struct is_tensor_parallel<TensorParallel<N, H>> : std::true_type {};

template <class P>
struct is_pipeline : std::false_type {};
template <auto N, class S>
struct is_pipeline<Pipeline<N, S>> : std::true_type {};

template <class P>
inline constexpr bool is_policy =
    is_sharding<P>::value || is_checkpoint<P>::value || is_tensor_parallel<P>::value || is_pipeline<P>::value;

template <template <class> class Is, class... Ps>
inline constexpr std::size_t count_of = (std::size_t{0} + ... + (Is<Ps>::value ? 1 : 0));

/// The policy of a family among Ps, or Default when none is given.
template <template <class> class Is, class Default, class... Ps>
struct find_policy {
  using type = Default;
};
template <template <class> class Is, class Default, class P, class... Ps>
struct find_policy<Is, Default, P, Ps...> {
  using type = std::conditional_t<Is<P>::value, P, typename find_policy<Is, Default, Ps...>::type>;
};

/// The run-time sharding a static choice means, or the Plan's for Dynamic.
template <class Mode>
ShardingMode sharding_mode(const Plan& plan) {
  if constexpr (std::is_same_v<Mode, Dynamic>)
    return plan.dynamic_sharding();
  else if constexpr (std::is_same_v<Mode, None>)
    return ShardingMode::none;
  else if constexpr (std::is_same_v<Mode, FSDP>)
    return ShardingMode::fsdp;
  else if constexpr (std::is_same_v<Mode, HSDP>)
    return ShardingMode::hsdp;
  else
    return ShardingMode::ddp;
}

/// The tensor-parallel degree a TensorParallel policy means on `plan`.
template <class P>
int tensor_parallel_degree(const Plan& plan) {
  if constexpr (P::dynamic_degree)
    return plan.tp_degree();
  else
    return P::degree;
}

/// The pipeline degree a Pipeline policy means on `plan`.
template <class P>
int pipeline_degree(const Plan& plan) {
  if constexpr (P::dynamic_degree)
    return plan.pp_degree();
  else
    return P::degree;
}

/// The schedule a Pipeline policy means on `plan`.
template <class P>
ScheduleKind pipeline_schedule(const Plan& plan) {
  using S = typename P::schedule;
  if constexpr (std::is_same_v<S, Dynamic>)
    return plan.pipeline.schedule;
  else
    return S::kind;
}

/// The run-time checkpointing a static choice means, or the Plan's for Dynamic.
template <class Mode>
CheckpointMode checkpoint_mode(const Plan& plan) {
  using K = CheckpointMode::Kind;
  if constexpr (std::is_same_v<Mode, Dynamic>)
    return plan.checkpoint;
  else if constexpr (std::is_same_v<Mode, None>)
    return {K::none, 0};
  else if constexpr (std::is_same_v<Mode, Full>)
    return {K::full, 0};
  else if constexpr (std::is_same_v<Mode, Selective<Op>>)
    return {K::selective_op, 0};
  else if constexpr (tessera::detail::is_selective_layer<Mode>::value)
    return []<int K2>(Selective<EveryNthBlock, K2>*) { return CheckpointMode{K::selective_layer, K2}; }(
        static_cast<Mode*>(nullptr));
  else
    return {K::none, 0};  // unreachable: Checkpoint<Mode> has refused Mode already
}

}  // namespace parallel
}  // namespace tessera
