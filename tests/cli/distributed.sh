#!/usr/bin/env bash
# llama-train across ranks, end to end: thread ranks in one process, and two processes
# under mpirun (where mpirun is given), train the debug model with the same global batch
# as one rank, data parallel (FSDP, HSDP, DDP), tensor parallel, pipeline parallel (each
# schedule) and their combinations, and must log the same loss at every step (1e-5
# relative); rank 0 alone writes the dump folder and prints. Then bad input on every
# launch mode: exit status 1 (under mpirun: non-zero) with the reason on stderr, never a
# hang, and the dump folder untouched.
# Under mpirun, a layout llama-plan plans for 8 CPU ranks and writes with --emit-config
# trains as written.
#   distributed.sh LLAMA_TRAIN CONFIGS_DIR MPIRUN|none [LLAMA_PLAN]
set -uo pipefail
train=$1
configs=$2
mpirun=${3:-none}
plan=${4:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# Ranks share the cores: OpenMP threads sleep rather than spin between loops.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

mpi_flags=()
if [ "$mpirun" != none ]; then
  # As tests/mpi/run_mpi.sh: more ranks than cores, root in containers, and no CMA copies.
  mpi_flags=(--oversubscribe)
  [ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
  # One OpenMP thread per process: the processes share the cores.
  mpi_flags+=(-x OMP_NUM_THREADS=1)
  # When every rank calls MPI_Abort at once (a bad layout fails alike everywhere), Open MPI
  # 4.1's mpirun can crash (SIGSEGV in pmix_server_log_fn) while aggregating the ranks'
  # identical abort banners, under meson's MALLOC_PERTURB_; printing each banner avoids it.
  export OMPI_MCA_orte_base_help_aggregate=${OMPI_MCA_orte_base_help_aggregate:-0}
  # In the sanitizer build, LeakSanitizer would report what Open MPI's components keep
  # until exit (from libraries already unloaded, so no suppression can name them): the
  # MPI ranks run without leak checks; the one-process and thread-rank runs keep them.
  mpi_flags+=(-x "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0")
else
  echo "note: no mpirun (or llama-train built without MPI): the mpirun runs are skipped"
fi

# A short run of the debug model at dim 64 (as the parity tests' model, tests/parallel/
# harness.hpp: every split the layouts make is the same, at a quarter of the width, and
# a run takes a quarter of the time): 3 steps of 32-token sequences, no step checkpoints,
# a given peak rate (measuring it takes time and changes nothing here).
small=(--config "$configs/debug_model.toml" --sample-tokens 8 --model.dim 64 --training.steps 3 --training.seq_len 32
       --checkpoint.enable false --metrics.peak_tflops 1)

# A pipeline order in PyTorch's CSV of actions, one row per rank: rank 0 holds stages 0
# and 3, rank 1 stages 1 and 2 (the V placement); two microbatches.
csv_order=$work/order.csv
printf '%s\n' 0F0,0F1,3F0,3I0,3W0,3F1,3B1,0I0,0B1,0W0 1F0,2F0,1F1,2F1,2I0,1B0,2B1,1I1,1W1,2W0 > "$csv_order"

# --- The same losses on every launch ---------------------------------------------

# train_run NAME LAUNCH...: trains into $work/NAME; LAUNCH is the command before the
# config ("$train" alone, or mpirun ... "$train"); stdout and stderr kept beside it.
train_run() {
  local name=$1 status start=$SECONDS
  shift
  timeout 300 "$@" "${small[@]}" --job.dump_folder "$work/$name" > "$work/$name.out" 2> "$work/$name.err" < /dev/null
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "FAIL: $name: exit status $status after $((SECONDS - start)) s"; tail -n 10 "$work/$name.err"
    failures=$((failures + 1))
    return 1
  fi
  echo "trained $name in $((SECONDS - start)) s"
}

# same_losses NAME: NAME's metrics.jsonl against the one-rank run's, step by step, and its MFU below 100%.
same_losses() {
  python3 - "$work/one/metrics.jsonl" "$work/$1/metrics.jsonl" <<'EOF'
import json, sys
ref = [json.loads(l) for l in open(sys.argv[1])]
got = [json.loads(l) for l in open(sys.argv[2])]
if [r["step"] for r in got] != [1, 2, 3] or [r["step"] for r in ref] != [1, 2, 3]:
    sys.exit("steps logged: %s (expected 1, 2, 3 once each; the reference %s)"
             % ([r["step"] for r in got], [r["step"] for r in ref]))
worst = max(abs(g["loss"] - r["loss"]) / abs(r["loss"]) for g, r in zip(got, ref))
# MFU against the CPU's measured GEMM peak (the fastest of the step's own GEMMs): a step
# cannot beat it.
for r in got + ref:
    if not 0 < r["mfu_causal_pct"] <= r["mfu_pct"] < 100:
        sys.exit("step %d: MFU %.2f%% (causal %.2f%%) is not within (0, 100)" % (r["step"], r["mfu_pct"], r["mfu_causal_pct"]))
print("losses %s, worst relative difference %.3g" % (" ".join("%.6f" % g["loss"] for g in got), worst))
sys.exit(0 if worst <= 1e-5 else "worst relative difference %.3g > 1e-5" % worst)
EOF
}

# check_parity NAME: same losses; rank 0 alone wrote the dump folder and printed.
check_parity() {
  local name=$1 result
  if ! result=$(same_losses "$name" 2>&1); then
    echo "FAIL: $name: $result"; failures=$((failures + 1)); return
  fi
  local files_one files
  files_one=$(cd "$work/one" && find . | sort)
  files=$(cd "$work/$name" && find . | sort)
  if [ "$files" != "$files_one" ]; then
    echo "FAIL: $name: the dump folder holds other files than one rank's:"
    diff <(echo "$files_one") <(echo "$files") | head -n 10
    failures=$((failures + 1)); return
  fi
  # Printed once: the run's header, each saved file, the sample.
  local header saved sample
  header=$(grep -c '^tessera llama-train:' "$work/$name.err")
  saved=$(grep -c '^saved .*model.safetensors$' "$work/$name.err")
  sample=$(grep -c -- '^--- sample' "$work/$name.out")
  if [ "$header" -ne 1 ] || [ "$saved" -ne 1 ] || [ "$sample" -ne 1 ]; then
    echo "FAIL: $name: printed $header headers, $saved 'saved' lines and $sample samples (expected one each, from rank 0)"
    failures=$((failures + 1)); return
  fi
  echo "ok: $name: $result; rank 0 alone wrote $(echo "$files" | wc -l) entries and printed once"
}

# check_init_memory NAME WANT: rank 0's memory after the model's initialisation (its first
# step's memory_after_init_bytes: parameters and gradients, before the optimizer's state)
# is WANT of one rank's, within 3% (FSDP's flat shards are padded to whole rows).
check_init_memory() {
  local result
  if result=$(python3 - "$work/one/metrics.jsonl" "$work/$1/metrics.jsonl" "$2" 2>&1 <<'EOF'
import json, sys
one, run = (json.loads(open(p).readline())["memory_after_init_bytes"] for p in sys.argv[1:3])
want = float(sys.argv[3])
print("rank 0 after init_weights: %d bytes, %.4f of one rank's %d (want %s)" % (run, run / one, one, sys.argv[3]))
sys.exit(0 if want <= run / one <= want * 1.03 else 1)
EOF
  ); then
    echo "ok: $1: $result"
  else
    echo "FAIL: $1: $result"; failures=$((failures + 1))
  fi
}

# check_pipeline_header NAME SCHEDULE: NAME's start-up header counts the whole model's
# parameters (as one rank's does, not one stage's) and has one pipeline line, naming
# SCHEDULE, the microbatches and the stages.
check_pipeline_header() {
  local name=$1 schedule=$2 params_one params line
  params_one=$(grep -o '| [0-9.]*M parameters' "$work/one.err")
  params=$(grep -o '| [0-9.]*M parameters' "$work/$name.err")
  line=$(grep '^  pipeline: ' "$work/$name.err")
  if [ "$params" != "$params_one" ]; then
    echo "FAIL: $name: the header says '$params', one rank's '$params_one'"; failures=$((failures + 1))
  elif [ "$(grep -c '^  pipeline: ' "$work/$name.err")" -ne 1 ] || [[ "$line" != "  pipeline: $schedule, "* ]] ||
       [[ "$line" != *" microbatches, bubble "* ]] || [[ "$line" != *"stages: embedding + "*" + output (pp rank "* ]]; then
    echo "FAIL: $name: the header's pipeline line is '$line' (expected one, naming $schedule, microbatches and stages)"
    failures=$((failures + 1))
  else
    echo "ok: $name: header counts ${params#| }; ${line#  }"
  fi
}

# losses_match NAME: same_losses, a failure counted (check_parity's other checks left out:
# a profiled run's folder holds its timelines too).
losses_match() {
  local result
  if ! result=$(same_losses "$1" 2>&1); then
    echo "FAIL: $1: $result"; failures=$((failures + 1)); return 1
  fi
}

# check_profile NAME RANKS: profiling.profile_freq 2 over 3 steps recorded step 2 alone,
# one Chrome trace per rank, each a span "step 2" holding the rank's layers and
# collectives; the ranks' steps overlap in time (one clock for all).
check_profile() {
  local name=$1 ranks=$2 result
  if result=$(python3 - "$work/$name/profile_trace" "$ranks" 2>&1 <<'PROFILE'
import json, os, sys
root, ranks = sys.argv[1], int(sys.argv[2])
if sorted(os.listdir(root)) != ["iteration_2"]:
    sys.exit("recorded %s (expected iteration_2 alone)" % sorted(os.listdir(root)))
files = sorted(os.listdir(os.path.join(root, "iteration_2")))
if files != ["rank%d_trace.json" % r for r in range(ranks)]:
    sys.exit("files %s" % files)
steps, total = [], 0
for r in range(ranks):
    ev = json.load(open(os.path.join(root, "iteration_2", "rank%d_trace.json" % r)))["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    total += len(spans)
    step = [e for e in spans if e["name"] == "step 2"]
    if len(step) != 1 or any(e["pid"] != r for e in spans):
        sys.exit("rank %d: %d spans 'step 2', pids %s" % (r, len(step), sorted({e["pid"] for e in spans})))
    s = step[0]
    outside = [e["name"] for e in spans if e["ts"] < s["ts"] or e["ts"] + e["dur"] > s["ts"] + s["dur"] + 0.01]
    if outside:
        sys.exit("rank %d: spans outside the step: %s" % (r, outside[:5]))
    names = {e["name"] for e in spans}
    for want in ("micro-batch 0", "optimizer"):
        if want not in names:
            sys.exit("rank %d: no span %r" % (r, want))
    if not any(n.startswith("layers.") and n.endswith(" backward") for n in names):
        sys.exit("rank %d: no layer's backward" % r)
    if not any(e["cat"] == "comm" and e.get("args", {}).get("bytes", 0) > 0 for e in spans):
        sys.exit("rank %d: no collective with its bytes" % r)
    if not any(e["ph"] == "C" and e["name"] == "memory in use" for e in ev):
        sys.exit("rank %d: no memory track" % r)
    steps.append((s["ts"], s["ts"] + s["dur"]))
if max(b for b, _ in steps) > min(e for _, e in steps):
    sys.exit("the ranks' steps do not overlap in time: %s" % steps)
print("%d ranks, %d spans" % (ranks, total))
PROFILE
  ); then
    echo "ok: $name: profile of step 2 ($result)"
  else
    echo "FAIL: $name: profile: $result"; failures=$((failures + 1))
  fi
}

# check_memory_snapshot NAME RANKS: profiling.enable_memory_snapshot with profile_freq 2
# over 3 steps wrote step 2's snapshot alone, one per rank, each whole
# (tools/memory_snapshot.py check: its events from the model's first parameter replay to
# the blocks it holds), rank 0's peak in use that of its metrics (blocks of 64 bytes, so
# within 0.1%), its blocks named by what they hold and the spans open at them.
check_memory_snapshot() {
  local name=$1 ranks=$2 result tools
  tools=$(dirname "$(dirname "$configs")")/tools
  if result=$(python3 - "$tools" "$work/$name" "$ranks" 2>&1 <<'SNAPSHOT'
import json, os, pickle, subprocess, sys
tools, dump, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tools)
import memory_snapshot
root = os.path.join(dump, "memory_snapshot")
if sorted(os.listdir(root)) != ["iteration_2"]:
    sys.exit("snapshots of %s (expected iteration_2 alone)" % sorted(os.listdir(root)))
files = sorted(os.listdir(os.path.join(root, "iteration_2")))
if files != ["rank%d_memory_snapshot.pickle" % r for r in range(ranks)]:
    sys.exit("files %s" % files)
paths = [os.path.join(root, "iteration_2", f) for f in files]
check = subprocess.run([sys.executable, os.path.join(tools, "memory_snapshot.py"), "check"] + paths,
                       capture_output=True, text=True)
if check.returncode != 0:
    sys.exit(check.stderr.strip())
s = pickle.load(open(paths[0], "rb"))
r = memory_snapshot.Replay(s["device_traces"][0])
steps = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
peak = max(m["peak_memory_bytes"] for m in steps if m["step"] <= 2)
if abs(r.peak - peak) > peak * 1e-3:
    sys.exit("rank 0's snapshot peaks at %d bytes in use, its metrics at %d" % (r.peak, peak))
sites = {memory_snapshot.where(f) for _, f in r.at_peak.values()}
if not any(x.startswith("temporary < layers.") and x.endswith(" < micro-batch 0 < step 2") for x in sites):
    sys.exit("no layer's temporaries of step 2 at the peak: %s" % sorted(sites)[:8])
if "optimizer" not in sites:
    sys.exit("no optimizer state at the peak: %s" % sorted(sites)[:8])
print("%d ranks, %d events on rank 0, peak %.1f MiB" % (ranks, len(s["device_traces"][0]), r.peak / 2**20))
SNAPSHOT
  ); then
    echo "ok: $name: memory snapshot of step 2 ($result)"
  else
    echo "FAIL: $name: memory snapshot: $result"; failures=$((failures + 1))
  fi
}

# One rank: a global batch of 4 sequences.
train_run one "$train" --training.local_batch_size 4 || { echo "the one-rank reference failed"; exit 1; }
# Four thread ranks (FSDP 4), one sequence each: the same global batch.
train_run threads4 "$train" --thread-ranks 4 --training.local_batch_size 1 && check_parity threads4 &&
  check_init_memory threads4 0.25
# HSDP 2 x 2 on thread ranks, through the degrees, held to NCCL's rules.
train_run threads_hsdp "$train" --thread-ranks 4 --training.local_batch_size 1 \
  --parallelism.data_parallel_replicate_degree 2 --comm.check_nccl_semantics true && check_parity threads_hsdp
# Tensor parallel 2 on two thread ranks: both read the whole batch of 4 and split each
# block's heads and hidden units, the rows between blocks and the vocabulary.
train_run threads_tp2 "$train" --thread-ranks 2 --training.local_batch_size 4 \
  --parallelism.tensor_parallel_degree 2 && check_parity threads_tp2
# The same without loss parallelism: every rank holds the output whole.
train_run threads_tp2_no_loss_parallel "$train" --thread-ranks 2 --training.local_batch_size 4 \
  --parallelism.tensor_parallel_degree 2 --parallelism.disable_loss_parallel true \
  && check_parity threads_tp2_no_loss_parallel
# FSDP 2 x TP 2 on four thread ranks, two sequences per data-parallel slice.
train_run threads_fsdp2_tp2 "$train" --thread-ranks 4 --training.local_batch_size 2 \
  --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2 && check_parity threads_fsdp2_tp2
# Pipeline parallel 2 on two thread ranks (1F1B): both read the whole batch of 4, cut
# into 4 microbatches of one sequence; rank 0 holds the embedding and blocks 0-2, rank 1
# blocks 3-5 and the output.
train_run threads_pp2 "$train" --thread-ranks 2 --training.local_batch_size 4 \
  --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \
  && check_parity threads_pp2 && check_pipeline_header threads_pp2 1F1B
# The same, its second step recorded on both ranks (profiling.enable_profiling,
# enable_memory_snapshot): the same losses, a timeline and a memory snapshot per rank.
train_run threads_pp2_profile "$train" --thread-ranks 2 --training.local_batch_size 4 \
  --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \
  --profiling.enable_profiling true --profiling.profile_freq 2 --profiling.enable_memory_snapshot true \
  && losses_match threads_pp2_profile && check_profile threads_pp2_profile 2 \
  && check_memory_snapshot threads_pp2_profile 2
# PP 2 x TP 2 on four thread ranks, zero bubble over two stages per rank.
train_run threads_pp2_tp2 "$train" --thread-ranks 4 --training.local_batch_size 4 \
  --parallelism.pipeline_parallel_degree 2 --parallelism.tensor_parallel_degree 2 \
  --parallelism.pipeline_parallel_schedule InterleavedZeroBubble \
  && check_parity threads_pp2_tp2 && check_pipeline_header threads_pp2_tp2 InterleavedZeroBubble
# FSDP 2 x TP 2 x PP 2 on eight thread ranks, interleaved 1F1B, two sequences per slice,
# held to NCCL's rules.
train_run threads_fsdp2_tp2_pp2 "$train" --thread-ranks 8 --training.local_batch_size 2 --comm.check_nccl_semantics true \
  --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2 \
  --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B \
  && check_parity threads_fsdp2_tp2_pp2 && check_pipeline_header threads_fsdp2_tp2_pp2 Interleaved1F1B
# Context parallel 2 on two thread ranks: both read the whole batch of 4, each holds two
# of the four chunks of every sequence; held to NCCL's rules.
train_run threads_cp2 "$train" --thread-ranks 2 --training.local_batch_size 4 --comm.check_nccl_semantics true \
  --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 && check_parity threads_cp2
if [ "$mpirun" != none ]; then
  # Two processes (FSDP 2), two sequences each.
  train_run mpi2 "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 2 && check_parity mpi2
  # The same with the second step recorded in each process: the two files line up in time.
  train_run mpi2_profile "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 2 \
    --profiling.enable_profiling true --profiling.profile_freq 2 \
    && losses_match mpi2_profile && check_profile mpi2_profile 2
  # Two processes as DDP, each accumulating two micro-batches of one sequence.
  train_run mpi2_ddp "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 1 \
    --training.global_batch_size 4 --parallelism.data_parallel_replicate_degree 2 \
    --parallelism.data_parallel_shard_degree 1 && check_parity mpi2_ddp
  # Two processes as tensor parallel 2, each reading the whole batch of 4, held to NCCL's rules.
  train_run mpi2_tp2 "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 4 \
    --parallelism.tensor_parallel_degree 2 --comm.check_nccl_semantics true && check_parity mpi2_tp2
  # Two processes as context parallel 2, each reading the whole batch of 4, held to NCCL's rules.
  train_run mpi2_cp2 "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 4 \
    --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 \
    --comm.check_nccl_semantics true && check_parity mpi2_cp2
  # The same with the keys all-gathered (torchtitan's allgather rotation).
  train_run mpi2_cp2_allgather "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 4 \
    --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 \
    --parallelism.context_parallel_rotate_method allgather --comm.check_nccl_semantics true \
    && check_parity mpi2_cp2_allgather
  # Two processes as pipeline parallel 2 (GPipe), two microbatches of two sequences,
  # held to NCCL's rules.
  train_run mpi2_pp2 "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 4 --comm.check_nccl_semantics true \
    --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule GPipe \
    --parallelism.pipeline_parallel_microbatch_size 2 && check_parity mpi2_pp2 && check_pipeline_header mpi2_pp2 GPipe
  # Two processes as pipeline parallel 2 by ZBVZeroBubble, four microbatches: stages down
  # the ranks and back up, so process 0 holds the embedding and the output; held to
  # NCCL's rules.
  train_run mpi2_zbv "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 4 --comm.check_nccl_semantics true \
    --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble \
    && check_parity mpi2_zbv && check_pipeline_header mpi2_zbv ZBVZeroBubble &&
    if grep -q '^  pipeline: .*stages: embedding + layer 0 (pp rank 0); layers 1-2 (pp rank 1); layers 3-4 (pp rank 1); layer 5 + output (pp rank 0)$' "$work/mpi2_zbv.err"; then
      echo "ok: mpi2_zbv: the V placement in the header"
    else
      echo "FAIL: mpi2_zbv: the header's stages are not placed down the ranks and back up: $(grep '^  pipeline: ' "$work/mpi2_zbv.err")"
      failures=$((failures + 1))
    fi
  # Two processes running an order read from a file (PyTorch's CSV of actions: stages in
  # the V placement, whole and split backwards mixed), two microbatches of two
  # sequences; held to NCCL's rules.
  train_run mpi2_csv "$mpirun" "${mpi_flags[@]}" -np 2 "$train" --training.local_batch_size 4 --comm.check_nccl_semantics true \
    --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule PipelineScheduleMulti \
    --parallelism.pipeline_parallel_schedule_csv "$csv_order" --parallelism.pipeline_parallel_microbatch_size 2 \
    && check_parity mpi2_csv && check_pipeline_header mpi2_csv PipelineScheduleMulti &&
    if grep -q "^  pipeline: .* | order from $csv_order | .*layer 5 + output (pp rank 0)\$" "$work/mpi2_csv.err"; then
      echo "ok: mpi2_csv: the file and the V placement in the header"
    else
      echo "FAIL: mpi2_csv: the header does not name the file or place the stages as its rows: $(grep '^  pipeline: ' "$work/mpi2_csv.err")"
      failures=$((failures + 1))
    fi
  # FSDP 2 x TP 2 x PP 2 on 8 CPU ranks, planned by llama-plan and emitted as a config
  # (its steps and folder with it), then trained from that file alone.
  if [ -n "$plan" ]; then
    start=$SECONDS
    if "$plan" --config "$configs/debug_model.toml" --model.dim 64 --training.seq_len 32 --training.steps 2 \
         --training.local_batch_size 2 --checkpoint.enable false --metrics.peak_tflops 1 --job.dump_folder "$work/planned" \
         --machine cpu --gpus 8 --parallelism.tensor_parallel_degree 2 --parallelism.pipeline_parallel_degree 2 \
         --emit-config "$work/planned.toml" > "$work/planned_plan.out" 2>&1 &&
       timeout 300 "$mpirun" "${mpi_flags[@]}" -np 8 "$train" --config "$work/planned.toml" \
         > "$work/planned.out" 2> "$work/planned.err" < /dev/null &&
       cat "$work/planned.out" "$work/planned.err" | grep -q '8 ranks \[pp 2, dp_replicate 1, dp_shard 2, tp 2\]' &&
       python3 -c 'import json,math,sys; r=[json.loads(l) for l in open(sys.argv[1])]; sys.exit([x["step"] for x in r] != [1, 2] or not all(math.isfinite(x["loss"]) for x in r))' \
         "$work/planned/metrics.jsonl"; then
      echo "ok: llama-plan's emitted config for 8 CPU ranks trains under mpirun -np 8 ($((SECONDS - start)) s)"
    else
      echo "FAIL: the emitted config under mpirun -np 8:"; tail -n 5 "$work/planned_plan.out" "$work/planned.err" 2>/dev/null
      failures=$((failures + 1))
    fi
  fi
fi

# --- Bad input: exit status 1 and the reason, on every launch --------------------
bad_start=$SECONDS

# expect_error MODE DESCRIPTION EXPECTED_TEXT COMMAND...: MODE "one" (a single process,
# thread ranks or not): exit status 1 and the last line of stderr names the problem;
# MODE "mpi": mpirun exits non-zero (not the time limit's 124) and stderr names it.
expect_error() {
  local mode=$1 what=$2 expected=$3 out status last
  shift 3
  out=$(timeout 120 "$@" 2>&1 > /dev/null < /dev/null)
  status=$?
  last=$(printf '%s\n' "$out" | grep -v '^$' | tail -n 1)
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "FAIL: $what: hung (killed after 120 s)"; failures=$((failures + 1))
  elif [ "$mode" = one ] && [ "$status" -ne 1 ]; then
    echo "FAIL: $what: exit status $status (expected 1)"; echo "$out" | tail -n 5; failures=$((failures + 1))
  elif [ "$mode" = mpi ] && [ "$status" -eq 0 ]; then
    echo "FAIL: $what: mpirun exit status 0"; failures=$((failures + 1))
  elif [ "$mode" = one ] && [[ "$last" != *"$expected"* ]]; then
    echo "FAIL: $what: last line '$last' lacks '$expected'"; failures=$((failures + 1))
  elif [ "$mode" = mpi ] && ! grep -qF -- "$expected" <<< "$out"; then
    echo "FAIL: $what: stderr lacks '$expected':"; echo "$out" | tail -n 10; failures=$((failures + 1))
  else
    [ "$mode" = mpi ] && last=$(grep -F -- "$expected" <<< "$out" | head -n 1)
    echo "ok: $what -> exit status $status; $last"
  fi
}

bad=(--job.dump_folder "$work/bad")
mpi2=("$mpirun" "${mpi_flags[@]}" -np 2 "$train")
# on_every_launch DESCRIPTION EXPECTED ONE_RANK_KEYS -- THREAD_KEYS -- MPI_KEYS: the same
# mistake made on one rank, on 4 thread ranks and on 2 MPI processes.
on_every_launch() {
  local what=$1 expected=$2
  shift 2
  local one=() threads=() mpi=() part=one
  for a in "$@"; do
    if [ "$a" = -- ]; then [ "$part" = one ] && part=threads || part=mpi; continue; fi
    case $part in one) one+=("$a") ;; threads) threads+=("$a") ;; mpi) mpi+=("$a") ;; esac
  done
  expect_error one "$what (one rank)" "$expected" "$train" "${small[@]}" "${bad[@]}" "${one[@]}"
  expect_error one "$what (4 thread ranks)" "$expected" "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" "${threads[@]}"
  if [ "$mpirun" != none ]; then
    expect_error mpi "$what (mpirun -np 2)" "$expected" "${mpi2[@]}" "${small[@]}" "${bad[@]}" "${mpi[@]}"
  fi
}

