#!/usr/bin/env bash
# tessera compiles with Clang as well as GCC: llama-train's source and the custom-layer
# example are checked with clang++ 16 or newer. Between them they use the trainer over the
# parallel policies, the checkpoints, the config, the planner's CPU profile, a user's own
# layer type, and MPI's launch where MPI is installed. The check uses -fsyntax-only:
# Clang's semantic analysis instantiates every template a file uses; only code generation
# is left out. (Each header alone is checked with g++ by check_headers.sh; that check
# under Clang too would add over two minutes of CPU.) The test is skipped (77) where no
# such clang++ is installed (Debian 12: clang-16 and libomp-16-dev).
#
#   check_clang.sh SOURCE_ROOT
set -euo pipefail
root=$1
cxx=""
for c in clang++-20 clang++-19 clang++-18 clang++-17 clang++-16 clang++; do
  command -v "$c" > /dev/null 2>&1 || continue
  major=$("$c" -dumpversion 2>/dev/null | cut -d. -f1)
  if [ -n "$major" ] && [ "$major" -ge 16 ] 2>/dev/null; then cxx=$c; break; fi
done
if [ -z "$cxx" ]; then
  echo "skipped: no clang++ 16 or newer (Debian 12: apt install clang-16 libomp-16-dev)"
  exit 77
fi
flags=$(pkg-config --cflags openblas tomlplusplus nlohmann_json)
mpi_flags=""
mpi_define=""
if mpi_flags=$(pkg-config --cflags ompi-cxx 2>/dev/null || pkg-config --cflags mpich 2>/dev/null ||
               mpicxx --showme:compile 2>/dev/null); then
  mpi_define=-DTESSERA_WITH_MPI=1
fi
common="-std=c++20 -fopenmp -Wall -Wextra -Werror -fsyntax-only -DTOML_HEADER_ONLY=0 -DTOML_SHARED_LIB=1"
common="$common -I$root/include $flags"
# The two side by side: CI has two cores.
pids=()
files=("$root/examples/llama/llama_train.cpp" "$root/examples/custom_layer.cpp")
# shellcheck disable=SC2086
"$cxx" $common $mpi_flags $mpi_define "${files[0]}" & pids+=($!)
# shellcheck disable=SC2086
"$cxx" $common "${files[1]}" & pids+=($!)
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "clang check failed: ${files[$i]}"
    status=1
  fi
done
[ $status -eq 0 ] && echo "llama-train's source and the custom-layer example compile with $cxx"
exit $status
