"""Shared harness of the engine tests: a reference model trained with plain
torch beside the same model trained through infinity, on the same data."""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import infinity
from infinity.models import GPT, GPTConfig

VOCAB, T, B = 256, 32, 4
# Hidden widths of UnequalNet's blocks: units of five different sizes, so a
# refetch rarely lands where the unit sat in forward (review finding A1).
UNEQUAL_HIDDEN = (64, 8, 32, 8, 64, 16, 8, 32)


def small_gpt(**kw) -> GPT:
    torch.manual_seed(1234)
    cfg = dict(vocab_size=VOCAB, block_size=T, n_layer=8, n_head=4, n_embd=32, qkv_bias=False)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


class MLPBlock(nn.Module):
    """x + Linear(h->d)(gelu(Linear(d->h)(x))): one paging unit of 33h + d parameters."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class UnequalNet(nn.Module):
    """Token embedding and head (the root unit) around ``blocks`` of unequal
    size; ``model(idx, targets)`` returns the cross-entropy loss, like GPT."""

    def __init__(self, hidden=UNEQUAL_HIDDEN, d: int = 16):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(MLPBlock(d, h) for h in hidden)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.blocks:
            x = blk(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def unequal_net(**kw) -> UnequalNet:
    torch.manual_seed(1234)
    return UnequalNet(**kw)


def min_device_budget(make_model: Callable[[], nn.Module], **config) -> int:
    """The engine's smallest ``device_memory`` (bytes) for ``make_model()``
    under ``infinity.Config(**config)``, read off the BudgetError of an
    initialize with ``device_memory=1``."""
    try:
        infinity.initialize(make_model(), infinity.Config(**dict(config, device_memory=1)))
    except infinity.BudgetError as e:
        m = re.search(r"at least (\d+) bytes", str(e))
        if m:
            return int(m.group(1))
        raise AssertionError(f"BudgetError without 'at least N bytes': {e}") from e
    raise AssertionError("initialize accepted device_memory=1: no minimum to read")


def add_lag(model: nn.Module, lag: Callable[[], None]) -> list:
    """Calls ``lag()`` before each block's forward and before its backward
    (a hook on the block's output gradient). With a GPU sleep as ``lag``
    compute falls behind the copy streams, so a missing wait reads bytes a
    copy is still writing. Register before ``infinity.initialize``. Returns
    the hook handles."""
    def pre(mod, args):
        lag()

    def post(mod, args, out):
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: (lag(), g)[1])

    handles = []
    for blk in model.blocks:
        handles.append(blk.register_forward_pre_hook(pre))
        handles.append(blk.register_forward_hook(post))
    return handles


def cuda_lag(ms: float, device=None) -> Callable[[], None]:
    """A lag of about ``ms`` milliseconds of GPU time per call
    (``torch.cuda._sleep``, its cycles per ms measured here with events)."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 1_000_000
        for _ in range(2):  # the first call pays start-up costs
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
        per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    n = max(1, int(ms * per_ms))
    return lambda: torch.cuda._sleep(n)


def batches(n: int, seed: int = 0, b: int = B):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (b, T), generator=gen), torch.randint(0, VOCAB, (b, T), generator=gen))
            for _ in range(n)]


def unit_bytes(model: GPT, dtype_bytes: int = 4) -> int:
    return max(sum(p.numel() for p in blk.parameters()) for blk in model.blocks) * dtype_bytes


