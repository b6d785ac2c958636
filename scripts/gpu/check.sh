#!/usr/bin/env bash
# The GPU checks in one command (CI runs its --dry-run: tests/integration/test_gpu_check_dry_run.py),
# for one short slot on a CUDA machine with no network. Stages, in order, each
# under its own `timeout` and logged to $OUT/stageN_<name>.log:
#   0 probe     versions, pinned pool close/re-open, pinned vs pageable GB/s   30 s
#   1 build     the native library (CMake) into $BUILD_DIR                    120 s
#   2 smoke     tests/engine/test_engine_cuda.py: "host and step" with
#               CUDA_LAUNCH_BLOCKING=1 (where async errors happen), then the
#               rest without it                                         120 + 180 s
#   3 race      scripts/gpu/race.py: lagged vs plain vs plain torch            90 s
#   4 sanitize  TORCH_CUDA_SANITIZER=1 scripts/gpu/race.py --sanitize          60 s
#   5 bench     scripts/bench/bench_train.py 24x1024, then a profiled small one 150 + 60 s
#   6 nccl      (if 60 s are left) world of one, zero_stage 2 and 1, over
#               nccl, then cpu:gloo,cuda:nccl                             60 + 60 s
# A failed stage never stops the later ones; a failed build makes them run
# with INFINITY_NATIVE=0. The whole run stops starting stages after
# --budget seconds (default 540) and cuts the last one's timeout to fit.
# At the end: one PASS/FAIL/SKIP line per stage with wall seconds, also in
# $OUT/summary.txt. Exit 1 if any stage failed.
#
# --dry-run: the same stages, tiny, on the CPU (seconds each), so CI proves
# this script and every Python entry point it calls; what needs CUDA is SKIP
# with the reason. --pip-install: also `pip install --no-build-isolation .`
# in stage 1 (done anyway when `import infinity` fails).
#
# Environment: OUT (default ./bench-results), PYTHON (default python3),
# BUILD_DIR (default ./build/gpu-native).
# Usage: bash scripts/gpu/check.sh [--dry-run] [--pip-install] [--budget SECONDS]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
dry=0 pip_install=0 budget=540
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --pip-install) pip_install=1 ;;
    --budget) budget="$2"; shift ;;
    *) echo "gpu/check.sh: unknown argument '$1' (use --dry-run, --pip-install, --budget SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
export OUT="${OUT:-$root/bench-results}" PY="${PYTHON:-python3}" BUILD_DIR="${BUILD_DIR:-$root/build/gpu-native}"
export ROOT="$root" DRY="$dry" PIP_INSTALL="$pip_install" PYTHONUNBUFFERED=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# A stage that runs out of time gets SIGABRT: with the fault handler on,
# every Python process in it prints all its threads' stacks (where it hung)
# before it dies. No core files: they would fill $OUT.
export PYTHONFAULTHANDLER=1
ulimit -c 0
mkdir -p "$OUT"
if [ "$dry" = 1 ]; then
  # Two shared cores: spinning kernel threads would slow each other ten-fold.
  export OMP_NUM_THREADS=1 INFINITY_NUM_THREADS=1 INFINITY_TEST_DEVICE=cpu
fi
# Timeouts inside a stage use --foreground: they then stay in the stage's
# process group, which the stage's own timeout signals as a whole.
# A stage writes $OUT/.stageN.note to add a remark to its summary line; exit
# status 77 means SKIP (the note says why).
note() { echo "$*" > "$OUT/.stage$STAGE.note"; }
export -f note

stage_probe() {
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/probe.py --device cpu --pool-mib 16 --copy-mib 8 --reps 2 --json "$OUT/probe.json"
  else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "$PY" scripts/gpu/probe.py --device cuda --json "$OUT/probe.json"
  fi
}

# tool NAME ATTR: NAME on PATH, else the binary of the pip package NAME (its
# folder is NAME.ATTR): a venv's cmake and ninja are not on PATH when the
# venv's python is called by path.
tool() {
  command -v "$1" 2>/dev/null && return 0
  "$PY" -c "import os, $1; p = os.path.join($1.$2, '$1'); assert os.access(p, os.X_OK); print(p)" 2>/dev/null
}
export -f tool

