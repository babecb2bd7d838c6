#!/usr/bin/env bash
# Fine-tuning on chat data end to end, as the README shows it: the embedded chat set
# written as JSON lines, tokenized into a shard with a loss mask, trained on with a
# validation loss from a held-out chat file, and the model answering in the chat format;
# LoRA from the trained model on two ranks, starting at the base model's loss; then every
# bad chat input ends in one error line naming the file (and line) and exit 1.
#   finetune.sh LLAMA_TOKENIZE LLAMA_TRAIN LLAMA_GENERATE CONFIGS_DIR
set -uo pipefail
tokenize=$1
train=$2
generate=$3
configs=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

source "$(dirname "$0")/expect.sh"

# The chat set: 400 conversations to train on, 40 held out.
"$tokenize" --write-synthetic-chat "$work/chat.jsonl" --conversations 400 2> "$work/write.log" || bad "write the chat set"
"$tokenize" --write-synthetic-chat "$work/val.jsonl" --first 400 --conversations 40 2>> "$work/write.log" ||
  bad "write the held-out chat set"
[ "$(wc -l < "$work/chat.jsonl")" -eq 400 ] && ok "400 conversations written" || bad "chat.jsonl has $(wc -l < "$work/chat.jsonl") lines"
if cmp -s "$work/chat.jsonl" "$work/val.jsonl"; then bad "the held-out set is the training set"; fi

# Tokenized in the tokenizer's chat format, with a loss mask: a version 3 shard, flag 1.
if "$tokenize" --tokenizer synthetic_bpe --chat auto --output "$work/chat.bin" "$work/chat.jsonl" 2> "$work/tok.log" &&
   grep -q "chat format llama3, with a loss mask" "$work/tok.log"; then
  version=$(od -An -tu4 -j 8 -N 4 --endian=little "$work/chat.bin" | tr -d ' ')
  flags=$(od -An -tu4 -j 28 -N 4 --endian=little "$work/chat.bin" | tr -d ' ')
  [ "$version" = 3 ] && [ "$flags" = 1 ] && ok "a chat shard with a loss mask: $(cat "$work/tok.log")" ||
    bad "shard version $version, flags $flags (expected 3 and 1)"
else
  bad "llama-tokenize --chat"; cat "$work/tok.log"
fi

# Trained on it, validated on the held-out conversations every 5 steps.
small=(--config "$configs/debug_model.toml" --sample-tokens 8 --model.dim 64 --training.seq_len 64 --training.steps 10
       --training.local_batch_size 4 --metrics.peak_tflops 1 --checkpoint.enable false
       --checkpoint.last_save_in_hf false --job.dump_folder "$work/out")
if "$train" "${small[@]}" --training.dataset shard --training.dataset_path "$work/chat.bin" \
     --validation.enable true --validation.dataset chat --validation.dataset_path "$work/val.jsonl" \
     --validation.freq 5 --validation.seq_len 64 --validation.local_batch_size 4 \
     --metrics.enable_tensorboard true > "$work/train.out" 2> "$work/train.log"; then
  grep -q "loss mask: the assistants' replies only" "$work/train.log" && ok "the run trains on the replies only" ||
    bad "no loss-mask line"
  grep -q "validation: every 5 steps" "$work/train.log" && ok "the run validates" || bad "no validation line"
  n=$(grep -c '"validation_loss"' "$work/out/metrics.jsonl")
  [ "$n" -eq 2 ] && ok "validation_loss at steps 5 and 10" || bad "$n validation losses in metrics.jsonl (expected 2)"
  # TensorBoard gets it too: the tag is in the events file (tensorboard_read.py, where the
  # tensorboard package is, reads the values back in cli_resume).
  grep -aq "validation_loss" "$work"/out/tb/events.out.tfevents.* && ok "validation_loss in TensorBoard" ||
    bad "no validation_loss in the TensorBoard events"
else
  bad "llama-train on the chat shard"; tail -n 5 "$work/train.log"
fi

# The same data through training.dataset = "chat" (tokenized at the start).
if "$train" "${small[@]}" --training.steps 2 --training.dataset chat --training.dataset_path "$work/chat.jsonl" \
     --job.dump_folder "$work/out2" > /dev/null 2> "$work/train2.log"; then
  ok "training.dataset = chat"
else
  bad "training.dataset = chat"; tail -n 5 "$work/train2.log"
fi

# The trained model answers in the chat format: a reply, ended by the turn (not the budget).
if answer=$("$generate" --checkpoint "$work/out/model.safetensors" --chat "What is two plus three?" \
              --max-new-tokens 30 --temperature 0 2> "$work/gen.log"); then
  ok "llama-generate --chat answers: '$answer'"
