#!/usr/bin/env bash
# Every bad input to the binaries ends in one clear error line and exit status 1:
# never a crash (status >= 128), a hang (each run is time-limited) or silence.
set -uo pipefail
train=$1
generate=$2
configs=$3
eval=$4
fixtures=$5
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
runs=0

# expect_error DESCRIPTION EXPECTED_TEXT COMMAND...
expect_error() {
  local what=$1 expected=$2
  shift 2
  runs=$((runs + 1))
  local out status
  out=$(timeout 60 "$@" 2>&1 >/dev/null)
  status=$?
  local last
  last=$(printf '%s\n' "$out" | grep -v '^$' | tail -n 1)
  if [ "$status" -ne 1 ]; then
    echo "FAIL: $what: exit status $status (expected 1)"; echo "$out" | tail -n 5; failures=$((failures + 1))
  elif [[ "$last" != *"$expected"* ]]; then
    echo "FAIL: $what: last line '$last' lacks '$expected'"; failures=$((failures + 1))
  else
    echo "ok: $what -> $last"
  fi
}

# A given MFU peak: a run on the CPU otherwise measures its GEMMs first (4 to 5 s, 16 under
# the sanitizers) before it reaches the data and checkpoint errors below; cli_distributed
# checks the measured peak.
small=(--config "$configs/debug_model.toml" --job.dump_folder "$work/out" --training.steps 1
       --model.n_layers 1 --model.dim 32 --model.n_heads 2 --training.seq_len 16 --training.local_batch_size 1
       --training.synthetic_documents 10 --checkpoint.enable false --metrics.peak_tflops 1)

expect_error "unknown key" "unknown option --training.stepz (did you mean --training.steps?)" "$train" "${small[@]}" --training.stepz 3
expect_error "mistyped value" "training.steps: expected an integer" "$train" "${small[@]}" --training.steps three
printf '[training]\nsteps = "ten"\n' > "$work/typed.toml"
expect_error "mistyped value in a file" "typed.toml" "$train" --config "$work/typed.toml"
printf '[training\nsteps = 1\n' > "$work/broken.toml"
expect_error "TOML syntax error" "broken.toml" "$train" --config "$work/broken.toml"
expect_error "missing config file" "missing.toml" "$train" --config "$work/missing.toml"
expect_error "--sample-tokens not a count" "--sample-tokens '-1': expected a number of tokens from 0 to 9999" \
  "$train" "${small[@]}" --sample-tokens -1
expect_error "--sample-tokens twice" "--sample-tokens: given twice" "$train" "${small[@]}" --sample-tokens 1 --sample-tokens=2
expect_error "n_heads not dividing dim" "n_heads (3) does not divide dim (32)" "$train" "${small[@]}" --model.n_heads 3
expect_error "torchtitan's Hub dataset" 'training.dataset = "c4": torchtitan streams it from the Hugging Face Hub' "$train" "${small[@]}" --training.dataset c4
expect_error "async tensor parallelism without sequence parallelism" "parallelism.enable_async_tensor_parallel = true cuts the sequence-parallel gathers" "$train" "${small[@]}" --parallelism.enable_async_tensor_parallel true --parallelism.disable_sequence_parallel true
expect_error "the early step with clipping" "optimizer.early_step_in_backward: each unit is updated as soon as its gradient is reduced" "$train" "${small[@]}" --optimizer.early_step_in_backward true --training.max_norm 1
expect_error "n_kv_heads not dividing n_heads" "n_kv_heads (3) does not divide n_heads (2)" "$train" "${small[@]}" --model.n_kv_heads 3
expect_error "unknown device" "training.device must be one of auto, cpu, cuda; got \"gpu\"" "$train" "${small[@]}" --training.device gpu
expect_error "unknown optimizer state dtype" "optimizer.state_dtype must be one of float32, bfloat16; got \"float16\"" "$train" "${small[@]}" --optimizer.state_dtype float16
expect_error "float8 GEMMs on a float32 model" "float8 GEMMs cast a bfloat16 model's values" \
  "$train" "${small[@]}" --model.converters float8 --float8.emulate true
