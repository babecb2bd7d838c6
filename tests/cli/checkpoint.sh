#!/usr/bin/env bash
# llama-checkpoint end to end, on the sharded checkpoints of two short llama-train runs
# (one rank, and two thread ranks of FSDP): `list` shows each step folder, complete or
# not, with the world that saved it, and a step's training state; `verify` checks every
# tensor's CRC-32C, and a flipped byte fails it naming the file and the tensor;
# `convert` loads the two-rank checkpoint into one fp32 model and writes a safetensors
# file and a Hugging Face directory holding bitwise the tensors the run's own final save
# holds, which llama-generate samples the same text from; a one-rank run with emulated
# float8 GEMMs closes with a sample from its float32 weights. Then bad input: one line naming
# the path or the flag, exit status 1, never a crash.
#   checkpoint.sh LLAMA_TRAIN LLAMA_CHECKPOINT LLAMA_GENERATE CONFIGS_DIR
set -uo pipefail
train=$1
ckpt=$2
generate=$3
configs=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
runs=0

# Ranks share the cores: OpenMP threads sleep rather than spin between loops.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

# ok WHAT / bad WHAT DETAIL...: one check's outcome.
ok() { runs=$((runs + 1)); echo "ok: $1"; }
bad() {
  runs=$((runs + 1)); failures=$((failures + 1))
  echo "FAIL: $1"; shift
  for line in "$@"; do echo "  $line"; done
}

# run_tool NAME ARGS...: llama-checkpoint ARGS, stdout in $work/NAME.out, stderr in
# $work/NAME.err; sets $status.
run_tool() {
  local name=$1
  shift
  timeout 60 "$ckpt" "$@" > "$work/$name.out" 2> "$work/$name.err" < /dev/null
  status=$?
}

# has NAME STREAM REGEX: the lines of $work/NAME.STREAM matching REGEX (extended).
has() { grep -cE -- "$3" "$work/$1.$2"; }

# expect_error WHAT EXPECTED_TEXT ARGS...: llama-checkpoint ARGS exits with status 1 and
# its last line on stderr holds EXPECTED_TEXT.
expect_error() {
  local what=$1 expected=$2
  shift 2
  run_tool error "$@"
  local last
  last=$(grep -v '^$' "$work/error.err" | tail -n 1)
  if [ "$status" -ne 1 ]; then
    bad "$what: exit status $status (expected 1)" "$(tail -n 3 "$work/error.err")"
  elif [[ "$last" != "llama-checkpoint: error: "*"$expected"* ]]; then
    bad "$what: last line '$last' lacks '$expected'"
  else
    ok "$what -> $last"
  fi
}

# same_tensors A B: the two safetensors files hold the same tensors (names, dtypes,
# shapes and bytes); prints how many.
same_tensors() {
  python3 - "$1" "$2" <<'EOF'
import json, struct, sys
def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
if sorted(a) != sorted(b):
    sys.exit("the tensor names differ: %s" % sorted(set(a) ^ set(b))[:4])
differ = [k for k in sorted(a) if a[k] != b[k]]
if differ:
    sys.exit("%d of %d tensors differ, the first %s" % (len(differ), len(a), differ[0]))
print("%d tensors bitwise the same" % len(a))
EOF
}

# dtypes FILE: the dtypes a safetensors file stores, sorted, space-separated.
dtypes() {
  python3 - "$1" <<'EOF'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
print(" ".join(sorted({v["dtype"] for k, v in header.items() if k != "__metadata__"})))
EOF
}

