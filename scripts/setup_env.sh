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
# The source tree's content (and this script, which lists the dependencies):
# when the installed package was built from the same, nothing is reinstalled.
src_hash="$(cd "$root" && find infinity native CMakeLists.txt pyproject.toml scripts/setup_env.sh -type f \
  ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
stamp="$venv/.infinity-source-sha256"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$src_hash" ] && "$vpy" -c "import infinity" >/dev/null 2>&1; then
  echo "[setup] infinity is installed from this source tree already (sha256 ${src_hash:0:12}); skipping the build"
  exit 0
fi
"$vpy" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $torch_spec"
  "$vpy" -m pip install -q "$torch_spec"
fi
rm -f "$stamp"
echo "[setup] building and installing infinity (native library via CMake)"
# accelerate, peft: the Hugging Face Trainer and LoRA tests (infinity.integrations.hf); matplotlib: `infinity report`
# and its test (the package's `plot` extra); tqdm, psutil: `infinity train`; expecttest: torch's own optimizer
# test inputs (torch.testing._internal.common_optimizers, tests/optim/test_adam_optim_db.py)
"$vpy" -m pip install -q scikit-build-core cmake ninja pytest numpy "transformers==5.24.0" "accelerate==1.15.0" \
  "peft==0.21.2" matplotlib tqdm psutil "expecttest==0.3.0"
"$vpy" -m pip install -q --no-build-isolation "$root"
"$vpy" -c "import infinity, json; print('[setup] infinity.system.native.info():', json.dumps(infinity.system.native.info()))"
echo "$src_hash" > "$stamp"
