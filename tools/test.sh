#!/usr/bin/env bash
# Builds tessera and runs every test: the suite in a release build, the CPU suite again
# under AddressSanitizer and UndefinedBehaviorSanitizer, then the libFuzzer targets (the
# safetensors parser and the tokenizer loader) for FUZZ_SECONDS each (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
jobs=$(nproc)

echo "== release build"
[ -f build/build.ninja ] || meson setup build --buildtype=release
meson compile -C build -j "$jobs"
meson test -C build --print-errorlogs --num-processes "$jobs"

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build"
[ -f build-san/build.ninja ] || meson setup build-san --buildtype=debugoptimized -Db_sanitize=address,undefined \
  -Db_lundef=false -Dcuda=disabled -Dsanitize_tests=true
meson compile -C build-san -j "$jobs"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  meson test -C build-san --print-errorlogs --num-processes "$jobs" --suite cpu --suite cli

echo "== libFuzzer targets, ${FUZZ_SECONDS:-60} s each"
bash tests/fuzz/run.sh "${FUZZ_SECONDS:-60}" build-fuzz