expect_error "float8 GEMMs not emulated on the CPU" "would run float8 GEMMs on the cpu backend, which has none" \
  "$train" "${small[@]}" --model.converters float8 --training.mixed_precision_param bfloat16
expect_error "an unknown float8 recipe" "float8.recipe_name must be one of tensorwise, rowwise, rowwise_with_gw_hp" \
  "$train" "${small[@]}" --model.converters float8 --float8.recipe_name blockwise
expect_error "a graphed step over two ranks" "training.cuda_graph: a graph is one rank's work and this layout has 2 ranks" \
  "$train" "${small[@]}" --thread-ranks 2 --training.cuda_graph true
expect_error "a seq_len context parallelism cannot balance" \
  "training.seq_len = 16 does not split into 2 x parallelism.context_parallel_degree = 6 equal chunks" \
  "$train" "${small[@]}" --thread-ranks 3 --parallelism.context_parallel_degree 3
expect_error "a context-parallel degree the ranks do not hold" \
  "context_parallel_degree 4 = 4 does not divide the world size 2" \
  "$train" "${small[@]}" --thread-ranks 2 --parallelism.context_parallel_degree 4
# Asking for the GPU where none can be used: without a device (or a build without CUDA)
# the error names the key; on a machine with a GPU this run would train, so it is skipped there.
if ! command -v nvidia-smi > /dev/null 2>&1 || ! nvidia-smi -L > /dev/null 2>&1; then
  expect_error "training.device = cuda without a GPU" 'training.device = "cuda": ' "$train" "${small[@]}" --training.device cuda
fi
expect_error "unknown attention" 'training.attention must be one of auto, cudnn, tessera; got "flash"' "$train" "${small[@]}" --training.attention flash
expect_error "cudnn attention on the CPU" 'training.attention = "cudnn": this run trains on the CPU (training.device); cuDNN attention runs on a GPU' "$train" "${small[@]}" --training.device cpu --training.attention cudnn
expect_error "missing token shard" "$work/none.tshard" "$train" "${small[@]}" --training.dataset shard --training.dataset_path "$work/none.tshard"
expect_error "a corpus shorter than a window" \
  "the synthetic corpus (training.dataset = \"synthetic\", training.synthetic_documents = 1, training.seq_len = 512): DataLoader: the synthetic corpus has 63 tokens, fewer than one window" \
  "$train" "${small[@]}" --training.synthetic_documents 1 --training.seq_len 512 --model.max_seq_len 512
expect_error "a dump folder that is a file" "$work/typed.toml: not a directory (job.dump_folder names the folder the run writes to)" \
  "$train" "${small[@]}" --job.dump_folder "$work/typed.toml"
# A file under a checkpoint's name is the user's: refused, never replaced by a save.
mkdir -p "$work/stray/checkpoint" && echo "notes" > "$work/stray/checkpoint/step-1"
expect_error "a file named like a checkpoint" \
  "$work/stray/checkpoint/step-1: a file where a checkpoint's folder goes (step-<N> and step-<N>.partial are the checkpoints' names); move it out of the checkpoint folder" \
  "$train" "${small[@]}" --job.dump_folder "$work/stray" --checkpoint.enable true
[ "$(cat "$work/stray/checkpoint/step-1")" = notes ] || { echo "FAIL: the stray file was changed"; failures=$((failures + 1)); }
expect_error "an initial model that is a run's folder" "checkpoint.initial_load_path '$work': a directory without config.json" \
  "$train" "${small[@]}" --checkpoint.initial_load_path "$work"
