"""``CPUAdamW``: a torch.optim.Optimizer whose step is infinity's native AdamW."""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from ..system import native
from . import master, moments
from .functional import adamw_step_, group_hyper

__all__ = ["CPUAdamW"]


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (or Adam with L2 weight decay) for fp32 (or bf16-master) CPU parameters.

    The update runs in the native SIMD kernel (AVX-512, AVX2, NEON or scalar,
    chosen at run time), multi-threaded, in one pass over memory per param
    group; without the native library a pure-torch fallback gives the same
    results more slowly.

    Args:
        params: iterable of parameters or param-group dicts.
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: term added to the denominator (>= 0).
        weight_decay: decoupled (AdamW) or L2 (Adam) weight decay (>= 0).
        adamw_mode: True for torch.optim.AdamW semantics, False for
            torch.optim.Adam semantics (decay added to the gradient).
        num_threads: CPU threads of the kernel; default all CPUs of this
            process (or ``INFINITY_NUM_THREADS``).
        moment_dtype: how ``exp_avg`` and ``exp_avg_sq`` are kept: ``"fp32"``
            (default; torch's, 8 bytes a parameter), ``"bf16"`` (4 bytes,
            rounded to nearest even) or ``"int8"`` (block-scaled 8-bit codes,
            ~2.03 bytes); see :mod:`infinity.optim.moments`.
        master_dtype: ``"fp32"`` (default: fp32 parameters are the master) or
            ``"bf16"``: the parameters are bf16 and are the master themselves
            (no fp32 copy anywhere), each update computed in fp32 and stored by
            stochastic rounding from a counter-based hash of (``seed``, the
            parameter's position in the groups, step, element index): see
            :mod:`infinity.optim.master`. Gradients bf16 or fp32.
        seed: the run's rounding seed (bf16 master only; int in [0, 2**64)),
            kept in each param group, so a state dict resumes bit-exactly.

    State per parameter uses torch.optim.AdamW's keys (``step``,
    ``exp_avg``, ``exp_avg_sq``; int8 adds ``exp_avg_scale`` and
    ``exp_avg_sq_scale``). :meth:`state_dict` always gives torch's format
    (fp32 moments, dequantised), and :meth:`load_state_dict` converts what
    it loads to ``moment_dtype``, so state dicts move between this and
    torch.optim.AdamW both ways. Hyper-parameters may differ per param group
    and may be changed by torch LR schedulers between steps.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        adamw_mode: bool = True,
        num_threads: Optional[int] = None,
        moment_dtype: str = "fp32",
        master_dtype: str = "fp32",
        seed: int = 0,
    ) -> None:
        self.moment_dtype = moments.check_moment_dtype(moment_dtype, "CPUAdamW moment_dtype")
        self.master_dtype = master.check_master_dtype(master_dtype, "CPUAdamW master_dtype")
        master.check_seed(seed, "CPUAdamW seed")
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        group_hyper(dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), "CPUAdamW")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"Invalid num_threads: {num_threads!r} (must be a positive int or None)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw_mode=bool(adamw_mode), num_threads=num_threads,
                        # torch's keys, so state dicts move both ways; maximize and
                        # decoupled_weight_decay are honoured, the others refused when on.
                        amsgrad=False, maximize=False, foreach=None, capturable=False,
                        differentiable=False, fused=None, decoupled_weight_decay=bool(adamw_mode))
        if self.master_dtype == "bf16":
            defaults["seed"] = seed
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                self._check_param(p, gi, pi)
        native.available()  # warn once, now, if the fallback will run

    def _check_param(self, p: torch.Tensor, gi: int, pi: int) -> None:
        where = f"param_groups[{gi}]['params'][{pi}]"
        if p.device.type != "cpu":
            raise TypeError(f"CPUAdamW: {where} is on {p.device}; it updates CPU parameters only")
        want = torch.bfloat16 if getattr(self, "master_dtype", "fp32") == "bf16" else torch.float32
        if p.dtype != want:
            raise TypeError(f"CPUAdamW: {where} has dtype {p.dtype}; with master_dtype="
                            f"{getattr(self, 'master_dtype', 'fp32')!r} the parameters must be {want}")
        if p.is_sparse:
            raise TypeError(f"CPUAdamW: {where} is sparse; dense parameters only")
        if not p.is_contiguous():
            raise ValueError(f"CPUAdamW: {where} is not contiguous (shape {tuple(p.shape)}, stride {p.stride()})")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # Groups loaded from a torch.optim.AdamW/Adam state dict lack our keys:
        # torch's decoupled_weight_decay says which (an Adam state goes on as Adam).
        for group in self.param_groups:
            dec = group.get("decoupled_weight_decay")
            group.setdefault("adamw_mode", self.defaults.get("adamw_mode", True) if dec is None else bool(dec))
            group.setdefault("decoupled_weight_decay", group["adamw_mode"])
            group.setdefault("num_threads", self.defaults.get("num_threads"))
            if "seed" in self.defaults:
                group.setdefault("seed", self.defaults["seed"])

    def add_param_group(self, param_group: dict) -> None:
        # A group naming one of the two names of the decay mode sets both (not the default for the other).
        for mine, theirs in (("adamw_mode", "decoupled_weight_decay"), ("decoupled_weight_decay", "adamw_mode")):
            if mine in param_group and theirs not in param_group:
                param_group[theirs] = bool(param_group[mine])
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for pi, p in enumerate(self.param_groups[-1]["params"]):
            self._check_param(p, gi, pi)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group is checked before any parameter changes.
        hypers = [group_hyper(g, f"CPUAdamW param_groups[{gi}]") for gi, g in enumerate(self.param_groups)]
        bf16 = self.master_dtype == "bf16"
        q8 = self.moment_dtype == "int8"
        base = 0  # a parameter's stream: its position over all groups (stable across a resume)
        for gi, (group, h) in enumerate(zip(self.param_groups, hypers)):
            for (step, _), (ps, gs, ms, vs, mss, vss, streams) in self._buckets(group, gi, base).items():
                adamw_step_(ps, gs, ms, vs, step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                            weight_decay=h.weight_decay, adamw_mode=h.adamw_mode, grad_scale=h.sign,
                            num_threads=group.get("num_threads"), validate=False,
                            exp_avg_scales=mss if q8 else None, exp_avg_sq_scales=vss if q8 else None,
                            seed=group["seed"] if bf16 else None, streams=streams if bf16 else None)
            base += len(group["params"])
        return loss

    def _buckets(self, group: dict, gi: int, base: int) -> dict:
        """The group's parameters that have gradients, their step counts
        advanced, bucketed by (step, grad dtype): tensors that stepped equally
        often share bias corrections, so one native call per bucket (normally
        exactly one). Each bucket: params, grads, moments, scales, streams."""
        gdtypes = (torch.float32, torch.bfloat16) if self.master_dtype == "bf16" else (torch.float32,)
        buckets: dict = {}
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise TypeError(f"CPUAdamW: param_groups[{gi}]['params'][{pi}] has a sparse gradient; "
                                "sparse gradients are not supported")
            if g.device.type != "cpu" or g.dtype not in gdtypes:
                raise TypeError(f"CPUAdamW: param_groups[{gi}]['params'][{pi}] has a gradient of "
                                f"{g.dtype} on {g.device}; expected {' or '.join(map(str, gdtypes))} on cpu")
            if not g.is_contiguous():
                g = g.contiguous()
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                zero = torch.zeros(p.shape)
                state.update(moments.encode(zero, zero, self.moment_dtype))
            self._own_moments(p, state)
            step_t = state["step"]
            step_t += 1
            bucket = buckets.setdefault((int(step_t.item()), g.dtype), ([], [], [], [], [], [], []))
            for k, t in enumerate((p, g, state["exp_avg"], state["exp_avg_sq"], state.get("exp_avg_scale"),
                                   state.get("exp_avg_sq_scale"), base + pi)):
                bucket[k].append(t)
        return buckets

    def _own_moments(self, p: torch.Tensor, state: dict) -> None:
        """Makes ``state``'s moments what the kernel takes: ``moment_dtype``,
        contiguous CPU tensors of p's shape (a state loaded from elsewhere is
        converted once; see :mod:`infinity.optim.moments`)."""
        m, v = state["exp_avg"], state["exp_avg_sq"]
        want = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[self.moment_dtype]
        if all(s.dtype == want and s.device.type == "cpu" and s.is_contiguous() and s.shape == p.shape
               for s in (m, v)) and (want != torch.uint8 or "exp_avg_scale" in state):
            return
        if m.dtype != torch.uint8:  # fp32 moments of another dtype, device or layout: cast, as torch would
            m = m.to(device="cpu", dtype=torch.float32).reshape(p.shape)
            v = v.to(device="cpu", dtype=torch.float32).reshape(p.shape)
        else:
            m, v = moments.decode(state)
        for key in ("exp_avg_scale", "exp_avg_sq_scale"):
            state.pop(key, None)
        state.update(moments.encode(m.view_as(p), v.view_as(p), self.moment_dtype))

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state dict: moments as fp32 tensors (bf16 and
        int8 moments dequantised; the int8 scales are not in it)."""
        sd = super().state_dict()
        if self.moment_dtype != "fp32":
            sd["state"] = {k: self._torch_state(s) for k, s in sd["state"].items()}
        return sd

    @staticmethod
    def _torch_state(state: dict) -> dict:
        out = {k: v for k, v in state.items() if k not in ("exp_avg_scale", "exp_avg_sq_scale")}
        if "exp_avg" in state:
            out["exp_avg"], out["exp_avg_sq"] = moments.decode(state)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads torch's format (any float moments) and stores the moments as ``moment_dtype``."""
        moments_kept = {}
        if self.master_dtype == "bf16":
            # torch casts floating state to the parameter's dtype on load, and
            # these parameters are bf16: the moments are set here instead.
            ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            params = dict(zip(ids, [p for g in self.param_groups for p in g["params"]]))
            state = {}
            for pid, st in state_dict["state"].items():
                state[pid] = {k: t for k, t in st.items() if k == "step" or not isinstance(t, torch.Tensor)}
                moments_kept[params[pid]] = {k: t.detach().to("cpu", copy=True) for k, t in st.items()
                                             if k != "step" and isinstance(t, torch.Tensor)}
            state_dict = dict(state_dict, state=state)
        super().load_state_dict(state_dict)
        for p, kept in moments_kept.items():
            self.state[p].update(kept)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "exp_avg" in state:
                    self._own_moments(p, state)
