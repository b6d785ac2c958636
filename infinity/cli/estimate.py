"""``infinity estimate RUN_FILE [--world N]``: a first estimate of the bytes
each tier needs for a run, before any memory is touched.

The model is built on the meta device and split into paging units exactly as
``infinity.initialize`` splits it; the figures then come from the engine's
own placement arithmetic (``infinity.engine.plan.placement``), so they are the
numbers ``initialize`` checks its budgets against. Then the peak of each
tier with its parts (activations included), whether the device's need fits
``--device-size``, and a placement for this machine. Every figure is one
rank's of ``--world`` ranks. Not counted: the CUDA context and allocator
slack.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional

import torch

from ..config.runtime import Config, format_bytes
from ..engine.plan.opt_kinds import state_bytes
from ..engine.plan.placement import device_need, host_need, nvme_capacity
from ..config.files import read_file
from .common import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help="estimate peak bytes per tier for a run file", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run file (.toml/.json) or DeepSpeed JSON")
    p.add_argument("--world", "--world-size", dest="world", type=int, default=1,
                   help="data-parallel ranks: every figure is one rank's (ZeRO shares the state; default 1)")
    p.add_argument("--device-size", default=None,
                   help="the accelerator's memory to check the device's need against (e.g. 80GiB; default: this "
                        "machine's GPU when the run is on CUDA and one is here)")
    p.add_argument("--time", action="store_true", help="also predict the step time per placement and overlap mode")
    p.add_argument("--profile", help="hardware profile for --time: a file from `infinity doctor --profile`, or "
                   "a shipped one by name (h200-pcie5-nvme, rtx4090-pcie4-nvme)")
    p.set_defaults(run=run)


def estimate(model: torch.nn.Module, config: Config, world: int = 1) -> Dict[str, Dict[str, Optional[int]]]:
    """Bytes per tier for ``model`` (any device, meta included) under
    ``config`` on each of ``world`` ranks: ``device`` (``minimum``: the
    smallest device_memory that runs, ``everything``: all units resident),
    ``host`` (``permanent`` homes, ``minimum``, ``capacity``: the most the pool
    uses) and ``nvme`` (``capacity``: the swap files over all paths). Each
    entry also has ``budget`` (the Config's, None when it is derived at start)."""
    if world < 1:
        raise UsageError(f"--world={world}: must be >= 1")
    from ..engine.plan.estimator import placed
    units, modes, places = placed(model, config, world)
    d = device_need(places, [False] * len(places), modes)
    h = host_need(places, modes)
    nv = nvme_capacity(h, len(units), len(config.swap_paths)) if modes.nvme_used else 0
    host_budget = config.host_memory
    n = sum(p.numel() for p in model.parameters())
    state = sum(state_bytes(p.state_numel, modes.moment_dtype, master_dtype=modes.master_dtype)
                for p in places if p.trainable)
    return {
        "device": {"minimum": d.minimum, "everything": d.everything, "budget": config.device_memory},
        "host": {"permanent": h.permanent, "minimum": h.minimum,
                 "capacity": min(h.capacity, host_budget) if host_budget else h.capacity, "budget": host_budget},
        "nvme": {"capacity": nv, "per_path": -(-nv // len(config.swap_paths)) if nv else 0, "budget": None},
        "units": {"count": len(units), "parameters": n},
        # master and moments (int8: and scales) in their host or NVMe homes, this rank's share
        "optimizer_state": {"moment_dtype": modes.moment_dtype, "master_dtype": modes.master_dtype, "bytes": state,
                            "bytes_per_parameter": state / n if n else 0.0},
    }


def load_for_estimate(config_path: str) -> tuple:
    """``(Config, model on the meta device)`` of a run file or DeepSpeed JSON
    (whose model is the run file default, the tiny GPT). The data file is
    only read for its vocabulary, when it exists."""
    run = load_run_for_estimate(config_path)
    return run[0], run[1]


def load_run_for_estimate(config_path: str) -> tuple:
    """``(Config, model on the meta device, forward)`` where ``forward(model)``
    runs one micro-batch of the run file's shape on meta inputs and returns
    the loss (for the activation estimate), plus whether the model is lazy."""
    from ..config.deepspeed import is_deepspeed
    from .runfile import load_run_file
    data = read_file(config_path)
    no_data = is_deepspeed(data) or "data" not in data
    return meta_run(load_run_file(config_path, {"data.path": "-"} if no_data else None))


def meta_run(run) -> tuple:
    """``(Config, model on the meta device, forward, lazy)`` of a parsed run
    file (see :func:`load_run_for_estimate`)."""
    from .data import open_tokens
    from .model import build_model
    d = run.data
    vocab = open_tokens(d.path, d.format, d.dtype)[1] if os.path.isfile(d.path) else 256
    model, loss, _ = build_model(run.model, run.config, d.seq_len, vocab, 0, meta=True)
    x = torch.zeros(d.micro_batch, d.seq_len, dtype=torch.long, device="meta")
    if run.model.path:
        # Hugging Face's mask building reads values (.item()), which meta tensors have not: a ready 4-D
        # mask skips it. The run itself has none (causal attention), so the stand-in is one element
        # broadcast: it costs the count nothing.
        mask = torch.zeros(1, 1, 1, 1, device="meta").expand(d.micro_batch, 1, d.seq_len, d.seq_len)
        return run.config, model, (lambda m: m(input_ids=x, attention_mask=mask, labels=x).loss), \
            bool(run.model.lazy)
    return run.config, model, (lambda m: loss(m, x, x)), bool(run.model.lazy)


def nvme_need(config_path: str) -> tuple:
    """``(Config, bytes of swap files over all paths)`` of a run file or
    DeepSpeed JSON, from ``infinity estimate``'s placement arithmetic."""
    config, model = load_for_estimate(config_path)
    return config, estimate(model, config)["nvme"]["capacity"]


def render(est: Dict[str, Dict[str, Optional[int]]]) -> str:
    """The estimate as a table, with what each figure means."""
    rows = [
        ("device", "minimum", "smallest device_memory that runs (activations not counted)"),
        ("device", "everything", "every unit resident: a larger budget buys nothing"),
        ("host", "permanent", "homes kept for good"),
        ("host", "minimum", "smallest host_memory that runs"),
        ("host", "capacity", "the most the host pool uses (budget-capped)"),
        ("nvme", "capacity", "swap files over all paths"),
        ("nvme", "per_path", "each swap path's share (check with `infinity doctor`)"),
    ]
    u = est["units"]
    o = est.get("optimizer_state")
    lines = [f"{u['parameters']:,} parameters in {u['count']} paging units"
             + (f"; optimizer state {format_bytes(o['bytes'])} ({o['bytes_per_parameter']:.2f} bytes a parameter: "
                f"{o.get('master_dtype', 'fp32')} master, {o['moment_dtype']} moments)" if o else ""), "",
             f"{'TIER':7}{'FIGURE':12}{'BYTES':>16}  {'':12}MEANING"]
    for tier, key, what in rows:
        v = est[tier][key]
        lines.append(f"{tier:7}{key:12}{v:>16,}  {format_bytes(v):12}{what}")
    for tier in ("device", "host"):
        b = est[tier]["budget"]
        if b is not None and b < est[tier]["minimum"]:
            lines.append(f"\n{tier} budget {format_bytes(b)} is below the minimum "
                         f"{format_bytes(est[tier]['minimum'])}: initialize will refuse it")
    return "\n".join(lines)


_PEAK_PARTS = {
    "device": ("model_state", "gradients_in_flight", "activations"),
    "host": ("model_state", "cache_and_transients"),
    "rss": ("baseline", "host_pool", "device_tier_in_ram", "activations", "weight_grad_workspace", "staging",
            "runtime", "model_fp32_at_initialize"),
}


def render_peaks(peaks: dict, world: int = 1) -> str:
    """The predicted peak of each tier on one of ``world`` ranks and its parts
    (see infinity.engine.plan.estimator): what the run needs."""
    lines = ["", f"NEED PER RANK ({world} rank{'s' if world > 1 else ''})",
             f"{'TIER':7}{'PEAK':>16}  {'':12}PARTS"]
    for tier in ("device", "host", "nvme", "rss"):
        p = peaks[tier]
        parts = ", ".join(f"{k} {format_bytes(p[k])}" for k in _PEAK_PARTS.get(tier, ()) if p.get(k))
        lines.append(f"{tier:7}{p['peak']:>16,}  {format_bytes(p['peak']):12}{parts}")
    a = peaks["activations"]
    if a.get("error"):
        lines.append(f"\nactivations NOT counted: {a['error']}; the device and rss peaks lack them")
        return "\n".join(lines)
    lines.append(f"\nactivations saved for backward: {format_bytes(a['saved'])} (one block {format_bytes(a['unit'])}, "
                 f"activation checkpointing {'on' if a['checkpointing'] else 'off'}); rss is the process's peak "
                 "resident memory; on CUDA the device peak holds the activations beside the model state")
    for mode in ("without", "with"):
        if f"peak_{mode}_checkpointing" in a:
            lines.append(f"activations at their peak {mode} activation checkpointing: "
                         f"{format_bytes(a[f'peak_{mode}_checkpointing'])}")
    return "\n".join(lines)


def device_fit(peaks: dict, size: Optional[int]) -> tuple:
    """``(fits, line)``: whether the device's need (model state and
    activations) fits a device of ``size`` bytes, said in a line; ``(True,
    None)`` when the size is unknown or the run is on the CPU."""
    d, a = peaks["device"], peaks["activations"]
    if size is None or not d.get("activations"):
        return True, None
    need = d["peak"]
    if need <= size:
        return True, f"device: needs {format_bytes(need)} of the device's {format_bytes(size)}: fits"
    other = "peak_with_checkpointing"
    alt = d["model_state_peak"] + a[other] if other in a and not a["checkpointing"] else None
    return False, (f"device: needs {format_bytes(need)} (model state {format_bytes(d['model_state_peak'])} + activations "
            f"{format_bytes(d['activations'])}) but the device has {format_bytes(size)}: the activations do not "
            "fit. " + (f"With activation checkpointing it needs {format_bytes(alt)}; " if alt else "")
            + "a smaller micro-batch or sequence lowers the activations")


def suggest(model: torch.nn.Module, config: Config, forward, world: int, lazy: bool, activations=None) -> str:
    """A placement for this machine: the first of none / host / nvme (with a
    host budget) whose predicted peaks fit the free device memory, 80% of the
    RAM this process may use and the free disk on the swap paths; if none
    does, what the last one needs against what the machine has.
    ``activations``: estimator.measure_activations's result, when measured already."""
    import dataclasses
    import shutil

    from ..system import sysinfo
    from ..engine.plan.estimator import compute_device, estimate_peaks
    from .doctor_checks import nearest_existing
    ram = int(0.8 * sysinfo.available_ram())
    disk = sum(shutil.disk_usage(nearest_existing(p)).free for p in config.swap_paths)
    gpu = None
    if compute_device(config).type == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.mem_get_info()[0]
    have = {"rss": ram, "nvme": disk, "device": gpu}
    need, over, p = None, [], None
    for place in ("none", "host", "nvme"):
        try:  # a placement Config refuses (ZeRO-3 keeps the homes off the device) is not a suggestion
            cfg = dataclasses.replace(config, offload_params=place,
                                      offload_optimizer="host" if place == "none" else place,
                                      device_memory=None if place == "none" else config.device_memory)
            p = estimate_peaks(model, cfg, forward, world=world, lazy=lazy, activations=activations)
        except ValueError:
            continue
        need = {t: p[t]["peak"] for t in have}
        over = [t for t in have if have[t] is not None and need[t] > have[t]]
        if not over:
            return (f"suggested for this machine: offload_params={place!r}, offload_optimizer="
                    f"{cfg.offload_optimizer!r} (predicted RSS {format_bytes(need['rss'])} of "
                    f"{format_bytes(ram)} usable RAM, swap {format_bytes(need['nvme'])} of "
                    f"{format_bytes(disk)} free disk"
                    + (f", device {format_bytes(need['device'])} of {format_bytes(gpu)} free" if gpu else "")
                    + ")")
    if p is None:
        return "no placement suggested: Config refuses every one of none, host and nvme for this run"
    return _no_fit(need, have, over, p)


_WHAT = {"rss": "of RAM (process peak)", "nvme": "of free disk on the swap paths", "device": "of free device memory"}


def _no_fit(need: dict, have: dict, over: list, peaks: dict) -> str:
    """The need of the NVMe placement against this machine, per tier over, and what lowers it."""
    short = "; ".join(f"{format_bytes(need[t])} {_WHAT[t]}, this machine has {format_bytes(have[t])}" for t in over)
    act, host, fixes = peaks["activations"], peaks["host"], []
    if "nvme" in over:
        fixes.append("add swap paths on other disks or free disk space")
    if ("rss" in over and peaks["rss"]["activations"]) or ("device" in over and peaks["device"]["activations"]):
        if not act.get("checkpointing") and "peak_with_checkpointing" in act:
            fixes.append("turn on activation checkpointing")
        fixes.append("lower the micro-batch or sequence length (the activations)")
    if "rss" in over and host["peak"] > host["minimum"]:
        fixes.append(f"lower host_memory toward the host minimum {format_bytes(host['minimum'])} (the NVMe "
                     "placement's pool caches up to its budget)")
    if "rss" in over and host["peak"] <= host["minimum"]:
        fixes.append(f"a machine with more RAM: the host minimum alone is {format_bytes(host['minimum'])}")
    return f"no placement fits this machine: with NVMe homes the run needs {short}; " + ", or ".join(fixes)


def run(args: argparse.Namespace) -> int:
    """Prints the estimate of the run file; 1 when a given budget is below a
    minimum or the device's need does not fit ``--device-size``."""
    from ..config.validate import parse_bytes
    from ..engine.plan.estimator import compute_device, estimate_peaks, measure_activations, placed
    config, model, forward, lazy = load_run_for_estimate(args.config)
    try:
        size = parse_bytes(args.device_size, "--device-size") if args.device_size is not None else None
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    if args.world < 1:
        raise UsageError(f"--world={args.world}: must be >= 1")
    if size is None and compute_device(config).type == "cuda" and torch.cuda.is_available():
        size = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    est = estimate(model, config, args.world)
    print(render(est))
    # One meta forward for the activations serves every placement below (they do not change it).
    act = measure_activations(model, placed(model, config, args.world)[0], forward)
    peaks = estimate_peaks(model, config, forward, world=args.world, lazy=lazy, activations=act)
    print(render_peaks(peaks, args.world))
    fits, line = device_fit(peaks, size)
    if line:
        print(line)
    print(suggest(model, config, forward, args.world, lazy, act))
    if args.time:
        from .estimate_time import run_time
        print(run_time(model, config, forward, args.world, lazy, args.profile, act))
    short = any(est[t]["budget"] is not None and est[t]["budget"] < est[t]["minimum"] for t in ("device", "host"))
    return 1 if short or not fits else 0
