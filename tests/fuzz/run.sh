#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ (ASan + UBSan) and runs them side by side, each
# for a bounded time.
#
#   tests/fuzz/run.sh [SECONDS] [BUILD_DIR]     (defaults: 60, $FUZZ_BUILD_DIR or build-fuzz)
#   tests/fuzz/run.sh --build-only [BUILD_DIR]  builds the targets and stops
#
# With FUZZ_PREBUILT=1 the run uses the targets a --build-only call left in BUILD_DIR
# (tools/test.sh builds them beside the release tests) and builds only those missing.
# Each target runs for SECONDS over a copy of its seed corpus made in BUILD_DIR/corpus/
# (tests/fuzz/corpus/ is never written), with a dictionary where there is one. A crash,
# leak, undefined behaviour, timeout (10 s per input) or memory blow-up (2 GiB) is a
# finding: the reproducer is kept under BUILD_DIR/findings/TARGET/, its path is printed,
# and the script exits 1 once every target has run. Reproduce one with
#   BUILD_DIR/fuzz_TARGET BUILD_DIR/findings/TARGET/crash-...
# Environment: CXX (default clang++-16, then clang++, then clang++-14), FUZZ_BUILD_DIR, FUZZ_JOBS (parallel
# fuzzing processes per target, default 1).
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=${1:-60}
build=${2:-${FUZZ_BUILD_DIR:-build-fuzz}}
build_only=false
if [ "$seconds" = --build-only ]; then
  build_only=true
  seconds=1  # not used: nothing runs
fi
jobs=${FUZZ_JOBS:-1}
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "fuzz: SECONDS must be a positive whole number, got '$seconds'" >&2
  exit 2
fi

# A clang++ that links libFuzzer (Debian: clang and libclang-rt-dev).
cxx=${CXX:-}
if [ -z "$cxx" ]; then
  for c in clang++-16 clang++ clang++-14; do
    if command -v "$c" >/dev/null; then cxx=$c; break; fi
  done
fi
if [ -z "$cxx" ] || ! command -v "$cxx" >/dev/null; then
  echo "fuzz: clang++ not found; install clang and libclang-rt-dev (Debian 12: clang-16, libclang-rt-16-dev)" >&2
  exit 1
fi
mkdir -p "$build"
build=$(cd "$build" && pwd)
probe="$build/probe.cpp"
printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }\n' > "$probe"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$probe" -o "$build/probe" 2> "$build/probe.log"; then
  echo "fuzz: $cxx cannot build a libFuzzer binary with ASan and UBSan (is libclang-rt-dev installed?):" >&2
  head -n 5 "$build/probe.log" >&2
  exit 1
fi

flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -Wall -Wextra -I include)
json_flags=$(pkg-config --cflags nlohmann_json 2>/dev/null) || { echo "fuzz: pkg-config cannot find nlohmann_json (nlohmann-json3-dev)" >&2; exit 1; }

# build TARGET EXTRA_FLAGS...: compiles tests/fuzz/fuzz_TARGET.cpp into $build/fuzz_TARGET.
build_target() {
  local target=$1
  shift
  echo "== building fuzz_$target"
  # shellcheck disable=SC2086
  "$cxx" "${flags[@]}" $json_flags "tests/fuzz/fuzz_$target.cpp" -o "$build/fuzz_$target" "$@"
}