on_every_launch "degrees not multiplying to the world size" "but the world has" \
  --parallelism.data_parallel_shard_degree 2 -- --parallelism.data_parallel_shard_degree 3 -- \
  --parallelism.data_parallel_shard_degree 4
# The exact sums, one launch each.
expect_error one "shard degree 3 on 4 thread ranks" \
  "data_parallel_shard_degree 3 x tensor_parallel_degree 1 x pipeline_parallel_degree 1 = 3, but the world has 4 ranks" \
  "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" --parallelism.data_parallel_shard_degree 3
if [ "$mpirun" != none ]; then
  expect_error mpi "shard degree 4 on 2 MPI processes" \
    "data_parallel_shard_degree 4 x tensor_parallel_degree 1 x pipeline_parallel_degree 1 = 4, but the world has 2 ranks" \
    "${mpi2[@]}" "${small[@]}" "${bad[@]}" --parallelism.data_parallel_shard_degree 4
fi
on_every_launch "global batch not a multiple of local batch x data-parallel degree" \
  "must be a multiple of training.local_batch_size" \
  --training.local_batch_size 4 --training.global_batch_size 6 -- \
  --training.local_batch_size 1 --training.global_batch_size 6 -- \
  --training.local_batch_size 2 --training.global_batch_size 6
