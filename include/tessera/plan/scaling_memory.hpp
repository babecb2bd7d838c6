// The memory of a training step on another runtime: Aleph Alpha's `scaling`, the
// Megatron-style PyTorch runtime that produced Hagemann et al.'s published layout sheets
// (ZeRO-1 x tensor x pipeline parallelism on A100s; tests/plan/layouts/).
//
// Why a model of someone else's runtime. llama-plan's memory figures come from a trace of
// tessera's own step (plan/dry_run.hpp), and that is the right answer for a layout tessera
// will run. A published out-of-memory is a fact about the program that ran, and that
// program holds much more than tessera: whole logits of every microbatch in fp32 on every
// tensor-parallel rank (tessera: 1/64 of the device, split by vocabulary), norms and the
// residual stream on whole rows (tessera: sequence-parallel), an unfused RMSNorm keeping
// an fp32 copy of its input, the stage outputs kept until their gradients come back. No
// rewrite of tessera's trace turns one into the other, so the runtime's memory is counted
// here from what its code keeps, term by term, to check the planner's fit predictions
// against the sheets' (llama-plan --plan.runtime scaling). The step's time is still priced
// from tessera's trace.
//
// Every term below is read from the runtime's public code, github.com/Aleph-Alpha/scaling
// (v0.1.0, the first public commit, for the unfused RMSNorm and the "RMS kernel"; v0.2.0
// elsewhere), with PyTorch's autograd rules for what an operation saves. Notation: b the
// microbatch, s the sequence, h the model dimension, f the SwiGLU hidden size, V the
// vocabulary, t the tensor-parallel degree, d the data-parallel degree, P a rank's
// parameters.
//
// - State (optimizer/parameter_group.py, ZeRO-1): bf16 parameters whole (a flat buffer),
//   bf16 gradients whole (per parameter, accumulated over the microbatches), the fp32
//   master copy and AdamW's two moments over the d ranks: 2P + 2P + 12P/d.
// - Each layer, each microbatch in flight, without checkpointing:
//   * RMSNorm, twice. Torch's (v0.1.0 `self._norm(x.float()).type_as(x) * weight`): the
//     fp32 copy of the input, the bf16 normalised rows and the fp32 rstd: 6bsh + 4bs. The
//     "RMS kernel" (flash-attn's fused rms_norm): the bf16 input and rstd: 2bsh + 4bs.
//     Either way the norm's output is the next linear's saved input: 2bsh. No sequence
//     parallelism in the sheets: whole rows on every tensor-parallel rank.
//   * Attention, the t-th share of the heads. FlashAttention (1 or 2): q and k after the
//     rotary embedding, v, the output, and the dense projection's input, which is the
//     output's rearranged copy when a microbatch holds several sequences and a view of the
//     output for one (core/nn/attention/attention.py:259, 616; einops views where the
//     strides allow): 2bs(2h + 2 kv_dim)/t, + 2bsh/t for b > 1; the fp32 log-sum-exp
//     4b(n/t)s, the rotary tables' gathered rows 8bs hd. Torch's attention: q, k, v and the context, 2bs(2h + 2 kv_dim)/t,
//     the softmax output in bf16, 2b(n/t)s^2, and the boolean causal mask, bs^2. The
//     "fused" softmax (Megatron's fused scale-mask-softmax) keeps no mask.
//   * SwiGLU (mlp.py, separate gate and up projections): the gate's output, the up
//     projection's, silu's output and the product, 4 x 2bsf/t.
// - Full checkpointing (every_layer: torch's non-reentrant checkpoint of each layer): the
//   layer's input, 2bsh, per layer and microbatch; one layer's whole set while it is
//   recomputed in the backward.
// - Pipeline (DeepSpeed-style 1F1B, pipeline_schedule/train.py): stage i of p holds
//   min(p - i, microbatches) microbatches in flight. Each keeps its output until the
//   gradient returns (2bsh, not on the last stage) and its received input's clone (2bsh,
//   not on the first); one receive buffer for activations and one for gradients persist.
//   Stages split [embedding, the layers, final norm, head] uniformly, the remainder to the
//   first stages (pipeline_partitioning.py).
// - The loss (lm_head.py, losses/cross_entropy.py): the head's logits are gathered whole
//   on every tensor-parallel rank (ColumnParallelLinear, parallel_output false), then
//   .float() and cross_entropy. At the backward of a microbatch's loss: its bf16 logits and
//   the previous microbatch's (the pipeline's output buffer keeps two), the fp32
//   log-softmax saved by the forward, the gradient from the NLL and log-softmax's own
//   gradient, all fp32: 2 + 2 + 4 + 4 + 4 = 16 bytes per logit, 16bsV.
// - The optimizer step (optimizer/allreduce.py): the gradients are all-reduced in buckets
//   of 500M elements, each flattened to bf16 and copied to fp32 for the all-reduce, 6 bytes
//   an element of one bucket; the last stage's output buffer still holds two microbatches'
//   bf16 logits, 4bsV.
//
// A stage's peak is the largest of: its state with the microbatches in flight; on the last
// stage, its state, one microbatch in flight and the loss's backward; its state with the
// step's transients.
//
// What the device must hold is more than that count: PyTorch's caching allocator keeps
// freed blocks for reuse, split and cached by size, and the tensors of a step do not
// pack its reservation. GMLake (Guo et al., ASPLOS 2024, arXiv:2401.08156) measured
// that on A100 80GB for eight LLMs' training: fragmentation = 1 - peak active memory /
// peak reserved memory (their README's definition), which their allocator reduced by
// 15% on average (up to 33%) while keeping its own below about 10% at scale. So
// PyTorch's averaged at least 15% of what it reserved; the stage's reservation is its
// peak / (1 - 0.15), and that is what must fit (kTorchAllocatorFragmentation;
// plan.fragmentation sets another). Their runs were DeepSpeed ZeRO-3 fine-tuning with
// recomputation, LoRA and offload; no figure of the sheets' runtime is published.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/comm/mesh.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layer/args.hpp"

