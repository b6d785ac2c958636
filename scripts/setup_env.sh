#!/usr/bin/env bash
# Creates ./.venv (if missing) with torch and infinity (native library built by
# the package's own CMake build). Idempotent; safe to run on a fresh machine.
#   INFINITY_VENV   venv folder (default: .venv in the repository root)
#   TORCH_SPEC      torch requirement (default: torch==2.13.0)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${INFINITY_VENV:-$root/.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating venv $venv"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
"$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $torch_spec"
  "$vpy" -m pip install -q "$torch_spec"
fi
echo "[setup] building and installing infinity (native library via CMake)"
# matplotlib: `infinity report` and its test (the package's `plot` extra); tqdm, psutil: `infinity train`
"$vpy" -m pip install -q scikit-build-core cmake ninja pytest numpy "transformers==5.24.0" matplotlib tqdm psutil
"$vpy" -m pip install -q --no-build-isolation "$root"
"$vpy" -c "import infinity, json; print('[setup] infinity.native.info():', json.dumps(infinity.native.info()))"