# A model no machine's memory holds (256 TB of embeddings): the allocator's error says
# what the run was building and the keys that size it. The sanitizers' allocator returns
# null for it (as the C library's does) only when allowed to.
ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}allocator_may_return_null=1" expect_error "a model larger than memory" \
  "out of host memory allocating 256000000000000 bytes, while building the model (model.dim, model.n_layers, model.vocab_size)" \
  "$train" "${small[@]}" --model.vocab_size 2000000000000
# One run at a time in a dump folder: a second one, started while the first holds it, is refused.
mkdir -p "$work/busy"
flock "$work/busy" sleep 30 &
locker=$!
sleep 0.5
expect_error "a dump folder another run is writing to" "$work/busy: another run is writing to this folder (job.dump_folder)" \
  "$train" "${small[@]}" --job.dump_folder "$work/busy"
kill "$locker" 2>/dev/null; wait "$locker" 2>/dev/null
# A valid shard first, then broken copies of it.
printf 'TSRATOKS' > "$work/bad_magic.tshard"; head -c 100 /dev/zero >> "$work/bad_magic.tshard"
expect_error "not a token shard" "bad_magic.tshard" "$train" "${small[@]}" --training.dataset shard --training.dataset_path "$work/bad_magic.tshard"
printf 'NOTASHRD' > "$work/wrong.tshard"; head -c 100 /dev/zero >> "$work/wrong.tshard"
expect_error "wrong magic" "not a tessera token shard" "$train" "${small[@]}" --training.dataset shard --training.dataset_path "$work/wrong.tshard"

# Train one step to get a real checkpoint, then corrupt it.
if ! timeout 120 "$train" "${small[@]}" > "$work/train.log" 2>&1; then
  echo "FAIL: the small training run itself failed"; tail -n 5 "$work/train.log"; exit 1
fi
ckpt="$work/out/model.safetensors"
head -c 50 "$ckpt" > "$work/truncated.safetensors"
expect_error "truncated checkpoint (generate)" "truncated.safetensors" "$generate" --checkpoint "$work/truncated.safetensors"
expect_error "truncated checkpoint (resume)" "truncated.safetensors" "$train" "${small[@]}" --checkpoint.initial_load_path "$work/truncated.safetensors"
cp "$ckpt" "$work/corrupt.safetensors"
printf '\x7b\x22\x7a' | dd of="$work/corrupt.safetensors" bs=1 seek=8 conv=notrunc status=none
expect_error "corrupt checkpoint header" "corrupt.safetensors" "$generate" --checkpoint "$work/corrupt.safetensors"
expect_error "missing checkpoint" "nothing.safetensors" "$generate" --checkpoint "$work/nothing.safetensors"
expect_error "checkpoint of another shape" "does not match [model]" "$train" "${small[@]}" --model.dim 64 --checkpoint.initial_load_path "$ckpt"
expect_error "generate: bad number" "--temperature: expected a number" "$generate" --checkpoint "$ckpt" --temperature hot
expect_error "generate: unknown option" "unknown option '--tempreature'" "$generate" --checkpoint "$ckpt" --tempreature 1
expect_error "generate: an unknown option last" "unknown option '--bogus'" "$generate" --checkpoint "$ckpt" --bogus
expect_error "generate: an option for a value" "--checkpoint: missing value (got the option '--max-new-tokens')" \
  "$generate" --checkpoint --max-new-tokens 5
expect_error "generate: an unknown device" "--device 'tpu': expected cpu or cuda" "$generate" --checkpoint "$ckpt" --device tpu
expect_error "generate: bf16 on the CPU" "--dtype bfloat16: only with --device cuda" \
  "$generate" --checkpoint "$ckpt" --dtype bfloat16
# --device cuda where no GPU is visible: a build with CUDA says so, one without says what it lacks.
# The binary says whether it was built with CUDA (the runtime may be linked statically,
# so the libraries it loads do not tell).
if "$generate" --help | grep -q 'samples on: cpu, cuda'; then
  no_gpu="CUDA backend: no CUDA device is visible"
else
  no_gpu="--device cuda: this llama-generate was built without CUDA"
