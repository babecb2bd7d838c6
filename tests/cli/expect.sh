# Shared by the CLI tests that source it: ok and bad count results into $failures, and
# expect_error checks that a command fails as a user should see it fail.
#   expect_error DESCRIPTION PROGRAM_NAME EXPECTED_TEXT COMMAND...
# passes when COMMAND exits 1 with one line on stderr, "PROGRAM_NAME: error: ..." holding
# EXPECTED_TEXT. Blank lines, and the start-up lines llama-train prints before an error
# found once it has begun (a refused resume), are not counted.
failures=${failures:-0}

ok() { echo "ok: $1"; }
bad() { echo "FAIL: $1"; failures=$((failures + 1)); }

expect_error() {
  local what=$1 program=$2 expected=$3
  shift 3
  local out status lines
  out=$(timeout 120 "$@" 2>&1 >/dev/null)
  status=$?
  out=$(printf '%s\n' "$out" | grep -v '^$' | grep -v '^tessera llama-train: ' | grep -v '^  ')
  lines=$(printf '%s\n' "$out" | grep -c .)
  if [ "$status" -ne 1 ]; then
    bad "$what: exit status $status (expected 1)"; echo "$out" | tail -n 5
  elif [ "$lines" -ne 1 ]; then
    bad "$what: $lines lines on stderr (expected 1)"; echo "$out" | tail -n 5
  elif [[ "$out" != "$program: error: "*"$expected"* ]]; then
    bad "$what: '$out' lacks '$expected'"
  else
    ok "$what -> $out"
  fi
}
