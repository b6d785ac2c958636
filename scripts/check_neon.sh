#!/usr/bin/env bash
# Cross-compiles the native library and its self-test for AArch64 and runs the
# test under qemu, so the NEON variant is checked on an x86 machine.
# Needs: apt-get install g++-aarch64-linux-gnu qemu-user
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-/tmp/infinity-build-aarch64}"
cat > "$build.toolchain.cmake" <<'TC'
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
TC
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_TOOLCHAIN_FILE="$build.toolchain.cmake" -DINFINITY_BUILD_SELFTEST=ON >/dev/null
cmake --build "$build"
QEMU_LD_PREFIX=/usr/aarch64-linux-gnu qemu-aarch64 "$build/native/adam_selftest"
