#!/usr/bin/env bash
# The main job of the README: sets up ./.venv from nothing if needed, then runs
# the CPU AdamW benchmark (later: the out-of-core training demo).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${INFINITY_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" scripts/bench_adam.py "$@"
