#!/usr/bin/env bash
# GPU checks in one go, for a machine with CUDA: the CUDA tests, then the
# training and AdamW benchmarks on the GPU machine. Writes logs and JSON to
# ${OUT:-bench-results}. Usage: bash scripts/gpu_check.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/bench-results}"
mkdir -p "$out"
cd "$root"
if ! python3 -c "import torch" 2>/dev/null; then
  bash scripts/setup_env.sh
  py="$root/.venv/bin/python"
else
  python3 -m pip install -q --no-build-isolation scikit-build-core cmake ninja pytest numpy >/dev/null 2>&1
  python3 -m pip install -q --no-build-isolation . || exit 1
  py=python3
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
"$py" -c "import torch, infinity, json; print(torch.__version__, torch.cuda.is_available()); print(json.dumps(infinity.native.info()))" | tee -a "$out/gpu.txt"
status=0
"$py" -m pytest -q tests/test_engine_cuda.py 2>&1 | tee "$out/gpu_tests.log" || status=1
"$py" scripts/bench_train.py --device cuda --layers 24 --embd 1024 --vocab 32000 --seq 512 --batch 8 \
  --steps 8 --no-sweep --json "$out/bench_train_cuda.json" 2>&1 | tee "$out/bench_train_cuda.log" || status=1
"$py" scripts/bench_adam.py --sizes 1e8 --rounds 5 --json "$out/bench_adam_gpu_host.json" 2>&1 \
  | tee "$out/bench_adam_gpu_host.log" || status=1
exit $status