expect_error one "global batch 6 over 4 thread ranks of 1" \
  "training.global_batch_size (6) must be a multiple of training.local_batch_size x the data-parallel degree (1 x 4 = 4)" \
  "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" --training.local_batch_size 1 --training.global_batch_size 6
if [ "$mpirun" != none ]; then
  expect_error mpi "global batch 6 over 2 MPI processes of 2" \
    "training.global_batch_size (6) must be a multiple of training.local_batch_size x the data-parallel degree (2 x 2 = 4)" \
    "${mpi2[@]}" "${small[@]}" "${bad[@]}" --training.local_batch_size 2 --training.global_batch_size 6
fi
ac_mode=(--activation_checkpoint.mode sometimes)
on_every_launch "unknown activation_checkpoint.mode" \
  'activation_checkpoint.mode must be one of none, full, selective; got "sometimes"' \
  "${ac_mode[@]}" -- "${ac_mode[@]}" -- "${ac_mode[@]}"
ac_zero=(--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 0)
on_every_launch "selective_ac_option 0" \
  'activation_checkpoint.selective_ac_option must be "op" or a positive integer, got "0"' \
  "${ac_zero[@]}" -- "${ac_zero[@]}" -- "${ac_zero[@]}"
cp=(--parallelism.context_parallel_degree 2 --training.seq_len 30)
on_every_launch "context parallel 2 over a seq_len of 30" \
  "training.seq_len = 30 does not split into 2 x parallelism.context_parallel_degree = 4 equal chunks" \
  "${cp[@]}" -- "${cp[@]}" -- "${cp[@]}"