# flip FILE TENSOR: flips one bit of TENSOR's fourth stored byte in FILE.
flip() {
  python3 - "$1" "$2" <<'EOF'
import json, struct, sys
with open(sys.argv[1], "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    at = 8 + n + json.loads(f.read(n))[sys.argv[2]]["data_offsets"][0] + 3
    f.seek(at); b = f.read(1); f.seek(at); f.write(bytes([b[0] ^ 0x10]))
EOF
}

# --- Two runs with checkpoints after steps 2 and 4 ------------------------------

small=(--config "$configs/debug_model.toml" --model.dim 64 --training.seq_len 32 --training.steps 4
       --metrics.peak_tflops 1 --checkpoint.enable true --checkpoint.interval 2
       --checkpoint.last_save_model_only false)
two_ranks=(--thread-ranks 2 --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 4)
for name in one two; do
  extra=()
  [ "$name" = two ] && extra=("${two_ranks[@]}")
  start=$SECONDS
  if ! timeout 120 "$train" "${small[@]}" "${extra[@]}" --sample-tokens 8 --job.dump_folder "$work/$name" \
       > "$work/train-$name.log" 2>&1; then
    echo "FAIL: the $name-rank training run itself failed"; tail -n 5 "$work/train-$name.log"; exit 1
  fi
  echo "trained $name in $((SECONDS - start)) s"
done
run2=$work/two/checkpoint

# --- list ------------------------------------------------------------------------

for name in one two; do
  world=1
  [ "$name" = two ] && world=2
  run_tool "list-$name" list "$work/$name/checkpoint"
  step2=$(has "list-$name" out "^ +2 +complete +$world +[0-9.]+ [kMG]?B +step-2$")
  step4=$(has "list-$name" out "^ +4 +complete +$world +[0-9.]+ [kMG]?B +step-4$")
  latest=$(has "list-$name" out "^latest complete checkpoint: .*/step-4$")
  if [ "$status" -eq 0 ] && [ "$step2" -eq 1 ] && [ "$step4" -eq 1 ] && [ "$latest" -eq 1 ]; then
    ok "list of the $name-rank run: step-2 and step-4 complete, saved by $world rank(s), then step-4 shown"
  else
    bad "list of the $name-rank run (status $status)" "$(head -n 6 "$work/list-$name.out")" \
        "$(cat "$work/list-$name.err")"
  fi
done

run_tool step2 list "$run2/step-2" --checksums
state=$(has step2 out '^ +step +2$')
optimizer=$(has step2 out '^ +optimizer_steps +2$')
ranks=$(has step2 out '^saved by +2 ranks$')
params=$(has step2 out '^parameters \(57\)$')
tensors=$(grep -E '^ +total +[0-9]+ ' "$work/step2.out" | awk '{print $2}')
crcs=$(has step2 out '^ +model-rank[01]-of-2\.safetensors +[^ ]+@[0-9]+ +[0-9]+ +[0-9a-f]{8}$')
if [ "$status" -eq 0 ] && [ "$state" -eq 1 ] && [ "$optimizer" -eq 1 ] && [ "$ranks" -eq 1 ] && [ "$params" -eq 1 ] \
   && [ -n "$tensors" ] && [ "$crcs" -eq "$tensors" ]; then
  ok "list of step-2: state step 2, 2 ranks, 57 parameters, a checksum for each of the $tensors tensors"
else
  bad "list of step-2 --checksums (status $status): state $state, optimizer $optimizer, ranks $ranks," \
      "parameters $params, $crcs checksums for '$tensors' tensors" "$(head -n 12 "$work/step2.out")"
fi

# --- verify ----------------------------------------------------------------------

run_tool verify verify "$run2"
good=$(has verify out '^ok step-[24]: 2 files, [0-9]+ tensors, [0-9.]+ [kMG]?B checked$')
if [ "$status" -eq 0 ] && [ "$good" -eq 2 ]; then
  ok "verify: $(tr '\n' ';' < "$work/verify.out")"
else
  bad "verify of the two-rank run (status $status, $good ok lines)" "$(cat "$work/verify.out" "$work/verify.err")"
fi

cp -r "$run2" "$work/corrupt"
victim=layers.1.attention.wq.weight@0
flip "$work/corrupt/step-4/model-rank0-of-2.safetensors" "$victim"
run_tool corrupt verify "$work/corrupt"
named=$(has corrupt err \
  "^llama-checkpoint: error: .*/step-4/model-rank0-of-2\.safetensors: tensor '$victim' is corrupt")
still=$(has corrupt out '^ok step-2: ')
if [ "$status" -eq 1 ] && [ "$named" -eq 1 ] && [ "$still" -eq 1 ]; then
  ok "verify after a flipped byte: step-2 ok, step-4 refused naming the file and tensor $victim"
else
  bad "verify after a flipped byte (status $status, named $named, step-2 ok $still)" \
      "$(cat "$work/corrupt.out" "$work/corrupt.err")"
fi
expect_error "convert of the flipped byte" "model-rank0-of-2.safetensors: tensor '$victim' is corrupt" \
  convert "$work/corrupt" --to safetensors "$work/corrupt.safetensors"
if [ -e "$work/corrupt.safetensors" ]; then
  bad "a failed convert wrote its output"
else
  ok "a failed convert wrote nothing"
fi

# Interrupted saves: step-4 without its marker, step-6 still .partial.
cp -r "$run2" "$work/incomplete"
rm "$work/incomplete/step-4/COMPLETE"
mkdir "$work/incomplete/step-6.partial"
cp "$run2/step-4/model-rank0-of-2.safetensors" "$work/incomplete/step-6.partial/"
run_tool incomplete-list list "$work/incomplete"
listed=$(( $(has incomplete-list out '^ +4 +incomplete .* +2 +[0-9.]+ [kMG]?B +step-4$') \
         + $(has incomplete-list out '^ +6 +partial .* +2 +[0-9.]+ [kMG]?B +step-6\.partial$') \
         + $(has incomplete-list out '^latest complete checkpoint: .*/step-2$') ))
run_tool incomplete-verify verify "$work/incomplete"
warned=$(( $(has incomplete-verify err '^llama-checkpoint: warning: .*/step-4: .*not verified$') \
         + $(has incomplete-verify err '^llama-checkpoint: warning: .*/step-6\.partial: .*not verified$') ))
verified=$(has incomplete-verify out '^ok step-2: ')
if [ "$listed" -eq 3 ] && [ "$status" -eq 0 ] && [ "$warned" -eq 2 ] && [ "$verified" -eq 1 ]; then
  ok "interrupted saves: listed as incomplete and partial, warned about and skipped by verify"
else
  bad "interrupted saves: $listed of 3 list lines, verify status $status, $warned of 2 warnings, step-2 ok $verified" \
      "$(cat "$work/incomplete-list.out" "$work/incomplete-verify.out" "$work/incomplete-verify.err")"
fi
expect_error "verify of an incomplete step folder" "step-4: no COMPLETE marker" verify "$work/incomplete/step-4"
expect_error "verify --step of an incomplete step" "step-4: no COMPLETE marker" verify "$work/incomplete" --step 4
expect_error "convert of a partial folder" "step-6.partial: no COMPLETE marker" \
  convert "$work/incomplete/step-6.partial" --to hf "$work/partial-hf"

# --- convert ---------------------------------------------------------------------

# The run folder's latest complete checkpoint (step 4, the run's last step), loaded into
# one rank, is the model the run saved at its end.
run_tool convert-st convert "$run2" --to safetensors "$work/two.safetensors"
if [ "$status" -eq 0 ] && result=$(same_tensors "$work/two.safetensors" "$work/two/model.safetensors" 2>&1); then
  ok "convert --to safetensors of the two-rank run: $result as its model.safetensors"
else
  bad "convert --to safetensors (status $status): ${result:-}" "$(cat "$work/convert-st.err")"
fi
run_tool convert-one convert "$work/one" --to safetensors "$work/one.safetensors"
if [ "$status" -eq 0 ] && result=$(same_tensors "$work/one.safetensors" "$work/one/model.safetensors" 2>&1); then
  ok "convert of the one-rank run (given its dump folder): $result as its model.safetensors"
else
  bad "convert of the one-rank run (status $status): ${result:-}" "$(cat "$work/convert-one.err")"
fi
run_tool convert-hf convert "$run2/step-4" --to hf "$work/hf" --tokenizer "$work/two/tokenizer.model"
if [ "$status" -eq 0 ] && result=$(same_tensors "$work/hf/model.safetensors" "$work/two/hf/model.safetensors" 2>&1) \
   && cmp -s "$work/hf/config.json" "$work/two/hf/config.json" \
   && cmp -s "$work/hf/tokenizer.model" "$work/two/tokenizer.model"; then
  ok "convert --to hf of step-4: $result as the run's own hf/, the same config.json and tokenizer"
else
  bad "convert --to hf (status $status): ${result:-}" "$(cat "$work/convert-hf.err")"
fi

# llama-generate samples the same text from the run's model and from both conversions.
sample() { timeout 60 "$generate" --prompt "Nora" --max-new-tokens 24 --seed 7 "$@" 2>&1; }
reference=$(sample --checkpoint "$work/two/model.safetensors" --tokenizer "$work/two/tokenizer.model")
from_st=$(sample --checkpoint "$work/two.safetensors" --tokenizer "$work/two/tokenizer.model")
from_hf=$(sample --checkpoint "$work/hf")
if [ -n "$reference" ] && [ "$from_st" = "$reference" ] && [ "$from_hf" = "$reference" ]; then
  ok "llama-generate: the same sample from the run's model and both conversions"
else
  bad "llama-generate samples differ" "run's model: $reference" "safetensors:  $from_st" "hf:           $from_hf"
fi

# One rank with emulated float8 GEMMs samples, at the end of its run, from a float32 copy
# of its weights (each token's forward would otherwise cast every weight to float8 again,
# in software): the sample's start is what llama-generate draws from the saved model with
# the same seed, temperature and window (24 tokens, inside training.seq_len's 32).
if timeout 120 "$train" "${small[@]}" --sample-tokens 24 --model.converters float8 --float8.emulate true --checkpoint.enable false \
     --training.mixed_precision_param bfloat16 --training.steps 2 --job.dump_folder "$work/f8" > "$work/train-f8.log" 2>&1; then
  drawn=$(timeout 60 "$generate" --checkpoint "$work/f8/model.safetensors" --max-new-tokens 24 --temperature 0.7 \
            --seed 0 2>&1)
  ended=$(sed -n '/^--- sample (temperature 0.7) ---$/{n;p;}' "$work/train-f8.log")
  if [ -n "$drawn" ] && [ "${ended:0:${#drawn}}" = "$drawn" ]; then
    ok "one rank, emulated float8: the run's closing sample starts as llama-generate's from its float32 model"
  else
    bad "one rank, emulated float8: the closing sample is not the float32 model's" "llama-generate: $drawn" \
        "the run:        ${ended:0:120}"
  fi
else
  bad "the float8 training run itself failed" "$(tail -n 5 "$work/train-f8.log")"
fi

# A LoRA run on two ranks of FSDP: its checkpoint holds the adapters apart (and the
# settings that merge them); convert merges them as the run's own final save does.
if timeout 120 "$train" "${small[@]}" "${two_ranks[@]}" --sample-tokens 8 --model.converters lora --lora.rank 4 \
     --job.dump_folder "$work/lora" > "$work/train-lora.log" 2>&1; then
  run_tool lora-list list "$work/lora/checkpoint/step-4"
  adapters=$(has lora-list out 'lora_a\.weight')
  run_tool convert-lora convert "$work/lora" --to safetensors "$work/lora.safetensors"
  if [ "$status" -eq 0 ] && [ "$adapters" -gt 0 ] &&
     result=$(same_tensors "$work/lora.safetensors" "$work/lora/model.safetensors" 2>&1) &&
     ! grep -q lora_ <(python3 -c "import json,struct,sys; f=open(sys.argv[1],'rb'); print(f.read(8+struct.unpack('<Q',f.read(8))[0]))" "$work/lora.safetensors"); then
    ok "convert of a LoRA run's checkpoint (its $adapters adapter rows listed): the adapters merged, $result as its model.safetensors"
  else
    bad "convert of the LoRA run (status $status, $adapters adapters listed): ${result:-}" "$(cat "$work/convert-lora.err")"
  fi
else
  bad "the LoRA training run itself failed" "$(tail -n 5 "$work/train-lora.log")"
fi

run_tool convert-bf16 convert "$run2" --step 2 --to safetensors "$work/bf16.safetensors" --dtype bfloat16
stored=$(dtypes "$work/bf16.safetensors" 2>&1)
from=$(has convert-bf16 out '^wrote .*: safetensors, bfloat16, from .*/step-2 ')
if [ "$status" -eq 0 ] && [ "$stored" = BF16 ] && [ "$from" -eq 1 ] \
   && sample --checkpoint "$work/bf16.safetensors" --tokenizer "$work/two/tokenizer.model" > /dev/null; then
  ok "convert --step 2 --dtype bfloat16: every tensor BF16, and llama-generate loads it"
else
  bad "convert --dtype bfloat16 (status $status): dtypes '$stored', from step-2 $from" "$(cat "$work/convert-bf16.err")"
fi

# An existing output is replaced only with --force.
before=$(md5sum < "$work/two.safetensors")
expect_error "convert onto an existing file" "two.safetensors: exists (give --force" \
  convert "$run2" --to safetensors "$work/two.safetensors" --step 2
expect_error "convert onto an existing directory" "hf: exists (give --force" convert "$run2" --to hf "$work/hf"
if [ "$(md5sum < "$work/two.safetensors")" = "$before" ]; then
  ok "a refused convert left the existing file alone"
else
  bad "a refused convert changed the existing file"
fi
run_tool force convert "$run2" --to safetensors "$work/two.safetensors" --step 2 --force
if [ "$status" -eq 0 ] && [ "$(md5sum < "$work/two.safetensors")" != "$before" ]; then
  ok "convert --force replaced the file (with step 2's model)"
else
  bad "convert --force (status $status)" "$(cat "$work/force.err")"
fi

# --- Bad input -------------------------------------------------------------------

mkdir "$work/empty"
touch "$work/plain"
expect_error "no command" "a command is required"
expect_error "unknown command" "unknown command 'show'" show "$run2"
expect_error "no PATH" "list: PATH is required" list
expect_error "missing path" "$work/nothing: no such file or directory" list "$work/nothing"
expect_error "a file for PATH" "$work/plain: not a directory" verify "$work/plain"
expect_error "a folder that is neither" "$work/empty: neither a run's checkpoint folder" \
  convert "$work/empty" --to hf "$work/x"
expect_error "unknown option" "unknown option '--chksums'" list "$run2" --chksums
expect_error "an option of another command" "--checksums: only for list" verify "$run2" --checksums
expect_error "two paths" "unexpected argument" list "$run2" "$work/one"
expect_error "--step without a number" "--step: missing step number" list "$run2" --step
expect_error "--step not a number" "--step: expected a step number, got 'last'" list "$run2" --step last
expect_error "--step of no checkpoint" "step-3: --step 3 names no checkpoint here" verify "$run2" --step 3
expect_error "--step with a step folder" "--step: " list "$run2/step-2" --step 2
expect_error "convert without --to" "--to hf OUTDIR or --to safetensors FILE is required" convert "$run2"
expect_error "convert --to an unknown kind" "--to: expected hf or safetensors, got 'gguf'" \
  convert "$run2" --to gguf "$work/x"
expect_error "convert --to without an output" "--to: missing output directory" convert "$run2" --to hf
expect_error "convert --to followed by an option" "--to: missing output directory (got the option '--force')" \
  convert "$run2" --to hf --force
expect_error "convert --dtype float16" "--dtype: expected float32 or bfloat16, got 'float16'" \
  convert "$run2" --to safetensors "$work/x.safetensors" --dtype float16
expect_error "convert --tokenizer missing" "--tokenizer $work/none.model: no such file" \
  convert "$run2" --to hf "$work/x" --tokenizer "$work/none.model"
expect_error "convert --tokenizer to safetensors" "--tokenizer: only with --to hf" \
  convert "$run2" --to safetensors "$work/x.safetensors" --tokenizer "$work/two/tokenizer.model"

cp -r "$run2/step-2" "$work/truncated"
head -c 1000 "$run2/step-2/model-rank1-of-2.safetensors" > "$work/truncated/model-rank1-of-2.safetensors"
expect_error "a truncated rank file" "truncated/model-rank1-of-2.safetensors: header length" verify "$work/truncated"
cp -r "$run2/step-2" "$work/missing"
rm "$work/missing/model-rank1-of-2.safetensors"
expect_error "a missing rank file" "missing/model-rank1-of-2.safetensors: missing" list "$work/missing"
cp -r "$run2/step-2" "$work/marker"
echo 'not json' > "$work/marker/COMPLETE"
expect_error "a broken COMPLETE marker" "marker/COMPLETE: not a valid marker" convert "$work/marker" --to hf "$work/x"
echo '{"world_size": 99999999999}' > "$work/marker/COMPLETE"
expect_error "a marker's world_size past any world" "marker/COMPLETE: world_size 99999999999 is not a number of ranks" \
  verify "$work/marker"
echo '{"world_size": 2, "format": "tessera sharded checkpoint 2"}' > "$work/marker/COMPLETE"
expect_error "a marker of another format" 'marker/COMPLETE: format "tessera sharded checkpoint 2" is not' verify "$work/marker"
# One rank's file from another save of the same layout: two models mixed, refused.
cp -r "$run2/step-4" "$work/mixed"
cp "$run2/step-2/model-rank1-of-2.safetensors" "$work/mixed/"
expect_error "files from different saves" \
  "mixed/model-rank1-of-2.safetensors: saved at step 2 (data position 16), where $work/mixed/model-rank0-of-2.safetensors was saved at step 4" \
  verify "$work/mixed"
cp -r "$run2/step-2" "$work/header"
# A byte of the JSON header's stretch index, flipped: the index checksum names the file.
python3 - "$work/header/model-rank0-of-2.safetensors" <<'EOF'
import sys
data = bytearray(open(sys.argv[1], "rb").read())
at = data.index(b"tok_embeddings.weight@0", data.index(b"tessera.stretches"))
data[at] ^= 0x01  # 't' -> 'u'
open(sys.argv[1], "wb").write(bytes(data))
EOF
expect_error "a corrupt header index" "header/model-rank0-of-2.safetensors: the index in its header is corrupt" \
  verify "$work/header"
if [ -e "$work/x" ] || [ -e "$work/x.safetensors" ] || [ -e "$work/partial-hf" ]; then
  bad "a refused convert wrote its output"
else
  ok "no refused convert wrote its output"
fi

echo "$((runs - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
