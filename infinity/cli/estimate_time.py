"""``infinity estimate RUN --time --profile FILE``: the predicted step time of
the run, and of the same run under the other placements and overlap modes,
from the step model (infinity/engine/plan/step_time.py) and a hardware
profile (``infinity doctor --profile``, or a shipped one by name)."""

from __future__ import annotations

import dataclasses
import shutil
from typing import List, Optional, Tuple

import torch

from ..config.runtime import Config, format_bytes
from ..engine.plan.costs import count_pass
from ..engine.plan.estimator import compute_device, estimate_peaks, placed
from ..engine.plan.profile import Profile, load_profile, shipped_profiles
from ..engine.plan.step_time import StepPrediction, predict_step
from .common import UsageError

__all__ = ["predict", "predict_run", "variants", "render_time", "run_time"]

PLACEMENTS = (("none", "host"), ("host", "host"), ("host", "nvme"), ("nvme", "nvme"))
OVERLAPS = ("step", "backward", "delayed")


def predict(model, config: Config, forward, profile: Profile, world: int = 1, costs=None) -> StepPrediction:
    """The predicted step of ``model`` (meta) under ``config`` on ``profile``'s machine."""
    return predict_step(model, config, forward, profile, placed(model, config, world), costs)


def predict_run(run, world: int = 1) -> Tuple[Optional[StepPrediction], str]:
    """The step of a parsed run file predicted on its ``[log] profile``, before
    the run (``infinity train``): ``(prediction, "")``, or ``(None, why not)``
    where the model does not cover the run. The meta model is built with the
    global RNG state saved and restored: the run's own seeding is untouched."""
    from .estimate import meta_run
    try:
        profile = load_profile(run.log.profile)
    except ValueError as e:
        raise UsageError(f"log.profile: {e}") from None
    if world > 1:
        try:
            profile.net("net_host")
        except ValueError as e:
            return None, f"world size {world}: {e}"
    with torch.random.fork_rng(devices=[]):
        config, model, forward, _ = meta_run(run)
    return predict(model, config, forward, profile), ""


def variants(config: Config) -> List[Config]:
    """The run's config under each placement and overlap mode the engine takes
    (delayed needs the optimizer in host memory), the run's own first."""
    out = [config]
    for params, opt in PLACEMENTS:
        for ov in OVERLAPS:
            if ov == "delayed" and opt != "host":
                continue
            try:
                c = dataclasses.replace(config, offload_params=params, offload_optimizer=opt, overlap=ov,
                                        device_memory=None if params == "none" else config.device_memory)
            except ValueError:  # not a placement Config takes with the run's other fields (ZeRO-3 on the device)
                continue
            if (params, opt, ov) != (config.offload_params, config.offload_optimizer, config.overlap):
                out.append(c)
    return out


def _fits(model, cfg: Config, world: int, lazy: bool, limits, act: int) -> Tuple[bool, str]:
    """Whether ``cfg`` fits; ``act``: the activations' peak (bytes), the same
    for every placement, measured once (a meta forward of a large model takes seconds)."""
    ram, disk, gpu = limits
    try:
        p = estimate_peaks(model, cfg, None, world=world, lazy=lazy)
    except ValueError as e:
        return False, str(e)
    on_cpu = compute_device(cfg).type == "cpu"
    p["rss"]["peak"] += act if on_cpu else 0
    p["device"]["activations"] = 0 if on_cpu else act
    if p["rss"]["peak"] > ram:
        return False, f"RSS {format_bytes(p['rss']['peak'])} > {format_bytes(ram)}"
    if p["nvme"]["peak"] > disk:
        return False, f"swap {format_bytes(p['nvme']['peak'])} > {format_bytes(disk)} free"
    if gpu is not None and p["device"]["peak"] + p["device"]["activations"] > gpu:
        return False, f"device {format_bytes(p['device']['peak'])} > {format_bytes(gpu)} free"
    return True, ""


def _limits(config: Config):
    from ..system import sysinfo
    from .doctor_checks import nearest_existing
    ram = int(0.8 * sysinfo.available_ram())
    disk = sum(shutil.disk_usage(nearest_existing(p)).free for p in config.swap_paths)
    gpu = torch.cuda.mem_get_info()[0] if compute_device(config).type == "cuda" and torch.cuda.is_available() else None
    return ram, disk, gpu