def assert_params_close(actual: dict, expected: dict, rtol: float = 1e-5, global_scale: bool = False,
                        lr_steps: Optional[float] = None) -> None:
    """max |a - e| <= rtol x scale + 1e-7 per tensor; the scale is the tensor's
    max |e|, or with ``global_scale`` the model's (for data-parallel runs,
    whose gradient sums differ from the single-process ones in rounding,
    which Adam amplifies in near-zero-gradient elements).

    ``lr_steps`` (the learning rate times the steps taken) admits those
    ill-conditioned elements by name rather than by a looser bound for all:
    an element whose true gradient is about zero can move by up to lr a step
    on rounding noise alone, so at most 0.1% of a tensor's elements (at least
    one) may exceed the bound, each by no more than ``lr_steps``. A real
    fault (a missed or doubled update, a wrong scale) moves far more
    elements than that."""
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    model_scale = max(e.abs().max().item() for e in expected.values())
    for k, e in expected.items():
        a = actual[k]
        assert a.shape == e.shape, (k, a.shape, e.shape)
        scale = model_scale if global_scale else e.abs().max().item()
        d = (a.float() - e.float()).abs()
        diff = d.max().item()
        bound = rtol * scale + 1e-7
        if lr_steps is not None and diff > bound:
            out = int((d > bound).sum())
            assert out <= max(1, d.numel() // 1000) and diff <= lr_steps, \
                f"{k}: {out} of {d.numel()} elements beyond {bound:.3e}, the largest {diff:.3e} (lr x steps {lr_steps})"
            continue
        assert diff <= bound, f"{k}: max abs diff {diff:.3e} > {rtol} x scale {scale:.3e}"


def train_steps(model: torch.nn.Module, opt, n: int, seed: int = 0) -> List[float]:
    """``n`` plain steps (forward, backward, step, zero_grad) on ``batches(n, seed)``; the losses."""
    losses = []
    for x, y in batches(n, seed):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def step_with_reference(model, opt, ref, ref_opt, data) -> None:
    """One step of ``model`` (through infinity) and of ``ref`` (plain, its
    optimizer ``ref_opt``) per batch of ``data``; their losses must be equal."""
    for x, y in data:
        loss, ref_loss = model(x, y), ref(x, y)
        loss.backward()
        ref_loss.backward()
        assert loss.item() == ref_loss.item()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def train_states(model: torch.nn.Module, cfg: infinity.Config, steps: int = 3, accum: int = 1,
                 lr: float = 1e-3, weight_decay: float = 0.1):
    """Trains ``model`` through infinity ``steps`` steps of ``accum`` micro-batches
    of ``batches``; (final fp32 parameters, optimizer.state_dict(), stats), closed after."""
    model, opt = infinity.initialize(model, cfg, lr=lr, weight_decay=weight_decay)
    data = batches(steps * accum)
    for i in range(steps):
        for x, y in data[i * accum:(i + 1) * accum]:
            (model(x, y) / accum).backward()
        opt.step()
        opt.zero_grad()
    out = ({k: v.clone() for k, v in infinity.full_state_dict(model).items()}, opt.state_dict(), infinity.stats(model))
    infinity.close(model)
    return out


def train_pair(make_model: Callable[[], torch.nn.Module], config: infinity.Config, steps: int = 20, *,
               lr: float = 1e-3, weight_decay: float = 0.1, accum: int = 1, clip: Optional[float] = None,
               scheduler: Optional[Callable] = None, forward: Optional[Callable] = None,
               between: Optional[Callable] = None, seed: int = 0, rtol: float = 1e-5,
               device: Optional[str] = None):
    """Trains ``make_model()`` with torch.optim.AdamW (foreach=False) and a deep
    copy through infinity on the same batches; compares every loss and the
    final parameters. With ``device`` the reference and the batches live
    there (a GPU reference runs the engine's kernels); by default both stay
    on the CPU. Returns (model, optimizer, losses, reference losses)."""
    ref = make_model()
    model = copy.deepcopy(ref)
    if device is not None:
        ref.to(device)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr,
                                weight_decay=weight_decay, foreach=False)
    model, opt = infinity.initialize(model, config, lr=lr, weight_decay=weight_decay)
    ref_sched = scheduler(ref_opt) if scheduler else None
    sched = scheduler(opt) if scheduler else None
    fwd = forward or (lambda m, x, y: m(x, y))
    data = [(x.to(device), y.to(device)) if device else (x, y) for x, y in batches(steps * accum, seed)]
    losses, ref_losses = [], []
    for step in range(steps):
        tot, ref_tot = 0.0, 0.0
        for a in range(accum):
            x, y = data[step * accum + a]
            loss = fwd(model, x, y) / accum
            loss.backward()
            rl = fwd(ref, x, y) / accum
            rl.backward()
            tot += loss.item()
            ref_tot += rl.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if sched:
            sched.step()
            ref_sched.step()
        losses.append(tot)
        ref_losses.append(ref_tot)
        if between:
            between(model, ref, step)
    for i, (l, r) in enumerate(zip(losses, ref_losses)):
        assert abs(l - r) <= rtol * abs(r), f"step {i}: loss {l} != reference {r}"
    ref_state = {k: v.cpu() for k, v in ref.state_dict().items()}
    assert_params_close(infinity.full_state_dict(model), ref_state, rtol)
    return model, opt, losses, ref_losses


def set_ieee_fp32() -> None:
    """CUDA fp32 matmuls and convolutions in full IEEE fp32 (no TF32), so a
    GPU reference and the engine agree to rounding; a no-op on the CPU."""
    mm = torch.backends.cuda.matmul
    if hasattr(mm, "fp32_precision"):  # torch >= 2.9; the legacy flags must not be mixed in
        mm.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
    else:
        mm.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@contextlib.contextmanager
def deterministic():
    """Same kernels, same bits, for comparisons of two runs bit for bit: IEEE
    fp32 (set_ieee_fp32, left on), deterministic algorithms (warn only) and
    the math attention (flash and memory-efficient attention backward may
    accumulate with atomics). Restores the deterministic-algorithms flags."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    set_ieee_fp32()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
