#!/usr/bin/env bash
# llama-plan end to end.
#   plan.sh LLAMA_PLAN CONFIGS_DIR MACHINES_DIR [all]
# Without `all`: the debug model on every built-in machine, on a machine file, and on the
# measured CPU, in JSON with every key a user reads; the whole run's cost; then bad input,
# each one line naming the key or file and exit status 1. With `all`: every config in CONFIGS_DIR on every GPU
# profile (h100-sxm, h200, a100-80gb-sxm) and two of them (a mid-size and the largest; the
# smallest is the run without `all`) on the measured cpu, one device each (parallelism
# degrees set to 1). Layouts
# across GPUs: a few compositions on GPU profiles and on this CPU (context parallelism
# among them), their --json summing up, --emit-config, and the layouts llama-plan
# refuses; --search, and at 128k tokens on 8 H200s its answer for Llama 3.1 8B.
set -uo pipefail
plan=$1
configs=$2
machines=$3
mode=${4:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

one_device=(--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1
            --parallelism.tensor_parallel_degree 1 --parallelism.pipeline_parallel_degree 1
            --parallelism.context_parallel_degree 1)

# check_json NAME FILE: the keys a user of --json reads, with sane values.
check_json() {
  python3 - "$2" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
for k in ["tokens_per_sec", "mfu_pct", "mfu_causal_pct", "step_seconds", "peak_memory_bytes", "reserved_memory_bytes",
          "fits", "breakdown", "usable_memory_bytes", "costliest", "machine"]:
    if k not in j:
        sys.exit("missing key %s" % k)
if not (j["step_seconds"] > 0 and j["tokens_per_sec"] > 0 and j["peak_memory_bytes"] > 0):
    sys.exit("non-positive step_seconds, tokens_per_sec or peak_memory_bytes: %s" % j)
if not (0 < j["mfu_causal_pct"] <= j["mfu_pct"] < 100):
    sys.exit("MFU out of range: %s, causal %s" % (j["mfu_pct"], j["mfu_causal_pct"]))
time = j["breakdown"]["time"]
for c in ["GEMMs", "attention", "memory-bound kernels", "loss head", "optimizer", "host synchronisations"]:
    if c not in time:
        sys.exit("breakdown.time lacks %s" % c)
total = sum(v["seconds"] for v in time.values())
if abs(total - j["step_seconds"]) > 1e-9 * max(1, j["step_seconds"]):
    sys.exit("the classes sum to %g, the step is %g" % (total, j["step_seconds"]))
mem = j["breakdown"]["memory"]
held = sum(mem[k] for k in ["parameters", "gradients", "optimizer", "saved_activations", "temporaries", "workspace"])
if held != j["peak_memory_bytes"]:
    sys.exit("the memory breakdown sums to %d, the peak is %d" % (held, j["peak_memory_bytes"]))
# On a GPU the caching allocator's segments (2 MiB multiples) decide the fit; the host
# (--machine cpu) caches nothing, so its live bytes do.
reserved = j["reserved_memory_bytes"]
if j["machine"].startswith("cpu") and reserved != j["peak_memory_bytes"]:
    sys.exit("the host reserves %d beyond its peak of %d" % (reserved, j["peak_memory_bytes"]))
if not j["machine"].startswith("cpu") and (reserved < j["peak_memory_bytes"] or reserved % (2 << 20) != 0):
    sys.exit("the caching allocator reserves %d for a peak of %d" % (reserved, j["peak_memory_bytes"]))
if j["fits"] != (reserved <= j["usable_memory_bytes"]):
    sys.exit("fits = %s for %d reserved of %d usable" % (j["fits"], reserved, j["usable_memory_bytes"]))
print("%s: %.4g s/step, %.0f tokens/s, MFU %.1f%%, peak %.2f GiB, %s" % (
    j["machine"], j["step_seconds"], j["tokens_per_sec"], j["mfu_pct"], j["peak_memory_bytes"] / 2**30,
    "fits" if j["fits"] else "does not fit"))
EOF
}

# plan_ok NAME ARGS...: llama-plan --json ARGS succeeds and its JSON holds.
plan_ok() {
  local name=$1 result
  shift
  if ! timeout 300 "$plan" --json "$@" > "$work/out.json" 2> "$work/err"; then
    echo "FAIL: $name: exit status $?"; tail -n 5 "$work/err"; failures=$((failures + 1)); return
  fi
  if ! result=$(check_json "$name" "$work/out.json" 2>&1); then
    echo "FAIL: $name: $result"; failures=$((failures + 1)); return
  fi
  echo "ok: $name: $result"
}

# plan_fails NAME EXPECTED ARGS...: exit status 1 and one error line holding EXPECTED.
plan_fails() {
  local name=$1 expected=$2 status
  shift 2
  timeout 120 "$plan" "$@" > "$work/out" 2> "$work/err"
  status=$?
  if [ "$status" -ne 1 ]; then
    echo "FAIL: $name: exit status $status (expected 1)"; tail -n 5 "$work/err"; failures=$((failures + 1)); return
  fi
  if [ "$(wc -l < "$work/err")" -ne 1 ] || ! grep -qF -- "$expected" "$work/err"; then
    echo "FAIL: $name: stderr is not one line holding '$expected':"; head -n 5 "$work/err"; failures=$((failures + 1)); return
  fi
  echo "ok: $name -> $(cat "$work/err")"
}

if [ "$mode" = all ]; then
  for config in "$configs"/*.toml; do
    machines=(h100-sxm h200 a100-80gb-sxm)
    # The CPU is measured on each config's own GEMMs (seconds a config): a mid-size and the
    # largest model cover its paths (shapes timed whole, scaled down) beside the debug
    # model, which the run without `all` (cli_plan) plans on it.
    case "$(basename "$config" .toml)" in llama3.2_1b | llama3.1_405b) machines+=(cpu) ;; esac
    for machine in "${machines[@]}"; do
      plan_ok "$(basename "$config" .toml) on $machine" --config "$config" --machine "$machine" "${one_device[@]}"
    done
  done
  [ "$failures" -eq 0 ] && echo "plan all: every config on every machine" || echo "plan all: $failures failures"
  exit $((failures > 0))
fi

debug=(--config "$configs/debug_model.toml")
for machine in h100-sxm h200 a100-80gb-sxm cpu; do
  plan_ok "debug model on $machine" "${debug[@]}" --machine "$machine"
done
plan_ok "debug model on a machine file" "${debug[@]}" --machine "$machines/a100-80gb-sxm.toml"
# A profile built on another: the built-in p4de cluster is the A100's GPU on a slower network, so
# the same FSDP layout's step takes longer there; a user's file may name a built-in profile as its base.
fsdp=(--config "$configs/llama2_7b.toml" --gpus 16 --model.n_layers 4 --training.seq_len 1024 --json)
printf '[machine]\nname = "mine"\nbase = "a100-80gb-sxm"\n[network.network_gbs]\nvalue = 2\nsource = "test"\n' \
  > "$work/mine.toml"
if "$plan" "${fsdp[@]}" --machine a100-80gb-sxm > "$work/sxm.json" 2> "$work/err" &&
   "$plan" "${fsdp[@]}" --machine a100-80gb-p4de > "$work/p4de.json" 2>> "$work/err" &&
   "$plan" "${fsdp[@]}" --machine "$work/mine.toml" > "$work/mine.json" 2>> "$work/err" &&
   python3 - "$work/sxm.json" "$work/p4de.json" "$work/mine.json" <<'EOF2'
import json, sys
sxm, p4de, mine = (json.load(open(f)) for f in sys.argv[1:])
assert p4de["machine"] == "a100-80gb-p4de" and mine["machine"] == "mine", (p4de["machine"], mine["machine"])
assert sxm["step_seconds"] < p4de["step_seconds"] < mine["step_seconds"], (sxm["step_seconds"], p4de["step_seconds"], mine["step_seconds"])
assert sxm["peak_memory_bytes"] == p4de["peak_memory_bytes"] == mine["peak_memory_bytes"]
EOF2
then
  echo "ok: profiles with a base: the GPU's figures, their own network"
else
  echo "FAIL: profiles with a base:"; cat "$work/err"; failures=$((failures + 1))
fi
printf '[machine]\nname = "mine"\nbase = "a100-80gb"\n' > "$work/no-base.toml"
plan_fails "a base that is no profile" "$work/no-base.toml:3: machine profile: machine.base = \"a100-80gb\": no such profile" \
  "${debug[@]}" --machine "$work/no-base.toml"
plan_ok "debug model in bf16 with full checkpointing" "${debug[@]}" --training.mixed_precision_param bfloat16 \
  --activation_checkpoint.mode full
# The table: the header, the step line, every class and the memory breakdown.
if "$plan" "${debug[@]}" --machine h100-sxm > "$work/table" 2> "$work/err" &&
   grep -q '^tessera llama-plan: debugmodel' "$work/table" && grep -q '^step .* tokens/s | MFU' "$work/table" &&
   grep -q '^  loss head' "$work/table" && grep -q '^  saved activations' "$work/table" &&
   grep -q '^  attention: tessera (auto: the model is float32' "$work/table" &&
   grep -qE '^step .* \| peak [0-9.]+ [GM]iB \([0-9.]+ [GM]iB reserved by the caching allocator\) of ' "$work/table"; then
  echo "ok: the table names the model, the attention kernels, the step, the classes and the memory"
else
  echo "FAIL: the table:"; head -n 20 "$work/table" "$work/err"; failures=$((failures + 1))
fi

# A bf16 model on a Hopper profile prices cuDNN's attention; the JSON says which ran and why.
if "$plan" "${debug[@]}" --machine h200 --training.mixed_precision_param bfloat16 --json > "$work/bf16.json" 2> "$work/err" &&
   python3 -c 'import json,sys; a=json.load(open(sys.argv[1]))["attention"]; sys.exit(a["kernel"] != "cudnn")' "$work/bf16.json"; then
  echo "ok: a bf16 model on h200 runs cuDNN's attention (auto)"
else
  echo "FAIL: a bf16 model on h200:"; head -n 5 "$work/bf16.json" "$work/err"; failures=$((failures + 1))
fi

# The whole run: training.steps steps and the validations, each priced; GPU-hours and the
# price. check_run FILE STEPS VALIDATIONS BATCHES GPUS [PRICE]: run's figures add up.
check_run() {
  python3 - "$@" <<'EOF2'
import json, sys
j = json.load(open(sys.argv[1]))
steps, validations, batches, gpus = (int(a) for a in sys.argv[2:6])
r = j["run"] if "run" in j else sys.exit("no 'run' in the JSON")
step = j["step_seconds"] if "step_seconds" in j else j["layouts"][0]["step_seconds"]
assert (r["steps"], r["validations"], r["validation_batches"], r["gpus"]) == (steps, validations, batches, gpus), r
assert r["step_seconds"] == step and step > 0, (r["step_seconds"], step)
assert (r["validation_batch_seconds"] > 0) == (batches > 0), r
want = steps * step + validations * batches * r["validation_batch_seconds"]
assert abs(r["seconds"] - want) <= 1e-9 * want, (r["seconds"], want)
assert abs(r["gpu_hours"] - gpus * want / 3600) <= 1e-9 * want, r
if len(sys.argv) > 6:
    assert abs(r["price"] - float(sys.argv[6]) * r["gpu_hours"]) <= 1e-9 * r["price"], r
EOF2
}
validate=(--validation.enable true --validation.freq 100 --training.steps 250)
if "$plan" "${debug[@]}" --machine h200 "${validate[@]}" --plan.gpu_hour_price 2.5 --json > "$work/run.json" 2> "$work/err" &&
   check_run "$work/run.json" 250 3 1 1 2.5 2>> "$work/err" &&
   "$plan" "${debug[@]}" --machine h200 "${validate[@]}" --plan.gpu_hour_price 2.5 > "$work/run.txt" 2>> "$work/err" &&
   grep -qE '^run: 250 steps \(training.steps\) x [0-9.]+ ms = .*; validation: 3 passes x 1 global batch x ' "$work/run.txt" &&
   grep -qE '^  .* on 1 GPU = [0-9.e-]+ GPU-hours, at 2.5 a GPU-hour: ' "$work/run.txt" &&
   "$plan" "${debug[@]}" --gpus 4 --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 \
     "${validate[@]}" --validation.steps 3 --json > "$work/run4.json" 2>> "$work/err" &&
   check_run "$work/run4.json" 250 3 3 4 2>> "$work/err" &&
   "$plan" "${debug[@]}" --machine h200 --json > "$work/run0.json" 2>> "$work/err" && check_run "$work/run0.json" 250 0 0 1 2>> "$work/err" &&
   "$plan" "${debug[@]}" "${validate[@]}" --validation.dataset shard --validation.dataset_path "$work/none.bin" \
     --json > "$work/runx.json" 2>> "$work/err" && check_run "$work/runx.json" 250 3 0 1 2>> "$work/err" &&
   grep -q '"validation_unpriced": "validation.steps = -1 reads the whole validation set, which cannot be counted here' \
     "$work/runx.json"; then
  echo "ok: the run: its steps and validations priced, in GPU-hours and at a price; on 4 GPUs; validation off; unpriced"
else
  echo "FAIL: the run:"; head -n 12 "$work/run.txt" "$work/err"; failures=$((failures + 1))
fi

# Bad input: one line, exit status 1.
plan_fails "cuDNN attention for a float32 model" 'training.attention = "cudnn": the model is float32' "${debug[@]}" \
  --machine h200 --training.attention cudnn --training.mixed_precision_param float32
awk '/^\[/ { skip = /^\[attention\./ } !skip' "$machines/a100-80gb-sxm.toml" > "$work/no-attention.toml"
plan_fails "cuDNN attention on a profile without its rates" \
  "training.attention = \"cudnn\": the machine profile $work/no-attention.toml gives no cuDNN attention rates" \
  "${debug[@]}" --machine "$work/no-attention.toml" --training.attention cudnn --training.mixed_precision_param bfloat16
plan_fails "an unknown attention" "training.attention must be one of auto, cudnn, tessera" "${debug[@]}" \
  --training.attention flash
f8=(--training.mixed_precision_param bfloat16 --model.converters float8 --float8.emulate false)
plan_fails "float8 GEMMs on a GPU without float8 tensor cores" \
  "machine profile: compute.fp8_tflops is missing, so model.converters = [\"float8\"] with float8.emulate = false" \
  "${debug[@]}" "${f8[@]}" --machine a100-80gb-sxm
plan_fails "float8 GEMMs over tokens cuBLASLt cannot take" \
  "training.seq_len = 24: float8 GEMMs (float8.emulate = false) reduce over a micro-batch's tokens" \
  "${debug[@]}" "${f8[@]}" --machine h200 --training.seq_len 24
plan_fails "unknown machine" "--machine tpu-v9: unknown machine (known: h100-sxm, h200, a100-80gb-sxm, a100-80gb-p4de, cpu" \
  "${debug[@]}" --machine tpu-v9
plan_fails "missing machine file" "$work/none.toml: cannot open the machine profile" "${debug[@]}" --machine "$work/none.toml"
mkdir -p "$work/profiles.toml"
plan_fails "a machine file that is a directory" "$work/profiles.toml: a directory, not a machine profile" "${debug[@]}" \
  --machine "$work/profiles.toml"
sed 's/^value = 3350$/value = 0/' "$machines/h100-sxm.toml" > "$work/broken.toml"
plan_fails "machine file with a non-positive rate" "machine profile: hbm.bandwidth_gbs.value must be a positive number, got 0" \
  "${debug[@]}" --machine "$work/broken.toml"
sed -n '/^\[hbm.achieved_fraction\]/,$!p' "$machines/h100-sxm.toml" > "$work/short.toml"
plan_fails "machine file without a rate" "machine profile: hbm.achieved_fraction is missing" "${debug[@]}" \
  --machine "$work/short.toml"
plan_fails "--machine without a name" "--machine: expected a machine name or a profile FILE.toml" "${debug[@]}" --machine
plan_fails "missing config" "none.toml" --config "$work/none.toml"
plan_fails "unknown key" "unknown option --training.stpes" "${debug[@]}" --training.stpes 3
plan_fails "--gpus not a number" "--gpus eight: expected a number of GPUs" "${debug[@]}" --gpus eight
plan_fails "a price that is not positive" "--plan.gpu_hour_price 0: expected the price of one GPU-hour, a positive number" \
  "${debug[@]}" --plan.gpu_hour_price 0

# A layout across GPUs: each pipeline position traced and replayed on the network.
# check_layout FILE GPUS PP: the keys a user of --json reads, every position, and sums that hold.
check_layout() {
  python3 - "$@" <<'EOF2'
import json, sys
j = json.load(open(sys.argv[1])); gpus = int(sys.argv[2]); pp = int(sys.argv[3])
for k in ["parallelism.data_parallel_shard_degree", "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
          "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size", "activation_checkpoint.mode",
          "training.local_batch_size", "training.global_batch_size", "training.seq_len", "fits", "peak_memory_bytes",
          "tokens_per_sec", "mfu_pct", "step_seconds", "positions"]:
    if k not in j:
        sys.exit("missing key %s" % k)
if j["gpus"] != gpus or len(j["positions"]) != pp or j["parallelism.pipeline_parallel_degree"] != pp:
    sys.exit("gpus %s, %d positions, pp %s: expected %d GPUs and %d positions" % (j["gpus"], len(j["positions"]),
             j["parallelism.pipeline_parallel_degree"], gpus, pp))
if abs(j["tokens_per_sec"] * gpus * j["step_seconds"] - j["tokens_per_step"]) > 1e-6 * j["tokens_per_step"]:
    sys.exit("tokens/s per GPU x GPUs x step is not the step's tokens")
if j["peak_memory_bytes"] != max(p["peak_memory_bytes"] for p in j["positions"]):
    sys.exit("the peak is not the largest position's")
if j["reserved_memory_bytes"] != max(p["reserved_memory_bytes"] for p in j["positions"]):
    sys.exit("the reservation is not the largest position's")
for p in j["positions"]:
    if p["reserved_memory_bytes"] < p["peak_memory_bytes"] or p["fits"] != (p["reserved_memory_bytes"] <= j["usable_memory_bytes"]):
        sys.exit("position %d: %d reserved for a peak of %d, fits %s" % (p["rank"], p["reserved_memory_bytes"],
                 p["peak_memory_bytes"], p["fits"]))
if j["fits"] != all(p["fits"] for p in j["positions"]):
    sys.exit("fits is not every position's")
if abs(j["step_seconds"] - max(p["end_seconds"] for p in j["positions"])) > 1e-12:
    sys.exit("the step does not end with its last position")
last = max(j["positions"], key=lambda p: p["end_seconds"])
if j["collective_sm_seconds"] != last["collective_sm_seconds"] or \
        any(not 0 <= p["collective_sm_seconds"] <= p["compute_seconds"] for p in j["positions"]):
    sys.exit("what the collectives' SMs add: %s, by position %s" % (j["collective_sm_seconds"],
             [p["collective_sm_seconds"] for p in j["positions"]]))
for p in j["positions"]:
    parts = p["compute_seconds"] + p["exposed_comm_seconds"] + p["pipeline_wait_seconds"]
    if abs(parts - p["end_seconds"]) > 1e-9 * max(1, p["end_seconds"]):
        sys.exit("position %d: compute + waits = %g, its end %g" % (p["rank"], parts, p["end_seconds"]))
    if p["collectives"] <= 0:
        sys.exit("position %d issued no collectives" % p["rank"])
    top = p["costliest"]
    classes = set(p["time"])
    if not top or any(o["class"] not in classes or o["count"] < 1 for o in top) or \
            [o["seconds"] for o in top] != sorted((o["seconds"] for o in top), reverse=True) or \
            top[0]["seconds"] > p["compute_seconds"] * (1 + 1e-9):
        sys.exit("position %d's costliest operations: %s" % (p["rank"], top))
print("%d GPUs: %.4g s/step, %.0f tokens/s per GPU, MFU %.1f%%, peak %.3f GiB, %s" % (
    gpus, j["step_seconds"], j["tokens_per_sec"], j["mfu_pct"], j["peak_memory_bytes"] / 2**30,
    "fits" if j["fits"] else "does not fit"))
EOF2
}
layout_ok() {
  local name=$1 gpus=$2 pp=$3 result
  shift 3
  if ! timeout 300 "$plan" --json --gpus "$gpus" --parallelism.pipeline_parallel_degree "$pp" "$@" > "$work/layout.json" 2> "$work/err"; then
    echo "FAIL: $name: exit status $?"; tail -n 5 "$work/err"; failures=$((failures + 1)); return
  fi
  if ! result=$(check_layout "$work/layout.json" "$gpus" "$pp" 2>&1); then
    echo "FAIL: $name: $result"; failures=$((failures + 1)); return
  fi
  echo "ok: $name: $result"
}
layout_ok "FSDP x TP x PP on 16 H100s" 16 2 "${debug[@]}" --machine h100-sxm --parallelism.tensor_parallel_degree 2 \
  --training.local_batch_size 4
layout_ok "HSDP x PP (interleaved) on two nodes of A100s" 16 2 "${debug[@]}" --machine a100-80gb-sxm \
  --parallelism.data_parallel_replicate_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B \
  --training.local_batch_size 4
layout_ok "FSDP on 2 ranks of this CPU" 2 1 "${debug[@]}" --machine cpu
layout_ok "FSDP x CP on 8 H100s" 8 1 "${debug[@]}" --machine h100-sxm --parallelism.context_parallel_degree 2
layout_ok "TP x CP x PP on 16 H100s" 16 2 "${debug[@]}" --machine h100-sxm --parallelism.context_parallel_degree 4 \
  --parallelism.tensor_parallel_degree 2 --training.local_batch_size 8 --parallelism.data_parallel_shard_degree 1
# Context parallelism is a layout key: in --json, the mesh, and what --emit-config writes.
if "$plan" "${debug[@]}" --gpus 8 --parallelism.context_parallel_degree 4 --json --emit-config "$work/cp.toml" \
     > "$work/cp.json" 2> "$work/err" &&
   "$plan" --config "$work/cp.toml" --gpus 8 --json > "$work/cp_again.json" 2>> "$work/err" &&
   python3 -c 'import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); sys.exit(not (a["parallelism.context_parallel_degree"] == 4 and a["mesh"] == "[pp 1, dp_replicate 1, dp_shard 2, cp 4, tp 1]" and a["step_seconds"] == b["step_seconds"] and a["peak_memory_bytes"] == b["peak_memory_bytes"]))' \
     "$work/cp.json" "$work/cp_again.json"; then
  echo "ok: context parallelism is a layout key, emitted and planned again alike"
else
  echo "FAIL: context parallelism as a layout key:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
# A collective between nodes holds SMs from the GEMMs beside it; one within a node does not.
if "$plan" "${debug[@]}" --machine a100-80gb-sxm --gpus 16 --json > "$work/two.json" 2> "$work/err" &&
   "$plan" "${debug[@]}" --machine a100-80gb-sxm --gpus 8 --json > "$work/one.json" 2>> "$work/err" &&
   "$plan" "${debug[@]}" --machine a100-80gb-sxm --gpus 16 > "$work/two.txt" 2>> "$work/err" &&
   python3 -c 'import json,sys; two,one=(json.load(open(f)) for f in sys.argv[1:]); sys.exit(not (two["collective_sm_seconds"] > 0 and one["collective_sm_seconds"] == 0))' \
     "$work/two.json" "$work/one.json" &&
   grep -q "more of GEMMs and attention on the SMs the collectives between nodes leave them" "$work/two.txt"; then
  echo "ok: FSDP over two nodes: the collectives' SMs slow the GEMMs beside them; over one node they do not"
else
  echo "FAIL: the collectives' SMs:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
# The table names the mesh and every position.
if "$plan" "${debug[@]}" --gpus 8 --parallelism.pipeline_parallel_degree 2 > "$work/table" 2> "$work/err" &&
   grep -q 'mesh \[pp 2, dp_replicate 1, dp_shard 4, tp 1\]' "$work/table" &&
   grep -q '^step .* tokens/s per GPU | MFU' "$work/table" && [ "$(grep -cE '^ +[01] +(0|4) ' "$work/table")" -eq 2 ] &&
   grep -q "^position [01]'s costliest operations$" "$work/table" && grep -qE '^ +[0-9.]+ [mu]?s +[0-9.]+% +x[0-9]+ +gemm ' "$work/table"; then
  echo "ok: the layout's table names the mesh, the step, each position and the last one's costliest operations"
else
  echo "FAIL: the layout's table:"; head -n 20 "$work/table" "$work/err"; failures=$((failures + 1))
fi
# --emit-config writes the layout as a llama-train config that plans the same step.
if "$plan" "${debug[@]}" --gpus 8 --parallelism.tensor_parallel_degree 2 --json --emit-config "$work/emitted.toml" \
     > "$work/a.json" 2> "$work/err" &&
   grep -q '^data_parallel_shard_degree = 4$' "$work/emitted.toml" &&
   "$plan" --config "$work/emitted.toml" --json > "$work/b.json" 2>> "$work/err" &&
   python3 -c 'import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); sys.exit(a["step_seconds"] != b["step_seconds"] or a["peak_memory_bytes"] != b["peak_memory_bytes"])' "$work/a.json" "$work/b.json"; then
  echo "ok: --emit-config writes a config that plans the same layout"
else
  echo "FAIL: --emit-config:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi

# --emit-schedule writes the layout's pipeline order in PyTorch's CSV; run from that file
# (PipelineScheduleMulti) the layout plans the same step as the named schedule.
pp_layout=(--gpus 4 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B
           --training.local_batch_size 4)
if "$plan" "${debug[@]}" "${pp_layout[@]}" --json --emit-schedule "$work/order.csv" > "$work/a.json" 2> "$work/err" &&
   [ "$(wc -l < "$work/order.csv")" -eq 2 ] && head -n 1 "$work/order.csv" | grep -q '^0F0,0F1,2F0,2F1,' &&
   "$plan" "${debug[@]}" "${pp_layout[@]}" --parallelism.pipeline_parallel_schedule PipelineScheduleMulti \
     --parallelism.pipeline_parallel_schedule_csv "$work/order.csv" --json > "$work/b.json" 2>> "$work/err" &&
   python3 -c 'import json,sys; a,b=(json.load(open(f)) for f in sys.argv[1:]); sys.exit(a["step_seconds"] != b["step_seconds"] or a["peak_memory_bytes"] != b["peak_memory_bytes"])' "$work/a.json" "$work/b.json"; then
  echo "ok: --emit-schedule writes the order, and the file plans the same step as the schedule it came from"
else
  echo "FAIL: --emit-schedule:"; head -n 5 "$work/err" "$work/order.csv"; failures=$((failures + 1))
fi

# --emit-memory-snapshot: the step as the CUDA allocator the dry run replays holds it, in
# PyTorch's format: whole (tools/memory_snapshot.py check: its blocks cover its segments
# and its events replay to them), its peaks those of --json (held at most: the
# reservation; in use at most: at least the live peak, the blocks being whole where the
# allocator split nothing off), each block named by what it holds and the spans open at
# it; a damaged copy is refused.
tools=$(dirname "$(dirname "$configs")")/tools
fsdp4=(--gpus 4 --parallelism.data_parallel_shard_degree 4 --training.mixed_precision_param bfloat16 --machine h200)
if "$plan" "${debug[@]}" "${fsdp4[@]}" --json --emit-memory-snapshot "$work/m.pickle" > "$work/a.json" 2> "$work/err" &&
   python3 "$tools/memory_snapshot.py" check "$work/m.pickle" > "$work/check" 2>> "$work/err" &&
   python3 - "$tools" "$work/m.pickle" "$work/a.json" >> "$work/err" 2>&1 <<'EOF2'
import json, pickle, sys
sys.path.insert(0, sys.argv[1])
import memory_snapshot
s = pickle.load(open(sys.argv[2], "rb"))
j = json.load(open(sys.argv[3]))
r = memory_snapshot.Replay(s["device_traces"][0])
if r.peak_held != j["reserved_memory_bytes"]:
    sys.exit("held at most %d, --json reserves %d" % (r.peak_held, j["reserved_memory_bytes"]))
if not j["peak_memory_bytes"] <= r.peak <= r.peak_held:
    sys.exit("in use at most %d, --json's peak %d, held %d" % (r.peak, j["peak_memory_bytes"], r.peak_held))
sites = {memory_snapshot.where(f) for _, f in r.at_peak.values()}
for want in ("optimizer", "gradients", "temporary < layers.0 forward < micro-batch 0"):
    if not any(x == want or x.startswith(want) for x in sites):
        sys.exit("no site %r at the peak among %s" % (want, sorted(sites)[:8]))
s["segments"][0]["blocks"][0]["size"] += 512
pickle.dump(s, open(sys.argv[2] + ".bad", "wb"))
EOF2
then
  if python3 "$tools/memory_snapshot.py" check "$work/m.pickle.bad" > /dev/null 2> "$work/bad" ||
     ! grep -q "m.pickle.bad: device 0: segment 0x" "$work/bad"; then
    echo "FAIL: --emit-memory-snapshot: a damaged snapshot passed the check:"; cat "$work/bad"; failures=$((failures + 1))
  else
    echo "ok: --emit-memory-snapshot: $(cat "$work/check"); the peaks of --json; damaged: $(cat "$work/bad")"
  fi
else
  echo "FAIL: --emit-memory-snapshot:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
plan_fails "--emit-memory-snapshot on the CPU" "--emit-memory-snapshot: the CUDA allocator's memory as tessera's step uses it on a GPU --machine" \
  "${debug[@]}" --machine cpu --emit-memory-snapshot "$work/cpu.pickle"
plan_fails "--emit-memory-snapshot to a folder that is not there" \
  "--emit-memory-snapshot: cannot write the memory snapshot $work/no/such/m.pickle" \
  "${debug[@]}" --emit-memory-snapshot "$work/no/such/m.pickle"

# --plan.balance_stages: the ends' weights of a pipeline's even split priced, each split of
# the blocks once, fastest first; the config's split among them; --emit-config writes the
# fastest, whose plan is that row's.
balanced=(--config "$configs/llama3_8b.toml" --machine h100-sxm --gpus 8 --parallelism.pipeline_parallel_degree 8
          --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 16 --training.global_batch_size 16)
if "$plan" "${balanced[@]}" --plan.balance_stages true --json --emit-config "$work/balanced.toml" > "$work/bal.json" 2> "$work/err" &&
   "$plan" --config "$work/balanced.toml" --json > "$work/bal_best.json" 2>> "$work/err" &&
   python3 - "$work/bal.json" "$work/bal_best.json" <<'EOF2'
import json, sys
j, best = (json.load(open(f)) for f in sys.argv[1:])
rows = j["stage_balance"]["weightings"]
splits = [tuple(r["blocks_per_stage"]) for r in rows]
if len(splits) != len(set(splits)) or any(sum(s) != 32 or len(s) != 8 for s in splits):
    sys.exit("splits %s: not 8 stages of the 32 blocks, each once" % splits)
fitting = [r["step_seconds"] for r in rows if r["fits"]]
if fitting != sorted(fitting) or not rows[0]["fits"]:
    sys.exit("not fastest first: %s" % fitting)
mine = [r for r in rows if r["first_stage_less_layers"] == 1 and r["last_stage_less_layers"] == 1]
if len(mine) != 1 or abs(mine[0]["step_seconds"] - j["step_seconds"]) > 1e-9:
    sys.exit("the config's own weighting is not its plan's step: %s against %s" % (mine, j["step_seconds"]))
if abs(best["step_seconds"] - rows[0]["step_seconds"]) > 1e-9:
    sys.exit("the emitted config plans %s, the fastest row %s" % (best["step_seconds"], rows[0]["step_seconds"]))
print("%d splits, the fastest %.3f s against the config's %.3f s" % (len(rows), rows[0]["step_seconds"], j["step_seconds"]))
EOF2
then
  echo "ok: --plan.balance_stages prices each split once, fastest first, and --emit-config writes the fastest"
else
  echo "FAIL: --plan.balance_stages:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
plan_fails "--plan.balance_stages without a pipeline" \
  "--plan.balance_stages: weighs the ends of a pipeline's stages; the layout has none (parallelism.pipeline_parallel_degree = 1)" \
  "${debug[@]}" --plan.balance_stages true
plan_fails "--plan.balance_stages with split points" \
  "--plan.balance_stages: weighs the ends of the even split; parallelism.pipeline_parallel_split_points" \
  "${balanced[@]}" --plan.balance_stages true --parallelism.pipeline_parallel_split_points \
  layers.4,layers.8,layers.12,layers.16,layers.20,layers.24,layers.28

# --plan.zero1: data-parallel replicas accounted as ZeRO-1 hold less than as DDP (the
# optimizer's state split 16 ways, bf16 gradients), and the mode is never emitted.
ddp=(--config "$configs/llama2_7b.toml" --machine a100-80gb-sxm --gpus 16 --training.seq_len 512
     --training.local_batch_size 1 --parallelism.data_parallel_replicate_degree 16 --parallelism.data_parallel_shard_degree 1)
if "$plan" "${ddp[@]}" --json > "$work/ddp.json" 2> "$work/err" &&
   "$plan" "${ddp[@]}" --json --plan.zero1 true > "$work/zero1.json" 2>> "$work/err" &&
   python3 - "$work/ddp.json" "$work/zero1.json" <<'EOF2'
import json, sys
ddp, z = (json.load(open(f)) for f in sys.argv[1:])
# 7B: the fp32 masters and moments (12 bytes a parameter) split 16 ways, the gradients 4 -> 2 bytes.
saved = ddp["peak_memory_bytes"] - z["peak_memory_bytes"]
if not (z["plan.zero1"] and not ddp["plan.zero1"] and 6.7e9 * (12 * 15 / 16 + 2) * 0.95 < saved < 6.8e9 * (12 * 15 / 16 + 2)):
    sys.exit("ZeRO-1 saves %.2f GiB of DDP's %.2f GiB" % (saved / 2**30, ddp["peak_memory_bytes"] / 2**30))
if not z["step_seconds"] < ddp["step_seconds"]:
    sys.exit("ZeRO-1's step (a sixteenth of the optimizer, bf16 gradients) is not shorter than DDP's")
EOF2
then
  echo "ok: --plan.zero1 accounts the replicas' optimizer state split and bf16 gradients"
else
  echo "FAIL: --plan.zero1:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
plan_fails "--emit-schedule of a layout without a pipeline" \
  "--emit-schedule $work/none.csv: the layout has no pipeline (parallelism.pipeline_parallel_degree = 1)" \
  "${debug[@]}" --emit-schedule "$work/none.csv"
plan_fails "--emit-config of a ZeRO-1 layout" "--emit-config: plan.zero1 is a layout tessera's runtime does not run" \
  "${ddp[@]}" --plan.zero1 true --emit-config "$work/zero1.toml"
plan_fails "--plan.zero1 with a bad value" "--plan.zero1 maybe: expected true or false" "${debug[@]}" --plan.zero1 maybe

# --plan.runtime scaling: the memory as the published sheets' runtime holds it, per
# position, with its kernels; the time is the ZeRO-1 trace's without sequence parallelism,
# its gradients reduced in fp32 after the backward (more), and more again with torch's
# eager RMSNorm.
sheet=(--config "$configs/llama2_7b.toml" --machine a100-80gb-sxm --gpus 16 --training.seq_len 1024
       --training.local_batch_size 2 --training.global_batch_size 64 --parallelism.tensor_parallel_degree 2
       --parallelism.data_parallel_replicate_degree 8 --parallelism.data_parallel_shard_degree 1
       --training.mixed_precision_param bfloat16 --activation_checkpoint.mode none)
if "$plan" "${sheet[@]}" --json --plan.zero1 true --parallelism.disable_sequence_parallel true > "$work/z.json" 2> "$work/err" &&
   "$plan" "${sheet[@]}" --json --plan.zero1 true > "$work/z_sp.json" 2>> "$work/err" &&
   "$plan" "${sheet[@]}" --json --plan.runtime scaling > "$work/s_torch.json" 2>> "$work/err" &&
   "$plan" "${sheet[@]}" --json --plan.runtime=scaling --plan.rmsnorm fused --plan.attention flash2 > "$work/s_fused.json" 2>> "$work/err" &&
   "$plan" "${sheet[@]}" --json --plan.runtime scaling --plan.fragmentation 0 > "$work/s_packed.json" 2>> "$work/err" &&
   "$plan" "${sheet[@]}" --plan.runtime scaling > "$work/s.txt" 2>> "$work/err" &&
   grep -q "memory: as Aleph Alpha's scaling holds it (attention flash2, RMSNorm torch" "$work/s.txt" &&
   grep -q "reserved by PyTorch's caching allocator at 15% fragmentation" "$work/s.txt" &&
   python3 - "$work/z.json" "$work/s_torch.json" "$work/s_fused.json" "$work/z_sp.json" "$work/s_packed.json" <<'EOF2'
import json, sys
z, t, f, sp, packed = (json.load(open(x)) for x in sys.argv[1:])
# What must fit is the caching allocator's reservation: the live peak / (1 - 0.15) by
# default, the live peak itself at plan.fragmentation 0.
for p in [t] + t["positions"]:
    if abs(p["reserved_memory_bytes"] - p["peak_memory_bytes"] / 0.85) > 2:
        sys.exit("reserved %d for a live peak of %d at 15%% fragmentation" % (p["reserved_memory_bytes"], p["peak_memory_bytes"]))
if not (t["plan.fragmentation"] == 0.15 and packed["plan.fragmentation"] == 0
        and packed["reserved_memory_bytes"] == packed["peak_memory_bytes"] == t["peak_memory_bytes"]):
    sys.exit("plan.fragmentation 0: reserved %d, live %d" % (packed["reserved_memory_bytes"], packed["peak_memory_bytes"]))
if not (t["plan.runtime"] == "scaling" and z["plan.runtime"] == "tessera" and t["plan.zero1"] and f["plan.rmsnorm"] == "fused"):
    sys.exit("plan.runtime / plan.zero1 / plan.rmsnorm not reported: %s %s %s" % (t["plan.runtime"], z["plan.runtime"], f["plan.rmsnorm"]))
if not (f["step_seconds"] > z["step_seconds"] and t["parallelism.disable_sequence_parallel"]):
    sys.exit("the runtime's gradient reduction: %g s against ZeRO-1's %g s" % (f["step_seconds"], z["step_seconds"]))
if not t["step_seconds"] > f["step_seconds"]:
    sys.exit("torch's RMSNorm %g s, the RMS kernel %g s" % (t["step_seconds"], f["step_seconds"]))
# Norms and residual adds on every row of every tp rank: more time, and the same bytes on the wire.
if not (z["step_seconds"] > sp["step_seconds"] and not sp["parallelism.disable_sequence_parallel"]):
    sys.exit("without sequence parallelism %g s, with %g s" % (z["step_seconds"], sp["step_seconds"]))
m = t["positions"][0]["scaling_memory"]
if t["peak_memory_bytes"] != t["positions"][0]["peak_memory_bytes"] or m["layers"] != 32 or m["in_flight"] != 1:
    sys.exit("the position's memory: %s" % t["positions"][0])
# Torch's RMSNorm keeps 4 more bytes an element, two norms, 32 layers, 2 x 1024 rows of 4096.
gap = t["peak_memory_bytes"] - f["peak_memory_bytes"]
if gap != 2 * 4 * 32 * 2 * 1024 * 4096:
    sys.exit("torch's RMSNorm holds %d bytes more than the kernel" % gap)
EOF2
then
  echo "ok: --plan.runtime scaling counts the runtime's memory and prices its layout, RMSNorm and gradient reduction"
else
  echo "FAIL: --plan.runtime scaling:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
plan_fails "--plan.attention without the runtime" "--plan.attention: describes the scaling runtime; give --plan.runtime scaling" \
  "${sheet[@]}" --plan.attention torch
plan_fails "--plan.runtime with a bad value" "--plan.runtime megatron: expected tessera, scaling or torchtitan" "${sheet[@]}" --plan.runtime megatron
plan_fails "--plan.attention with a bad value" "plan.attention xformers: expected torch, fused, flash1 or flash2" \
  "${sheet[@]}" --plan.runtime scaling --plan.attention xformers
plan_fails "the scaling runtime with selective checkpointing" "activation_checkpoint.mode selective: plan.runtime scaling checkpoints every layer (full) or none" \
  "${sheet[@]}" --plan.runtime scaling --activation_checkpoint.mode selective
plan_fails "--plan.fragmentation without the runtime" "--plan.fragmentation: describes the scaling runtime's allocator" \
  "${sheet[@]}" --plan.fragmentation 0.1
plan_fails "--plan.fragmentation of 1" "--plan.fragmentation 1: expected a share of the reservation, from 0 up to (not including) 1" \
  "${sheet[@]}" --plan.runtime scaling --plan.fragmentation 1
plan_fails "--plan.fragmentation not a number" "--plan.fragmentation 15%: expected a share of the reservation" \
  "${sheet[@]}" --plan.runtime scaling --plan.fragmentation 15%
plan_fails "an unknown plan key" "--plan.budget: unknown key" "${sheet[@]}" --plan.budget 3

# training.expandable_segments: the replay runs the allocator in the config's mode. At
# this layout the live peak fits on an A100 and the expandable segment's reservation does
# not (the run would remap free pages each step: said, not counted as fitting); a segment
# per block reserves more, and the table says only that it does not fit.
edge=(--config "$configs/llama2_13b.toml" --machine a100-80gb-sxm --gpus 64 --parallelism.data_parallel_shard_degree 64
      --training.global_batch_size -1 --training.seq_len 4352 --model.max_seq_len 8192 --training.local_batch_size 5
      --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op)
if "$plan" "${edge[@]}" > "$work/e.txt" 2> "$work/err" &&
   "$plan" "${edge[@]}" --training.expandable_segments false > "$work/e_seg.txt" 2>> "$work/err" &&
   "$plan" "${edge[@]}" --json > "$work/e.json" 2>> "$work/err" &&
   "$plan" "${edge[@]}" --json --training.expandable_segments false > "$work/e_seg.json" 2>> "$work/err" &&
   grep -q 'usable: does NOT fit as planned (its live peak does: the run would unmap the free pages' "$work/e.txt" &&
   grep -qE 'usable: does NOT fit$' "$work/e_seg.txt" &&
   python3 - "$work/e.json" "$work/e_seg.json" <<'EOF2'
import json, sys
grow, seg = (json.load(open(x)) for x in sys.argv[1:])
if grow["fits"] or seg["fits"] or not grow["peak_memory_bytes"] <= grow["usable_memory_bytes"] < grow["reserved_memory_bytes"]:
    sys.exit("expected a live peak that fits and a reservation that does not: %s" % grow)
if not (grow["peak_memory_bytes"] == seg["peak_memory_bytes"] and grow["reserved_memory_bytes"] < seg["reserved_memory_bytes"]):
    sys.exit("expandable segments reserve %d, a segment per block %d, live %d and %d" % (
        grow["reserved_memory_bytes"], seg["reserved_memory_bytes"], grow["peak_memory_bytes"], seg["peak_memory_bytes"]))
EOF2
then
  echo "ok: training.expandable_segments: the replay follows it; a live peak that fits beside a reservation that does not is said"
else
  echo "FAIL: training.expandable_segments in the plan"; cat "$work/err"; failures=$((failures + 1))
fi

# --plan.runtime torchtitan: the time as its eager FSDP2 step runs it (Triton or eager
# RMSNorm), longer than tessera's step of the same layout; the memory is the trace's.
titan=(--config "$configs/llama3_8b.toml" --machine a100-80gb-sxm --gpus 16 --model.n_layers 4 --training.seq_len 2048
       --training.local_batch_size 1 --parallelism.data_parallel_shard_degree 16 --training.mixed_precision_param bfloat16)
if "$plan" "${titan[@]}" --json > "$work/t_tessera.json" 2> "$work/err" &&
   "$plan" "${titan[@]}" --json --plan.runtime torchtitan > "$work/t_fused.json" 2>> "$work/err" &&
   "$plan" "${titan[@]}" --json --plan.runtime torchtitan --plan.rmsnorm torch > "$work/t_torch.json" 2>> "$work/err" &&
   "$plan" "${titan[@]}" --plan.runtime torchtitan > "$work/t.txt" 2>> "$work/err" &&
   grep -q "time: as torchtitan's eager FSDP2 step runs it (RMSNorm Triton" "$work/t.txt" &&
   python3 - "$work/t_tessera.json" "$work/t_fused.json" "$work/t_torch.json" <<'EOF2'
import json, sys
own, fused, torch = (json.load(open(x)) for x in sys.argv[1:])
if not (fused["plan.runtime"] == "torchtitan" and fused["plan.rmsnorm"] == "fused" and torch["plan.rmsnorm"] == "torch"):
    sys.exit("plan.runtime / plan.rmsnorm not reported: %s %s" % (fused["plan.runtime"], fused.get("plan.rmsnorm")))
if not own["step_seconds"] < fused["step_seconds"] < torch["step_seconds"]:
    sys.exit("tessera %g s, torchtitan with Triton's norm %g s, with eager norms %g s" % (
        own["step_seconds"], fused["step_seconds"], torch["step_seconds"]))
if not own["peak_memory_bytes"] == fused["peak_memory_bytes"] == torch["peak_memory_bytes"]:
    sys.exit("the memory is the trace's: %d, %d, %d" % (own["peak_memory_bytes"], fused["peak_memory_bytes"], torch["peak_memory_bytes"]))
EOF2
then
  echo "ok: --plan.runtime torchtitan prices its eager FSDP2 step, longer than tessera's, with the trace's memory"
else
  echo "FAIL: --plan.runtime torchtitan:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
plan_fails "the torchtitan runtime with tensor parallelism" \
  "parallelism.tensor_parallel_degree 2: plan.runtime torchtitan counts the FSDP layouts of its published table" \
  "${titan[@]}" --plan.runtime torchtitan --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 8
plan_fails "the torchtitan runtime on the CPU" "--machine cpu: plan.runtime torchtitan prices that runtime's CUDA step" \
  "${titan[@]}" --plan.runtime torchtitan --machine cpu
plan_fails "--plan.rmsnorm without a runtime" "--plan.rmsnorm: describes another runtime's RMSNorm" \
  "${titan[@]}" --plan.rmsnorm torch

plan_fails "a layout that does not divide the GPUs" "tensor_parallel_degree 4 x pipeline_parallel_degree 1 = 4 does not divide the world size 6" \
  "${debug[@]}" --gpus 6 --parallelism.tensor_parallel_degree 4
plan_fails "a tensor degree that does not divide the heads" "parallelism.tensor_parallel_degree = 32 does not divide n_heads = 16" \
  "${debug[@]}" --gpus 32 --parallelism.tensor_parallel_degree 32
plan_fails "more stages than layers" "parallelism.pipeline_parallel_degree: pipeline degree larger than the layer count" \
  "${debug[@]}" --gpus 16 --parallelism.pipeline_parallel_degree 16
plan_fails "GPUs that are not whole nodes" "--gpus 12: not whole nodes of 8 GPUs" "${debug[@]}" --gpus 12
plan_fails "a sequence that does not split into 2 cp chunks" \
  "training.seq_len = 100 does not split into 2 x parallelism.context_parallel_degree = 8 equal chunks" \
  "${debug[@]}" --gpus 8 --parallelism.context_parallel_degree 4 --training.seq_len 100
plan_fails "a context-parallel degree that does not divide the world" \
  "context_parallel_degree 3 = 3 does not divide the world size 8, so data_parallel_shard_degree = -1 cannot be inferred" \
  "${debug[@]}" --gpus 8 --parallelism.context_parallel_degree 3 --training.seq_len 120
plan_fails "context parallelism as ZeRO-1" "parallelism.context_parallel_degree 2: plan.zero1 accounts data-parallel replicas" \
  "${debug[@]}" --gpus 8 --parallelism.context_parallel_degree 2 --plan.zero1 true
plan_fails "context parallelism in torchtitan's eager runtime" \
  "parallelism.context_parallel_degree 2: plan.runtime torchtitan counts the FSDP layouts of its published A100 table" \
  "${debug[@]}" --gpus 8 --parallelism.context_parallel_degree 2 --plan.runtime torchtitan
sed '/^\[network.nvlink_gbs\]/,/^source/d' "$machines/h100-sxm.toml" > "$work/no_nvlink.toml"
plan_fails "a machine file missing a network field" "network.nvlink_gbs is missing" "${debug[@]}" --gpus 8 \
  --machine "$work/no_nvlink.toml"
python3 - "$machines/h100-sxm.toml" "$work/one_gpu.toml" <<'EOF2'
import re, sys
text = open(sys.argv[1]).read()
open(sys.argv[2], "w").write(re.sub(r"\n\[network\.[^\]]*\]\n(#.*\n)*value = .*\nsource = .*", "", text))
EOF2
plan_fails "several GPUs on a profile without a network" "the profile has no [network] section, so 8 GPUs cannot be priced" \
  "${debug[@]}" --gpus 8 --machine "$work/one_gpu.toml"

# --search: every layout of the debug model on 8 GPUs, fitting ones first and fastest
# first, each with llama-train's keys; the first predicted in full, and what
# --emit-config writes of it plans the same step.
if "$plan" "${debug[@]}" --gpus 8 --search --json --emit-config "$work/best.toml" > "$work/search.json" 2> "$work/err" &&
   "$plan" --config "$work/best.toml" --gpus 8 --json > "$work/best.json" 2>> "$work/err" &&
   python3 - "$work/search.json" "$work/best.json" <<'EOF2'
import json, sys
s, best = (json.load(open(f)) for f in sys.argv[1:])
layouts = s["layouts"]
keys = ["parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
        "parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
        "parallelism.context_parallel_degree", "parallelism.pipeline_parallel_schedule", "parallelism.pipeline_parallel_microbatch_size",
        "parallelism.fsdp_reshard_after_forward", "activation_checkpoint.mode", "training.local_batch_size",
        "training.global_batch_size", "fits", "peak_memory_bytes", "tokens_per_sec", "mfu_pct", "step_seconds",
        "collective_sm_seconds"]
for l in layouts:
    for k in keys:
        if k not in l:
            sys.exit("a layout lacks %s: %s" % (k, l))
    degrees = 1
    for k in keys[:5]:
        degrees *= l[k]
    if degrees != 8 or l["training.global_batch_size"] != 64:
        sys.exit("a layout of %d GPUs or a global batch of %d: %s" % (degrees, l["training.global_batch_size"], l))
if len(layouts) < 20 or not layouts[0]["fits"] or layouts[0]["extrapolated"]:
    sys.exit("%d layouts, the first fits: %s, extrapolated: %s" % (len(layouts), layouts[0]["fits"], layouts[0]["extrapolated"]))
fit = [l for l in layouts if l["fits"]]
if layouts[:len(fit)] != fit or any(a["tokens_per_sec"] < b["tokens_per_sec"] for a, b in zip(fit, fit[1:])):
    sys.exit("the layouts are not fitting ones first, fastest first")
if s["search"]["enumerated"] < s["search"]["priced"] + s["search"]["refused"]:
    sys.exit("more layouts priced or refused than enumerated: %s" % s["search"])
if abs(best["step_seconds"] - layouts[0]["step_seconds"]) > 1e-12 or best["peak_memory_bytes"] != layouts[0]["peak_memory_bytes"]:
    sys.exit("the emitted config plans %g s and %d bytes, the search's first %g s and %d bytes" % (
        best["step_seconds"], best["peak_memory_bytes"], layouts[0]["step_seconds"], layouts[0]["peak_memory_bytes"]))
print("%d layouts priced, %d fit; the first: %.0f tokens/s per GPU" % (len(layouts), len(fit), fit[0]["tokens_per_sec"]))
EOF2
then
  echo "ok: --search ranks the layouts of 8 GPUs and emits the first"
else
  echo "FAIL: --search:"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
if "$plan" "${debug[@]}" --gpus 8 --search --search.max_microbatch 1 > "$work/search.txt" 2> "$work/err" &&
   grep -q '^ rank  repl shard  cp  tp  pp  schedule' "$work/search.txt" && grep -qE '^ +1  ' "$work/search.txt" &&
   grep -q 'layouts: .* priced' "$work/search.txt"; then
  echo "ok: --search's table"
else
  echo "FAIL: --search's table:"; head -n 12 "$work/search.txt" "$work/err"; failures=$((failures + 1))
fi
# The issue's target for context parallelism: Llama 3.1 8B at 131,072 tokens a sequence on
# 8 H200s, at torchtitan's 128k batch (2 sequences), has a layout that fits and at least
# torchtitan's published 1,071 tokens/s per GPU (FSDP 2 x CP 4 on 8 H100s, float8), and
# layouts that split the sequences among those that fit. About a second.
if "$plan" --config "$configs/llama3.1_8b.toml" --machine h200 --gpus 8 --training.seq_len 131072 \
     --training.global_batch_size 2 --search --json > "$work/search_128k.json" 2> "$work/err" &&
   result=$(python3 - "$work/search_128k.json" <<'EOF2'
import json, sys
s = json.load(open(sys.argv[1]))
fit = [l for l in s["layouts"] if l["fits"]]
if not fit or fit[0]["tokens_per_sec"] < 1071:
    sys.exit("the first layout: %s" % (fit[0] if fit else "none fits"))
if not any(l["parallelism.context_parallel_degree"] > 1 for l in fit):
    sys.exit("no layout that fits splits the sequences")
f = fit[0]
print("%.0f tokens/s per GPU, cp %d x tp %d x shard %d, %s checkpointing, %.1f GiB" % (
    f["tokens_per_sec"], f["parallelism.context_parallel_degree"], f["parallelism.tensor_parallel_degree"],
    f["parallelism.data_parallel_shard_degree"], f["activation_checkpoint.mode"], f["peak_memory_bytes"] / 2**30))
EOF2
); then
  echo "ok: --search for Llama 3.1 8B at 128k on 8 H200s: $result"
else
  echo "FAIL: --search for Llama 3.1 8B at 128k on 8 H200s: ${result:-}"; head -n 5 "$work/err"; failures=$((failures + 1))
fi
sed "s/^value = 85045477376$/value = 1920000000/" "$machines/h100-sxm.toml" > "$work/small_gpu.toml"
plan_fails "--search over nothing that fits" "--search: none of the 1720 layouts of debugmodel on 8 GPUs of h100-sxm fits" \
  "${debug[@]}" --gpus 8 --search --machine "$work/small_gpu.toml"
# ... and stdout says what the memory levers the config leaves off would fit: CPU offload does.
if grep -q "^  training.enable_cpu_offload = true (AdamW on the host's cores, the shards over the host link): fits: " "$work/out" &&
   [ "$(grep -c '^  optimizer.state_dtype = bfloat16' "$work/out")" -eq 2 ]; then
  echo "ok: --search over nothing that fits lists the memory levers: $(grep -c '^  ' "$work/out") of them"
else
  echo "FAIL: --search over nothing that fits: no memory levers on stdout:"; head -n 6 "$work/out"; failures=$((failures + 1))
fi
plan_fails "--search of ZeRO-1" "--search: plan.zero1 is a layout tessera's runtime does not run" "${debug[@]}" --gpus 8 \
  --search --plan.zero1 true
plan_fails "--search on the CPU" "--search: plans GPU clusters" "${debug[@]}" --gpus 2 --search --machine cpu
plan_fails "--search.max_microbatch not a number" "--search.max_microbatch many: expected a positive number" \
  "${debug[@]}" --gpus 8 --search --search.max_microbatch many

[ "$failures" -eq 0 ] && echo "cli_plan: all checks passed" || echo "cli_plan: $failures failures"
exit $((failures > 0))
