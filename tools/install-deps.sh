#!/usr/bin/env bash
# Installs what tessera needs to build and test on Debian 12 (bookworm), if missing.
# The CUDA toolkit is optional: when nvcc is on PATH the CUDA parts build too.
set -euo pipefail
packages=(g++ meson ninja-build pkg-config doctest-dev libtomlplusplus-dev nlohmann-json3-dev
          libopenblas-openmp-dev clang libclang-rt-14-dev libpcre2-dev libsentencepiece-dev
          libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: everything is installed"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
