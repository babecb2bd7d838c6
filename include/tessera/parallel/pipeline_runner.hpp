// The pipeline runtime: one rank's lowered program (pipeline_program.hpp) walked over
// the stages a model holds on that rank.
//
// The stages' side (model_pipeline.hpp, over a model's parts) knows how a stage's forward
// runs for a microbatch (from the token ids on stage 0, from a received activation
// elsewhere), how its backward runs from an output gradient (the head's own on the last
// stage), and what weight-gradient work a zero-bubble schedule's backward_input leaves
// for its backward_weight. It gives them through the PipelineStages interface below and
// keeps whatever it saves between a microbatch's forward and backward. The runner knows the rest of a pass: which transfer
// groups go out when, which recv a compute waits for, where each tensor in flight lives.
//   - each group of the program is one Communicator::send_recv_async call, every PeerOp
//     tag 0: the engines match transfers in issue order, as NCCL does;
//   - a compute that takes a received tensor waits for its recv's group first (the time
//     spent waiting is the pass's wait_seconds: this rank's share of the bubble,
//     measured);
//   - a send's buffer stays alive until its group has completed; a tensor whose producer
//     and consumer share a rank (one rank only) is handed over in memory;
//   - every group has completed before the pass returns, even when a stage throws.
// The loss the last stage's forwards add up is summed over the pipeline ranks
// (all_reduce_host), so every rank returns the pass's loss; stages that keep their loss
// in the backend's memory (kLossOnDevice) sum it there themselves, and the host reads
// nothing.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <map>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tessera/backend/backend.hpp"
#include "tessera/comm/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/profile.hpp"
#include "tessera/parallel/host_values.hpp"
#include "tessera/parallel/pipeline_program.hpp"