stage_build() {
  local gen=() check
  check="import infinity, json; assert infinity.system.native.available(); print(json.dumps(infinity.system.native.info()))"
  local lib="$BUILD_DIR/native/libinfinity_native.so"
  local cm nj
  cm=$(tool cmake CMAKE_BIN_DIR) || { echo "no cmake on PATH nor as a Python package"; return 1; }
  nj=$(tool ninja BIN_DIR) && gen=(-G Ninja "-DCMAKE_MAKE_PROGRAM=$nj")
  # Configure once; `cmake --build` reconfigures by itself when a CMakeLists changes.
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    "$cm" -S "$ROOT" -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null || return 1
  fi
  "$cm" --build "$BUILD_DIR" -j "$(nproc)" || return 1
  # One Python start in the usual case: the check fails only if the library
  # or the package does not load; pip runs only when the package is at fault.
  if [ "$PIP_INSTALL" = 1 ] || ! INFINITY_NATIVE_LIB="$lib" "$PY" -c "$check"; then
    if [ "$PIP_INSTALL" = 1 ] || ! "$PY" -c "import infinity"; then
      # --no-index: no network on the GPU machine, and a retrying pip would eat the slot.
      "$PY" -m pip install --no-build-isolation --no-index . || return 1
    fi
    INFINITY_NATIVE_LIB="$lib" "$PY" -c "$check" || return 1
  fi
  touch "$OUT/.native_ok"
}

stage_smoke() {
  local to=() rc=0
  # Thread method: a test hung inside a CUDA call never returns to Python for
  # the signal method; the thread method dumps every stack and ends pytest.
  "$PY" -c "import pytest_timeout" 2>/dev/null && to=(--timeout=90 --timeout-method=thread)
  CUDA_LAUNCH_BLOCKING=1 timeout --foreground -s ABRT -k 5 120 "$PY" -m pytest -x -q -p no:cacheprovider "${to[@]}" \
    tests/engine/test_engine_cuda.py -k "host and step" || rc=1
  timeout --foreground -s ABRT -k 5 180 "$PY" -m pytest -q -p no:cacheprovider "${to[@]}" tests/engine/test_engine_cuda.py \
    -k "not (host and step)" || rc=1
  [ "$DRY" = 1 ] && note "dry run: the CUDA tests ran on the CPU (INFINITY_TEST_DEVICE=cpu)"
  return $rc
}

stage_race() {
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/race.py --device cpu --steps 2 --depths 1 --json "$OUT/race.json"
  else
    "$PY" scripts/gpu/race.py --device cuda --json "$OUT/race.json"
  fi
}

stage_sanitize() {
  if [ "$DRY" = 1 ]; then
    # The sanitizer watches CUDA streams and kernels only; its cases still run here.
    "$PY" scripts/gpu/race.py --sanitize --device cpu --json "$OUT/sanitize.json" || return 1
    note "needs CUDA (TORCH_CUDA_SANITIZER); the --sanitize cases ran on the CPU without it"
    return 77
  fi
  TORCH_CUDA_SANITIZER=1 "$PY" scripts/gpu/race.py --sanitize --device cuda --json "$OUT/sanitize.json"
}

stage_bench() {
  local rc=0
  if [ "$DRY" = 1 ]; then
    timeout --foreground -s ABRT -k 5 60 "$PY" scripts/bench/bench_train.py --device cpu --layers 8 --embd 32 --heads 2 \
      --vocab 256 --seq 32 --batch 2 --steps 2 --no-sweep --prefetch-depth 1 --budget-frac 0.6 \
      --json "$OUT/bench_train.json" --profile "$OUT/bench_profile.json.gz" || rc=1
    note "dry run: one tiny run, profiled, on the CPU (CUDA memory and pinned-copy numbers need CUDA)"
    return $rc
  fi
  timeout --foreground -s ABRT -k 5 150 "$PY" scripts/bench/bench_train.py --device cuda --layers 24 --embd 1024 \
    --vocab 32000 --seq 512 --batch 8 --steps 6 --no-sweep --json "$OUT/bench_train_cuda.json" || rc=1
  timeout --foreground -s ABRT -k 5 60 "$PY" scripts/bench/bench_train.py --device cuda --layers 8 --embd 1024 \
    --vocab 32000 --seq 512 --batch 8 --steps 2 --no-sweep --json "$OUT/bench_train_cuda_small.json" \
    --profile "$OUT/bench_profile_cuda.json.gz" || rc=1
  return $rc
}

