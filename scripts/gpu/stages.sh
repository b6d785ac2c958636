# The stages of scripts/gpu/check.sh (sourced by it; see its header for the
# plan). Each stage_NAME runs in its own bash under the stage's cap, writes its
# figures into $WORK, and with $DRY=1 runs tiny on the CPU. Exit status 77:
# SKIP (note says why). $STAGE_LIMIT is the stage's cap in seconds.

# bounded SECONDS CMD...: CMD under its own timeout inside the stage (ABRT
# first: the fault handler prints where Python hung).
bounded() {
  local s=$1
  shift
  timeout --foreground -s ABRT -k 5 "$s" "$@"
}

stage_probe() {
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/probe.py --device cpu --pool-mib 16 --copy-mib 8 --reps 2 --json "$WORK/probe.json"
    return
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm \
    --format=csv || true
  nvidia-smi topo -m 2>/dev/null | head -5 || true
  { echo "nproc $(nproc)"; echo "ulimit -l $(ulimit -l)"; df -h . /tmp; lscpu; cat /proc/meminfo; } > "$WORK/host.txt" 2>&1
  bounded 15 "$PY" scripts/gpu/probe.py --device cuda --json "$WORK/probe.json"
}

# tool NAME ATTR: NAME on PATH, else the binary of the pip package NAME (its
# folder is NAME.ATTR): a venv's cmake and ninja are not on PATH when the
# venv's python is called by path.
tool() {
  command -v "$1" 2>/dev/null && return 0
  "$PY" -c "import os, $1; p = os.path.join($1.$2, '$1'); assert os.access(p, os.X_OK); print(p)" 2>/dev/null
}

stage_build() {
  local gen=() check cm nj lib="$BUILD_DIR/native/libinfinity_native.so"
  check="import infinity, json; assert infinity.system.native.available(); print(json.dumps(infinity.system.native.info()))"
  cm=$(tool cmake CMAKE_BIN_DIR) || { echo "no cmake on PATH nor as a Python package"; return 1; }
  nj=$(tool ninja BIN_DIR) && gen=(-G Ninja "-DCMAKE_MAKE_PROGRAM=$nj")
  # Configure once; `cmake --build` reconfigures by itself when a CMakeLists changes.
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    "$cm" -S "$ROOT" -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null || return 1
  fi
  "$cm" --build "$BUILD_DIR" -j "$(nproc)" || return 1
  if [ "$PIP_INSTALL" = 1 ] || ! INFINITY_NATIVE_LIB="$lib" "$PY" -c "$check" > "$WORK/native_info.json"; then
    if [ "$PIP_INSTALL" = 1 ] || ! "$PY" -c "import infinity"; then
      # --no-index: no network on the GPU machine, and a retrying pip would eat the slot.
      "$PY" -m pip install --no-build-isolation --no-index . || return 1
    fi
    INFINITY_NATIVE_LIB="$lib" "$PY" -c "$check" > "$WORK/native_info.json" || return 1
  fi
  cat "$WORK/native_info.json"
  touch "$WORK/.native_ok"
  if [ "$DRY" = 1 ]; then
    note "dry run: the kernel self-test runs in CI's own suite (tests/optim)"
    return 0
  fi
  # The kernel self-test on this machine's CPU (its SIMD levels differ from CI's).
  INFINITY_NATIVE_LIB="$lib" bounded $(( STAGE_LIMIT / 2 )) "$PY" -m pytest -q -p no:cacheprovider \
    tests/optim/test_adam_native.py -k "simd_variant or info_fields or fallback or env_var" \
    --junitxml="$WORK/selftest.xml"
}

stage_smoke() {
  local to=() k=()
  # Thread method: a test hung inside a CUDA call never returns to Python for
  # the signal method; the thread method dumps every stack and ends pytest.
  "$PY" -c "import pytest_timeout" 2>/dev/null && to=(--timeout=45 --timeout-method=thread)
  if [ "$DRY" = 1 ]; then
    k=(-k "parity and host and step")
    note "dry run: one CUDA test ran on the CPU (INFINITY_TEST_DEVICE=cpu)"
  fi
  bounded $(( STAGE_LIMIT - 5 )) "$PY" -m pytest -q -p no:cacheprovider "${to[@]}" "${k[@]}" --durations=5 \
    --junitxml="$WORK/smoke.xml" tests/engine/test_engine_cuda.py
}

stage_race() {
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/race.py --device cpu --models gpt --dtypes fp32 --steps 2 --depths 1 --json "$WORK/race.json"
    return
  fi
  # Depth 1 alone: the tightest arena, where refetches into other ranges happen (review A1).
  "$PY" scripts/gpu/race.py --device cuda --depths 1 --json "$WORK/race.json"
}

stage_nccl() {
  local rc=0 half=$(( (STAGE_LIMIT - 5) / 2 ))
  set -o pipefail
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/race.py --dist gloo --device cpu --steps 2 --zero 3,2,1 --json "$WORK/nccl.json" || rc=1
    note "dry run: gloo on the CPU (NCCL needs CUDA)"
    return $rc
  fi
  # NCCL_DEBUG=VERSION: NCCL prints its version when a communicator starts, the proof that it ran.
  NCCL_DEBUG=VERSION bounded "$half" "$PY" scripts/gpu/race.py --dist nccl --device cuda --steps 3 --zero 3,2,1 \
    --json "$WORK/nccl.json" 2>&1 | tee "$WORK/nccl_run.log" || rc=1
  NCCL_DEBUG=VERSION bounded "$half" "$PY" scripts/gpu/race.py --dist cpu:gloo,cuda:nccl --device cuda --steps 3 \
    --zero 3 --json "$WORK/nccl_mixed.json" 2>&1 | tee -a "$WORK/nccl_run.log" || rc=1
  if grep -q "NCCL version" "$WORK/nccl_run.log"; then
    note "NCCL ran: $(grep -o 'NCCL version [^ ]*' "$WORK/nccl_run.log" | head -1); a world of one (NCCL refuses 2 ranks on 1 GPU)"
  else
    note "no NCCL communicator started: ZeRO 3's gathers did not reach NCCL"
    rc=1
  fi
  return $rc
}

stage_bench() {
  local args=(--json "$WORK/bench_gpu.json" --profile "$WORK/profile.json.gz" --budget-s $(( STAGE_LIMIT - 15 )))
  if [ "$DRY" = 1 ]; then
    "$PY" scripts/gpu/bench_gpu.py --dry-run "${args[@]}"
    return
  fi
  # Swap files on the disk under the tree (build/ is ignored), not in /tmp, which may be RAM.
  mkdir -p "${SWAP_DIR:=$ROOT/build/bench-swap}"
  "$PY" scripts/gpu/bench_gpu.py --swap-dir "$SWAP_DIR" "${args[@]}"
}

stage_sanitize() {
  if [ "$DRY" = 1 ]; then
    # The sanitizer watches CUDA streams and kernels only; its cases still run here.
    "$PY" scripts/gpu/race.py --sanitize --device cpu --json "$WORK/sanitize.json" || return 1
    note "needs CUDA (TORCH_CUDA_SANITIZER); the --sanitize cases ran on the CPU without it"
    return 77
  fi
  TORCH_CUDA_SANITIZER=1 "$PY" scripts/gpu/race.py --sanitize --device cuda --json "$WORK/sanitize.json"
}

export -f bounded tool stage_probe stage_build stage_smoke stage_race stage_nccl stage_bench stage_sanitize