else
  bad "llama-generate --chat"; cat "$work/gen.log"
fi

# LoRA from the trained model, on two thread ranks of FSDP (the frozen weights in shards of
# their own): B starts at zero, so its first step's loss is the full fine-tune's from the
# same model, bit for bit; then the adapters train, and the saved model (merged) answers.
tune=("${small[@]}" --training.steps 3 --training.dataset shard --training.dataset_path "$work/chat.bin"
      --checkpoint.initial_load_path "$work/out/model.safetensors" --thread-ranks 2
      --parallelism.data_parallel_shard_degree 2 --training.local_batch_size 2)
first_loss() { python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["loss"])' "$1"; }
if "$train" "${tune[@]}" --job.dump_folder "$work/full" > /dev/null 2> "$work/full.log" &&
   "$train" "${tune[@]}" --model.converters lora --job.dump_folder "$work/lora" > /dev/null 2> "$work/lora.log"; then
  grep -q "LoRA: rank 8, alpha 16 on every linear layer" "$work/lora.log" && ok "the LoRA run says so" ||
    bad "no LoRA line"
  full=$(first_loss "$work/full/metrics.jsonl")
  lora=$(first_loss "$work/lora/metrics.jsonl")
  [ -n "$full" ] && [ "$full" = "$lora" ] && ok "LoRA's first loss is the base model's: $lora" ||
    bad "first losses: full fine-tune '$full', LoRA '$lora'"
  if "$generate" --checkpoint "$work/lora/model.safetensors" --chat "What is two plus three?" --max-new-tokens 10 \
       --temperature 0 > /dev/null 2> "$work/lora-gen.log"; then
    ok "llama-generate loads the LoRA run's merged model"
  else
    bad "llama-generate on the LoRA run's model"; cat "$work/lora-gen.log"
  fi
else
  bad "the full and LoRA fine-tunes on two ranks"; tail -n 5 "$work/full.log" "$work/lora.log"
fi

# Bad input.
printf '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"messages": [\n' > "$work/broken.jsonl"
expect_error "a malformed JSON line" llama-tokenize "broken.jsonl:2: not a JSON object" \
  "$tokenize" --tokenizer synthetic_bpe --chat auto --output "$work/x.bin" "$work/broken.jsonl"
[ -e "$work/x.bin" ] || [ -e "$work/x.bin.tmp" ] && bad "a failed run left a shard behind"
printf '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}\n' > "$work/role.jsonl"
expect_error "an unknown role" llama-tokenize "role.jsonl:1: message 2 has role 'bot'" \
  "$tokenize" --tokenizer synthetic_bpe --chat llama3 --output "$work/x.bin" "$work/role.jsonl"
printf '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}\n' > "$work/empty.jsonl"
expect_error "an empty assistant turn" llama-tokenize "empty.jsonl:1: message 2 is an empty assistant turn" \
  "$tokenize" --tokenizer synthetic_bpe --chat auto --output "$work/x.bin" "$work/empty.jsonl"
expect_error "llama3 without its special tokens" llama-tokenize \
  "chat format llama3 needs the special token <|start_header_id|>, which the byte tokenizer lacks" \
  "$tokenize" --tokenizer byte --chat llama3 --output "$work/x.bin" "$work/chat.jsonl"
expect_error "an unknown chat format" llama-tokenize "--chat: unknown chat format 'chatml'" \
  "$tokenize" --tokenizer byte --chat chatml --output "$work/x.bin" "$work/chat.jsonl"
printf 'plain text\n' > "$work/plain.txt"
expect_error "chat data that is not JSON lines" llama-tokenize "plain.txt: chat data is JSON lines" \
  "$tokenize" --tokenizer byte --chat llama2 --output "$work/x.bin" "$work/plain.txt"
expect_error "a chat dataset with a bad line" llama-train "broken.jsonl:2: not a JSON object" \
  "$train" "${small[@]}" --training.dataset chat --training.dataset_path "$work/broken.jsonl"
expect_error "a missing validation file" llama-train "validation.dataset_path '$work/none.jsonl': cannot open" \
  "$train" "${small[@]}" --validation.enable true --validation.dataset chat --validation.dataset_path "$work/none.jsonl"
expect_error "chat_format llama3 with the byte tokenizer" llama-train "lacks Llama 3's <|start_header_id|>" \
  "$train" "${small[@]}" --model.tokenizer byte --training.dataset chat --training.dataset_path "$work/chat.jsonl" \
  --training.chat_format llama3

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "fine-tuning on chat data: every check passed"