# run TARGET [MAX_LEN]: fuzzes for $seconds; returns 1 on a finding.
run_target() {
  local target=$1 max_len=${2:-}
  local corpus="$build/corpus/$target" findings="$build/findings/$target" log="$build/fuzz_$target.log"
  mkdir -p "$corpus" "$findings"
  cp -n tests/fuzz/corpus/"$target"/* "$corpus"/ 2>/dev/null
  # The config reader also starts from the shipped configs (not copied into the corpus).
  [ "$target" = config ] && cp -n examples/configs/*.toml "$corpus"/ 2>/dev/null
  # The machine profile reader starts from the shipped profiles too.
  [ "$target" = machine ] && cp -n examples/machines/*.toml "$corpus"/ 2>/dev/null
  local args=(-max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1
              -artifact_prefix="$findings/")
  [ -f "tests/fuzz/$target.dict" ] && args+=(-dict="tests/fuzz/$target.dict")
  [ -n "$max_len" ] && args+=(-max_len="$max_len")
  if [ "$jobs" -gt 1 ]; then args+=(-fork="$jobs" -ignore_crashes=0); fi
  echo "== fuzzing $target for ${seconds}s (corpus $corpus, log $log)"
  local before
  before=$(find "$findings" -type f | wc -l)
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    timeout $((seconds + 300)) "$build/fuzz_$target" "${args[@]}" "$corpus" > "$log" 2>&1
  local status=$?
  grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb)' "$log"
  grep -E '^#[0-9]+.*(cov|ft):' "$log" | tail -n 1
  local new
  new=$(find "$findings" -type f -newer "$build/fuzz_$target" | sort)
  if [ "$status" -ne 0 ] || [ "$(find "$findings" -type f | wc -l)" -gt "$before" ]; then
    echo "FINDING in $target (exit status $status); log: $log"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|fuzz_|.*runtime error|.*Test unit written)' "$log" | head -n 10
    for f in $new; do echo "reproducer: $f  (run: $build/fuzz_$target $f)"; done
    return 1
  fi
  echo "ok: $target, no finding"
  return 0
}

# Build every target, then fuzz them side by side, each with FUZZ_JOBS processes and
# reporting into its own file, printed in order once all have ended (CI has two cores,
# which the nine targets share).
# The config and machine profile readers link the system's toml++ as llama-train does (its header-only form
# asserts on inputs the compiled library reports as syntax errors).
toml_flags=$(pkg-config --cflags --libs tomlplusplus 2>/dev/null) || { echo "fuzz: pkg-config cannot find tomlplusplus (libtomlplusplus-dev)" >&2; exit 1; }
targets=(safetensors schedule_csv config token_shard machine)
extra_flags=("" "" "$toml_flags" "" "$toml_flags")
if [ -f include/tessera/io/tiktoken.hpp ]; then
  pcre_flags=$(pkg-config --cflags --libs libpcre2-8 2>/dev/null) || { echo "fuzz: pkg-config cannot find libpcre2-8 (libpcre2-dev)" >&2; exit 1; }
  # The model config reader's header reaches the SentencePiece wrapper (checkpoint/hf.hpp).
  sp_flags=$(pkg-config --cflags --libs sentencepiece 2>/dev/null) || { echo "fuzz: pkg-config cannot find sentencepiece (libsentencepiece-dev)" >&2; exit 1; }
  targets+=(tiktoken chat hf_tokenizer model_config)
  extra_flags+=("$pcre_flags" "$pcre_flags" "$pcre_flags" "$pcre_flags $sp_flags")
else
  echo "== skipping fuzz_tiktoken, fuzz_chat, fuzz_hf_tokenizer and fuzz_model_config: include/tessera/io/tiktoken.hpp does not exist"
fi
pids=()
for i in "${!targets[@]}"; do
  if [ "${FUZZ_PREBUILT:-0}" = 1 ] && [ -x "$build/fuzz_${targets[$i]}" ]; then
    echo "== fuzz_${targets[$i]}: built beforehand"
    pids+=("")
    continue
  fi
  # shellcheck disable=SC2086
  build_target "${targets[$i]}" ${extra_flags[$i]} &
  pids+=($!)
done
for i in "${!targets[@]}"; do
  [ -z "${pids[$i]}" ] || wait "${pids[$i]}" || { echo "fuzz: building fuzz_${targets[$i]} failed" >&2; exit 1; }
done
$build_only && exit 0

declare -A max_len=([safetensors]=8192 [tiktoken]=16384 [schedule_csv]=2048 [config]=4096 [chat]=4096 [hf_tokenizer]=16384 [token_shard]=4096 [model_config]=2048 [machine]=16384)
pids=()
for t in "${targets[@]}"; do
  run_target "$t" "${max_len[$t]}" > "$build/report_$t.txt" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!targets[@]}"; do
  wait "${pids[$i]}" || status=1
  cat "$build/report_${targets[$i]}.txt"
done

[ "$status" -eq 0 ] && echo "fuzz: no findings" || echo "fuzz: FINDINGS above"
exit $status