namespace tessera::plan {

/// plan.rmsnorm's name for the runtime's RMSNorm: flash-attn's fused kernel, or torch's.
inline std::string_view scaling_rmsnorm_name(bool fused) { return fused ? "fused" : "torch"; }

/// The runtime's attention kernels, as the sheets' `kernel` column names them.
enum class ScalingAttention { torch, fused, flash1, flash2 };

inline ScalingAttention parse_scaling_attention(std::string_view s) {
  if (s == "torch") return ScalingAttention::torch;
  if (s == "fused") return ScalingAttention::fused;
  if (s == "flash1") return ScalingAttention::flash1;
  if (s == "flash2") return ScalingAttention::flash2;
  throw Error(tessera::detail::concat("plan.attention ", s, ": expected torch, fused, flash1 or flash2"));
}

inline std::string_view scaling_attention_name(ScalingAttention a) {
  switch (a) {
    case ScalingAttention::torch: return "torch";
    case ScalingAttention::fused: return "fused";
    case ScalingAttention::flash1: return "flash1";
    case ScalingAttention::flash2: return "flash2";
  }
  return "?";
}

/// The share of PyTorch's caching allocator's peak reservation that its live tensors do
/// not fill at their peak (GMLake's average on A100 80GB; the header comment).
inline constexpr double kTorchAllocatorFragmentation = 0.15;

/// One run of the runtime: the model, the layout, the batch and the kernels.
struct ScalingRun {
  nn::ModelArgs args;
  comm::MeshShape mesh;            // dp_replicate x tp x pp (ZeRO-1 over the replicas)
  std::int64_t microbatch = 1;     // sequences per microbatch
  std::int64_t seq_len = 2048;
  std::int64_t microbatches = 1;   // per step, on one data-parallel rank
  bool full_checkpoint = false;    // every_layer, else none
  ScalingAttention attention = ScalingAttention::flash2;
  bool fused_rmsnorm = false;      // flash-attn's RMSNorm kernel, else torch's
  double fragmentation = kTorchAllocatorFragmentation;  // 1 - live peak / reserved peak, in [0, 1)
};

/// One pipeline stage of the runtime: what it holds and what it keeps at each moment.
struct ScalingStage {
  int first_layer = 0, layers = 0;
  bool embedding = false, head = false;  // the token embedding; the final norm and the head
  std::int64_t parameters = 0;           // on one rank: its tensor-parallel share
  int in_flight = 1;                     // microbatches whose activations it holds at once
  double state_bytes = 0;                // parameters, gradients, the optimizer's shard
  double activation_bytes = 0;           // saved for the backward at the most in flight, with buffers
  double loss_bytes = 0;                 // the last stage: the logits at a loss's backward
  double step_bytes = 0;                 // the gradient all-reduce's bucket and the logits kept
  double peak_bytes = 0;                 // live tensors at the peak
  double reserved_bytes = 0;             // what the caching allocator holds then: peak / (1 - fragmentation)
};

/// Items per stage of the runtime's uniform partition of `items` over `stages`: the same
/// count each, the remainder one each to the first stages.
inline std::vector<int> scaling_partition(int items, int stages) {
  TESSERA_CHECK(stages >= 1 && stages <= items, "plan.runtime scaling: ", stages, " pipeline stages for ", items,
                " layer items (embedding, layers, final norm, head)");
  std::vector<int> out(static_cast<std::size_t>(stages), items / stages);
  for (int i = 0; i < items % stages; ++i) ++out[static_cast<std::size_t>(i)];
  return out;
}

/// The runtime's stages of `n_layers` layers over `pp` stages: [first_layer, layers, has
/// the embedding, has the head], from its partition of [embedding, layers..., norm, head].
inline std::vector<ScalingStage> scaling_stages(int n_layers, int pp) {
  const std::vector<int> sizes = scaling_partition(n_layers + 3, pp);
  std::vector<ScalingStage> stages;
  int item = 0;  // 0 the embedding, 1..n_layers the layers, then the norm, then the head
  for (int size : sizes) {
    ScalingStage st;
    const int end = item + size;
    st.embedding = item == 0;
    st.head = end == n_layers + 3;
    st.first_layer = std::clamp(item - 1, 0, n_layers);
    st.layers = std::clamp(end - 1, 0, n_layers) - st.first_layer;
    stages.push_back(st);
    item = end;
  }
  return stages;
}

/// The same split as tessera's parallelism.pipeline_parallel_split_points ("layers.N":
/// the block each stage after the first begins at), so that tessera's trace, which prices
/// the step, places the layers where the runtime did.
inline std::vector<std::string> scaling_split_points(int n_layers, int pp) {
  std::vector<std::string> points;
  const std::vector<ScalingStage> stages = scaling_stages(n_layers, pp);
  for (std::size_t i = 1; i < stages.size(); ++i)
    points.push_back("layers." + std::to_string(stages[i].first_layer));
  return points;
}

/// Each pipeline stage's memory on one rank of `run`, in pipeline order (the terms are in
/// the header comment).
inline std::vector<ScalingStage> scaling_memory(const ScalingRun& run) {
  const nn::ModelArgs& a = run.args;
  const comm::MeshShape& m = run.mesh;
  TESSERA_CHECK(m.dp_shard == 1, "plan.runtime scaling: the data-parallel ranks are ZeRO-1 replicas "
                "(data_parallel_shard_degree 1, got ", m.dp_shard, ")");
  TESSERA_CHECK(run.microbatch >= 1 && run.seq_len >= 1 && run.microbatches >= 1,
                "plan.runtime scaling: a step needs at least one microbatch of one sequence");
  TESSERA_CHECK(run.fragmentation >= 0 && run.fragmentation < 1, "plan.fragmentation ", run.fragmentation,
                ": expected a share of the reservation, from 0 up to (not including) 1");
  TESSERA_CHECK(a.n_heads % m.tp == 0 && a.kv_heads() % m.tp == 0, "plan.runtime scaling: ", a.n_heads, " heads (",
                a.kv_heads(), " kv) do not divide over tensor_parallel_degree ", m.tp);
  const double t = m.tp, d = m.dp(), b = static_cast<double>(run.microbatch), s = static_cast<double>(run.seq_len);
  const double h = static_cast<double>(a.dim), f = static_cast<double>(a.ffn_hidden_dim());
  const double V = static_cast<double>(a.vocab_size), hd = static_cast<double>(a.head_dim());
  const double heads = static_cast<double>(a.n_heads), kv_dim = static_cast<double>(a.kv_heads()) * hd;
  const double bs = b * s, bsh = bs * h;

  // One layer's saved tensors for one microbatch, without checkpointing.
  const double norm = (run.fused_rmsnorm ? 2 * bsh : 6 * bsh) + 4 * bs + 2 * bsh;  // + the next linear's input
  double attention = 0;
  if (run.attention == ScalingAttention::flash1 || run.attention == ScalingAttention::flash2) {
    // q, k, v, the output, and the dense projection's input: the output's rearranged copy
    // when a microbatch holds several sequences, a view of it for one (attention.py:259, 616).
    const double dense_input = run.microbatch > 1 ? h : 0;
    attention = 2 * bs * (2 * h + dense_input + 2 * kv_dim) / t + 4 * b * (heads / t) * s + 8 * bs * hd;
  } else {
    attention = 2 * bs * (2 * h + 2 * kv_dim) / t + 2 * b * (heads / t) * s * s;
    if (run.attention == ScalingAttention::torch) attention += bs * s;  // the boolean causal mask
  }
  const double mlp = 4 * 2 * bs * f / t;
  const double layer = 2 * norm + attention + mlp;

  const double layer_params = (2 * h * h + 2 * h * kv_dim + 3 * h * f) / t + 2 * h;  // norms whole
  std::vector<ScalingStage> stages = scaling_stages(static_cast<int>(a.n_layers), m.pp);
  for (std::size_t i = 0; i < stages.size(); ++i) {
    ScalingStage& st = stages[i];
    const bool first = i == 0, last = i + 1 == stages.size();
    double p = st.layers * layer_params;
    if (st.embedding) p += V * h / t;
    // The final norm and the head; a head tied to the embedding on the same stage shares
    // its weight, on another stage it keeps a copy (tied_layer_index.py).
    if (st.head) p += h + (a.tie_embeddings && st.embedding ? 0 : V * h / t);
    st.parameters = static_cast<std::int64_t>(p);
    st.state_bytes = 2 * p + 2 * p + 12 * p / d;
    st.in_flight = static_cast<int>(std::min<std::int64_t>(m.pp - static_cast<int>(i), run.microbatches));
    const double saved = run.full_checkpoint ? 2 * bsh * st.layers : layer * st.layers;
    const double per_microbatch = saved + (last ? 0 : 2 * bsh) + (first ? 0 : 2 * bsh);
    const double buffers = (first ? 0 : 2 * bsh) + (last ? 0 : 2 * bsh);
    const double recompute = run.full_checkpoint && st.layers > 0 ? layer : 0;
    st.activation_bytes = buffers + per_microbatch * st.in_flight + recompute;
    double peak = st.state_bytes + st.activation_bytes;
    if (st.head) {
      st.loss_bytes = 16 * bs * V;
      peak = std::max(peak, st.state_bytes + buffers + per_microbatch + recompute + st.loss_bytes);
    }
    st.step_bytes = 6 * std::min(5e8, p) + (st.head ? 4 * bs * V : 0);
    st.peak_bytes = std::max(peak, st.state_bytes + st.step_bytes);
    st.reserved_bytes = st.peak_bytes / (1 - run.fragmentation);
  }
  return stages;
}

}  // namespace tessera::plan