def _label(c: Config) -> str:
    return f"params={c.offload_params:4} opt={c.offload_optimizer:4} overlap={c.overlap:8}"


def render_time(rows) -> str:
    """The table of (config, prediction, fits, why) rows; the first is the run's own."""
    lines = [f"{'PLACEMENT':44}{'STEP s':>9}  {'BOUND':11}{'FITS':5} EXPOSED (s)"]
    for c, pr, ok, why in rows:
        exp = ", ".join(f"{k} {v:.3f}" for k, v in sorted(pr.exposed.items(), key=lambda kv: -kv[1]) if v > 5e-4)
        lines.append(f"{_label(c):44}{pr.seconds:9.3f}  {pr.bound:11}{'yes' if ok else 'no':5} {exp}"
                     + ("" if ok else f"  ({why})"))
    fit = [(pr.seconds, c) for c, pr, ok, _ in rows if ok]
    if fit:
        best_s, best = min(fit, key=lambda x: x[0])
        own = rows[0][1].seconds
        lines.append(f"\nfastest placement that fits: {_label(best).strip()} at {best_s:.3f} s a step"
                     + (f" ({100 * (1 - best_s / own):.0f}% below the run's {own:.3f} s)" if best_s < own else
                        " (the run's own)"))
    else:
        lines.append("\nno placement fits this machine's memory and disk")
    return "\n".join(lines)


def run_time(model, config: Config, forward, world: int, lazy: bool, profile_path: Optional[str],
             activations=None) -> str:
    """The ``--time`` section of ``infinity estimate`` (``activations``:
    estimator.measure_activations's result when measured already)."""
    if not profile_path:
        raise UsageError("--time needs --profile FILE: measure one with `infinity doctor --profile OUT.json`, "
                         f"or name a shipped one: {shipped_profiles()}")
    try:
        profile = load_profile(profile_path)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if world > 1:
        try:
            profile.net("net_host")
        except ValueError as e:
            raise UsageError(f"--time with --world={world}: {e}") from None
    modes_dtype = config.torch_dtype
    units = placed(model, config, world)[0]
    costs = count_pass(model, forward, {u.index: u.modules for u in units[1:]}, modes_dtype)
    limits = _limits(config)
    a = estimate_peaks(model, config, forward, world=world, lazy=lazy, activations=activations)["activations"]
    act = a.get("peak_with_checkpointing" if a["checkpointing"] else "peak_without_checkpointing", 0)
    rows = []
    for c in variants(config):
        ok, why = _fits(model, c, world, lazy, limits, act)
        rows.append((c, predict(model, c, forward, profile, world, costs), ok, why))
    lines = what_if(model, config, forward, profile, costs, world)
    head = (f"\npredicted step time on {profile.name} ({profile.source}); one micro-batch, steady state "
            "(docs/cli.md: the model and its measured error)")
    return head + "\n" + render_time(rows) + "".join("\n" + x for x in lines)


def what_if(model, config: Config, forward, profile: Profile, costs, world: int = 1) -> List[str]:
    """What would change the run's own step by 5% or more: a second swap
    path as fast as the first, a deeper prefetch, a faster copy link."""
    base = predict(model, config, forward, profile, world, costs).seconds
    tries = [("a second swap path of the same speed", config,
              dataclasses.replace(profile, disk_read_bw=2 * profile.disk_read_bw,
                                  disk_write_bw=2 * profile.disk_write_bw)),
             (f"prefetch_depth={config.prefetch_depth + 2}",
              dataclasses.replace(config, prefetch_depth=config.prefetch_depth + 2), profile),
             ("copies twice as fast", config,
              dataclasses.replace(profile, h2d_bw=2 * profile.h2d_bw, d2h_bw=2 * profile.d2h_bw))]
    out = []
    for what, cfg, prof in tries:
        t = predict(model, cfg, forward, prof, world, costs).seconds
        if abs(t - base) >= 0.05 * base:
            out.append(f"{what} would {'cut' if t < base else 'lengthen'} the step {100 * abs(1 - t / base):.0f}% "
                       f"({base:.3f} -> {t:.3f} s)")
    return out