fi
expect_error "generate: --device cuda without a GPU" "$no_gpu" \
  env CUDA_VISIBLE_DEVICES= "$generate" --checkpoint "$ckpt" --device cuda

# A checkpoint that was saved is never clobbered by a failed run.
before=$(md5sum < "$ckpt")
timeout 60 "$train" "${small[@]}" --training.dataset shard --training.dataset_path "$work/none.tshard" >/dev/null 2>&1
after=$(md5sum < "$ckpt")
runs=$((runs + 1))
if [ "$before" != "$after" ]; then echo "FAIL: a failed run changed the saved model"; failures=$((failures + 1)); else echo "ok: a failed run leaves the saved model alone"; fi

# Pruning old checkpoints removes only the step-N folders llama-train wrote.
mkdir -p "$work/out/checkpoint/step-5-best" "$work/out/checkpoint/step-x"
timeout 120 "$train" "${small[@]}" --training.steps 2 --checkpoint.enable true --checkpoint.interval 1 --checkpoint.last_save_model_only false \
  --checkpoint.keep_latest_k 1 >/dev/null 2>&1
runs=$((runs + 1))
if [ -d "$work/out/checkpoint/step-5-best" ] && [ -d "$work/out/checkpoint/step-x" ] && [ -d "$work/out/checkpoint/step-2" ] \
   && [ ! -d "$work/out/checkpoint/step-1" ]; then
  echo "ok: pruning keeps the user's folders and the latest checkpoint"
else
  echo "FAIL: checkpoint pruning"; ls "$work/out/checkpoint"; failures=$((failures + 1))
fi

# A resume from a checkpoint with a flipped byte is refused, naming the file and the
# tensor; one saved under another global batch, naming the setting.
rank_file="$work/out/checkpoint/step-2/model-rank0-of-1.safetensors"
if [ -f "$rank_file" ]; then
  cp "$rank_file" "$work/rank_file.bak"
  printf '\xff' | dd of="$rank_file" bs=1 seek=$(($(stat -c %s "$rank_file") - 3)) conv=notrunc status=none
  expect_error "corrupt checkpoint (resume)" "model-rank0-of-1.safetensors: tensor '" "$train" "${small[@]}" \
    --training.steps 3 --checkpoint.enable true
  cp "$work/rank_file.bak" "$rank_file"
  expect_error "resume with another batch" "training.global_batch_size was 1 when this checkpoint was saved and is 2 now" \
    "$train" "${small[@]}" --training.steps 3 --checkpoint.enable true --training.local_batch_size 2
  expect_error "resume from a missing step" "checkpoint.load_step = 7 names a checkpoint that is not there" \
    "$train" "${small[@]}" --training.steps 3 --checkpoint.enable true --checkpoint.load_step 7
  expect_error "resume past the run's end" "step-2: the run would resume at step 2, past its end (training.steps = 1)" \
    "$train" "${small[@]}" --training.steps 1 --checkpoint.enable true
  # A model argument no shape shows may change on a resume: the run goes on and says so.
  runs=$((runs + 1))
  out=$(timeout 60 "$train" "${small[@]}" --training.steps 3 --checkpoint.enable true --model.rope_theta 1000000 2>&1 >/dev/null)
  status=$?
  warning="step-2: model.rope_theta was 500000.0 when this checkpoint was saved and is 1000000.0 now: the run goes on with the new value"
  if [ "$status" -eq 0 ] && [[ "$out" == *"$warning"* ]]; then
    echo "ok: resume with another RoPE base -> warning: ...$warning"
  else
    echo "FAIL: resume with another RoPE base: exit status $status, no warning '$warning'"; echo "$out" | tail -n 5
    failures=$((failures + 1))
  fi
else
  echo "FAIL: no checkpoint at $rank_file"; failures=$((failures + 1))
fi

