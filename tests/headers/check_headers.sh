#!/usr/bin/env bash
# Compiles every public header alone: each one includes what it uses. One compiler per
# run, so that the test runner can schedule the three side by side:
#
#   check_headers.sh INCLUDE_DIR host CXX      every .hpp as host C++ (-fsyntax-only), with
#                                              g++, or clang++ ("clang": 16 or newer,
#                                              skipped without one); and none outside
#                                              backend/cuda and comm/nccl.hpp includes a
#                                              CUDA or NCCL header
#   check_headers.sh INCLUDE_DIR cuda NVCC     every .cuh, and every .hpp that includes
#                                              one, as CUDA with nvcc (the host side
#                                              through its g++)
#
# Flags after the compiler are added to every compile (tests/meson.build passes the
# build's -Dgcc_lazy_gc flags to the g++ run).
#
# The host headers that use CUDA's runtime or NCCL (backend/cuda/*.hpp, comm/nccl.hpp)
# are compiled with the toolkit's include directory where it exists, and skipped (named)
# where it does not; cudnn_attention_impl.hpp also needs the cuDNN frontend's headers
# (tools/install-deps.sh fetches them), comm/mpi.hpp MPI's.
# Each header is compiled twice in one file (its include guard), with -Wall -Wextra
# -Werror, two compiles at a time.
#
# Precompiled preludes (host check with GCC): a few hub headers that many others include
# (HUBS below) are each parsed once into a precompiled header, and a header whose own
# include closure holds a hub loads that hub first (-include; preludes.py picks the one
# with the largest precompiled header). The hub and everything it includes would have
# been read by the header's compile anyway, so what the check finds is unchanged: a
# header that uses what it does not include, directly or through its includes, still
# fails. It costs the header's own parse instead of its whole closure's (the check took
# 163 CPU-s of g++, now 118). More hubs do not pay: four more (layer/layer.hpp,
# parallel/plan.hpp, parallel/tensor_parallel.hpp, nn/linear.hpp), the preludes of 42
# headers, left the check at 245 CPU-s, as loading a larger precompiled header costs
# what its parse saved; the time is spread over the headers (the costliest, instances.hpp,
# 8 s of 214).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
include_dir=$(cd "$1" && pwd)
mode=$2
compiler=$3
shift 3
root=$(cd "$include_dir/.." && pwd)
# Any further arguments are flags for every compile (the build's -Dgcc_lazy_gc).
flags="$(pkg-config --cflags openblas tomlplusplus nlohmann_json 2>/dev/null || true) $*"
mpi_flags=$(pkg-config --cflags ompi-cxx 2>/dev/null || pkg-config --cflags mpich 2>/dev/null ||
            mpicxx --showme:compile 2>/dev/null || true)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$include_dir"

# The CUDA toolkit's include directory, beside nvcc (or /usr/local/cuda).
cuda_include=""
for nvcc in "$(command -v nvcc 2>/dev/null || true)" /usr/local/cuda/bin/nvcc; do
  [ -n "$nvcc" ] && [ -f "$(dirname "$nvcc")/../include/cuda_runtime.h" ] || continue
  cuda_include=$(cd "$(dirname "$nvcc")/../include" && pwd)
  break
done
cudnn_frontend="$root/third_party/cudnn_frontend/include"

# "clang": the newest clang++ from 16 on (Debian 12: clang-16), or skipped (77).
if [ "$compiler" = clang ]; then
  source "$here/find_clang.sh"
  compiler=$clang_cxx
fi

