#!/usr/bin/env bash
# Training data from several token shards: a list of shards (and a glob pattern) reads as
# the one shard of their documents in order, losses bitwise; a weighted mix, shuffled,
# trains, says its shares, and resumes from a checkpoint bitwise the run that went
# straight through; chat data packed first fit trains and validates; and a resume that
# would read other files, weights or order, a pattern that matches nothing, or rows too
# short for any document, ends in one error line naming the key.
# The shuffled mix on 2 thread ranks and on 2 MPI processes (each mapping the shards)
# trains what one rank trains, within the parity bar.
#   data.sh LLAMA_TOKENIZE LLAMA_TRAIN CONFIGS_DIR [MPIRUN|none]
set -uo pipefail
tokenize=$1
train=$2
configs=$3
mpirun=${4:-none}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

source "$(dirname "$0")/expect.sh"

# losses DIR: the losses of DIR/metrics.jsonl, one per line.
losses() { python3 -c 'import json,sys; [print(repr(json.loads(l)["loss"])) for l in open(sys.argv[1])]' "$1/metrics.jsonl"; }

# Two corpora of JSON lines: different words, so a mix's batches differ from either's.
python3 - "$work" <<'EOF'
import json, random, sys
for name, words in (("a", "north river stone quiet lantern meadow".split()), ("b", "seven orbit copper signal engine delta".split())):
    rng = random.Random(name)
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))}) + "\n")
EOF
mkdir -p "$work/shards"
for s in a b; do
  "$tokenize" --tokenizer byte --output "$work/shards/$s.bin" "$work/$s.jsonl" 2>> "$work/tok.log" || bad "tokenize $s"
done
"$tokenize" --tokenizer byte --output "$work/ab.bin" "$work/a.jsonl" "$work/b.jsonl" 2>> "$work/tok.log" || bad "tokenize a + b"

small=(--config "$configs/debug_model.toml" --sample-tokens 8 --model.dim 64 --model.tokenizer byte --training.seq_len 64
       --training.local_batch_size 4 --training.steps 4 --metrics.peak_tflops 1 --checkpoint.enable false
       --checkpoint.last_save_in_hf false --checkpoint.last_save_model_only false --training.dataset shard)

# A list of shards, and a pattern, read as the one shard of both.
run() {  # run NAME ARGS...: trains into $work/NAME
  local name=$1
  shift
  if ! timeout 300 "$train" "${small[@]}" "$@" --job.dump_folder "$work/$name" > "$work/$name.out" 2> "$work/$name.err"; then
    bad "$name: exit status $?"; tail -n 5 "$work/$name.err"; return 1
  fi
}
run whole --training.dataset_path "$work/ab.bin"
run list --training.dataset_path "$work/shards/a.bin,$work/shards/b.bin"
run pattern --training.dataset_path "$work/shards/*.bin"
if [ -s "$work/whole/metrics.jsonl" ] && [ "$(losses "$work/whole")" = "$(losses "$work/list")" ] &&
   [ "$(losses "$work/whole")" = "$(losses "$work/pattern")" ]; then
  ok "two shards listed, or matched by a pattern, train as the one shard of both: losses bitwise"
else
  bad "the losses of a list of shards differ from the one shard's"; paste <(losses "$work/whole") <(losses "$work/list") <(losses "$work/pattern")
fi
grep -q "data: .*a.bin and 1 more file (" "$work/pattern.err" && ok "the start names the files" || bad "no data line: $(head -n 4 "$work/pattern.err")"

# A shard of version 1 (its tokens in the whole layout, as tessera wrote before version 3)
# is read whole at the start, and the start says so; upgraded, it trains bitwise the same.
python3 - "$work/ab.bin" "$work/ab1.bin" <<'EOF'
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
vocab, count = struct.unpack_from("<IQ", data, 12)
payload = data[32:32 + 4 * count]
open(sys.argv[2], "wb").write(b"TSRATOKS" + struct.pack("<IIQII", 1, vocab, count, zlib.crc32(payload), 0) + payload)
EOF
run version1 --training.dataset_path "$work/ab1.bin"
"$tokenize" --upgrade "$work/ab1.bin" 2>> "$work/tok.log" || bad "llama-tokenize --upgrade"
run upgraded --training.dataset_path "$work/ab1.bin"
if grep -q "tokens in shards of version 1 or 2, read whole at every start" "$work/version1.err" &&
   ! grep -q "version 1 or 2" "$work/upgraded.err" &&
   [ "$(losses "$work/whole")" = "$(losses "$work/version1")" ] && [ "$(losses "$work/whole")" = "$(losses "$work/upgraded")" ]; then
  ok "a version 1 shard trains as its version 3 twin, the start says it was read whole, and upgraded it is not"