# Hugging Face directories, token files and tokenizers.
hf=$fixtures/hf/llama3
python3 -c 'import struct; open("'"$work"'/toks.u32","wb").write(struct.pack("<40I", *[i % 50 for i in range(40)]))'
expect_error "eval: no --model" "--model: required" "$eval" --tokens "$work/toks.u32"
expect_error "eval: unknown option" "unknown option '--seqlen'" "$eval" --model "$hf" --tokens "$work/toks.u32" --seqlen 4
expect_error "eval: bad --seq-len" "--seq-len: expected a positive integer, got 'x'" "$eval" --model "$hf" --tokens "$work/toks.u32" --seq-len x
expect_error "eval: window too long" "takes at most" "$eval" --model "$hf" --tokens "$work/toks.u32" --seq-len 100000000
head -c 30 "$work/toks.u32" > "$work/odd.u32"
expect_error "eval: .u32 of odd size" "odd.u32': 30 bytes is not a whole number" "$eval" --model "$hf" --tokens "$work/odd.u32"
cp "$work/toks.u32" "$work/toks.bin"
expect_error "eval: neither shard nor .u32" "toks.bin': not a token shard" "$eval" --model "$hf" --tokens "$work/toks.bin"
python3 -c 'import struct; open("'"$work"'/big.u32","wb").write(struct.pack("<3I", 1, 2, 4000000))'
expect_error "eval: id outside the vocabulary" "token id 4000000 at index 2" "$eval" --model "$hf" --tokens "$work/big.u32"
mkdir -p "$work/hf_missing"
expect_error "eval: directory without config.json" "hf_missing: a directory without config.json" \
  "$eval" --model "$work/hf_missing" --tokens "$work/toks.u32"
cp "$hf/config.json" "$work/hf_missing/"
expect_error "eval: config.json but no weights" "hf_missing: no model.safetensors and no model.safetensors.index.json" \
  "$eval" --model "$work/hf_missing" --tokens "$work/toks.u32"
cp -r "$hf" "$work/hf_shape"
sed -i 's/"intermediate_size": [0-9]*/"intermediate_size": 64/' "$work/hf_shape/config.json"
expect_error "HF tensor shaped otherwise than config.json" "but the model config.json describes needs" \
  "$eval" --model "$work/hf_shape" --tokens "$work/toks.u32"
cp -r "$hf" "$work/hf_layers"
sed -i 's/"num_hidden_layers": [0-9]*/"num_hidden_layers": 3/' "$work/hf_layers/config.json"
expect_error "HF tensor missing" "tensor 'model.layers.2.input_layernorm.weight'" \
  "$eval" --model "$work/hf_layers" --tokens "$work/toks.u32"
cp -r "$hf" "$work/hf_nokey"
sed -i '/"hidden_size"/d' "$work/hf_nokey/config.json"
expect_error "config.json without hidden_size" "config.json: key 'hidden_size' is missing" \
  "$eval" --model "$work/hf_nokey" --tokens "$work/toks.u32"
cp -r "$hf" "$work/hf_trunc"
head -c 200 "$hf/model.safetensors" > "$work/hf_trunc/model.safetensors"
expect_error "HF weights truncated" "hf_trunc/model.safetensors: header length" \
  "$eval" --model "$work/hf_trunc" --tokens "$work/toks.u32"
expect_error "initial_load_in_hf on a file" "is not a Hugging Face model directory" \
  "$train" "${small[@]}" --checkpoint.initial_load_in_hf true --checkpoint.initial_load_path "$ckpt"
printf 'YQ== 0\nnot base64! 1\n' > "$work/bad.tiktoken"
expect_error "malformed tokenizer line" "bad.tiktoken" "$train" "${small[@]}" --model.tokenizer "$work/bad.tiktoken"
expect_error "unknown tokenizer" "tokenizer 'gpt2'" "$train" "${small[@]}" --model.tokenizer gpt2
expect_error "tokenizer larger than the model" "more than the model's vocabulary of 300" \
  "$train" "${small[@]}" --model.vocab_size 300

echo "$((runs - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
