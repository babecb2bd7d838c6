#!/usr/bin/env bash
# Builds tessera and runs every test: the whole suite in a release build, the CPU and CLI
# suites again under AddressSanitizer and UndefinedBehaviorSanitizer, then the libFuzzer
# targets (the safetensors parser and the tokenizer loader) side by side for FUZZ_SECONDS
# each (default 30). At the end (also after a failure) it prints each phase's wall time and
# the doctest cases each build ran, so a change that slows CI shows at once
# (docs/testing.md has the budget: 25 minutes cold on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

phase_names=()
phase_seconds=()
phase=""
phase_start=$SECONDS
start_phase() {
  end_phase
  phase=$1
  phase_start=$SECONDS
  echo "== $phase"
}
end_phase() {
  if [ -n "$phase" ]; then
    phase_names+=("$phase")
    phase_seconds+=($((SECONDS - phase_start)))
  fi
  phase=""
}
# doctest_cases LOG: the test cases doctest reports as passed in a meson test log.
doctest_cases() {
  [ -f "$1" ] || { echo 0; return; }
  grep -o '\[doctest\] test cases: *[0-9]* | *[0-9]* passed' "$1" | awk '{ n += $(NF - 1) } END { print n + 0 }'
}
summary() {
  local status=$?
  [ -n "$phase" ] && phase="$phase (stopped)"
  end_phase
  echo
  echo "== CI phases (wall time)"
  local total=0
  for i in "${!phase_names[@]}"; do
    printf '  %-34s %3dm%02ds\n' "${phase_names[$i]}" $((phase_seconds[i] / 60)) $((phase_seconds[i] % 60))
    total=$((total + phase_seconds[i]))
  done
  printf '  %-34s %3dm%02ds\n' "total" $((total / 60)) $((total % 60))
  echo "  doctest cases passed: release $(doctest_cases build/meson-logs/testlog.txt)," \
    "sanitizers $(doctest_cases build-san/meson-logs/testlog.txt)"
  [ "$status" -eq 0 ] || echo "  FAILED (exit status $status)"
}
trap summary EXIT

start_phase "dependencies"
bash tools/install-deps.sh

start_phase "release build"
# The test executables the sanitizer build runs case for case are left to it
# (-Dsanitizer_twins=false; tests/meson.build names them).
[ -f build/build.ninja ] || meson setup build --buildtype=release -Dsanitizer_twins=false
meson compile -C build -j "$jobs"

start_phase "release tests"
meson test -C build --print-errorlogs --num-processes "$jobs"

# -O1 with line tables (meson.build adds -g1 under sanitize_tests): a third of -O2 -g's
# compile time, and the tests still run at a useful speed.
start_phase "sanitizer build"
[ -f build-san/build.ninja ] || meson setup build-san -Doptimization=1 -Ddebug=false \
  -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dsanitize_tests=true
meson compile -C build-san -j "$jobs"

start_phase "sanitizer tests"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  meson test -C build-san --print-errorlogs --num-processes "$jobs" --suite cpu --suite cli

start_phase "fuzzers (${FUZZ_SECONDS:-30} s each, side by side)"
bash tests/fuzz/run.sh "${FUZZ_SECONDS:-30}" build-fuzz
end_phase
