#!/usr/bin/env bash
# Installs what tessera needs to build and test on Debian 12 (bookworm), if missing.
# The CUDA toolkit is optional: when nvcc is on PATH the CUDA parts build too, and then
# the cuDNN frontend's headers (header-only C++, for attention through cuDNN) are fetched
# into third_party/cudnn_frontend/ (ignored by git; see fetch_cudnn_frontend below).
set -euo pipefail
cd "$(dirname "$0")/.."

# The cuDNN frontend, pinned: the nvidia-cudnn-frontend wheel from PyPI carries its
# include/ folder; only that is unpacked. The headers are the same in every wheel of a
# version, so one wheel is named exactly and its hash checked. Fetched only where nvcc
# exists: a build without CUDA never reads them. Nothing happens when the pinned version
# is already there.
cudnn_frontend_version=1.32.0
cudnn_frontend_wheel=nvidia_cudnn_frontend-1.32.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
cudnn_frontend_sha256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
fetch_cudnn_frontend() {
  local dest=third_party/cudnn_frontend
  if ! command -v nvcc > /dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    return 0
  fi
  if [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$cudnn_frontend_version" ] && [ -f "$dest/include/cudnn_frontend.h" ]; then
    return 0
  fi
  if ! python3 -m pip --version > /dev/null 2>&1; then
    echo "install-deps: no pip: the cuDNN frontend headers are not fetched (the CUDA build uses tessera's own attention only)"
    return 0
  fi
  echo "install-deps: fetching the cuDNN frontend $cudnn_frontend_version headers into $dest"
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" --python-version 3.11 \
    --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 "nvidia-cudnn-frontend==$cudnn_frontend_version"
  echo "$cudnn_frontend_sha256  $tmp/$cudnn_frontend_wheel" | sha256sum --check --quiet
  rm -rf "$dest"
  mkdir -p "$dest"
  python3 - "$tmp/$cudnn_frontend_wheel" "$dest" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for entry in wheel.infolist():
        if entry.filename.startswith("include/"):
            wheel.extract(entry, sys.argv[2])
PY
  echo "$cudnn_frontend_version" > "$dest/VERSION"
  rm -rf "$tmp"
}
packages=(g++ meson ninja-build pkg-config cmake make doctest-dev libtomlplusplus-dev nlohmann-json3-dev
          libopenblas-openmp-dev clang-16 libclang-rt-16-dev libomp-16-dev libpcre2-dev libsentencepiece-dev
          libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  fetch_cudnn_frontend
  echo "install-deps: everything is installed"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fetch_cudnn_frontend
echo "install-deps: done"