else
  bad "version 1 shard: $(grep 'version 1 or 2' "$work/version1.err")"; paste <(losses "$work/whole") <(losses "$work/version1") <(losses "$work/upgraded")
fi

# A weighted mix, shuffled: its shares at the start, and a resume from step 2 bitwise the
# straight run.
mix=(--training.dataset_path "$work/shards/a.bin,$work/shards/b.bin" --training.dataset_weights 3,1
     --training.shuffle true --checkpoint.enable true --checkpoint.interval 2 --checkpoint.keep_latest_k 5)
run mix "${mix[@]}"
grep -q "data: a mix of .*a.bin (.* 75.0% of them); .*b.bin (.* 25.0% of them)" "$work/mix.err" &&
  ok "the mix's shares at the start" || bad "no mix line: $(head -n 4 "$work/mix.err")"
if [ -s "$work/mix/metrics.jsonl" ] && [ "$(losses "$work/mix")" != "$(losses "$work/whole")" ]; then
  ok "the mix trains on other batches than the concatenation"
else
  bad "the mix's losses are the concatenation's"
fi
cp "$work/mix/metrics.jsonl" "$work/mix.straight.jsonl"
rm -rf "$work/mix/checkpoint/step-4"
run mix "${mix[@]}"
if [ "$(python3 -c 'import json,sys; print([json.loads(l)["loss"] for l in open(sys.argv[1])])' "$work/mix/metrics.jsonl")" = \
     "$(python3 -c 'import json,sys; print([json.loads(l)["loss"] for l in open(sys.argv[1])])' "$work/mix.straight.jsonl")" ]; then
  ok "the mix resumed from step 2: steps 3 and 4 bitwise the straight run's"
else
  bad "the resumed mix differs"; paste "$work/mix/metrics.jsonl" "$work/mix.straight.jsonl" | head
fi

# The same mix on 2 ranks (FSDP, each rank 2 of the 4 sequences): one rank's losses within
# the parity bar, the global batch dealt the same, on thread ranks and on MPI processes.
mix_one=(--training.dataset_path "$work/shards/a.bin,$work/shards/b.bin" --training.dataset_weights 3,1
         --training.shuffle true)
run mix_one "${mix_one[@]}"
run mix_threads "${mix_one[@]}" --thread-ranks 2 --training.local_batch_size 2
parity() {  # parity NAME: NAME's losses within 1e-5 (relative) of mix_one's; prints the gap
  python3 - "$work/mix_one/metrics.jsonl" "$work/$1/metrics.jsonl" <<'EOF'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
gap = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")
print(f"{gap:.2e}")
sys.exit(0 if gap <= 1e-5 else 1)
EOF
}
if gap=$(parity mix_threads); then ok "the mix on 2 thread ranks: one rank's losses within $gap"; else bad "the mix on 2 thread ranks: gap $gap"; fi
if [ "$mpirun" != none ]; then
  mpi_flags=(--oversubscribe -x OMP_NUM_THREADS=1 -x "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0")
  [ "$(id -u)" -eq 0 ] && mpi_flags+=(--allow-run-as-root)
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
  export OMPI_MCA_orte_base_help_aggregate=${OMPI_MCA_orte_base_help_aggregate:-0}
  if timeout 300 "$mpirun" "${mpi_flags[@]}" -np 2 "$train" "${small[@]}" "${mix_one[@]}" --training.local_batch_size 2 \
       --job.dump_folder "$work/mix_mpi" > "$work/mix_mpi.out" 2> "$work/mix_mpi.err" && gap=$(parity mix_mpi); then
    ok "the mix on 2 MPI processes: one rank's losses within $gap"
  else
    bad "the mix on 2 MPI processes"; tail -n 5 "$work/mix_mpi.err"
  fi
