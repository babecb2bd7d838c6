#!/usr/bin/env bash
# The predicted GPU step of bench/RESULTS.md: llama-plan on Llama 3.2 1B and 3B (no
# activation checkpointing) and Llama 3 8B (full), batch 1 x seq 8192, bf16, one device,
# on each GPU profile; one markdown row per (model, machine). Arguments after `--` go to
# llama-plan as they are (--training.attention tessera, --optimizer.state_dtype bfloat16).
#   predicted_gpu_step.sh LLAMA_PLAN CONFIGS_DIR [MACHINE...] [-- KEY VALUE...]   (default h100-sxm h200)
set -euo pipefail
plan=$1
configs=$2
shift 2
machines=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do machines+=("$1"); shift; done
[ $# -gt 0 ] && shift
extra=("$@")
[ ${#machines[@]} -gt 0 ] || machines=(h100-sxm h200)
one=(--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1
     --parallelism.tensor_parallel_degree 1 --parallelism.pipeline_parallel_degree 1
     --parallelism.context_parallel_degree 1 --training.seq_len 8192 --training.local_batch_size 1
     --training.global_batch_size 1 --training.mixed_precision_param bfloat16)
echo "| model | machine | checkpointing | step | tokens/s | MFU (causal) | GEMMs | attention | kernels | loss head | optimizer | peak memory | fits |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for entry in llama3.2_1b:none llama3.2_3b:none llama3_8b:full; do
  model=${entry%%:*}
  ac=${entry##*:}
  for machine in "${machines[@]}"; do
    "$plan" --config "$configs/$model.toml" --machine "$machine" --json --activation_checkpoint.mode "$ac" "${one[@]}" ${extra[@]+"${extra[@]}"} |
      python3 -c '
import json, sys
j = json.load(sys.stdin)
t = j["breakdown"]["time"]
pct = lambda k: 100 * t[k]["seconds"] / j["step_seconds"]
gib = lambda b: b / 2**30
fits = "yes" if j["fits"] else "no (%.1f GiB usable)" % gib(j["usable_memory_bytes"])
print("| %s | %s | %s | %.2f s | %.0f | %.1f%% (%.1f%%) | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.1f%% | %.2f GiB | %s |" % (
    sys.argv[1], j["machine"], sys.argv[2], j["step_seconds"], j["tokens_per_sec"], j["mfu_pct"], j["mfu_causal_pct"],
    pct("GEMMs"), pct("attention"), pct("memory-bound kernels"), pct("loss head"), pct("optimizer"),
    gib(j["peak_memory_bytes"]), fits))' "$model" "$ac"
  done
done
