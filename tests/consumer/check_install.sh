#!/usr/bin/env bash
# Installs tessera into a staging folder (meson install --destdir) and uses it from
# outside, only through what was installed, as the README says:
#   Meson  dependency('tessera') through the relocatable tessera.pc: a trainer of its own
#          (the custom-layer example: its own block, its backward checked, trained under
#          FSDP, TP, PP and their compositions against one rank's losses);
#   CMake  find_package(tessera) through tesseraConfig.cmake: a one-layer model that links
#          what the headers call into (OpenBLAS, OpenMP, PCRE2, SentencePiece);
#   make   pkg-config --cflags --libs tessera: the same.
#
#   check_install.sh BUILD_DIR [TRAIN_STEPS]
set -euo pipefail
# Thread ranks share the cores: idle OpenMP threads sleep rather than spin.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
build_dir=$1
steps=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
examples=$(cd "$here/../../examples" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
meson install -C "$build_dir" --destdir "$work/root" --no-rebuild >/dev/null
pc=$(find "$work/root" -name tessera.pc | head -n 1)
[ -n "$pc" ] || { echo "tessera.pc was not installed"; exit 1; }
config=$(find "$work/root" -name tesseraConfig.cmake | head -n 1)
[ -n "$config" ] || { echo "tesseraConfig.cmake was not installed"; exit 1; }
grep -q '^prefix=${pcfiledir}' "$pc" || {
  echo "$pc: not relocatable (a build directory configured before meson.build set pkgconfig.relocatable:" \
    "meson configure $build_dir -Dpkgconfig.relocatable=true)"
  exit 1
}
export PKG_CONFIG_PATH
PKG_CONFIG_PATH=$(dirname "$pc")
# The staged prefix: where the config sits, less share/cmake/tessera.
prefix=$(cd "$(dirname "$config")/../../.." && pwd)

project=$work/consumer
mkdir "$project"
cp "$here/consumer.cpp" "$here/CMakeLists.txt" "$here/Makefile" "$project/"
cp "$here/meson.build.in" "$project/meson.build"
cp "$examples/custom_layer.cpp" "$examples/custom_layer.hpp" "$project/"

# Meson at -O1: the quickest compile and run together (-O2 compiles a third longer, -O0 runs
# three times as long).
quiet() { "$@" > "$work/step.log" 2>&1 || { cat "$work/step.log"; echo "failed: $*"; exit 1; }; }
quiet meson setup "$project/build" "$project" -Doptimization=1 -Ddebug=false
quiet meson compile -C "$project/build"
"$project/build/custom-layer" "$steps" > "$work/train.log" || { cat "$work/train.log"; exit 1; }
grep -E '^(one rank|FSDP|TP|PP)' "$work/train.log"
echo "meson: a separate project built against the staged install; its trainer's layouts agree with one rank"

quiet cmake -S "$project" -B "$project/cmake-build" -DCMAKE_PREFIX_PATH="$prefix"
quiet cmake --build "$project/cmake-build"
"$project/cmake-build/consumer"
echo "cmake: find_package(tessera) from the staged install"

quiet make -C "$project" consumer CXXFLAGS=-O0  # a quick compile: the program only checks the flags
"$project/consumer"
echo "make: pkg-config's flags from the staged install"
