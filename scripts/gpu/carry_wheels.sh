#!/usr/bin/env bash
# Wheels the GPU machine lacks, into ./.whl (ignored by git) for the device
# tool to carry: name ".whl" in the run's carry list; scripts/gpu/check.sh
# installs them offline (pip --no-index --target /tmp/site) before its stages.
# Now only torchao, for the torchao row of scripts/gpu/bench_gpu.py
# (CPUOffloadOptimizer is pure Python: its C++ extensions need not match the
# machine's torch). Run here, where PyPI is reachable; about 3.4 MB.
# Usage: bash scripts/gpu/carry_wheels.sh [PYTHON]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
py="${1:-${PYTHON:-python3}}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || grep -qx '/.whl/' .gitignore || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
# The GPU machine runs CPython 3.12 on x86-64 (the device tool's notes).
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "torchao==0.18.0"
ls -l .whl