# Tensor parallelism the model cannot take, refused on every rank before any file is written.
expect_error one "tensor_parallel_degree 3 on 3 thread ranks (16 heads)" \
  "parallelism.tensor_parallel_degree = 3 does not divide n_heads = 16" \
  "$train" --thread-ranks 3 "${small[@]}" "${bad[@]}" --parallelism.tensor_parallel_degree 3
no_loss_parallel_tied=(--parallelism.tensor_parallel_degree 2 --parallelism.disable_loss_parallel true
                       --model.tie_embeddings true)
expect_error one "disable_loss_parallel with tied embeddings on 2 thread ranks of TP 2" \
  "parallelism.disable_loss_parallel = true with tied embeddings (debugmodel) and tensor parallelism" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" "${no_loss_parallel_tied[@]}"
if [ "$mpirun" != none ]; then
  expect_error mpi "disable_loss_parallel with tied embeddings on 2 MPI processes of TP 2" \
    "parallelism.disable_loss_parallel = true with tied embeddings (debugmodel) and tensor parallelism" \
    "${mpi2[@]}" "${small[@]}" "${bad[@]}" "${no_loss_parallel_tied[@]}"
fi
expect_error one "33 tokens per micro-batch over TP 2" \
  "training.local_batch_size x training.seq_len (1 x 33 = 33 tokens) does not split into equal rows over parallelism.tensor_parallel_degree = 2 ranks" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" --parallelism.tensor_parallel_degree 2 \
  --training.local_batch_size 1 --training.seq_len 33
