#!/usr/bin/env bash
# tessera compiles with Clang as well as GCC: llama-train's source and the custom-layer
# example are checked with clang++ 16 or newer. Between them they use the trainer over the
# parallel policies, the checkpoints, the config, the planner's CPU profile, a user's own
# layer type, and MPI's launch where MPI is installed. The check uses -fsyntax-only:
# Clang's semantic analysis instantiates every template a file uses; only code generation
# is left out. Every host header is compiled too, all in one file (each header alone is
# checked with g++ by check_headers.sh; alone under Clang as well, it would add two and a
# half minutes of CPU for what the include lines already settled). The test is skipped
# (77) where no such clang++ is installed (Debian 12: clang-16 and libomp-16-dev).
#
#   check_clang.sh SOURCE_ROOT
set -euo pipefail
root=$1
source "$(dirname "${BASH_SOURCE[0]}")/find_clang.sh"
cxx=$clang_cxx
flags=$(pkg-config --cflags openblas tomlplusplus nlohmann_json)
mpi_flags=""
mpi_define=""
if mpi_flags=$(pkg-config --cflags ompi-cxx 2>/dev/null || pkg-config --cflags mpich 2>/dev/null ||
               mpicxx --showme:compile 2>/dev/null); then
  mpi_define=-DTESSERA_WITH_MPI=1
fi
common="-std=c++20 -fopenmp -Wall -Wextra -Werror -fsyntax-only -DTOML_HEADER_ONLY=0 -DTOML_SHARED_LIB=1"
common="$common -I$root/include $flags"
# And every host header (those of CUDA, NCCL and cuDNN aside) in one file: each header's
# code under Clang's rules. (Each header alone is checked with g++: which headers a
# header includes does not depend on the compiler, both using the same standard library.)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
all="$tmp/all_headers.cpp"
(cd "$root/include" && find tessera -name '*.hpp' ! -path 'tessera/backend/cuda/*' ! -path 'tessera/comm/nccl.hpp' |
   sort | sed 's/.*/#include "&"/') > "$all"
[ -n "$mpi_define" ] || sed -i '/tessera\/comm\/mpi.hpp/d' "$all"
# Two at a time: CI has two cores. Each compile's output and status in $tmp/N.{log,rc}.
files=("$root/examples/llama/llama_train.cpp" "$root/examples/custom_layer.cpp" "$all")
run() {
  local i=$1 rc=0
  shift
  "$cxx" "$@" > "$tmp/$i.log" 2>&1 || rc=$?
  echo "$rc" > "$tmp/$i.rc"
}
# shellcheck disable=SC2086
run 0 $common $mpi_flags $mpi_define "${files[0]}" &
# shellcheck disable=SC2086
run 1 $common "${files[1]}" &
wait -n
# shellcheck disable=SC2086
run 2 $common $mpi_flags "${files[2]}" &
wait
status=0
for i in "${!files[@]}"; do
  if [ "$(cat "$tmp/$i.rc")" -ne 0 ]; then
    cat "$tmp/$i.log"
    echo "clang check failed: ${files[$i]}"
    status=1
  fi
done
[ $status -eq 0 ] && echo "llama-train's source, the custom-layer example and every host header compile with $cxx"
exit $status
