"""The parity harness: a user's training loop run through plain torch and
through infinity, in every placement, overlap mode and budget, comparing
every loss and every final tensor.

    check_parity(make_model, loop, tmp_path)

``loop(model, opt, step)`` is one step of the user's code (forward,
backward, ``opt.step()``, ``opt.zero_grad(...)``, whatever the pattern under
test does) and returns the step's loss as a float. It runs unchanged on
``make_model()`` with ``torch.optim.AdamW`` and on a deep copy through
``infinity.initialize``. Data must depend only on ``step`` (seed a generator
with it), so both runs see the same batches.

Elements whose true gradient is about zero (an attention key bias, a
parameter a step leaves out) move on rounding noise alone; the comparison
admits them by the bound of ``engine_utils.assert_params_close(lr_steps=)``
(the learning rate times the steps), not by a looser tolerance for all.
overlap="delayed" is compared with its definition, torch's update applied
one step late (:class:`DelayedReference`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

import infinity
from engine_utils import assert_params_close, min_device_budget

__all__ = ["PLACEMENTS", "OVERLAPS", "DelayedReference", "parity_configs", "check_parity", "run_pair"]

# (offload_params, offload_optimizer): device-resident parameters with the
# host optimizer, host homes, NVMe homes and state, and the device optimizer.
PLACEMENTS: Tuple[Tuple[str, str], ...] = (("none", "host"), ("host", "host"), ("nvme", "nvme"), ("none", "none"))
OVERLAPS: Tuple[str, ...] = ("step", "backward", "delayed")


def parity_configs(make_model: Callable[[], nn.Module], tmp_path, *, placements: Sequence = PLACEMENTS,
                   overlaps: Sequence[str] = OVERLAPS, budgets: Sequence[Optional[str]] = ("min", None),
                   **extra) -> Iterator[Tuple[str, dict]]:
    """(name, Config keyword arguments) for every valid combination: the
    device budget is the engine's own minimum for the model (``"min"``) or
    unbounded (None). Combinations ``infinity.Config`` refuses (the delayed
    mode with NVMe or the device optimizer) are left out."""
    for params, opt in placements:
        for overlap in overlaps:
            base = dict(device="cpu", dtype="fp32", host_memory="64MiB", prefetch_depth=1, offload_params=params,
                        offload_optimizer=opt, overlap=overlap, swap_paths=[str(tmp_path)], swap_block_size=4096)
            base.update(extra)
            try:
                infinity.Config(**base)
            except ValueError:
                continue
            for budget in budgets:
                cfg = dict(base)
                if budget == "min":
                    cfg["device_memory"] = min_device_budget(make_model, **base)
                yield f"{params}/{opt}/{overlap}/{budget or 'unbounded'}", cfg


class DelayedReference:
    """torch's optimizer one step late, the definition of overlap="delayed":
    ``step()`` applies the gradients of the previous ``step()`` (a parameter
    that had none then is left alone) and keeps this one's; ``flush()``
    applies the kept ones, as infinity's ``flush()`` does."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner, self.param_groups, self._pending = inner, inner.param_groups, None
        self._params = [p for g in inner.param_groups for p in g["params"]]

    def step(self) -> None:
        now = [None if p.grad is None else p.grad.clone() for p in self._params]
        self.flush()
        self._pending = now

    def flush(self) -> None:
        if self._pending is None:
            return
        keep = [p.grad for p in self._params]
        for p, g in zip(self._params, self._pending):
            p.grad = g
        self.inner.step()
        for p, g in zip(self._params, keep):
            p.grad = g
        self._pending = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


def run_pair(make_model: Callable[[], nn.Module], loop: Callable, cfg: dict, *, steps: int = 4, lr: float = 1e-2,
             weight_decay: float = 0.1, init_kw=None, torch_opt: Optional[Callable] = None,
             ) -> Tuple[List[float], List[float], dict, dict]:
    """Runs ``loop`` for ``steps`` on ``make_model()`` with torch's AdamW
    (or ``torch_opt(model)``) and on a copy through infinity with ``cfg``
    (``initialize``'s keyword arguments: ``init_kw``, or ``init_kw(copy)``).
    Returns (infinity's losses, torch's, infinity's final tensors, torch's)."""
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch_opt(ref) if torch_opt else torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay, foreach=False)
    if cfg.get("overlap") == "delayed":
        ref_opt = DelayedReference(ref_opt)
    kw = init_kw(model) if callable(init_kw) else init_kw if init_kw is not None else dict(lr=lr,
                                                                                           weight_decay=weight_decay)
    model, opt = infinity.initialize(model, infinity.Config(**cfg), **kw)
    losses, ref_losses = [], []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "infinity: parameters of unit", RuntimeWarning)
            for step in range(steps):
                torch.manual_seed(1000 + step)  # dropout and other randomness alike in both runs
                ref_losses.append(float(loop(ref, ref_opt, step)))
                torch.manual_seed(1000 + step)
                losses.append(float(loop(model, opt, step)))
        opt.flush()
        if isinstance(ref_opt, DelayedReference):
            ref_opt.flush()
        got = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
    finally:
        infinity.close(model)
    return losses, ref_losses, got, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def check_parity(make_model: Callable[[], nn.Module], loop: Callable, tmp_path, *, steps: int = 4, lr: float = 1e-2,
                 rtol: float = 1e-5, configs: Optional[Sequence[Tuple[str, dict]]] = None,
                 placements: Sequence = PLACEMENTS, overlaps: Sequence[str] = OVERLAPS,
                 budgets: Sequence[Optional[str]] = ("min", None), **kw) -> int:
    """Asserts, for every configuration (default: :func:`parity_configs` of
    ``placements`` x ``overlaps`` x ``budgets``), that every loss and every
    final parameter and buffer equals torch's within ``rtol`` (ill-conditioned
    elements within lr x steps). ``kw`` goes to :func:`run_pair`. Returns
    the number of configurations checked (so a test can assert it ran some)."""
    if configs is None:
        configs = parity_configs(make_model, tmp_path, placements=placements, overlaps=overlaps, budgets=budgets)
    configs = list(configs)
    assert configs, "no configuration to compare"
    for name, cfg in configs:
        losses, ref_losses, got, want = run_pair(make_model, loop, cfg, steps=steps, lr=lr, **kw)
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= rtol * abs(b) + 1e-7, f"{name}: step {i} loss {a} != torch's {b}"
        try:
            assert_params_close(got, want, rtol, lr_steps=lr * steps)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    return len(configs)
