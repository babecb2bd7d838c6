#!/usr/bin/env bash
# Compiles every public header alone with the host compiler: each one includes what
# it uses, and none outside backend/cuda and comm/nccl.hpp pulls in CUDA or NCCL headers.
# comm/mpi.hpp compiles with MPI's include flags; it is skipped only where MPI is not installed.
set -euo pipefail
include_dir=$1
cxx=${2:-g++}
flags=$(pkg-config --cflags openblas tomlplusplus nlohmann_json 2>/dev/null || true)
mpi_flags=$(pkg-config --cflags ompi-cxx 2>/dev/null || pkg-config --cflags mpich 2>/dev/null ||
            mpicxx --showme:compile 2>/dev/null || true)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
skip_mpi=()
if ! printf '#include <mpi.h>\n' | $cxx -std=c++20 -fsyntax-only $mpi_flags -x c++ - 2>/dev/null; then
  echo "note: MPI is not installed (no mpi.h): comm/mpi.hpp is not checked"
  skip_mpi=(! -path 'tessera/comm/mpi.hpp')
fi
flags="$flags $mpi_flags"
cd "$include_dir"
headers=$(find tessera -name '*.hpp' ! -path 'tessera/backend/cuda/*' ! -path 'tessera/comm/nccl.hpp' "${skip_mpi[@]}" | sort)
status=0
for h in $headers; do
  src="$tmp/$(echo "$h" | tr '/.' '__').cpp"
  printf '#include "%s"\n#include "%s"\n' "$h" "$h" > "$src"
done
# Two at a time: CI has two cores.
if ! ls "$tmp"/*.cpp | xargs -P 2 -I{} sh -c "$cxx -std=c++20 -fopenmp -Wall -Wextra -Werror -fsyntax-only -I'$include_dir' $flags {} || { echo 'header check failed: {}'; exit 1; }"; then
  status=1
fi
n=$(echo "$headers" | wc -w)
if grep -rlE '#include *<(cuda|cublas|nccl|cub/)' $headers; then
  echo "CUDA or NCCL header included outside backend/cuda or comm/nccl"
  status=1
fi
[ $status -eq 0 ] && echo "$n headers compile alone with $cxx"
exit $status
