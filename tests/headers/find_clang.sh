# Sourced by the header checks: sets `clang_cxx` to the newest clang++ from 16 on
# (Debian 12: clang-16), or exits the check as skipped (77) where none is installed.
clang_cxx=""
for c in clang++-20 clang++-19 clang++-18 clang++-17 clang++-16 clang++; do
  command -v "$c" > /dev/null 2>&1 || continue
  major=$("$c" -dumpversion 2>/dev/null | cut -d. -f1)
  if [ -n "$major" ] && [ "$major" -ge 16 ] 2>/dev/null; then clang_cxx=$c; break; fi
done
if [ -z "$clang_cxx" ]; then
  echo "skipped: no clang++ 16 or newer (Debian 12: apt install clang-16 libomp-16-dev)"
  exit 77
fi