namespace tessera::parallel {

/// The stages a model holds on one pipeline rank, for one pass. `tensor_type` is what
/// crosses between stages (a Tensor<T>).
///   transfer_buffer()                 an unfilled tensor of the shape that crosses between stages
///   forward(stage, m, input, loss)    the stage's forward for microbatch m; `input` is empty on
///                                     stage 0 (it reads the tokens); returns the output, empty on
///                                     the last stage, whose forward adds its loss sum to `loss`
///   backward(stage, m, dy, defer)     the stage's backward for microbatch m from its output gradient
///                                     (empty on the last stage: the head's own); returns the input
///                                     gradient, empty on stage 0; with `defer`, the weight-gradient
///                                     work is left for backward_weight
///   backward_weight(stage, m)         runs the work a deferring backward left
/// A stage type with `static constexpr bool kLossOnDevice = true` adds its loss into memory
/// of its own instead (`loss` untouched): the pass then returns 0 as its loss, and the
/// stages sum theirs over the pipeline (the model's do, on the device).
template <class S>
concept PipelineStages = requires(S& s, typename S::tensor_type x, int stage, int m, double& loss, bool defer) {
  typename S::tensor_type;
  { s.transfer_buffer() } -> std::same_as<typename S::tensor_type>;
  { s.forward(stage, m, std::move(x), loss) } -> std::same_as<typename S::tensor_type>;
  { s.backward(stage, m, std::move(x), defer) } -> std::same_as<typename S::tensor_type>;
  s.backward_weight(stage, m);
};

/// What one pass measured.
struct PipelinePass {
  double loss = 0;          ///< the sum of token losses, the same on every pipeline rank
  double wait_seconds = 0;  ///< how long this rank waited for received activations and gradients
};

/// Runs rank `rank`'s part of `program` over `stages`, moving tensors over `pp` (the
/// pipeline communicator, whose rank `rank` is). A collective over the pipeline ranks:
/// each runs its own part of the same program.
template <Backend B, PipelineStages Stages>
PipelinePass run_pipeline(const Program& program, int rank, comm::Communicator& pp, Stages& stages) {
  using Tensor = typename Stages::tensor_type;
  using Element = std::remove_cv_t<std::remove_pointer_t<decltype(std::declval<Tensor&>().data())>>;
  TESSERA_CHECK(rank >= 0 && rank < program.ranks && pp.size() == program.ranks && pp.rank() == rank,
                "pipeline: a program for ", program.ranks, " ranks run as rank ", rank, " of a communicator of ",
                pp.size());
  const int S = program.stages();
  using Key = std::tuple<int, int, int>;  // (carries, stage, microbatch)
  auto key = [](const Payload& x) { return Key{static_cast<int>(x.what), x.stage, x.microbatch}; };

  struct Group {
    std::vector<Tensor> buffers;  // sent and received tensors, alive until the group completes
    comm::Handle handle;          // declared last: destroyed (so completed) first
  };
  std::vector<Group> groups;
  std::map<Key, std::size_t> received_in;  // a received tensor: the group whose completion gives it
  std::map<Key, Tensor> ready;             // tensors made here or received, until a compute takes them
  PipelinePass pass;

  auto complete = [&](std::size_t g) {
    Group& group = groups[g];
    if (!group.handle.pending()) return;
    group.handle.wait();
    group.buffers.clear();  // ready holds the received ones
  };
  auto take = [&](const Payload& x) {
    auto it = ready.find(key(x));
    TESSERA_CHECK(it != ready.end(), "pipeline: rank ", rank, " has no ", detail::carries_name(x.what), " of stage ",
                  x.stage, ", microbatch ", x.microbatch, " (a bug in the lowered program)");
    Tensor t = std::move(it->second);
    ready.erase(it);
    return t;
  };

  try {
    for (const Step& step : program.per_rank[static_cast<std::size_t>(rank)]) {
      if (step.kind == Step::Kind::transfers) {
        Group group;
        std::vector<comm::PeerOp> ops;
        for (const Transfer& t : step.group) {
          Tensor buffer;
          if (t.kind == Transfer::Kind::send) {
            buffer = take(t.payload);
          } else {
            buffer = stages.transfer_buffer();
            received_in[key(t.payload)] = groups.size();
            ready[key(t.payload)] = buffer;
          }
          ops.push_back({t.kind == Transfer::Kind::send ? comm::PeerOp::Kind::send : comm::PeerOp::Kind::recv, t.peer,
                         buffer.data(), static_cast<std::size_t>(buffer.numel()), comm::data_type_of<Element>(), 0});
          group.buffers.push_back(std::move(buffer));
        }
        group.handle = pp.send_recv_async(std::span<const comm::PeerOp>(ops));
        groups.push_back(std::move(group));
        continue;
      }
      const Action& a = step.action;
      Tensor input;
      if (const auto in = input_of(a, S)) {
        if (auto it = received_in.find(key(*in)); it != received_in.end()) {
          const profile::Span span("pipeline", "pipeline wait");
          const auto t0 = std::chrono::steady_clock::now();
          complete(it->second);
          pass.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          received_in.erase(it);
        }
        input = take(*in);
      }
      Tensor output;
      // PyTorch's label of the action: stage, op letter, microbatch ("1F0", "0W3").
      const profile::Span span("pipeline", [&] {
        return ::tessera::detail::concat(a.stage, "FBIW"[static_cast<int>(a.op)], a.microbatch);
      });
      switch (a.op) {
        case Op::forward: output = stages.forward(a.stage, a.microbatch, std::move(input), pass.loss); break;
        case Op::backward:
        case Op::backward_input:
          output = stages.backward(a.stage, a.microbatch, std::move(input), a.op == Op::backward_input);
          break;
        case Op::backward_weight: stages.backward_weight(a.stage, a.microbatch); break;
      }
      if (const auto out = output_of(a, S)) {
        TESSERA_CHECK(!output.empty(), "pipeline: rank ", rank, ": ", detail::spell(a), " gave no output");
        ready[key(*out)] = std::move(output);
      }
    }
    for (std::size_t g = 0; g < groups.size(); ++g) complete(g);
  } catch (...) {
    groups.clear();  // each handle completes before its buffers go
    throw;
  }
  TESSERA_CHECK(ready.empty(), "pipeline: rank ", rank, " ended its pass with ", ready.size(),
                " tensors nobody took (a bug in the lowered program)");
  if constexpr (!requires { Stages::kLossOnDevice; }) pass.loss = all_reduce_host<B>(pp, pass.loss);
  return pass;
}

}  // namespace tessera::parallel
