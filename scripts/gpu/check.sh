#!/usr/bin/env bash
# The GPU check in one command, for one short slot on a CUDA machine with no
# network (about 15 minutes of device time, its start included). Run from the
# repository root of the working tree the device tool carries; the package is
# served from the tree (PYTHONPATH), the native library built here by CMake.
#
# Stages in the order issue 36 sets (what a short slot must bring back first:
# the facts, a build, a smoke run, then the bench's figures; the ordering
# checks after), each under its own cap (seconds):
#   probe     20  machine facts (nvidia-smi, meminfo, CPUs, ulimit -l, disk, NCCL and
#                 torchao versions), pinned pool close/re-open, pinned vs pageable GB/s
#   build     50  the native library (CMake) into $BUILD_DIR, and its kernel self-test
#                 on this CPU (tests/optim/test_adam_native.py: every SIMD level
#                 bit-identical to scalar)
#   smoke     70  tests/engine/test_engine_cuda.py, one pytest run on the device:
#                 copy streams, events and lagged compute against plain torch
#   bench    170  scripts/gpu/bench_gpu.py: torch, infinity (3 placements), torchao,
#                 FSDP2 CPUOffloadPolicy, bf16 interleaved, then fp32 if time is left
#   race      45  scripts/gpu/race.py: GPT and UnequalNet at the minimum budget, fp32 and
#                 bf16, with and without a GPU lag, against plain torch
#   sanitize  30  TORCH_CUDA_SANITIZER=1 race.py --sanitize (weak evidence: CSAN
#                 matches exact data_ptr()s, so only each unit's first slot)
#   nccl      35  race.py --dist nccl, a world of one: ZeRO 3 (its gathers run through
#                 NCCL on the side stream), 2 and 1; then cpu:gloo,cuda:nccl with ZeRO 3.
#                 One process: NCCL refuses two ranks on one GPU ("Duplicate GPU detected")
# The caps add up to the default --budget of 420 s: with the machine's start
# (1-2 minutes) the run leaves room for a targeted rerun (--only) inside the
# slot. --plan prints this plan and exits (1 when the caps exceed the budget).
# On the device tool: run(command="bash scripts/gpu/check.sh", timeout_s=480,
# carry=[".whl"]) (.whl only after scripts/gpu/carry_wheels.sh); a rerun:
# command="bash scripts/gpu/check.sh --only bench" while the machine is warm.
#
# Results: every stage writes its log and figures (JSON) into $WORK; after
# every stage $OUT/gpu_check.tgz (all of $WORK) and $OUT/summary.txt are
# rewritten, so a run killed by its limit still returns what it did; the
# bench's profile is $OUT/profile.json.gz. Three files at most in $OUT (the
# device tool returns 8). The summary has one PASS/FAIL/SKIP line per stage
# with its wall seconds. A failed stage never stops the later ones; a failed
# build makes them run with INFINITY_NATIVE=0. Exit 1 if any stage failed.
#
# --only STAGE[,STAGE]: those stages alone (a rerun); build is added when a
# later stage needs the library and none is built. --dry-run: the same stages,
# tiny, on the CPU (CI runs a subset: tests/integration/test_gpu_check_dry_run.py);
# what needs CUDA is SKIP with the reason. --pip-install: also `pip install
# --no-build-isolation --no-index .` in the build stage.
# Wheels in ./.whl (scripts/gpu/carry_wheels.sh: torchao) are installed
# offline into /tmp/site first.
#
# Environment: OUT (default ./bench-results), WORK (default /tmp/gpu-check-work),
# PYTHON (default python3), BUILD_DIR (default ./build/gpu-native).
# Usage: bash scripts/gpu/check.sh [--dry-run] [--only STAGES] [--budget SECONDS] [--plan] [--pip-install]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
STAGES=(probe build smoke bench race sanitize nccl)
CAPS=(20 50 70 170 45 30 35)
dry=0 pip_install=0 budget=420 only="" plan=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --pip-install) pip_install=1 ;;
    --budget) budget="$2"; shift ;;
    --only) only="$2"; shift ;;
    --plan) plan=1 ;;
    *) echo "gpu/check.sh: unknown argument '$1' (use --dry-run, --only STAGES, --budget SECONDS, --plan, --pip-install)" >&2
       exit 2 ;;
  esac
  shift
done
for s in ${only//,/ }; do
  [[ " ${STAGES[*]} " == *" $s "* ]] || { echo "gpu/check.sh: --only: no stage '$s' (stages: ${STAGES[*]})" >&2; exit 2; }
done
selected() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }

if [ "$plan" = 1 ]; then
  total=0
  echo "stage     cap s  starts by"
  for i in "${!STAGES[@]}"; do
    selected "${STAGES[$i]}" || continue
    printf "%-9s %5d  %5d\n" "${STAGES[$i]}" "${CAPS[$i]}" "$total"
    total=$(( total + CAPS[i] ))
  done
  echo "total $total s of the $budget s budget; device tool timeout_s $(( budget + 60 ))"
  [ "$total" -le "$budget" ]
  exit $?
fi

