#!/usr/bin/env bash
# Installs tessera into a scratch prefix and builds a separate Meson project against
# it with dependency('tessera'), found through the installed tessera.pc.
set -euo pipefail
build_dir=$1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
meson install -C "$build_dir" --destdir "$work/root" --no-rebuild >/dev/null
pc=$(find "$work/root" -name tessera.pc | head -n 1)
[ -n "$pc" ] || { echo "tessera.pc was not installed"; exit 1; }
prefix=$(sed -n 's/^prefix=//p' "$pc")
sed -i "s|^prefix=.*|prefix=$work/root$prefix|" "$pc"
mkdir "$work/consumer"
cp "$here/meson.build.in" "$work/consumer/meson.build"
cp "$here/consumer.cpp" "$work/consumer/"
PKG_CONFIG_PATH=$(dirname "$pc") meson setup "$work/consumer/build" "$work/consumer" >/dev/null
meson compile -C "$work/consumer/build" >/dev/null
"$work/consumer/build/consumer"
echo "a separate project built and ran against the installed headers and tessera.pc"