# Pipelines the model or the schedule cannot take, refused on every rank before any file is written.
expect_error one "1F1B on PP 4 with 2 microbatches" \
  "parallelism.pipeline_parallel_microbatch_size: schedule 1F1B on 4 ranks needs at least 4 microbatches, got 2" \
  "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" --parallelism.pipeline_parallel_degree 4 \
  --training.local_batch_size 2
pp_uneven=(--parallelism.pipeline_parallel_degree 2 --training.local_batch_size 3
           --parallelism.pipeline_parallel_microbatch_size 2)
expect_error one "microbatch size 2 for a local batch of 3 on PP 2" \
  "parallelism.pipeline_parallel_microbatch_size = 2 does not divide training.local_batch_size = 3" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" "${pp_uneven[@]}"
if [ "$mpirun" != none ]; then
  expect_error mpi "microbatch size 2 for a local batch of 3 on 2 MPI processes of PP 2" \
    "parallelism.pipeline_parallel_microbatch_size = 2 does not divide training.local_batch_size = 3" \
    "${mpi2[@]}" "${small[@]}" "${bad[@]}" "${pp_uneven[@]}"
fi
expect_error one "Interleaved1F1B on PP 2 with 3 microbatches" \
  "schedule Interleaved1F1B with 2 stages per rank needs a microbatch count that is a multiple of the 2 ranks, got 3" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" --parallelism.pipeline_parallel_degree 2 \
  --parallelism.pipeline_parallel_schedule Interleaved1F1B --training.local_batch_size 3