skipped=()
headers=()
case $mode in
  host)
    probe() { printf '#include <%s>\n' "$1" | $compiler -std=c++20 -fsyntax-only $2 -x c++ - 2>/dev/null; }
    for h in $(find tessera -name '*.hpp' | sort); do
      # A header that includes a .cuh is CUDA itself: the cuda run checks it.
      grep -q '^#include ".*\.cuh"' "$h" && continue
      case $h in
        tessera/comm/mpi.hpp)
          probe mpi.h "$mpi_flags" || { skipped+=("$h (no mpi.h)"); continue; } ;;
        tessera/backend/cuda/cudnn_attention_impl.hpp)
          [ -n "$cuda_include" ] && [ -f "$cudnn_frontend/cudnn_frontend.h" ] &&
            probe cudnn.h "-I$cuda_include" || { skipped+=("$h (no cuDNN or its frontend's headers)"); continue; } ;;
        tessera/backend/cuda/kernel_profile.hpp)
          [ -n "$cuda_include" ] && probe cupti.h "-I$cuda_include" || { skipped+=("$h (no CUPTI)"); continue; } ;;
        tessera/comm/nccl.hpp)
          [ -n "$cuda_include" ] && probe nccl.h "-I$cuda_include" || { skipped+=("$h (no nccl.h)"); continue; } ;;
        tessera/backend/cuda/*)
          [ -n "$cuda_include" ] || { skipped+=("$h (no CUDA toolkit)"); continue; } ;;
      esac
      headers+=("$h")
    done
    compile() {
      local extra=""
      case $1 in
        tessera/comm/mpi.hpp) extra=$mpi_flags ;;
        tessera/backend/cuda/cudnn_attention_impl.hpp)
          extra="-I$cuda_include -isystem $cudnn_frontend -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING" ;;
        tessera/backend/cuda/* | tessera/comm/nccl.hpp) extra="-I$cuda_include" ;;
      esac
      # The hub's precompiled prelude, where this header has one (same flags: no extra).
      [ "$3" != - ] && [ -z "$extra" ] && extra="-include $3 -Winvalid-pch"
      # shellcheck disable=SC2086
      $compiler -std=c++20 -fopenmp -Wall -Wextra -Werror -fsyntax-only -I"$include_dir" $flags $extra "$2"
    }
    ;;
  cuda)
    if ! command -v "$compiler" > /dev/null 2>&1; then
      echo "skipped: no CUDA compiler ($compiler)"
      exit 77
    fi
    # The .cuh, and the .hpp that include one (CUDA code behind a host-style name).
    mapfile -t headers < <({ find tessera -name '*.cuh'; grep -rl '^#include ".*\.cuh"' --include='*.hpp' tessera; } | sort)
    compile() {
      # -c rather than a syntax check: nvcc has none, and a header alone instantiates
      # next to nothing, so code generation costs little. Warnings are errors on the
      # host side as in the host check, and in the device compiler.
      # shellcheck disable=SC2086
      "$compiler" -std=c++20 --expt-relaxed-constexpr -x cu -Werror all-warnings \
        -Xcompiler=-fopenmp,-Wall,-Wextra,-Werror -I"$include_dir" $flags -c "$2" -o "$2.o"
    }
    ;;
  *)
    echo "usage: check_headers.sh INCLUDE_DIR host|cuda COMPILER" >&2
    exit 2
    ;;
esac
export -f compile
export compiler flags mpi_flags include_dir cuda_include cudnn_frontend

# The hubs of the precompiled preludes (see the top): headers that many others include,
# chosen by what they save (each costs one compile of its own). Only GCC, and only a hub
# that precompiles; a header whose hub does not is checked without a prelude.
HUBS=(tessera/core/error.hpp tessera/backend/backend.hpp tessera/plan/cost.hpp tessera/io/safetensors.hpp)
prelude_of=()
if [ "$mode" = host ] && $compiler --version 2>/dev/null | grep -q 'Free Software Foundation'; then
  mkdir -p "$tmp/prelude"
  for i in "${!HUBS[@]}"; do
    printf '#include "%s"\n' "${HUBS[$i]}" > "$tmp/prelude/$i.hpp"
    printf '%s\n' "$i"
  done | xargs -P 2 -I{} bash -c '
    # shellcheck disable=SC2086
    $compiler -std=c++20 -fopenmp -Wall -Wextra -Werror -I"$include_dir" $flags -x c++-header \
      "$0/{}.hpp" -o "$0/{}.hpp.gch" 2> "$0/{}.err" || rm -f "$0/{}.hpp.gch"' "$tmp/prelude"
  usable=()
  for i in "${!HUBS[@]}"; do
    [ -f "$tmp/prelude/$i.hpp.gch" ] && usable+=("${HUBS[$i]}=$(stat -c %s "$tmp/prelude/$i.hpp.gch")")
  done
  declare -A hub_file
  for i in "${!HUBS[@]}"; do hub_file[${HUBS[$i]}]="$tmp/prelude/$i.hpp"; done
  while IFS=$'\t' read -r h hub; do
    [ "$hub" = - ] && prelude_of+=(-) || prelude_of+=("${hub_file[$hub]}")
  done < <(printf '%s\n' "${headers[@]}" | python3 "$here/preludes.py" "$include_dir" "${usable[@]}")
fi

status=0
for j in "${!headers[@]}"; do
  h=${headers[$j]}
  src="$tmp/$(echo "$h" | tr '/.' '__').cpp"
  [ "$mode" = cuda ] && src="${src%.cpp}.cu"
  printf '#include "%s"\n#include "%s"\n' "$h" "$h" > "$src"
  printf '%s\t%s\t%s\n' "$h" "$src" "${prelude_of[$j]:--}"
done > "$tmp/list"
# Two at a time: CI has two cores.
if ! xargs -P 2 -L 1 bash -c 'compile "$0" "$1" "$2" || { echo "header check failed: $0"; exit 1; }' < "$tmp/list"; then
  status=1
fi
if [ "$mode" = host ]; then
  outside=$(find tessera -name '*.hpp' ! -path 'tessera/backend/cuda/*' ! -path 'tessera/comm/nccl.hpp' | sort)
  # shellcheck disable=SC2086
  if grep -lE '#include *<(cuda|cublas|cudnn|cupti|nccl|cub/)' $outside; then
    echo "CUDA or NCCL header included outside backend/cuda and comm/nccl.hpp"
    status=1
  fi
fi
for s in "${skipped[@]}"; do echo "not checked here: $s"; done
[ $status -eq 0 ] && echo "${#headers[@]} headers compile alone with $compiler"
exit $status