stage_nccl() {
  local rc=0
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/race.py --dist gloo --device cpu --steps 2 --json "$OUT/zero2_gloo.json" || rc=1
    note "dry run: gloo on the CPU (NCCL needs CUDA)"
    return $rc
  fi
  # The documented backend first (review D1 predicts a failure), then the mixed one.
  timeout --foreground -s ABRT -k 5 60 "$PY" scripts/gpu/race.py --dist nccl --device cuda \
    --json "$OUT/zero2_nccl.json" || rc=1
  timeout --foreground -s ABRT -k 5 60 "$PY" scripts/gpu/race.py --dist cpu:gloo,cuda:nccl --device cuda \
    --json "$OUT/zero2_mixed.json" || rc=1
  return $rc
}
export -f stage_probe stage_build stage_smoke stage_race stage_sanitize stage_bench stage_nccl

t_start=$SECONDS
failed=0
: > "$OUT/summary.txt"
record() {  # record N NAME STATUS SECONDS [NOTE]
  local line
  line=$(printf "stage %s %-9s %-4s %4s s%s" "$1" "$2" "$3" "$4" "${5:+  ($5)}")
  echo "$line" >> "$OUT/summary.txt"
  [ "$3" = FAIL ] && failed=1
  return 0
}

# run_stage N NAME LIMIT [MIN_LEFT]: runs stage_NAME under `timeout`, unless
# fewer than MIN_LEFT seconds of the budget are left.
run_stage() {
  local n=$1 name=$2 limit=$3 min_left=${4:-10} left rc t0 status extra=""
  left=$(( budget - (SECONDS - t_start) ))
  if [ "$left" -lt "$min_left" ]; then
    record "$n" "$name" SKIP 0 "no time left: ${left} s of the ${budget} s budget"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  rm -f "$OUT/.stage$n.note"
  echo "=== stage $n $name (timeout ${limit} s) ==="
  t0=$SECONDS
  STAGE=$n timeout -s ABRT -k 10 "$limit" bash -c "stage_$name" 2>&1 | tee "$OUT/stage${n}_${name}.log"
  rc=$?
  case $rc in
    0) status=PASS ;;
    77) status=SKIP ;;
    124|137) status=FAIL; extra="timed out after ${limit} s" ;;
    *) status=FAIL; extra="exit status $rc" ;;
  esac
  [ -f "$OUT/.stage$n.note" ] && extra="${extra:+$extra; }$(cat "$OUT/.stage$n.note")"
  rm -f "$OUT/.stage$n.note"
  record "$n" "$name" "$status" $(( SECONDS - t0 )) "$extra"
}

run_stage 0 probe 30
rm -f "$OUT/.native_ok"
run_stage 1 build 120
if [ -f "$OUT/.native_ok" ]; then
  export INFINITY_NATIVE_LIB="$BUILD_DIR/native/libinfinity_native.so"
else
  export INFINITY_NATIVE=0
  echo "no native library from stage 1: the later stages run with INFINITY_NATIVE=0 (pure-torch AdamW)"
fi
rm -f "$OUT/.native_ok"
run_stage 2 smoke 300
run_stage 3 race 90
run_stage 4 sanitize 60
run_stage 5 bench 210
run_stage 6 nccl 120 60

echo "total $(( SECONDS - t_start )) s of the ${budget} s budget" >> "$OUT/summary.txt"
echo "=== summary (${OUT}/summary.txt) ==="
cat "$OUT/summary.txt"
exit $failed
