#!/usr/bin/env bash
# The main job of the README: sets up ./.venv from nothing if needed, then
# trains a model whose state is ~10x the device budget through infinity
# (scripts/demo.py; arguments are passed on).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${INFINITY_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" scripts/demo.py "$@"
