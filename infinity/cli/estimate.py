"""``infinity estimate RUN_FILE [--world N]``: a first estimate of the bytes
each tier needs for a run, before any memory is touched.

The model is built on the meta device and split into paging units exactly as
``infinity.initialize`` splits it; the figures then come from the engine's
own placement arithmetic (``infinity.engine.plan.placement``), so they are the
numbers ``initialize`` checks its budgets against. Not counted: activations
and autograd's temporaries on the device, the CUDA context, the Python and
torch runtime in host RAM.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional

import torch

from ..config.runtime import Config, format_bytes
from ..engine.plan.placement import device_need, host_need, nvme_capacity
from ..config.files import read_file
from .common import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help="estimate peak bytes per tier for a run file", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run file (.toml/.json) or DeepSpeed JSON")
    p.add_argument("--world", type=int, default=1, help="data-parallel ranks (ZeRO shares; default 1)")
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
    return {
        "device": {"minimum": d.minimum, "everything": d.everything, "budget": config.device_memory},
        "host": {"permanent": h.permanent, "minimum": h.minimum,
                 "capacity": min(h.capacity, host_budget) if host_budget else h.capacity, "budget": host_budget},
        "nvme": {"capacity": nv, "per_path": -(-nv // len(config.swap_paths)) if nv else 0, "budget": None},
        "units": {"count": len(units), "parameters": sum(p.numel() for p in model.parameters())},
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
    from .data import open_tokens
    from .model import build_model
    from .runfile import load_run_file
    data = read_file(config_path)
    no_data = is_deepspeed(data) or "data" not in data
    run = load_run_file(config_path, {"data.path": "-"} if no_data else None)
    d = run.data
    vocab = open_tokens(d.path, d.format, d.dtype)[1] if os.path.isfile(d.path) else 256
    with torch.device("meta"):
        model, loss, _ = build_model(run.model, run.config, d.seq_len, vocab, 0)
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
    lines = [f"{u['parameters']:,} parameters in {u['count']} paging units", "",
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
    "rss": ("baseline", "host_pool", "device_tier_in_ram", "activations", "staging", "runtime",
            "model_fp32_at_initialize"),
}


def render_peaks(peaks: dict) -> str:
    """The predicted peak of each tier and its parts (see infinity.engine.plan.estimator)."""
    lines = ["", f"{'TIER':7}{'PEAK':>16}  {'':12}PARTS"]
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
                 "resident memory, device activations count beside the tier on CUDA")
    for mode in ("without", "with"):
        if f"peak_{mode}_checkpointing" in a:
            lines.append(f"activations at their peak {mode} activation checkpointing: "
                         f"{format_bytes(a[f'peak_{mode}_checkpointing'])}")
    return "\n".join(lines)


def suggest(model: torch.nn.Module, config: Config, forward, world: int, lazy: bool) -> str:
    """A placement for this machine: the first of none / host / nvme (with a
    host budget) whose predicted peaks fit the free device memory, 80% of the
    RAM this process may use and the free disk on the swap paths."""
    import dataclasses
    import shutil

    from ..system import sysinfo
    from ..engine.plan.estimator import estimate_peaks
    from .doctor_checks import nearest_existing
    ram = int(0.8 * sysinfo.available_ram())
    disk = sum(shutil.disk_usage(nearest_existing(p)).free for p in config.swap_paths)
    gpu = None
    from ..engine.plan.estimator import compute_device
    if compute_device(config).type == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.mem_get_info()[0]
    for place in ("none", "host", "nvme"):
        cfg = dataclasses.replace(config, offload_params=place, offload_optimizer="host" if place == "none" else place,
                                  device_memory=None if place == "none" else config.device_memory)
        try:
            p = estimate_peaks(model, cfg, forward, world=world, lazy=lazy)
        except ValueError:
            continue
        dev_ok = gpu is None or p["device"]["peak"] + p["device"]["activations"] <= gpu
        if dev_ok and p["rss"]["peak"] <= ram and p["nvme"]["peak"] <= disk:
            return (f"suggested for this machine: offload_params={place!r}, offload_optimizer="
                    f"{cfg.offload_optimizer!r} (predicted RSS {format_bytes(p['rss']['peak'])} of "
                    f"{format_bytes(ram)} usable RAM, swap {format_bytes(p['nvme']['peak'])} of "
                    f"{format_bytes(disk)} free disk"
                    + (f", device {format_bytes(p['device']['peak'])} of {format_bytes(gpu)} free" if gpu else "")
                    + ")")
    return (f"no placement fits this machine: even with NVMe homes the run needs more than {format_bytes(ram)} "
            f"of RAM or {format_bytes(disk)} of free disk on {config.swap_paths}; lower the micro-batch, turn on "
            "activation checkpointing, or add swap paths")


def run(args: argparse.Namespace) -> int:
    """Prints the estimate of the run file; 1 when a given budget is below a minimum."""
    from ..engine.plan.estimator import estimate_peaks
    config, model, forward, lazy = load_run_for_estimate(args.config)
    est = estimate(model, config, args.world)
    print(render(est))
    print(render_peaks(estimate_peaks(model, config, forward, world=args.world, lazy=lazy)))
    print(suggest(model, config, forward, args.world, lazy))
    short = any(est[t]["budget"] is not None and est[t]["budget"] < est[t]["minimum"] for t in ("device", "host"))
    return 1 if short else 0