expect_error one "PP 4 for a model of 1 layer" \
  "pipeline degree larger than the layer count: 4 stages for 1 layers + embedding + output = 3 units" \
  "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" --parallelism.pipeline_parallel_degree 4 --model.n_layers 1
expect_error one "unknown pipeline schedule" \
  'parallelism.pipeline_parallel_schedule must be one of 1F1B, Interleaved1F1B, GPipe, InterleavedZeroBubble, LoopedBFS, ZBVZeroBubble, DualPipeV, PipelineScheduleSingle, PipelineScheduleMulti; got "ZeroBubble"' \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" --parallelism.pipeline_parallel_degree 2 \
  --parallelism.pipeline_parallel_schedule ZeroBubble
pp2_csv=(--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule PipelineScheduleMulti
         --parallelism.pipeline_parallel_microbatch_size 2 --training.local_batch_size 4)
expect_error one "a schedule file that is not there" \
  "parallelism.pipeline_parallel_schedule_csv: $work/none.csv: schedule file not found" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" "${pp2_csv[@]}" --parallelism.pipeline_parallel_schedule_csv "$work/none.csv"
printf '0F0,0X1\n' > "$work/broken.csv"
expect_error one "a schedule file with a cell that is not an action" \
  "parallelism.pipeline_parallel_schedule_csv: $work/broken.csv: row 1, column 2: \"0X1\" is not an action (unknown type \"X\"" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" "${pp2_csv[@]}" --parallelism.pipeline_parallel_schedule_csv "$work/broken.csv"