t_start=$SECONDS  # the budget counts from here: the wheels' install is inside it
export OUT="${OUT:-$root/bench-results}" WORK="${WORK:-/tmp/gpu-check-work}" PY="${PYTHON:-python3}"
export BUILD_DIR="${BUILD_DIR:-$root/build/gpu-native}"
export ROOT="$root" DRY="$dry" PIP_INSTALL="$pip_install" PYTHONUNBUFFERED=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# A stage that runs out of time gets SIGABRT: with the fault handler on,
# every Python process in it prints all its threads' stacks (where it hung)
# before it dies. No core files: they would fill the disk.
export PYTHONFAULTHANDLER=1
ulimit -c 0
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
rm -f "$OUT/gpu_check.tgz" "$OUT/summary.txt" "$OUT/profile.json.gz"
if [ "$dry" = 1 ]; then
  # Two shared cores: spinning kernel threads would slow each other ten-fold.
  export OMP_NUM_THREADS=1 INFINITY_NUM_THREADS=1 INFINITY_TEST_DEVICE=cpu
  # The caps are the GPU run's plan. A dry run proves code paths, not speed,
  # on shared CI cores where a Python start alone can take 10 s: ten times the
  # caps and the budget, so that time never decides its outcome.
  budget=$(( budget * 10 ))
  for i in "${!CAPS[@]}"; do CAPS[i]=$(( CAPS[i] * 10 )); done
elif ls "$root"/.whl/*.whl >/dev/null 2>&1; then
  # No network there: carried wheels only, never an index.
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$root"/.whl/*.whl > "$WORK/wheels.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# A stage writes $WORK/.note to add a remark to its summary line; exit status
# 77 means SKIP (the note says why). Timeouts inside a stage use --foreground:
# they stay in the stage's process group, which the stage's timeout signals.
note() { echo "$*" >> "$WORK/.note"; }
export -f note
# shellcheck source=scripts/gpu/stages.sh
source "$root/scripts/gpu/stages.sh"

failed=0
: > "$WORK/summary.txt"
pack() {  # the results into $OUT: the tarball (rewritten whole), the summary, the profile
  local part="${TMPDIR:-/tmp}/gpu_check.tgz.part"
  cp "$WORK/summary.txt" "$OUT/summary.txt"
  [ -f "$WORK/profile.json.gz" ] && cp "$WORK/profile.json.gz" "$OUT/profile.json.gz"
  tar -czf "$part" -C "$WORK" --exclude=profile.json.gz . && mv -f "$part" "$OUT/gpu_check.tgz"
}
record() {  # record N NAME STATUS SECONDS [NOTE]
  printf "stage %s %-9s %-4s %4s s%s\n" "$1" "$2" "$3" "$4" "${5:+  ($5)}" >> "$WORK/summary.txt"
  [ "$3" = FAIL ] && failed=1
  return 0
}

# run_stage N NAME CAP: stage_NAME under `timeout`, its cap cut to the budget
# left; SKIP when fewer than 10 s are left.
run_stage() {
  local n=$1 name=$2 limit=$3 left rc t0 status extra=""
  left=$(( budget - (SECONDS - t_start) ))
  if [ "$left" -lt 10 ]; then
    record "$n" "$name" SKIP 0 "no time left: ${left} s of the ${budget} s budget"
    pack
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  rm -f "$WORK/.note"
  echo "=== stage $n $name (cap ${limit} s) ==="
  t0=$SECONDS
  STAGE_LIMIT=$limit timeout -s ABRT -k 5 "$limit" bash -c "stage_$name" 2>&1 | tee "$WORK/stage${n}_${name}.log"
  rc=$?
  case $rc in
    0) status=PASS ;;
    77) status=SKIP ;;
    124|134|137) status=FAIL; extra="timed out after ${limit} s" ;;
    *) status=FAIL; extra="exit status $rc" ;;
  esac
  [ -f "$WORK/.note" ] && extra="${extra:+$extra; }$(paste -sd';' "$WORK/.note")"
  rm -f "$WORK/.note"
  record "$n" "$name" "$status" $(( SECONDS - t0 )) "$extra"
  pack
}

lib="$BUILD_DIR/native/libinfinity_native.so"
if [ -n "$only" ] && ! selected build && [ "$dry" = 0 ] && [ ! -f "$lib" ] && [ "$only" != probe ]; then
  only="$only,build"  # the later stages need the library; none is built on this machine yet
elif [ -f "$lib" ] && ! selected build; then
  export INFINITY_NATIVE_LIB="$lib"  # built by an earlier run on this machine
fi
for i in "${!STAGES[@]}"; do
  name=${STAGES[$i]}
  selected "$name" || continue
  run_stage "$i" "$name" "${CAPS[$i]}"
  if [ "$name" = build ]; then
    if [ -f "$WORK/.native_ok" ]; then
      export INFINITY_NATIVE_LIB="$lib"
    else
      export INFINITY_NATIVE=0
      echo "no native library from the build stage: the later stages run with INFINITY_NATIVE=0 (pure-torch AdamW)"
    fi
  fi
done

echo "total $(( SECONDS - t_start )) s of the ${budget} s budget" >> "$WORK/summary.txt"
pack
# The bench's table again, last: only the end of the output is sure to come back.
for f in "$WORK"/stage*_bench.log; do
  [ -f "$f" ] && { echo "=== bench (end of $(basename "$f")) ==="; grep -v "^USDT" "$f" | tail -n 30; }
done
echo "=== summary ($OUT/summary.txt; logs and figures in $OUT/gpu_check.tgz) ==="
cat "$WORK/summary.txt"
exit $failed
