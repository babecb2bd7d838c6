#!/usr/bin/env bash
# llama-tokenize end to end: text and JSON lines files become one token shard with the
# expected token count, the same bytes for every --threads, a summary line always and a
# progress bar only on a terminal; every bad input ends in one error line naming the
# file (and line), exit status 1, and an existing output left as it was.
set -uo pipefail
tokenize=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
runs=0

ok() { echo "ok: $1"; }
bad() { echo "FAIL: $1"; failures=$((failures + 1)); }

# u32 at byte OFFSET of FILE, little-endian.
u32_at() { od -An -tu4 -j "$2" -N 4 --endian=little "$1" | tr -d ' '; }
u64_at() { od -An -tu8 -j "$2" -N 8 --endian=little "$1" | tr -d ' '; }

# expect_shard DESCRIPTION FILE TOKENS: a token shard of the byte tokenizer with TOKENS ids
# (version 3: the ids, then the chunk table, 8 bytes per 65536 tokens).
expect_shard() {
  runs=$((runs + 1))
  local what=$1 file=$2 tokens=$3
  if [ ! -f "$file" ]; then bad "$what: no shard at $file"; return; fi
  local magic count vocab size
  magic=$(head -c 8 "$file")
  vocab=$(u32_at "$file" 12)
  count=$(u64_at "$file" 16)
  size=$(wc -c < "$file")
  if [ "$magic" != "TSRATOKS" ] || [ "$vocab" != 258 ] || [ "$count" != "$tokens" ] || [ "$size" -ne $((32 + 4 * tokens + 8 * ((tokens + 65535) / 65536))) ]; then
    bad "$what: magic '$magic', vocab $vocab, count $count, $size bytes (expected $tokens tokens)"
  elif [ -e "$file.tmp" ]; then
    bad "$what: $file.tmp left behind"
  else
    ok "$what ($tokens tokens)"
  fi
}

# expect_error DESCRIPTION EXPECTED_TEXT COMMAND...: exit 1 and one stderr line holding the text.
expect_error() {
  local what=$1 expected=$2
  shift 2
  runs=$((runs + 1))
  local out status lines
  out=$(timeout 60 "$@" 2>&1 >/dev/null)
  status=$?
  lines=$(printf '%s\n' "$out" | grep -c .)
  if [ "$status" -ne 1 ]; then
    bad "$what: exit status $status (expected 1)"; echo "$out" | tail -n 5
  elif [ "$lines" -ne 1 ]; then
    bad "$what: $lines lines on stderr (expected 1)"; echo "$out" | tail -n 5
  elif [[ "$out" != "llama-tokenize: error: "*"$expected"* ]]; then
    bad "$what: '$out' lacks '$expected'"
  else
    ok "$what -> $out"
  fi
}

