#!/usr/bin/env bash
# A run killed with SIGKILL and started again with the same command is the uninterrupted
# run: it resumes from the latest complete checkpoint, and metrics.jsonl ends up with
# every step once, each loss bitwise the uninterrupted run's (fp32 on the CPU, same
# layout), or within 1e-5 when the resume changes the layout. Killed at a random step
# on one rank, on thread ranks (resumed on one rank) and under mpirun (one rank process
# killed); and once in the middle of a save, which must leave the earlier checkpoints
# loadable. The seed of the random steps is printed, and TEST_SEED replays it.
#   resume.sh LLAMA_TRAIN CONFIGS_DIR MPIRUN|none
set -uo pipefail
train=$1
configs=$2
mpirun=${3:-none}
work=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2> /dev/null; rm -rf "$work"' EXIT
failures=0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
seed=${TEST_SEED:-$RANDOM}
RANDOM=$seed
echo "random steps from TEST_SEED=$seed"

# The debug model at dim 64 (tests/cli/distributed.sh), 10 steps, a checkpoint every 2.
steps=10
small=(--config "$configs/debug_model.toml" --sample-tokens 8 --model.dim 64 --training.seq_len 32 --training.steps $steps
       --metrics.peak_tflops 1 --checkpoint.enable true --checkpoint.interval 2 --checkpoint.keep_latest_k 2
       --checkpoint.last_save_model_only false --checkpoint.last_save_in_hf false)

