#!/usr/bin/env bash
# The main job of the README: sets up ./.venv from nothing if needed, then
# trains a model larger than the host and device budgets through infinity,
# with NVMe swap files in ./infinity-swap
# (scripts/demo.py; arguments are passed on).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${INFINITY_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" scripts/demo.py "$@"
