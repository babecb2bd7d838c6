#!/usr/bin/env bash
# llama-eval on the Hugging Face fixture directories: the last line is exactly
# "loss=<float> ppl=<float> tokens=<int>", and the loss is the one Hugging Face
# transformers computes for the same windows (LlamaForCausalLM with labels = the window,
# weighted by the window's predictions; figures from transformers 5.23, fp32).
set -uo pipefail
eval_bin=$1
fixtures=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# 40 tokens: 0, 1, ..., 49 modulo 50, as a headerless little-endian uint32 array.
python3 -c 'import struct, sys; open(sys.argv[1], "wb").write(struct.pack("<40I", *[i % 50 for i in range(40)]))' \
  "$work/t40.u32"

# check NAME MODEL_DIR EXPECTED_LOSS EXPECTED_TOKENS [llama-eval options...]
check() {
  local name=$1 model=$2 loss=$3 tokens=$4
  shift 4
  local out status last
  out=$(timeout 120 "$eval_bin" --model "$fixtures/hf/$model" --tokens "$work/t40.u32" "$@" 2>/dev/null)
  status=$?
  last=$(printf '%s\n' "$out" | tail -n 1)
  if [ "$status" -ne 0 ]; then
    echo "FAIL: $name: exit status $status"; failures=$((failures + 1)); return
  fi
  if ! [[ "$last" =~ ^loss=([0-9]+\.[0-9]+)\ ppl=([0-9]+\.[0-9]+)\ tokens=([0-9]+)$ ]]; then
    echo "FAIL: $name: last line '$last' is not 'loss=<float> ppl=<float> tokens=<int>'"; failures=$((failures + 1)); return
  fi
  local got_loss=${BASH_REMATCH[1]} got_ppl=${BASH_REMATCH[2]} got_tokens=${BASH_REMATCH[3]}
  if [ "$got_tokens" != "$tokens" ] ||
     ! awk -v a="$got_loss" -v b="$loss" -v p="$got_ppl" 'BEGIN { d = a - b; if (d < 0) d = -d; e = p - exp(a); if (e < 0) e = -e;
                                                               exit !(d <= 5e-6 && e <= 1e-4 * p) }'; then
    echo "FAIL: $name: '$last', expected loss $loss (transformers) over $tokens tokens"; failures=$((failures + 1)); return
  fi
  echo "ok: $name -> $last (transformers: $loss)"
}

check "llama3, windows of 16"          llama3        5.400368 37 --seq-len 16
check "llama2 (sharded), windows of 16" llama2       5.152579 37 --seq-len 16
check "llama2, default windows (max_position_embeddings)" llama2 5.228078 39
check "llama2, batch 1 changes nothing" llama2       5.152579 37 --seq-len 16 --batch 1

echo "$((4 - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