mpi_flags=(--oversubscribe -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
export OMPI_MCA_orte_base_help_aggregate=${OMPI_MCA_orte_base_help_aggregate:-0}
mpi_flags+=(-x "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0")

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# run NAME LAUNCH...: runs to the end into $work/NAME (appending its output).
run() {
  local name=$1
  shift
  if ! timeout 300 "$@" --job.dump_folder "$work/$name" >> "$work/$name.out" 2>> "$work/$name.err" < /dev/null; then
    fail "$name: exit status $?"; tail -n 5 "$work/$name.err"; return 1
  fi
}

# lines FILE: the lines FILE has (0 when it is not there).
lines() { if [ -f "$1" ]; then wc -l < "$1"; else echo 0; fi; }

# kill_at NAME STEP PATTERN LAUNCH...: starts the run into $work/NAME and, once its
# metrics.jsonl has STEP lines, SIGKILLs the processes whose command line matches
# PATTERN (the run's own; under mpirun, one rank). False if the run ended first.
kill_at() {
  local name=$1 step=$2 pattern=$3
  shift 3
  timeout 300 "$@" --job.dump_folder "$work/$name" > "$work/$name.out" 2> "$work/$name.err" < /dev/null &
  local pid=$!
  while kill -0 "$pid" 2> /dev/null; do
    if [ "$(lines "$work/$name/metrics.jsonl")" -ge "$step" ]; then
      pkill -9 -n -f -- "$pattern"  # the newest match: the run itself, or one rank
      wait "$pid" 2> /dev/null
      return 0
    fi
    sleep 0.02
  done
  wait "$pid"
  return 1
}

# compare NAME REFERENCE TOLERANCE: NAME's metrics.jsonl has steps 1..$steps once each,
# and its losses equal REFERENCE's (bitwise for tolerance 0).
compare() {
  local result
  if ! result=$(python3 - "$work/$2/metrics.jsonl" "$work/$1/metrics.jsonl" "$3" 2>&1 <<'EOF'
import json, sys
ref = [json.loads(l) for l in open(sys.argv[1])]
got = [json.loads(l) for l in open(sys.argv[2])]
tolerance = float(sys.argv[3])
steps = [r["step"] for r in got]
if steps != list(range(1, len(ref) + 1)):
    sys.exit("steps logged: %s (expected 1..%d once each)" % (steps, len(ref)))
bad = [(g["step"], g["loss"], r["loss"]) for g, r in zip(got, ref)
       if (g["loss"] != r["loss"] if tolerance == 0 else abs(g["loss"] - r["loss"]) > tolerance * abs(r["loss"]))]
if bad:
    sys.exit("step %d: loss %r, uninterrupted %r" % bad[0])
print("every step once, losses %s the uninterrupted run's" % ("bitwise" if tolerance == 0 else "within %g of" % tolerance))
EOF
  ); then
    fail "$1: $result"; return 1
  fi
  echo "ok: $1: $result"
}

# tensorboard_matches NAME: TensorBoard's own reader (tensorboard_read.py, with the
# python of $TB_PYTHON, or python3) shows each step's loss once, metrics.jsonl's as a
# float. Skipped where the tensorboard package is not installed.
tensorboard_matches() {
  local shown status
  shown=$("${TB_PYTHON:-python3}" "$(dirname "$0")/tensorboard_read.py" "$work/$1/tb" 2>&1)
  status=$?
  if [ "$status" -eq 77 ]; then echo "note: $shown: TensorBoard's reader not run"; return; fi
  [ "$status" -eq 0 ] || { fail "$1: tensorboard_read.py: $shown"; return; }
  local result
  if ! result=$(python3 - "$work/$1/metrics.jsonl" <(echo "$shown") 2>&1 <<'EOF'
import json, struct, sys
want = ["%d loss %.9g" % (r["step"], struct.unpack("f", struct.pack("f", r["loss"]))[0])
        for r in map(json.loads, open(sys.argv[1]))]
got = [l.strip() for l in open(sys.argv[2]) if " loss " in l]
sys.exit(0 if got == want else "TensorBoard shows %s, metrics.jsonl %s" % (got, want))
EOF
  ); then
    fail "$1: $result"; return
  fi
  echo "ok: $1: TensorBoard's reader shows every step's loss once"
}

# --- One rank ----------------------------------------------------------------------------
run one "$train" "${small[@]}" || exit 1
# Step 3 or later: step 2's checkpoint commits before step 3's line is written, so there
# is one to resume from. (A step's line is written before its own checkpoint commits: a
# kill right after line 2 may find step-2.partial alone, and the rerun starts afresh.)
k=$((3 + RANDOM % (steps - 3)))
tb=(--metrics.enable_tensorboard true)
if kill_at one_killed "$k" "job.dump_folder $work/one_killed" "$train" "${small[@]}" "${tb[@]}"; then
  echo "killed one rank after step $k's metrics ($(ls "$work/one_killed/checkpoint" | tr '\n' ' '))"
  run one_killed "$train" "${small[@]}" "${tb[@]}" && compare one_killed one 0
  tensorboard_matches one_killed
  grep -q "^resumed from .*/checkpoint/step-" "$work/one_killed.err" || fail "one_killed: no 'resumed from' line"
  saved=$(ls "$work/one_killed/checkpoint" | sort -V | tr '\n' ' ')
  [ "$saved" = "step-8 step-10 " ] || fail "one_killed: checkpoint.keep_latest_k = 2 kept '$saved'"
else
  fail "one_killed: the run ended before step $k"
fi

# --- In the middle of a save -------------------------------------------------------------
# The debug model at full width, whose saves take long enough to be caught: killed as soon
# as a save's partial folder appears, which no resume may load.
wide=(--config "$configs/debug_model.toml" --sample-tokens 8 --training.seq_len 32 --training.steps 6 --metrics.peak_tflops 1
      --checkpoint.enable true --checkpoint.interval 2 --checkpoint.last_save_model_only false
      --checkpoint.last_save_in_hf false --training.local_batch_size 2)
run wide "$train" "${wide[@]}" || exit 1
caught=false
for attempt in 1 2 3 4 5; do
  rm -rf "$work/wide_killed" "$work/wide_killed.out" "$work/wide_killed.err"
  timeout 300 "$train" "${wide[@]}" --job.dump_folder "$work/wide_killed" > "$work/wide_killed.out" 2> "$work/wide_killed.err" < /dev/null &
  pid=$!
  while kill -0 "$pid" 2> /dev/null; do
    partial=$(compgen -G "$work/wide_killed/checkpoint/step-*.partial" | head -n 1)
    # The second save or later: an earlier checkpoint is there to resume from.
    if [ -n "$partial" ] && [ "$partial" != "$work/wide_killed/checkpoint/step-2.partial" ]; then
      pkill -9 -P "$pid"; wait "$pid" 2> /dev/null; caught=true; break  # timeout's child: the run
    fi
    sleep 0.005
  done
  $caught && break
  wait "$pid"
done
if $caught; then
  echo "killed in the middle of the save to $(basename "$partial") (attempt $attempt)"
  run wide_killed "$train" "${wide[@]}" && compare wide_killed wide 0
  resumed=$(grep -o "^resumed from [^:]*" "$work/wide_killed.err" | sed 's|.*/||')
  [ -n "$resumed" ] && [ "$resumed.partial" != "$(basename "$partial")" ] ||
    fail "wide_killed: resumed from '$resumed' after the kill in $(basename "$partial")"
  compgen -G "$work/wide_killed/checkpoint/*.partial" > /dev/null && fail "wide_killed: a partial folder was left"
else
  fail "wide_killed: no save was caught in 5 runs"
fi

# --- Thread ranks, resumed on one rank ---------------------------------------------------
# FSDP 2 with half the local batch: the same global batch, so the same run as one rank's.
fsdp=(--thread-ranks 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4)
k=$((1 + RANDOM % (steps - 1)))
if kill_at fsdp_killed "$k" "job.dump_folder $work/fsdp_killed" "$train" "${small[@]}" "${fsdp[@]}"; then
  echo "killed FSDP 2 (thread ranks) after step $k's metrics; resumed on one rank"
  run fsdp_killed "$train" "${small[@]}" && compare fsdp_killed one 1e-5
else
  fail "fsdp_killed: the run ended before step $k"
fi

# --- Float8 under FSDP 2, its weights gathered in float8 ------------------------------------
# Checkpoints hold the high-precision shards: killed and resumed with the same layout, the
# run is the uninterrupted one, bit for bit (emulated float8 GEMMs, on thread ranks).
f8=("${fsdp[@]}" --training.mixed_precision_param bfloat16 --model.converters float8 --float8.emulate true
    --float8.recipe_name tensorwise --float8.enable_fsdp_float8_all_gather true)
run f8 "$train" "${small[@]}" "${f8[@]}" || exit 1
k=$((3 + RANDOM % (steps - 3)))
if kill_at f8_killed "$k" "job.dump_folder $work/f8_killed" "$train" "${small[@]}" "${f8[@]}"; then
  echo "killed float8 FSDP 2 (thread ranks, float8 all-gather) after step $k's metrics"
  run f8_killed "$train" "${small[@]}" "${f8[@]}" && compare f8_killed f8 0
else
  fail "f8_killed: the run ended before step $k"
fi

# --- checkpoint.enable_first_step_checkpoint: a save right after step 1 -------------------
# Three steps, an interval past them, the last save the model alone: the only whole
# checkpoint is step 1's, and it is complete.
first=("${small[@]}" --training.steps 3 --checkpoint.interval 100 --checkpoint.last_save_model_only true)
if run first_step "$train" "${first[@]}" --checkpoint.enable_first_step_checkpoint true; then
  if [ "$(cd "$work/first_step/checkpoint" && ls)" = "step-1" ] && [ -f "$work/first_step/checkpoint/step-1/COMPLETE" ]; then
    echo "ok: enable_first_step_checkpoint saved step 1 alone, complete"
  else
    fail "first_step: checkpoint folder holds '$(ls "$work/first_step/checkpoint" 2>&1 | tr '\n' ' ')' (expected step-1, complete)"
  fi
fi

# --- checkpoint.create_seed_checkpoint: step 0 written under one layout, trained under another
# FSDP 2 on thread ranks writes step-0 alone and trains nothing; one rank in the same
# folder starts from it and logs the uninterrupted one-rank run's losses bitwise (the
# initial weights do not depend on the layout that makes them). A second seed into a
# folder that holds a checkpoint, and a seed without checkpoint.enable, are refused.
seed_args=("${small[@]}" --checkpoint.interval 100)
if run seeded "$train" "${seed_args[@]}" --thread-ranks 2 --parallelism.data_parallel_shard_degree 2 \
     --training.local_batch_size 4 --checkpoint.create_seed_checkpoint true; then
  if [ "$(cd "$work/seeded/checkpoint" && ls)" != "step-0" ] || [ ! -f "$work/seeded/checkpoint/step-0/COMPLETE" ] ||
     [ -e "$work/seeded/metrics.jsonl" ]; then
    fail "seeded: after the seed the folder holds '$(ls "$work/seeded" "$work/seeded/checkpoint" 2>&1 | tr '\n' ' ')' (expected step-0, complete, and no step trained)"
  elif run seeded "$train" "${seed_args[@]}" && grep -q "resumed from $work/seeded/checkpoint/step-0: step 0 of" "$work/seeded.err"; then
    compare seeded one 0
  else
    fail "seeded: the run did not start from step-0"; tail -n 3 "$work/seeded.err"
  fi
  timeout 120 "$train" "${seed_args[@]}" --checkpoint.create_seed_checkpoint true --job.dump_folder "$work/seeded" \
    > /dev/null 2> "$work/reseed.err" < /dev/null
  status=$?
  if [ "$status" -eq 1 ] && grep -q "checkpoint.create_seed_checkpoint = true: $work/seeded/checkpoint/step-10 is already there" \
       "$work/reseed.err" && [ "$(cd "$work/seeded/checkpoint" && ls | tr '\n' ' ')" = "step-0 step-10 " ]; then
    echo "ok: a seed into a folder with checkpoints is refused, the folder untouched"
  else
    fail "reseed: exit status $status, $(tail -n 1 "$work/reseed.err"), folder: $(ls "$work/seeded/checkpoint" | tr '\n' ' ')"
  fi
fi
timeout 120 "$train" "${seed_args[@]}" --checkpoint.enable false --checkpoint.create_seed_checkpoint true \
  --job.dump_folder "$work/unseeded" > /dev/null 2> "$work/unseeded.err" < /dev/null
status=$?
if [ "$status" -eq 1 ] && grep -q "checkpoint.create_seed_checkpoint = true writes a checkpoint: it needs checkpoint.enable = true" \
     "$work/unseeded.err" && [ ! -e "$work/unseeded" ]; then
  echo "ok: a seed without checkpoint.enable is refused, nothing written"
else
  fail "unseeded: exit status $status, $(tail -n 1 "$work/unseeded.err")"
fi

# --- checkpoint.async_mode = "async_with_pinned_mem" (torchtitan's name): tessera's async --
# saves, the training unchanged, the last checkpoint complete.
if run pinned "$train" "${small[@]}" --checkpoint.async_mode async_with_pinned_mem &&
   compare pinned one 0 && [ -f "$work/pinned/checkpoint/step-10/COMPLETE" ]; then
  echo "ok: async_with_pinned_mem saves as async does"
else
  [ -f "$work/pinned/checkpoint/step-10/COMPLETE" ] || fail "pinned: no complete step-10"
fi

# --- mpirun: one rank process killed -----------------------------------------------------
if [ "$mpirun" != none ]; then
  # The float8 all-gather over MPI: thread ranks' run, within the parity bar.
  run mpi_f8 "$mpirun" "${mpi_flags[@]}" -np 2 "$train" "${small[@]}" "${f8[@]:2}" && compare mpi_f8 f8 1e-5
  mpi=("$mpirun" "${mpi_flags[@]}" -np 2 "$train" "${small[@]}" --parallelism.data_parallel_shard_degree 2
       --training.local_batch_size 4)
  run mpi "${mpi[@]}" || exit 1
  compare mpi one 1e-5
  k=$((1 + RANDOM % (steps - 1)))
  # The rank processes, not mpirun: pkill matches llama-train's own command line.
  if kill_at mpi_killed "$k" "^$train .*job.dump_folder $work/mpi_killed" "${mpi[@]}"; then
    echo "killed one of mpirun's ranks after step $k's metrics"
    run mpi_killed "${mpi[@]}" && compare mpi_killed mpi 0
  else
    fail "mpi_killed: the run ended before step $k"
  fi
else
  echo "note: no mpirun: the mpirun case is skipped"
fi

[ "$failures" -eq 0 ] || { echo "$failures failure(s) (TEST_SEED=$seed)"; exit 1; }
echo "all resume cases pass"
