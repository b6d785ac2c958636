#!/usr/bin/env bash
# The test command of the README: sets up ./.venv from nothing if needed, then
# runs the test suite (slow cases excluded; run them with `-m slow`). Arguments go on to
# pytest: `bash scripts/run_tests.sh tests/optim` runs that part alone.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
venv="${INFINITY_VENV:-$root/.venv}"
cd "$root"
exec "$venv/bin/python" -m pytest -q "$@"
