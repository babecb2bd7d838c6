#!/usr/bin/env bash
# Compile-fail tests: the policy static_assert messages are part of the interface.
#
#   check.sh INCLUDE_DIR [CXX [CXX_ARGS...]]
#
# Each case here (*.cpp) starts with one or more `// expect: TEXT` lines. The first
# TEXT is the static_assert message its compile must stop on: the compile fails, its
# first error carries TEXT, and exactly one static_assert fails. Further lines are texts
# the diagnostic must also contain (the offending type's name). `// expect: compiles`
# marks the control, which must compile with the same flags; without it a wrong flag
# would make every case "fail" for the wrong reason.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
include_dir=${1:?usage: check.sh INCLUDE_DIR [CXX [CXX_ARGS...]]}
shift
cxx=("$@")
[ ${#cxx[@]} -gt 0 ] || cxx=(g++)
export LC_ALL=C  # plain quotes and English diagnostics

if ! pkg_flags=$(pkg-config --cflags openblas tomlplusplus nlohmann_json); then
  echo "compile_fail: pkg-config cannot give the flags for openblas, tomlplusplus and nlohmann_json"
  exit 1
fi
# shellcheck disable=SC2206  # pkg-config's output is a list of words
flags=(-std=c++20 -fopenmp -Wall -Wextra -Werror -fsyntax-only -fdiagnostics-color=never
       -I"$include_dir" $pkg_flags)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The headers every case includes, parsed once into a precompiled header that each
# compile loads (-include): a case then costs its own instantiations, not the library's
# parse (a third of the time). The cases still include the headers themselves; with the
# precompiled header those includes are no-ops. Where the compiler cannot make one (not
# GCC, or different flags), each case parses the headers as before.
prelude="$tmp/prelude.hpp"
cat "$here"/*.cpp | grep -h '^#include ' | sort -u >"$prelude"
pch=()
pch_flags=()
for f in "${flags[@]}"; do [ "$f" = -fsyntax-only ] || pch_flags+=("$f"); done
if "${cxx[@]}" "${pch_flags[@]}" -x c++-header "$prelude" -o "$prelude.gch" 2>"$tmp/prelude.err"; then
  pch=(-include "$prelude" -Winvalid-pch)
else
  echo "note: no precompiled header (each case parses the headers):"
  sed -n '1,5p' "$tmp/prelude.err"
fi

compile() {  # CASE.cpp: its stderr in $tmp/CASE.err, its exit status in $tmp/CASE.rc
  local name rc=0
  name=$(basename "$1" .cpp)
  "${cxx[@]}" "${flags[@]}" "${pch[@]}" "$1" >/dev/null 2>"$tmp/$name.err" || rc=$?
  echo "$rc" >"$tmp/$name.rc"
}

cases=("$here"/*.cpp)
# Two compiles at a time: CI has two cores.
running=0
for f in "${cases[@]}"; do
  compile "$f" &
  running=$((running + 1))
  if [ $running -ge 2 ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait

failures=0
controls=0
fail() {
  echo "FAIL $1: $2"
  sed -n '1,40p' "$3" | sed 's/^/  | /'
  failures=$((failures + 1))
}
for f in "${cases[@]}"; do
  name=$(basename "$f" .cpp)
  err="$tmp/$name.err"
  rc=$(cat "$tmp/$name.rc")
  expects=()
  while IFS= read -r line; do
    [[ $line == "// expect: "* ]] || break
    expects+=("${line#// expect: }")
  done <"$f"
  if [ ${#expects[@]} -eq 0 ]; then
    fail "$name" "no '// expect: ' line at the top of the file" /dev/null
    continue
  fi
  if [ "${expects[0]}" = compiles ]; then
    controls=$((controls + 1))
    if [ "$rc" -ne 0 ]; then
      fail "$name" "the control does not compile: the flags or the headers are wrong" "$err"
    else
      echo "ok   $name: compiles"
    fi
    continue
  fi
  if [ "$rc" -eq 0 ]; then
    fail "$name" "compiled, but must fail with: ${expects[0]}" "$err"
    continue
  fi
  first_error=$(grep -m1 'error:' "$err" || true)
  if ! grep -qF -- "${expects[0]}" <<<"$first_error"; then
    fail "$name" "the first error is not the expected message: ${expects[0]}" "$err"
    continue
  fi
  asserts=$(grep -c 'static assertion failed' "$err" || true)
  if [ "$asserts" -ne 1 ]; then
    fail "$name" "$asserts static_asserts failed; a case must fail for exactly one reason" "$err"
    continue
  fi
  missing=""
  for text in "${expects[@]:1}"; do
    grep -qF -- "$text" "$err" || missing="$text"
  done
  if [ -n "$missing" ]; then
    fail "$name" "the diagnostic does not name: $missing" "$err"
    continue
  fi
  echo "ok   $name: ${expects[0]}"
done

if [ $controls -eq 0 ]; then
  echo "FAIL: no control case ('// expect: compiles')"
  failures=$((failures + 1))
fi
echo "${#cases[@]} cases, $failures failed"
[ $failures -eq 0 ]
