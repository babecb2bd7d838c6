// The policy types and the rules for combining them.
//
//   tessera::Parallel<Block, tessera::Sharding<tessera::FSDP>, tessera::Checkpoint<tessera::Full>>
//
// A policy is an empty tag type; a policy family (Sharding, Checkpoint) is a template
// over its choice. Policies may be given in any order. Giving a family twice, or a
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
struct Layer {};
/// Selective<Op>, or Selective<Layer, K>: every K-th block fully checkpointed.
template <class What, int K = 0>
struct Selective {
  static_assert(std::is_same_v<What, Op> || std::is_same_v<What, Layer>,
                "tessera::Selective<What, K>: What must be tessera::Op or tessera::Layer");
  static_assert(!std::is_same_v<What, Layer> || K >= 1,
                "tessera::Selective<Layer, K>: K (checkpoint every K-th block) must be at least 1");
  static_assert(!std::is_same_v<What, Op> || K == 0, "tessera::Selective<Op>: takes no K");
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
struct is_selective_layer<Selective<Layer, K>> : std::true_type {};
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
                "tessera::Selective<tessera::Layer, K> or tessera::Dynamic (tessera::Op and tessera::Layer go inside "
                "tessera::Selective<...>)");
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
inline constexpr bool is_policy = is_sharding<P>::value || is_checkpoint<P>::value;

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
    return []<int K2>(Selective<Layer, K2>*) { return CheckpointMode{K::selective_layer, K2}; }(
        static_cast<Mode*>(nullptr));
  else
    return {K::none, 0};  // unreachable: Checkpoint<Mode> has refused Mode already
}

}  // namespace parallel
}  // namespace tessera