fi

# A resume must read the same files in the same shares; a pattern must match something.
rm -rf "$work/mix/checkpoint/step-4"
expect_error "a resume unshuffled" llama-train "training.shuffle was true when this checkpoint was saved and is false now" \
  "$train" "${small[@]}" "${mix[@]}" --training.shuffle false --job.dump_folder "$work/mix"
expect_error "a resume with other weights" llama-train "training.dataset_weights was [3.0,1.0] when this checkpoint was saved and is [1.0,1.0] now" \
  "$train" "${small[@]}" "${mix[@]}" --training.dataset_weights 1,1 --job.dump_folder "$work/mix"
cp "$work/shards/a.bin" "$work/shards/c.bin"
expect_error "a resume whose pattern finds another file" llama-train "training.dataset_path was [[\"$work/shards/a.bin\"],[\"$work/shards/b.bin\"]]" \
  "$train" "${small[@]}" "${mix[@]}" --training.dataset_path "$work/shards/a.bin,$work/shards/[bc].bin" \
  --job.dump_folder "$work/mix"
expect_error "a pattern that matches nothing" llama-train "training.dataset_path: '$work/none/*.bin' matches no file" \
  "$train" "${small[@]}" --training.dataset_path "$work/none/*.bin" --job.dump_folder "$work/none"
expect_error "weights without one per entry" llama-train "training.dataset_weights has 1 weight and training.dataset_path 2 entries" \
  "$train" "${small[@]}" --training.dataset_path "$work/shards/a.bin,$work/shards/b.bin" --training.dataset_weights 1 \
  --job.dump_folder "$work/none"

cp "$work/shards/b.bin" "$work/flipped.bin"
printf '\x55' | dd of="$work/flipped.bin" bs=1 seek=1000 conv=notrunc status=none
# Checked as read: the first step's windows come from the flipped chunk.
expect_error "a corrupt shard among several" llama-train "token shard '$work/flipped.bin': corrupt: chunk 0 (tokens [0, " \
  "$train" "${small[@]}" --training.dataset_path "$work/flipped.bin,$work/shards/a.bin" --job.dump_folder "$work/none"

# Chat data packed first fit: whole conversations in each row, with document masking.
"$tokenize" --write-synthetic-chat "$work/chat.jsonl" --conversations 200 2>> "$work/tok.log" || bad "write the chat set"
"$tokenize" --tokenizer synthetic_bpe --chat auto --output "$work/chat.bin" "$work/chat.jsonl" 2>> "$work/tok.log" ||
  bad "tokenize the chat set"
chat=(--config "$configs/debug_model.toml" --model.dim 64 --training.seq_len 256 --training.local_batch_size 2
      --training.steps 3 --metrics.peak_tflops 1 --checkpoint.enable false --checkpoint.last_save_in_hf false
      --training.dataset shard --training.dataset_path "$work/chat.bin" --training.document_mask true
      --validation.enable true --validation.dataset shard --validation.dataset_path "$work/chat.bin" --validation.steps 1
      --validation.seq_len 256 --validation.local_batch_size 2)
if timeout 300 "$train" "${chat[@]}" --training.packing first_fit --job.dump_folder "$work/packed" \
     > "$work/packed.out" 2> "$work/packed.err" &&
   grep -qE "packing: first fit, 200 documents in [0-9]+ rows \([0-9.]+% padding\)" "$work/packed.err" &&
   [ "$(grep -c '"validation_loss"' "$work/packed/metrics.jsonl")" -ge 1 ]; then
  ok "chat data packed first fit, validated: $(grep 'packing:' "$work/packed.err" | sed 's/^ *//')"
else
  bad "first-fit packing"; tail -n 5 "$work/packed.err"
fi
expect_error "first-fit rows too short for any conversation" llama-train "every one of its 200 documents is longer than a row of seq_len + 1 = 9 tokens" \
  "$train" "${chat[@]}" --training.packing first_fit --training.seq_len 8 --job.dump_folder "$work/none"

[ "$failures" -eq 0 ] && echo "all data checks passed" || echo "$failures data check(s) failed"
exit $((failures > 0))
