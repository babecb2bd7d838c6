#!/usr/bin/env bash
# llama-plan's step on ranks that do not share cores, against llama-train under mpirun.
#
#   bench/plan_mpi.sh LLAMA_PLAN LLAMA_TRAIN [CONFIG] [STEPS]
#
# For each layout of 2 ranks (FSDP, DDP, tensor parallelism, a 1F1B pipeline), with one
# OpenMP thread per rank (OMP_NUM_THREADS=1; mpirun places one rank per core): llama-plan
# --machine cpu --gpus 2 measures the CPU on the step's own work with that one thread and
# predicts the step; mpirun -np 2 llama-train runs STEPS steps (default 12) and the median
# of the steps after the first two is taken. Prints predicted against measured step time
# and memory peak per layout. On a machine with fewer than 2 cores the ranks would share
# one: it says so and stops.
set -euo pipefail
plan=$1
train=$2
config=${3:-$(dirname "$0")/../examples/configs/debug_model.toml}
steps=${4:-12}
[ "$(nproc)" -ge 2 ] || { echo "plan_mpi: needs 2 cores (one per rank), this machine has $(nproc)"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE OMPI_MCA_btl_vader_single_copy_mechanism=none
mpirun_args=(--allow-run-as-root -np 2)
[ "$(id -u)" -eq 0 ] || mpirun_args=(-np 2)

layouts=(
  "FSDP 2|--parallelism.data_parallel_shard_degree 2"
  "DDP 2|--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1"
  "TP 2|--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1"
  "PP 2 (1F1B)|--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 1"
)
printf '%-14s %12s %12s %8s %14s %14s\n' layout predicted measured gap "predicted peak" "measured peak"
for entry in "${layouts[@]}"; do
  name=${entry%%|*}
  read -r -a keys <<< "${entry#*|}"
  "$plan" --config "$config" --machine cpu --gpus 2 --json "${keys[@]}" > "$work/plan.json"
  rm -rf "$work/run"
  mpirun "${mpirun_args[@]}" "$train" --sample-tokens 0 --config "$config" --training.steps "$steps" --job.dump_folder "$work/run" \
    --checkpoint.enable false "${keys[@]}" > "$work/train.log" 2>&1 || { tail -n 5 "$work/train.log"; exit 1; }
  python3 - "$work/plan.json" "$work/run/metrics.jsonl" "$name" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(sys.argv[2])]
steps = sorted(r["step_seconds"] for r in rows[2:])
measured = steps[len(steps) // 2]
peak = max(r["peak_memory_bytes"] for r in rows[2:])
print("%-14s %10.1f ms %10.1f ms %+7.1f%% %14d %14d" % (
    sys.argv[3], 1e3 * plan["step_seconds"], 1e3 * measured, 100 * (plan["step_seconds"] / measured - 1),
    plan["peak_memory_bytes"], peak))
EOF
done
