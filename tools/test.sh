#!/usr/bin/env bash
# Builds tessera and runs every test: the whole suite in a release build, the CPU and CLI
# suites again under AddressSanitizer and UndefinedBehaviorSanitizer, then the libFuzzer
# targets (the safetensors parser, the tokenizer loader, the pipeline schedule reader, the
# job config reader and the chat data reader) side by side for FUZZ_SECONDS
# each (default 30). At the end (also after a failure) it prints each phase's wall time,
# the doctest cases each build ran and the ten slowest compiles and tests, so a change
# that slows CI shows at once (docs/testing.md has the budget: 20 minutes cold on two
# cores).
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
san_pid=""
summary() {
  local status=$?
  # The report must not change the run's status: no -e or pipefail inside it, and the
  # run's own status at the end.
  set +e +o pipefail
  # A background build still running (a release test failed): stop it and its compilers.
  [ -n "$san_pid" ] && kill -- "-$san_pid" 2>/dev/null || true
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
  slowest_units
  slowest_tests
  [ "$status" -eq 0 ] || echo "  FAILED (exit status $status)"
  exit "$status"
}
# The ten slowest translation units of both builds (ninja's log: start and end in ms),
# and the ten slowest tests (meson's test log), so that a change which slows CI names
# itself. awk rather than head takes the first ten: it reads to the end, so sort never
# writes into a closed pipe (SIGPIPE, exit 141, once the list outgrew the pipe's buffer).
slowest_units() {
  local logs=()
  for b in build build-san; do [ -f "$b/.ninja_log" ] && logs+=("$b/.ninja_log"); done
  [ ${#logs[@]} -gt 0 ] || return 0
  echo "== ten slowest translation units (seconds; build-san's beside the release tests, at low priority)"
  awk -F'\t' 'FNR > 1 && $4 ~ /\.o$/ { d = FILENAME; sub("/\\.ninja_log$", "", d)
                                          printf "  %6.1f  %s: %s\n", ($2 - $1) / 1000, d, $4 }' "${logs[@]}" |
    sort -rn | awk 'NR <= 10'
}
slowest_tests() {
  local logs=()
  for b in build build-san; do [ -f "$b/meson-logs/testlog.json" ] && logs+=("$b/meson-logs/testlog.json"); done
  [ ${#logs[@]} -gt 0 ] || return 0
  echo "== ten slowest tests (seconds)"
  python3 - "${logs[@]}" <<'PY'
import json, sys
rows = []
for path in sys.argv[1:]:
    build = path.split("/meson-logs/")[0]
    for line in open(path):
        t = json.loads(line)
        rows.append((t["duration"], f"{build}: {t['name']} ({t['result'].lower()})"))
for duration, name in sorted(rows, reverse=True)[:10]:
    print(f"  {duration:6.1f}  {name}")
PY
}
trap summary EXIT

start_phase "dependencies"
bash tools/install-deps.sh

# OpenBLAS picks its kernels from the CPU it detects, and Debian 12's (0.3.21) does not
# know the newest Intel server CPUs: it falls back to its SSE3 "Prescott" kernels, which
# run the suite's GEMMs two to three times slower (bench/README.md). Where it would, the
# tests run with the kernels the CPU has (AVX-512: SkylakeX, AVX2: Haswell); a setting
# of OPENBLAS_CORETYPE in the environment wins. The tests check results, never timing,
# within tolerances any of the kernels meet.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  core=$(python3 -c 'import ctypes, ctypes.util
lib = ctypes.CDLL(ctypes.util.find_library("openblas") or "libopenblas.so.0")
lib.openblas_get_corename.restype = ctypes.c_char_p
print(lib.openblas_get_corename().decode())' 2>/dev/null || true)
  if [ "${core,,}" = prescott ]; then
    cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    if [[ $cpu_flags == *" avx512f "* && $cpu_flags == *" avx512bw "* && $cpu_flags == *" avx512vl "* &&
          $cpu_flags == *" avx512dq "* ]]; then
      export OPENBLAS_CORETYPE=SkylakeX
    elif [[ $cpu_flags == *" avx2 "* && $cpu_flags == *" fma "* ]]; then
      export OPENBLAS_CORETYPE=Haswell
    fi
    [ -n "${OPENBLAS_CORETYPE:-}" ] &&
      echo "OpenBLAS would run its Prescott kernels on this CPU: the tests run with OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE"
  fi
fi

start_phase "release build"
# The test executables the sanitizer build runs case for case are left to it
# (-Dsanitizer_twins=false; tests/meson.build names them). Both builds let GCC collect its
# garbage late (-Dgcc_lazy_gc: a tenth less compile time for more memory, meson.build).
# Everything at -O1, as the test code always is: -O3 spends 40% more compile time and the
# suites run no faster (docs/testing.md); the CUDA code, which CI compiles but cannot run,
# to PTX without machine code, and the host code only a GPU runs at -O0 (-Dgpu_code=check).
[ -f build/build.ninja ] || meson setup build -Doptimization=1 -Ddebug=false -Dsanitizer_twins=false \
  -Dgcc_lazy_gc=true -Dgpu_code=check
meson compile -C build -j "$jobs"

# The sanitizer build runs beside the release tests, at the lowest CPU priority (nice 19):
# it takes the time the tests leave a core idle (a test that runs alone, the last long
# test) and yields the cores to them otherwise. At -Og with line tables (meson.build adds
# -g1 under sanitize_tests): under the sanitizers -O1 compiles twice as long and its tests
# run no faster, -O0 compiles little faster and its long tests run twice as long
# (docs/testing.md). The fuzz targets are built after it, the same way. Its own process
# group, so that a failing release test stops it too; its output goes to
# build-san/compile.log.
mkdir -p build-san
san_start=$SECONDS
setsid nice -n 19 bash -c '
  [ -f build-san/build.ninja ] || meson setup build-san -Doptimization=g -Ddebug=false \
    -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dsanitize_tests=true \
    -Dgcc_lazy_gc=true
  meson compile -C build-san -j "$1" && bash tests/fuzz/run.sh --build-only build-fuzz' \
  san-build "$jobs" > build-san/compile.log 2>&1 &
san_pid=$!

start_phase "release tests (sanitizer build beside them)"
# One OpenMP thread a test: two tests side by side then fill the two cores without
# oversubscribing them. A team of two threads on a core another process also wants waits
# at every barrier for its descheduled thread: test_parallel beside two busy processes took
# 242 s with two threads and 134 s with one (docs/testing.md). The sanitizer tests keep
# the default, so that the kernels' threaded loops run under the sanitizers. A value
# already in the environment wins.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} meson test -C build --print-errorlogs --num-processes "$jobs"

start_phase "sanitizer build, the rest"
san_status=0
wait "$san_pid" || san_status=$?
san_pid=""
echo "sanitizer build and fuzz targets: $((SECONDS - san_start)) s from their start, beside the release tests"
if [ "$san_status" -ne 0 ]; then
  tail -n 80 build-san/compile.log
  echo "sanitizer build or fuzz targets failed (exit status $san_status): build-san/compile.log"
  exit "$san_status"
fi

start_phase "sanitizer tests"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  meson test -C build-san --print-errorlogs --num-processes "$jobs" --suite cpu --suite cli

start_phase "fuzzers (${FUZZ_SECONDS:-30} s each, side by side)"
FUZZ_PREBUILT=1 bash tests/fuzz/run.sh "${FUZZ_SECONDS:-30}" build-fuzz
end_phase
