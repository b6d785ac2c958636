"""``infinity doctor [--swap-path P ...] [CONFIG]``: checks each swap path
(exists or can be created, filesystem, O_DIRECT and alignment, free space
against the run's need, read/write bandwidth, lock) and the system (memlock
limit and pinning, native library and SIMD level, io_uring, CUDA). Prints a
table of OK/WARN/FAIL with a fix per problem; exit status 1 on any FAIL.

Nothing is left behind: the probes run in a temporary directory made in the
swap path (or, when it is missing, in its nearest existing parent) and
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any, List, Optional


from ..config.runtime import Config, format_bytes, parse_bytes
from .common import UsageError
from .estimate import nvme_need
from .doctor_checks import FAIL, OK, WARN, Check, check_bandwidth, check_cuda, check_direct, check_fs, \
    check_lock, check_memlock, check_native, check_path, check_space, free_bytes

PROBE_BYTES = 64 << 20


def add_parser(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check swap paths and the system before a run", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="run file or DeepSpeed JSON: its swap paths and NVMe need")
    p.add_argument("--swap-path", action="append", default=[], metavar="P", help="a swap path (repeatable)")
    p.add_argument("--need", help="bytes the run puts on NVMe in all (e.g. 200GiB), shared by the paths")
    p.add_argument("--probe-bytes", default=str(PROBE_BYTES), help="bandwidth probe size (default 64MiB)")
    p.add_argument("--profile", metavar="OUT.json", help="measure this machine's speeds for `infinity estimate "
                   "--time` (under a minute) and write them to OUT.json, instead of the checks")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="compute dtype to profile (default: the "
                   "run file's, else bf16)")
    p.set_defaults(run=run)


def diagnose_path(path: str, need: Optional[int], probe_bytes: int, block_size: int) -> List[Check]:
    """Every check of one swap path; the temporary probe directory is removed."""
    rows, base = check_path(path)
    if base is None:
        return rows + check_lock(path)
    rows += check_fs(path, base)
    if any(r.status == FAIL for r in rows):
        return rows + check_lock(path)
    probe = tempfile.mkdtemp(prefix=".infinity-doctor-", dir=base)
    try:
        rows += check_direct(path, probe)
        rows += check_space(path, base, need)
        rows += _bandwidth(path, probe, probe_bytes, block_size, free_bytes(base))
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return rows + check_lock(path)


def _bandwidth(path: str, probe: str, probe_bytes: int, block_size: int, free: int) -> List[Check]:
    """The bandwidth row, its probe (and blocks) sized to at most half the free
    space: a nearly full disk is measured with less, not failed by the probe."""
    room = free // 2 // 4096 * 4096
    block_size = min(block_size, max(room, 4096))
    size = min(probe_bytes, room // block_size * block_size)
    if size < 4096:
        return [Check(path, "bandwidth", WARN, f"not measured: {format_bytes(free)} free",
                      "free space on this filesystem: a run cannot write its swap files either")]
    try:
        rows = check_bandwidth(path, probe, size, block_size)
    except Exception as exc:  # noqa: BLE001 - reported as a row, the other checks still run
        return [Check(path, "bandwidth", FAIL, f"the {format_bytes(size)} probe failed: {type(exc).__name__}: "
                      f"{exc}", "fix what the error names; a run on this path would meet it too")]
    if size < probe_bytes:
        rows[0].detail += f"; probe shrunk from {format_bytes(probe_bytes)} to half the free space"
    return rows


def render(rows: List[Check]) -> str:
    """The table: target, check, status, detail; then the fixes."""
    w1 = max(len(r.target) for r in rows)
    w2 = max(len(r.name) for r in rows)
    lines = [f"{'TARGET':{w1}}  {'CHECK':{w2}}  STATUS  DETAIL"]
    lines += [f"{r.target:{w1}}  {r.name:{w2}}  {r.status:6}  {r.detail}" for r in rows]
    fixes = [r for r in rows if r.status != OK and r.fix]
    if fixes:
        lines += ["", "fixes:"] + [f"  [{r.status}] {r.target} {r.name}: {r.fix}" for r in fixes]
    return "\n".join(lines)


def write_profile(out: str, config: Config, paths: List[str], dtype: str) -> int:
    """Measures the profile (cli/profile_measure.py) on the config's device, writes it to ``out``; 0."""
    from ..engine.plan.estimator import compute_device
    from .profile_measure import measure_profile
    dev = compute_device(config)
    for p in paths:
        os.makedirs(p, exist_ok=True)
    prof = measure_profile(dev, dtype, paths, config.num_threads)
    with open(out, "w") as f:
        f.write(prof.to_json())
    best = max(r for pts in prof.gemm_flops.values() for _, r in pts)
    print(f"profile of {dev.type} in {dtype} written to {out} in {prof.extra['seconds_to_measure']} s: GEMM up to "
          f"{best / 1e9:.1f} GFLOP/s, memory {prof.mem_bw / 1e9:.1f} GB/s, op {prof.op_overhead_s * 1e6:.0f} us, "
          f"h2d {prof.h2d_bw / 1e9:.1f} GB/s, d2h {prof.d2h_bw / 1e9:.1f} GB/s, AdamW "
          f"{prof.adamw_params_per_s['fp32'] / 1e6:.0f} M params/s, disk read {prof.disk_read_bw / 1e9:.2f} GB/s "
          f"write {prof.disk_write_bw / 1e9:.2f} GB/s; interference {prof.slow}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs every check, prints the table; 1 if any FAIL, else 0."""
    config, need = Config(), None
    if args.config:
        config, need = nvme_need(args.config)
    paths = args.swap_path or list(config.swap_paths)
    try:
        if args.need is not None:
            need = parse_bytes(args.need, "--need")
        probe = parse_bytes(args.probe_bytes, "--probe-bytes")
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if args.profile:
        return write_profile(args.profile, config, paths, args.dtype or (config.dtype if args.config else "bf16"))
    share = None if need is None else -(-need // len(paths))
    block = min(int(config.swap_block_size), 8 << 20)
    rows: List[Check] = []
    for p in paths:
        t0 = time.perf_counter()
        rows += diagnose_path(p, share, max(block, probe - probe % block), block)
        rows.append(Check(p, "doctor time", OK, f"{time.perf_counter() - t0:.2f} s"))
    host = config.host_memory if isinstance(config.host_memory, int) else None
    rows += check_memlock(host) + check_native() + check_cuda()
    print(render(rows))
    fails = sum(r.status == FAIL for r in rows)
    warns = sum(r.status == WARN for r in rows)
    print(f"\n{fails} FAIL, {warns} WARN" + (f"; NVMe need {format_bytes(need)} over {len(paths)} path(s)"
                                             if need else ""))
    return 1 if fails else 0