expect_error one "PipelineScheduleMulti without a schedule file" \
  'parallelism.pipeline_parallel_schedule = "PipelineScheduleMulti" runs the order of a schedule file, and parallelism.pipeline_parallel_schedule_csv names none' \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" "${pp2_csv[@]}"
expect_error one "a schedule file with 1F1B" \
  "parallelism.pipeline_parallel_schedule_csv = \"$csv_order\" is an order to run, and parallelism.pipeline_parallel_schedule = \"1F1B\" lays out its own" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" "${pp2_csv[@]}" --parallelism.pipeline_parallel_schedule 1F1B \
  --parallelism.pipeline_parallel_schedule_csv "$csv_order"
expect_error one "a schedule file of 2 ranks on PP 4" \
  "parallelism.pipeline_parallel_schedule_csv: $csv_order: has 2 rows (one a pipeline rank), and parallelism.pipeline_parallel_degree = 4" \
  "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" "${pp2_csv[@]}" --parallelism.pipeline_parallel_degree 4 \
  --parallelism.pipeline_parallel_schedule_csv "$csv_order"
expect_error one "tied embeddings on PP 2" \
  "parallelism.pipeline_parallel_degree = 2 with tied embeddings (debugmodel): the embedding and the output live on different stages" \
  "$train" --thread-ranks 2 "${small[@]}" "${bad[@]}" --parallelism.pipeline_parallel_degree 2 --model.tie_embeddings true
