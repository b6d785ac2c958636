#!/usr/bin/env bash
# The main job of the README: sets up ./.venv from nothing if needed (skipped
# when the installed package matches the source tree), then trains a GPT on
# readable text through infinity with budgets smaller than its state and NVMe
# swap files in ./infinity-swap, beside plain PyTorch in the same run
# (scripts/demo.py; arguments are passed on, --help lists them).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${INFINITY_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" scripts/demo.py "$@"
