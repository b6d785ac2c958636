#!/usr/bin/env python3
"""Runs the same small training several times and compares the results
bitwise: any difference (or error, or hang) is a race. Used to find the
staging race of [Note: a handle under submission] (1 run in 30-60 differed
before the fix, 0 in 240 after).

Usage: python scripts/bench/repeat_check.py [--params nvme --opt nvme --overlap backward --trials 30 --block 4096]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import infinity  # noqa: E402
from paging_zoo import Chain, base_config  # noqa: E402


def run(args, swap: str) -> dict:
    torch.manual_seed(0)
    cfg = infinity.Config(**base_config(offload_params=args.params, offload_optimizer=args.opt, overlap=args.overlap,
                                        device_memory=1 << 20, swap_paths=[swap], swap_block_size=args.block))
    m, o = infinity.initialize(Chain([32, 16, 64, 8]), cfg, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    try:
        for _ in range(args.steps):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
            m(x, y).backward()
            o.step()
            o.zero_grad()
        return infinity.full_state_dict(m)
    finally:
        infinity.close(m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="nvme", help="offload_params: none, host or nvme")
    ap.add_argument("--opt", default="nvme", help="offload_optimizer: host or nvme")
    ap.add_argument("--overlap", default="backward", help="step, backward or delayed")
    ap.add_argument("--trials", type=int, default=30, help="runs compared with the first")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    ap.add_argument("--block", type=int, default=4096, help="swap_block_size in bytes (small: more staging)")
    ap.add_argument("--hang-s", type=int, default=60, help="seconds a run may take before stacks are dumped")
    args = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        ref = run(args, os.path.join(tmp, "ref"))
        for t in range(args.trials):
            faulthandler.dump_traceback_later(args.hang_s, exit=True)
            try:
                out = run(args, os.path.join(tmp, "t"))
                diff = max((out[k] - ref[k]).abs().max().item() for k in out)
            except Exception:  # noqa: BLE001 - reported and counted
                traceback.print_exc()
                diff = float("inf")
            faulthandler.cancel_dump_traceback_later()
            if diff != 0.0:
                bad += 1
                print(f"trial {t}: max difference {diff}")
    print(f"{args.params}/{args.opt} overlap={args.overlap} block={args.block}: {bad} of {args.trials} runs differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