# Inputs: two text files (one document each) and JSON lines with ASCII texts of known length.
printf 'The first document, a whole file.\nIts second line.\n' > "$work/one.txt"
printf 'A second text file.' > "$work/two.txt"
jsonl_tokens=0
jsonl_docs=0
for i in $(seq 1 300); do
  text="document $i says $(printf 'w%.0s' $(seq 1 $((i % 17 + 1))))"
  printf '{"id": %d, "text": "%s", "url": "https://example.com/%d"}\n' "$i" "$text" "$i" >> "$work/c4.jsonl"
  jsonl_tokens=$((jsonl_tokens + ${#text} + 2))
  jsonl_docs=$((jsonl_docs + 1))
done
printf '\n{"text": "caf\\u00e9"}\n' >> "$work/c4.jsonl"  # a blank line, then 5 bytes of UTF-8
jsonl_tokens=$((jsonl_tokens + 5 + 2))
jsonl_docs=$((jsonl_docs + 1))
cp "$work/c4.jsonl" "$work/c4.json"
text_tokens=$(($(wc -c < "$work/one.txt") + $(wc -c < "$work/two.txt") + 4))  # 2 documents
all_tokens=$((text_tokens + 2 * jsonl_tokens))
inputs=("$work/one.txt" "$work/c4.jsonl" "$work/two.txt" "$work/c4.json")

# Tokenize; the summary line is the only stderr output when stderr is not a terminal.
runs=$((runs + 1))
if ! timeout 60 "$tokenize" --tokenizer byte --output "$work/out.bin" "${inputs[@]}" 2> "$work/stderr.txt"; then
  bad "tokenizing text and JSON lines failed"; cat "$work/stderr.txt"
elif ! grep -q "^llama-tokenize: $((2 + 2 * jsonl_docs)) documents, $all_tokens tokens from .* bytes in .* s (.* tokens/s" "$work/stderr.txt" \
   || [ "$(wc -l < "$work/stderr.txt")" -ne 1 ] || grep -q $'\r' "$work/stderr.txt"; then
  bad "summary line: $(cat "$work/stderr.txt")"
else
  ok "summary: $(cat "$work/stderr.txt")"
fi
expect_shard "text + jsonl + json" "$work/out.bin" "$all_tokens"
# The first document: BOS, 'T' (84), ..., then EOS after the file's last byte.
runs=$((runs + 1))
first_eos=$((32 + 4 * ($(wc -c < "$work/one.txt") + 1)))
if [ "$(u32_at "$work/out.bin" 32)" = 256 ] && [ "$(u32_at "$work/out.bin" 36)" = 84 ] && [ "$(u32_at "$work/out.bin" "$first_eos")" = 257 ]; then
  ok "documents are BOS + bytes + EOS"
else
  bad "first document is not BOS 'T'... EOS"
fi

# The same bytes whatever the thread count.
for threads in 1 3 8; do
  runs=$((runs + 1))
  timeout 60 "$tokenize" --tokenizer byte --output "$work/t$threads.bin" --threads "$threads" "${inputs[@]}" 2>/dev/null
  if cmp -s "$work/out.bin" "$work/t$threads.bin"; then ok "--threads $threads gives the same shard"; else bad "--threads $threads changes the shard"; fi
done

# --no-bos / --no-eos, --field, --format and standard input.
timeout 60 "$tokenize" --tokenizer byte --output "$work/nobos.bin" --no-bos "${inputs[@]}" 2>/dev/null
expect_shard "--no-bos" "$work/nobos.bin" $((all_tokens - 2 - 2 * jsonl_docs))
timeout 60 "$tokenize" --tokenizer byte --output "$work/bare.bin" --no-bos --no-eos "${inputs[@]}" 2>/dev/null
expect_shard "--no-bos --no-eos" "$work/bare.bin" $((all_tokens - 4 - 4 * jsonl_docs))
printf '{"body": "abc", "text": 1}\n{"body": "de"}\n' > "$work/body.jsonl"
timeout 60 "$tokenize" --tokenizer byte --output "$work/body.bin" --field body "$work/body.jsonl" 2>/dev/null
expect_shard "--field body" "$work/body.bin" 9
timeout 60 "$tokenize" --tokenizer byte --output "$work/stdin.bin" --format jsonl - < "$work/c4.jsonl" 2>/dev/null
expect_shard "standard input as JSON lines" "$work/stdin.bin" "$jsonl_tokens"
timeout 60 "$tokenize" --tokenizer byte --output "$work/astext.bin" --format text "$work/body.jsonl" 2>/dev/null
expect_shard "--format text reads a .jsonl file whole" "$work/astext.bin" $(($(wc -c < "$work/body.jsonl") + 2))

# A progress bar on a terminal (script(1) gives the program one), none otherwise.
if command -v script >/dev/null; then
  runs=$((runs + 1))
  script -qec "timeout 60 '$tokenize' --tokenizer byte --output '$work/tty.bin' ${inputs[*]}" /dev/null > "$work/tty.txt" 2>&1
  if cmp -s "$work/out.bin" "$work/tty.bin" && grep -q "llama-tokenize: .* documents" "$work/tty.txt"; then
    ok "on a terminal: same shard and a summary"
  else
    bad "on a terminal: $(tr '\r' '\n' < "$work/tty.txt" | tail -n 3)"
  fi
  # Input that arrives slowly keeps it running long enough to draw the bar (size unknown: no percentage).
  runs=$((runs + 1))
  script -qec "(cat '$work/c4.jsonl'; sleep 0.5; cat '$work/c4.jsonl') | timeout 60 '$tokenize' --tokenizer byte --format jsonl --output '$work/slow.bin' -" /dev/null > "$work/slow.txt" 2>&1
  if tr '\r' '\n' < "$work/slow.txt" | grep "B read | .* tokens | .*B/s | .* tokens/s" > /dev/null; then
    ok "on a terminal: a progress line"
  else
    bad "on a terminal: no progress line in: $(tr '\r' '\n' < "$work/slow.txt" | tail -n 3)"
  fi
else
  echo "skip: script(1) is not installed, the terminal run is not tested"
fi

# --import: ids tokenized elsewhere (an llm.c GPT-2 file, a NumPy uint32 array) in the order
# given, as they are: the same ids as the byte tokenizer's shard of the same documents.
python3 - "$work" <<'PY'
import struct, sys
work = sys.argv[1]
ids = list(struct.unpack("<300I", open(work + "/bare.bin", "rb").read()[32:32 + 4 * 300]))  # its first 300
first, rest = ids[:120], ids[120:]
with open(work + "/part1.bin", "wb") as f:  # llm.c: 256 int32 (magic, version, count), uint16 ids
    f.write(struct.pack("<3i", 20240520, 1, len(first)) + bytes(253 * 4) + struct.pack("<%dH" % len(first), *first))
header = "{'descr': '<u4', 'fortran_order': False, 'shape': (%d,), }" % len(rest)
header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
with open(work + "/part2.npy", "wb") as f:  # numpy.save's layout, version 1.0
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + struct.pack("<%dI" % len(rest), *rest))
PY
runs=$((runs + 1))
if timeout 60 "$tokenize" --import "$work/part1.bin" "$work/part2.npy" --vocab-size 258 --output "$work/imported.bin" \
     2> "$work/import.txt" &&
   grep -q "part1.bin: 120 ids (llm.c, uint16 ids)" "$work/import.txt" &&
   grep -q "part2.npy: 180 ids (NumPy '<u4')" "$work/import.txt" &&
   grep -q "^llama-tokenize: 300 ids from 2 files, vocab_size 258, .* s -> " "$work/import.txt" &&
   cmp -s <(tail -c +33 "$work/imported.bin" | head -c 1200) <(tail -c +33 "$work/bare.bin" | head -c 1200); then
  ok "--import: $(tail -n 1 "$work/import.txt")"
else
  bad "--import of an llm.c file and a NumPy array"; cat "$work/import.txt"
fi
expect_shard "--import's shard" "$work/imported.bin" 300
expect_error "--import: an id past the vocabulary" "part1.bin: id " "$tokenize" --import "$work/part1.bin" "$work/part2.npy" \
  --vocab-size 100 --output "$work/small.bin"
expect_error "--import: no vocabulary size" "--import: give the vocabulary size" "$tokenize" --import "$work/part1.bin" \
  --output "$work/none.bin"
expect_error "--import: a text file" "one.txt: neither a NumPy .npy file nor an llm.c token file" "$tokenize" --import \
  "$work/one.txt" --vocab-size 258 --output "$work/none.bin"

# Bad input: one line naming the file and line, status 1, the existing output untouched.
cp "$work/out.bin" "$work/keep.bin"
before=$(md5sum < "$work/keep.bin")
printf '{"text": "fine"}\n{"text": "fine"}\n{"text": "broken\n' > "$work/broken.jsonl"
expect_error "JSON syntax error" "broken.jsonl:3: not valid JSON" "$tokenize" --tokenizer byte --output "$work/keep.bin" "${inputs[@]}" "$work/broken.jsonl"
printf '{"text": "fine"}\n\n["a", "list"]\n' > "$work/array.jsonl"
expect_error "not an object" "array.jsonl:3: expected a JSON object, found array" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/array.jsonl"
printf '{"text": "fine"}\n{"content": "x"}\n' > "$work/nofield.jsonl"
expect_error "no text field" 'nofield.jsonl:2: no "text" field (the object has "content")' "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/nofield.jsonl"
printf '{"text": ["x"]}\n' > "$work/notstring.jsonl"
expect_error "field not a string" 'notstring.jsonl:1: field "text" is array, not a string' "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/notstring.jsonl"
expect_error "--field missing everywhere" 'c4.jsonl:1: no "body" field' "$tokenize" --tokenizer byte --output "$work/keep.bin" --field body "$work/c4.jsonl"
printf '{\n  "text": "pretty-printed"\n}\n' > "$work/pretty.json"
expect_error "pretty-printed .json" "pretty.json:1: not valid JSON" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/pretty.json"
printf '\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03' > "$work/c4.json.gz"
expect_error "gzip input" "c4.json.gz: looks gzip-compressed" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/c4.json.gz"
expect_error "missing input" "$work/missing.jsonl: no such file" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/one.txt" "$work/missing.jsonl"
expect_error "directory input" "$work: is a directory" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work"
if [ "$(id -u)" -ne 0 ]; then  # root reads any file
  printf 'locked' > "$work/locked.txt"; chmod 000 "$work/locked.txt"
  expect_error "unreadable input" "locked.txt: cannot open for reading" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/locked.txt"
fi
expect_error "no inputs" "no input files" "$tokenize" --tokenizer byte --output "$work/keep.bin"
expect_error "unknown option" "unknown option '--thread'" "$tokenize" --tokenizer byte --output "$work/keep.bin" --thread 2 "$work/one.txt"
expect_error "missing --output" "--output: required" "$tokenize" --tokenizer byte "$work/one.txt"
expect_error "missing --tokenizer" "--tokenizer: required" "$tokenize" --output "$work/keep.bin" "$work/one.txt"
expect_error "option without value" "--output: missing value" "$tokenize" --tokenizer byte "$work/one.txt" --output
expect_error "unknown tokenizer" "tokenizer 'no-such-tokenizer'" "$tokenize" --tokenizer no-such-tokenizer --output "$work/keep.bin" "$work/one.txt"
expect_error "bad --threads" "--threads: expected a whole number" "$tokenize" --tokenizer byte --output "$work/keep.bin" --threads 0 "$work/one.txt"
expect_error "bad --format" "--format: expected auto, text or jsonl" "$tokenize" --tokenizer byte --output "$work/keep.bin" --format csv "$work/one.txt"
expect_error "output directory missing" "no/such/dir/out.bin: its directory" "$tokenize" --tokenizer byte --output "$work/no/such/dir/out.bin" "$work/one.txt"
expect_error "output is a directory" "is a directory; --output names the shard file" "$tokenize" --tokenizer byte --output "$work" "$work/one.txt"
: > "$work/empty.jsonl"
printf '\n\n' > "$work/blank.jsonl"
expect_error "an empty input" "empty.jsonl: no documents, so no token shard is written" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/empty.jsonl"
expect_error "blank lines only" "blank.jsonl: no documents, so no token shard is written" "$tokenize" --tokenizer byte --output "$work/keep.bin" "$work/blank.jsonl"
expect_error "--field with chat data" "--field: chat data is read from each line's" "$tokenize" --tokenizer byte --chat llama2 --field x --output "$work/keep.bin" "$work/c4.jsonl"

# --check: every chunk of each shard; a flipped byte is named with its chunk.
runs=$((runs + 1))
if "$tokenize" --check "$work/out.bin" "$work/keep.bin" --threads 2 2> "$work/check.txt" &&
   [ "$(grep -c ': good: ' "$work/check.txt")" = 2 ]; then
  ok "--check: $(head -n 1 "$work/check.txt")"
else
  bad "--check of two good shards"; cat "$work/check.txt"
fi
cp "$work/out.bin" "$work/flipped.bin"
printf '\x55' | dd of="$work/flipped.bin" bs=1 seek=1000 conv=notrunc status=none
expect_error "--check of a flipped byte" "flipped.bin': corrupt: chunk 0 (tokens [0, " "$tokenize" --check "$work/flipped.bin"
expect_error "--check of a missing shard" "no-such.bin': no such file" "$tokenize" --check "$work/no-such.bin"
expect_error "--check of nothing" "--check: no token shards named" "$tokenize" --check
expect_error "--check with a tokenizer option" "unknown option '--output' with --check" "$tokenize" --check "$work/keep.bin" --output x

# --upgrade: shards of versions 1 and 2 (written here by hand, as older tessera wrote them)
# become version 3 with the same tokens and mask; a version 3 shard is left alone.
python3 - "$work" <<'PY'
import random, struct, sys, zlib
rng = random.Random(7)
ids = [rng.randrange(258) for _ in range(70000)]  # two chunks of version 3
payload = struct.pack(f"<{len(ids)}I", *ids)
mask = bytes(rng.randrange(256) for _ in range((len(ids) + 7) // 8))
for name, version, flags, body in (("v1", 1, 0, payload), ("v2", 2, 1, payload + mask)):
    header = b"TSRATOKS" + struct.pack("<IIQII", version, 258, len(ids), zlib.crc32(body), flags)
    with open(f"{sys.argv[1]}/{name}.bin", "wb") as f:
        f.write(header + body)
PY
cp "$work/v1.bin" "$work/v1.orig"; cp "$work/v2.bin" "$work/v2.orig"
runs=$((runs + 1))
if "$tokenize" --upgrade "$work/v1.bin" "$work/v2.bin" "$work/out.bin" 2> "$work/upgrade.txt" &&
   grep -q "v1.bin: version 1 -> 3 (70000 tokens, 2 chunks)" "$work/upgrade.txt" &&
   grep -q "v2.bin: version 2 -> 3 (70000 tokens, 2 chunks)" "$work/upgrade.txt" &&
   grep -q "out.bin: already version 3, left as it is" "$work/upgrade.txt" &&
   [ "$(u32_at "$work/v1.bin" 8)" = 3 ] && [ "$(u32_at "$work/v1.bin" 28)" = 0 ] &&
   [ "$(u32_at "$work/v2.bin" 8)" = 3 ] && [ "$(u32_at "$work/v2.bin" 28)" = 1 ] &&
   cmp -s <(tail -c +33 "$work/v1.orig") <(tail -c +33 "$work/v1.bin" | head -c 280000) &&
   cmp -s <(tail -c +33 "$work/v2.orig") <(tail -c +33 "$work/v2.bin" | head -c 288750) &&
   "$tokenize" --check "$work/v1.bin" "$work/v2.bin" 2> /dev/null && [ ! -e "$work/v1.bin.tmp" ]; then
  ok "--upgrade: $(head -n 1 "$work/upgrade.txt")"
else
  bad "--upgrade of version 1 and 2 shards"; cat "$work/upgrade.txt"
fi
cp "$work/v1.orig" "$work/v1bad.bin"
printf '\x55' | dd of="$work/v1bad.bin" bs=1 seek=1000 conv=notrunc status=none
cp "$work/v1bad.bin" "$work/v1bad.orig"
expect_error "--upgrade of a corrupt shard" "v1bad.bin': corrupt: payload CRC-32" "$tokenize" --upgrade "$work/v1bad.bin"
runs=$((runs + 1))
if cmp -s "$work/v1bad.bin" "$work/v1bad.orig" && [ ! -e "$work/v1bad.bin.tmp" ]; then
  ok "a corrupt shard is left as it was"
else
  bad "--upgrade changed a corrupt shard, or left its temporary file"
fi

runs=$((runs + 1))
if [ "$before" = "$(md5sum < "$work/keep.bin")" ] && [ ! -e "$work/keep.bin.tmp" ]; then
  ok "failed runs leave the existing output intact and no temporary file"
else
  bad "a failed run changed $work/keep.bin or left keep.bin.tmp"
fi

echo "$((runs - failures)) passed, $failures failed"
[ "$failures" -eq 0 ]
