#!/usr/bin/env python3
"""CPU AdamW throughput: infinity's native kernel against torch, in one run.

For each size (parameters) and layout (one flat tensor, or many 4M-element
tensors) it times, interleaved round by round so that memory-bandwidth drift
hits every method alike:

  probe_fp32      native read-modify-write probe, AdamW's fp32 traffic (28 B/param)
  ours_fp32       infinity.CPUAdamW.step()
  ours_fp32_sums  adamw_step_ that also takes the swap store's CRC32C sums of
                  the updated buffers (the NVMe optimizer's call; its ratio to
                  ours_fp32 is the price of those sums, paid here instead of by
                  a second pass over DRAM in the write-back)
  torch_fused     torch.optim.AdamW(fused=True).step()
  torch_foreach   torch.optim.AdamW(foreach=True).step()   (first rounds only: slow)
  probe_mixed     probe with bf16 grad in + bf16 copy out (28 B/param)
  ours_mixed      infinity.optim.adamw_step_(bf16 grads, outs=bf16)
  torch_fused+copy  torch fused AdamW (fp32 grads), then param.to(bf16) into a buffer
  probe_f32g_bf16o / ours_f32g_bf16o   fp32 grads + bf16 copy out (30 B/param)
  probe_m_bf16 / ours_m_bf16   ours_mixed with bf16 moments (20 B/param)
  probe_m_int8 / ours_m_int8   ours_mixed with block-scaled 8-bit moments
                  (16.06 B/param: codes + one fp32 scale per 256 per moment)
  ours_p_bf16_m_bf16 / ours_p_bf16_m_int8   a bf16 master (the bf16 parameter
                  itself, stochastic rounding; no copy-out) with bf16 moments
                  (14 B/param moved, 6 B/param of state) or 8-bit ones (10.06
                  B/param moved, 4.03 B/param of state), bf16 grads
  deepspeed       DeepSpeedCPUAdam, only when deepspeed is importable
  bnb_adamw8bit / torchao_adamw8bit   bitsandbytes' and torchao's AdamW8bit on
                  CPU tensors (fp32 grads; their own parameter copies), first
                  --q8-rounds rounds only (slow). Skipped, with the reason
                  printed, when not importable: they are not dependencies; run
                  this script with a Python that has them (e.g. a separate
                  venv, PYTHONPATH=. and INFINITY_NATIVE_LIB set).

All methods share the same parameter, gradient and moment buffers (so memory
use stays ~30 bytes a parameter with the low-bit moments' own), whose start addresses are staggered: equal
addresses modulo a large power of two cut bandwidth (../shared/README.md).

The probe runs the kernel's exact loads and stores with trivial arithmetic in
the same ISA and threads: its time is the memory roofline of this pattern.
Each timed call follows an untimed call of the same method (steady state;
see the comment in bench()). Figures are medians of per-round ratios. Prints a table, checks the issue's
targets, writes JSON.

Usage: python scripts/bench/bench_adam.py [--sizes 1e8,5e8] [--rounds 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import infinity  # noqa: E402
from infinity.system import native  # noqa: E402
from infinity.optim import CPUAdamW, adamw_step_, moments  # noqa: E402
from _common import write_json  # noqa: E402

STAGGER_ELEMS = 1040  # 4160 bytes: moves each buffer by one page + one cache line


def staggered(n: int, k: int, dtype=torch.float32) -> torch.Tensor:
    pad = STAGGER_ELEMS * k
    base = torch.empty(n + pad, dtype=dtype)
    return base[pad:pad + n]


def chunks(t: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [t[i:i + size] for i in range(0, t.numel(), size)]


class Setup:
    """Buffers and optimizers of one (size, layout) configuration."""

    def __init__(self, n: int, chunk: int | None, threads: int, with_foreach: bool):
        self.n = n
        gen = torch.Generator().manual_seed(0)
        self.p = staggered(n, 0)
        self.g = staggered(n, 1)
        self.m = staggered(n, 2)
        self.v = staggered(n, 3)
        self.gb = staggered(n, 4, torch.bfloat16)
        self.ob = staggered(n, 5, torch.bfloat16)
        for t in (self.p, self.g, self.m):
            t.normal_(generator=gen)
        self.m.mul_(0.01)
        self.v.uniform_(0.0, 1e-4, generator=gen)
        self.gb.copy_(self.g)
        size = chunk or n
        self.views = {name: chunks(getattr(self, name), size) for name in ("p", "g", "m", "v", "gb", "ob")}
        self.params = [torch.nn.Parameter(x, requires_grad=True) for x in self.views["p"]]
        for prm, g in zip(self.params, self.views["g"]):
            prm.grad = g
        kw = dict(lr=1e-7, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        self.ours = CPUAdamW(self.params, num_threads=threads, **kw)
        self.tfused = torch.optim.AdamW(self.params, fused=True, **kw)
        self.tforeach = torch.optim.AdamW(self.params, foreach=True, **kw) if with_foreach else None
        # One step each creates their state; then every optimizer is pointed at
        # the same moment buffers, so they all stream the same memory.
        for opt in filter(None, (self.ours, self.tfused, self.tforeach)):
            opt.step()
            for prm, m, v in zip(self.params, self.views["m"], self.views["v"]):
                st = opt.state[prm]
                st["exp_avg"], st["exp_avg_sq"] = m.view_as(prm), v.view_as(prm)
        self.threads = threads
        self.step = 10
        self.ds = None
        try:  # optional comparison, never a dependency
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore
            self.ds = DeepSpeedCPUAdam(self.params, adamw_mode=True, **kw)
            self.ds.step()
        except Exception:
            self.ds = None
        self.q8_opts = {}
        numel = [x.numel() for x in self.views["p"]]
        self.numels = (ctypes.c_int64 * len(numel))(*numel)
        self._low_bit_moments(n, size)

    def add_q8_baselines(self) -> None:
        """bitsandbytes' and torchao's CPU AdamW8bit on copies of the
        parameters (the shared fp32 grads), when importable; prints why not."""
        kw = dict(lr=1e-7, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        makers = {"bnb_adamw8bit": lambda ps: __import__("bitsandbytes").optim.AdamW8bit(ps, **kw),
                  "torchao_adamw8bit": lambda ps: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit(ps, **kw)}
        for name, make in makers.items():
            try:
                params = [torch.nn.Parameter(x.clone()) for x in self.views["p"]]
                for prm, g in zip(params, self.views["g"]):
                    prm.grad = g
                opt = make(params)
                opt.step()
                self.q8_opts[name] = opt
            except Exception as exc:  # optional comparison, never a dependency
                print(f"{name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")

    def _low_bit_moments(self, n: int, size: int) -> None:
        """bf16 and 8-bit copies of the moments, views per tensor (size is a
        multiple of the 8-bit block, so every view starts on a block)."""
        self.mb = staggered(n, 6, torch.bfloat16)
        self.vb = staggered(n, 7, torch.bfloat16)
        self.mq = staggered(n, 8, torch.uint8)
        self.vq = staggered(n, 9, torch.uint8)
        nb = moments.num_blocks(n)
        self.ms, self.vs = torch.empty(nb), torch.empty(nb)
        step = 1 << 22
        for i in range(0, n, step):  # slices of whole blocks: bounded temporaries
            st = moments.encode(self.m[i:i + step], self.v[i:i + step], "int8")
            b = i // moments.QBLOCK
            self.mq[i:i + step], self.vq[i:i + step] = st["exp_avg"], st["exp_avg_sq"]
            self.ms[b:b + st["exp_avg_scale"].numel()] = st["exp_avg_scale"]
            self.vs[b:b + st["exp_avg_sq_scale"].numel()] = st["exp_avg_sq_scale"]
            self.mb[i:i + step], self.vb[i:i + step] = self.m[i:i + step], self.v[i:i + step]
        self.pb = staggered(n, 10, torch.bfloat16)
        self.pb.copy_(self.p)
        for name in ("mb", "vb", "mq", "vq", "pb"):
            self.views[name] = chunks(getattr(self, name), size)
        self.views["ms"] = chunks(self.ms, moments.num_blocks(size))
        self.views["vs"] = chunks(self.vs, moments.num_blocks(size))

    def probe_moments(self, mdt: int) -> None:
        """The probe of the low-bit kernels (bf16 grads in, bf16 copy out)."""
        v = self.views
        m, s = ("mb", "vb") if mdt == native.DT_BF16 else ("mq", "vq")
        ptrs = [x.data_ptr() for k in ("p", "gb", m, s, "ob") for x in v[k]]
        k = len(v["p"])
        ptrs += [x.data_ptr() for x in v["ms"]] + [x.data_ptr() for x in v["vs"]] if mdt == native.DT_I8 else [0] * 2 * k
        arr = (ctypes.c_int64 * len(ptrs))(*ptrs)
        rc = native.lib().inf_probe_step_moments(native.selected_isa(), k, arr, self.numels, native.DT_BF16,
                                                 native.DT_BF16, mdt, self.threads)
        assert rc == 0

    def ours_moments(self, q8: bool) -> None:
        """ours_mixed (bf16 grads, bf16 copy out) over bf16 or 8-bit moments."""
        self.step += 1
        v = self.views
        m, s = ("mq", "vq") if q8 else ("mb", "vb")
        adamw_step_(v["p"], v["gb"], v[m], v[s], step=self.step, lr=1e-7, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, outs=v["ob"], num_threads=self.threads, validate=False,
                    exp_avg_scales=v["ms"] if q8 else None, exp_avg_sq_scales=v["vs"] if q8 else None)

    def ours_master(self, q8: bool) -> None:
        """A bf16 master (stochastic rounding), bf16 grads, bf16 or 8-bit moments."""
        self.step += 1
        v = self.views
        m, s = ("mq", "vq") if q8 else ("mb", "vb")
        adamw_step_(v["pb"], v["gb"], v[m], v[s], step=self.step, lr=1e-7, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, num_threads=self.threads, validate=False, seed=0,
                    streams=list(range(len(v["pb"]))),
                    exp_avg_scales=v["ms"] if q8 else None, exp_avg_sq_scales=v["vs"] if q8 else None)

    def probe(self, gname: str, oname: str | None) -> None:
        k = len(self.views["p"])
        ptrs = [x.data_ptr() for x in self.views["p"]] + [x.data_ptr() for x in self.views[gname]]
        ptrs += [x.data_ptr() for x in self.views["m"]] + [x.data_ptr() for x in self.views["v"]]
        ptrs += [x.data_ptr() for x in self.views[oname]] if oname else [0] * k
        arr = (ctypes.c_int64 * len(ptrs))(*ptrs)
        gdt = native.DT_F32 if gname == "g" else native.DT_BF16
        odt = native.DT_BF16 if oname else native.DT_NONE
        rc = native.lib().inf_probe_step(native.selected_isa(), k, arr, self.numels, gdt, odt, self.threads)
        assert rc == 0

    def ours_mixed(self, gname: str) -> None:
        self.step += 1
        v = self.views
        adamw_step_(v["p"], v[gname], v["m"], v["v"], step=self.step, lr=1e-7, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, outs=v["ob"], num_threads=self.threads, validate=False)

    def ours_sums(self) -> None:
        """fp32 step that also takes the swap store's sums of the updated
        buffers (what the NVMe optimizer runs; [Note: sums from the producer])."""
        self.step += 1
        v = self.views
        adamw_step_(v["p"], v["g"], v["m"], v["v"], step=self.step, lr=1e-7, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.01, num_threads=self.threads, validate=False, sum_chunk_bytes=256 << 10)

    def torch_fused_copy(self) -> None:
        self.tfused.step()
        torch._foreach_copy_(self.views["ob"], self.views["p"])

    def methods(self) -> dict:
        m = {
            "probe_fp32": lambda: self.probe("g", None),
            "ours_fp32": self.ours.step,
            "ours_fp32_sums": self.ours_sums,
            "torch_fused": self.tfused.step,
            "probe_mixed": lambda: self.probe("gb", "ob"),
            "ours_mixed": lambda: self.ours_mixed("gb"),
            "torch_fused+copy": self.torch_fused_copy,
            "probe_f32g_bf16o": lambda: self.probe("g", "ob"),
            "ours_f32g_bf16o": lambda: self.ours_mixed("g"),
            "probe_m_bf16": lambda: self.probe_moments(native.DT_BF16),
            "ours_m_bf16": lambda: self.ours_moments(False),
            "probe_m_int8": lambda: self.probe_moments(native.DT_I8),
            "ours_m_int8": lambda: self.ours_moments(True),
            "ours_p_bf16_m_bf16": lambda: self.ours_master(False),
            "ours_p_bf16_m_int8": lambda: self.ours_master(True),
        }
        if self.tforeach is not None:
            m["torch_foreach"] = self.tforeach.step
        if self.ds is not None:
            m["deepspeed"] = self.ds.step
        for name, opt in self.q8_opts.items():
            m[name] = opt.step
        return m


BYTES = {"probe_fp32": 28, "ours_fp32": 28, "ours_fp32_sums": 28, "torch_fused": 28, "torch_foreach": 28, "deepspeed": 28,
         "probe_mixed": 28, "ours_mixed": 28, "torch_fused+copy": 34, "probe_f32g_bf16o": 30, "ours_f32g_bf16o": 30,
         "probe_m_bf16": 20, "ours_m_bf16": 20, "probe_m_int8": 16 + 8 / moments.QBLOCK,
         "ours_m_int8": 16 + 8 / moments.QBLOCK,
         "ours_p_bf16_m_bf16": 14, "ours_p_bf16_m_int8": 10 + 8 / moments.QBLOCK,
         # fp32 grads in, no copy-out; their block scales left out of the count
         "bnb_adamw8bit": 16, "torchao_adamw8bit": 16}


def bench(n: int, chunk: int | None, rounds: int, threads: int, foreach_rounds: int, q8_rounds: int) -> dict:
    s = Setup(n, chunk, threads, with_foreach=foreach_rounds > 0)
    if q8_rounds > 0:
        s.add_q8_baselines()
    methods = s.methods()
    limit = {"torch_foreach": foreach_rounds, "bnb_adamw8bit": q8_rounds, "torchao_adamw8bit": q8_rounds}
    for f in methods.values():  # warm-up: page faults, thread start
        f()
    times = {k: [] for k in methods}
    names = list(methods)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            if r >= limit.get(k, rounds):
                continue
            # Untimed call first, so every timed call follows its own method:
            # right after a torch op, torch's OpenMP workers keep spinning for a
            # few ms and would slow whichever method ran next.
            methods[k]()
            t0 = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t0)
    for x in (s.p, s.m, s.v, s.ob, s.pb):
        assert torch.isfinite(x.float()).all(), "benchmark buffers went non-finite"

    def ratio(num, den):  # per-round ratio of den's time to num's time = num's speed / den's speed
        return statistics.median(b / a for a, b in zip(times[num], times[den]))

    def bw_fraction(k):  # k's bytes at probe_mixed's bandwidth over k's time, per round
        return statistics.median(BYTES[k] / BYTES["probe_mixed"] * p / t
                                 for p, t in zip(times["probe_mixed"], times[k]))

    res = {"params": n, "layout": "flat" if chunk is None else f"{chunk}-element tensors",
           "tensors": len(s.params), "rounds": rounds, "threads": threads, "methods": {}}
    for k, ts in times.items():
        med = statistics.median(ts)
        res["methods"][k] = {"median_s": med, "params_per_s": n / med, "GB_per_s": BYTES[k] * n / med / 1e9,
                             "times_s": ts}
    res["ratios"] = {
        "ours_fp32/roofline": ratio("ours_fp32", "probe_fp32"),
        "ours_fp32/torch_fused": ratio("ours_fp32", "torch_fused"),
        "ours_mixed/roofline": ratio("ours_mixed", "probe_mixed"),
        "ours_mixed/torch_fused+copy": ratio("ours_mixed", "torch_fused+copy"),
        "ours_f32g_bf16o/roofline": ratio("ours_f32g_bf16o", "probe_f32g_bf16o"),
        "torch_fused/roofline": ratio("torch_fused", "probe_fp32"),
        "ours_fp32_sums/ours_fp32": ratio("ours_fp32_sums", "ours_fp32"),
        "ours_m_bf16/ours_mixed": ratio("ours_m_bf16", "ours_mixed"),
        "ours_m_int8/ours_mixed": ratio("ours_m_int8", "ours_mixed"),
        "ours_p_bf16_m_bf16/ours_mixed": ratio("ours_p_bf16_m_bf16", "ours_mixed"),
        "ours_p_bf16_m_int8/ours_mixed": ratio("ours_p_bf16_m_int8", "ours_mixed"),
        "ours_p_bf16_m_int8/ours_m_int8": ratio("ours_p_bf16_m_int8", "ours_m_int8"),
        "ours_m_bf16/roofline": ratio("ours_m_bf16", "probe_m_bf16"),
        "ours_m_int8/roofline": ratio("ours_m_int8", "probe_m_int8"),
        # Bytes a parameter over the bandwidth probe_mixed measures (one roofline for every mode).
        "ours_mixed/bw_roofline": bw_fraction("ours_mixed"),
        "ours_m_bf16/bw_roofline": bw_fraction("ours_m_bf16"),
        "ours_m_int8/bw_roofline": bw_fraction("ours_m_int8"),
        "ours_p_bf16_m_bf16/bw_roofline": bw_fraction("ours_p_bf16_m_bf16"),
        "ours_p_bf16_m_int8/bw_roofline": bw_fraction("ours_p_bf16_m_int8"),
    }
    if "torch_foreach" in times:
        res["ratios"]["ours_fp32/torch_foreach"] = statistics.median(
            b / a for a, b in zip(times["ours_fp32"], times["torch_foreach"]))
    if "deepspeed" in times:
        res["ratios"]["ours_fp32/deepspeed"] = ratio("ours_fp32", "deepspeed")
    for k in s.q8_opts:  # rounds where both ran
        res["ratios"][f"ours_m_int8/{k}"] = statistics.median(
            b / a for a, b in zip(times["ours_m_int8"], times[k]))
    del s
    return res


TARGETS = [("ours_fp32/roofline", 0.90), ("ours_fp32/torch_fused", 0.95), ("ours_mixed/roofline", 0.90),
           ("ours_mixed/torch_fused+copy", 1.20), ("ours_m_bf16/ours_mixed", 1.30), ("ours_m_int8/ours_mixed", 1.50),
           ("ours_m_bf16/bw_roofline", 0.90), ("ours_m_int8/bw_roofline", 0.90)]


Q8_BASELINES = ("ours_m_int8/bnb_adamw8bit", "ours_m_int8/torchao_adamw8bit")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e8,5e8", help="parameter counts, comma-separated (default 1e8,5e8)")
    ap.add_argument("--layouts", default="flat,chunked", help="flat and/or chunked (default both)")
    ap.add_argument("--chunk", type=int, default=4 * 1024 * 1024,
                    help="elements per tensor in the chunked layout (default 4194304)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--foreach-rounds", type=int, default=2,
                    help="first rounds that include torch foreach (slow; default 2)")
    ap.add_argument("--q8-rounds", type=int, default=2,
                    help="first rounds that include bitsandbytes/torchao AdamW8bit when importable (slow; "
                         "default 2; 0: never)")
    ap.add_argument("--threads", type=int, default=native.default_num_threads(),
                    help="CPU threads for every method, ours and torch's (default here: %(default)s)")
    ap.add_argument("--json", default="bench-results/bench_adam.json",
                    help="where to write the JSON results (default %(default)s)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)  # torch's kernels get the same cores as ours
    sizes = [int(float(x)) for x in args.sizes.split(",")]
    layouts = args.layouts.split(",")
    need = max(sizes) * 30
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > avail:
            print(f"warning: {max(sizes):.0e} parameters need ~{need / 2**30:.1f} GiB; "
                  f"{avail / 2**30:.1f} GiB are free", file=sys.stderr)
    except (ValueError, OSError):
        pass
    info = native.info()
    print(f"infinity {infinity.__version__} | backend {info['backend']} simd {info['simd']} threads {args.threads} | "
          f"torch {torch.__version__} | {platform.processor() or platform.machine()}")
    results = []
    for n in sizes:
        for layout in layouts:
            chunk = None if layout == "flat" else args.chunk
            t0 = time.time()
            r = bench(n, chunk, args.rounds, args.threads, args.foreach_rounds, args.q8_rounds)
            results.append(r)
            print(f"\n== {n:.0e} params, {r['layout']} ({r['tensors']} tensors), {time.time() - t0:.0f} s")
            print(f"{'method':20s} {'median ms':>10s} {'Gparam/s':>9s} {'GB/s':>7s}")
            for k, m in r["methods"].items():
                print(f"{k:20s} {m['median_s'] * 1e3:10.1f} {m['params_per_s'] / 1e9:9.2f} {m['GB_per_s']:7.1f}")
            for k, v in r["ratios"].items():
                print(f"  {k:32s} {v:6.3f}")
    print("\nTargets (median of per-round ratios, every configuration):")
    ok_all = True
    for key, target in TARGETS + [(k, 20.0) for k in Q8_BASELINES]:
        vals = [r["ratios"][key] for r in results if key in r["ratios"]]
        if not vals:
            print(f"  {key:32s} >= {target:4.2f}: not run (baseline not importable)")
            continue
        ok = min(vals) >= target
        ok_all &= ok
        print(f"  {key:32s} >= {target:4.2f}: min {min(vals):.3f} median {statistics.median(vals):.3f} "
              f"{'PASS' if ok else 'FAIL'}")
    out = write_json(args.json, {"info": info, "torch": torch.__version__, "results": results,
                                 "targets": {k: t for k, t in TARGETS}, "all_targets_met": ok_all})
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