expect_error one "33 tokens per pipeline microbatch over TP 2" \
  "parallelism.pipeline_parallel_microbatch_size x training.seq_len (1 x 33 = 33 tokens) does not split into equal rows over parallelism.tensor_parallel_degree = 2 ranks" \
  "$train" --thread-ranks 4 "${small[@]}" "${bad[@]}" --parallelism.pipeline_parallel_degree 2 \
  --parallelism.tensor_parallel_degree 2 --training.local_batch_size 2 --training.seq_len 33
expect_error one "tensor_parallel_degree 2 on one rank" \
  "data_parallel_replicate_degree 1 x tensor_parallel_degree 2 x pipeline_parallel_degree 1 = 2 does not divide the world size 1" \
  "$train" "${small[@]}" "${bad[@]}" --parallelism.tensor_parallel_degree 2

expect_error one "--thread-ranks 0" "--thread-ranks '0': expected a number of ranks from 1 to 9999" \
  "$train" --thread-ranks 0 "${small[@]}" "${bad[@]}"
expect_error one "--thread-ranks abc" "--thread-ranks 'abc': expected a number of ranks from 1 to 9999" \
  "$train" --thread-ranks abc "${small[@]}" "${bad[@]}"
expect_error one "--thread-ranks without a number" "--thread-ranks '': expected a number of ranks from 1 to 9999" \
  "$train" "${small[@]}" "${bad[@]}" --thread-ranks
expect_error one "--thread-ranks twice" "--thread-ranks: given twice" \
  "$train" --thread-ranks=2 "${small[@]}" "${bad[@]}" --thread-ranks 4
if [ "$mpirun" != none ]; then
  expect_error mpi "--thread-ranks 2 under mpirun -np 2" \
    "--thread-ranks 2 under an MPI launch of 2 processes: use one or the other" \
    "${mpi2[@]}" --thread-ranks 2 "${small[@]}" "${bad[@]}"
fi
# shellcheck disable=SC2016  # the backquotes are the message's own
expect_error one "a torchrun-style launch on the CPU" 'on the CPU start the ranks with `mpirun -np 2` (or srun) instead' \
  env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 "$train" "${small[@]}" "${bad[@]}"

# No failed run touched the dump folder.
if [ -e "$work/bad" ]; then
  echo "FAIL: a run with bad input wrote $work/bad:"; find "$work/bad" | head; failures=$((failures + 1))
else
  echo "ok: no run with bad input wrote its dump folder"
fi

# A rank that fails after the others have started training (rank 0 cannot open its
# metrics.jsonl: a folder is in the way): the run ends with rank 0's error, and the
# flight recorder of the rank that had issued a collective shows it waiting there, rank 0
# absent (comm.trace_buf_size; tools/comm_trace.py sets the files side by side).
tools=$(dirname "$(dirname "$configs")")/tools
mkdir -p "$work/stalled/metrics.jsonl"
expect_error one "rank 0 failing on 2 thread ranks" "rank 0: $work/stalled/metrics.jsonl: cannot open for writing" \
  "$train" --thread-ranks 2 "${small[@]}" --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4 \
  --debug.enable_structured_logging true --job.dump_folder "$work/stalled"
if report=$(python3 "$tools/comm_trace.py" "$work/stalled/comm_traces" 2>&1) &&
   [ "$(cd "$work/stalled/comm_traces" && ls)" = "rank1_trace.json" ] &&
   grep -q "^1 of 2 ranks left a trace; none from rank 0$" <<< "$report" &&
   grep -q "rank 0 left no trace; the others issued #1 there" <<< "$report" &&
   grep -q "^rank 1 waits for dp #1, all_reduce" <<< "$report" &&
   grep -q "^rank 1 failed: .*rank 0: $work/stalled/metrics.jsonl: cannot open for writing" <<< "$report"; then
  echo "ok: the flight record of rank 1: $(grep "^rank 1 waits" <<< "$report")"
else
  echo "FAIL: the flight records of the stalled run:"; echo "$report"; ls "$work/stalled/comm_traces"
  failures=$((failures + 1))
fi
# Its structured logs (debug.enable_structured_logging): rank 1's first step ended by the
# abort, rank 0 failed before its first step (tools/rank_log.py).
if report=$(python3 "$tools/rank_log.py" "$work/stalled/structured_logs" 2>&1) &&
   [ "$(cd "$work/stalled/structured_logs" && ls | tr '\n' ' ')" = "rank_0.jsonl rank_1.jsonl " ] &&
   grep -q "^2 ranks logged$" <<< "$report" && grep -q "^rank 1 failed in step at step 1" <<< "$report" &&
   ! grep -q "^rank 0 failed" <<< "$report" && grep -q '"log_type_name": "training_start"' "$work/stalled/structured_logs/rank_1.jsonl"; then
  echo "ok: the structured logs of the stalled run: $(grep '^rank 1 failed' <<< "$report" | head -n 2 | tr '\n' ';')"
else
  echo "FAIL: the structured logs of the stalled run:"; echo "$report"; ls "$work/stalled/structured_logs"
  failures=$((failures + 1))
fi

echo "bad input checked in $((SECONDS - bad_start)) s"
[ "$failures" -eq 0 ] && echo "cli_distributed: all checks passed"
[ "$failures" -eq 0 ]
