"""``InfinityOptimizer``: the optimizer ``infinity.initialize`` returns.

A ``torch.optim.Optimizer`` whose ``param_groups`` hold the model's parameters
(so torch LR schedulers work) but whose state lives in the units' flat fp32
buffers: the update is the native CPU AdamW (``offload_optimizer="host"``) or
the same maths on the device (``"none"``), one call per unit and param group.

[Note: when the optimizer runs]
- overlap="step": in ``step()``, unit by unit, after backward.
- overlap="backward": a unit's update is queued on the host worker thread as
  soon as its last gradient has left the device during the last backward of
  the accumulation window (``Config.grad_accumulation_steps``). It reads only
  host buffers and writes the master, the moments and the host compute copy;
  the device copy that backward still reads is untouched until ``step()``
  invalidates it. Clipping and fp16 overflow checks need every gradient
  first, so with either the updates wait for ``step()``.
- overlap="delayed": ``step()`` applies the update computed from the previous
  step's gradients (swapping in the second compute buffer) and queues the
  update of this step's gradients, which then runs during the next forward
  and backward. The update applied at step t uses the gradients of step t-1.

[Note: the accumulation window]
``Config.grad_accumulation_steps`` backward passes make one step. In the last
of them some work happens during backward: with overlap="backward" each
unit's update, and under data parallelism (stages 0, 2, 3) each unit's
gradient reduction. Once that ran (``Engine.window_closed``), another
backward before ``step()`` would add gradients nothing reads any more, so its
first gradient raises instead of being dropped; ``zero_grad()`` after an
early update raises too, since the update cannot be undone.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch
# torch.optim.Optimizer imports torch._dynamo on first use. Imported after
# init_process_group, it keeps the gloo group alive past destroy_process_group
# (torch 2.13), and gloo then releases its last work during interpreter
# shutdown, which can abort a finished run (SIGABRT). Imported with infinity,
# usually before the process group exists, it does not.
import torch._dynamo  # noqa: F401,E402

from ..optim.functional import adamw_step_, check_hyperparameters
from .core import Engine
from .state import GradState, transition
from .units import Unit

__all__ = ["InfinityOptimizer"]


class InfinityOptimizer(torch.optim.Optimizer):
    """AdamW over the engine's units. Use like any torch optimizer:
    ``step()``, ``zero_grad()``, LR schedulers on ``param_groups``.

    fp16: multiply the loss by :meth:`scale_loss` before ``backward()``
    (``optimizer.scale_loss(loss).backward()``); ``step()`` unscales, skips
    the step on overflow and adjusts the scale (see :attr:`loss_scale`).
    """

    def __init__(self, engine: Engine, param_groups: List[dict], defaults: dict):
        self.engine = engine
        super().__init__(param_groups, defaults)
        cfg = engine.config
        self.overlap = cfg.overlap
        self.max_grad_norm = cfg.max_grad_norm
        self.fp16 = cfg.dtype == "fp16"
        self.loss_scale = float(cfg.initial_loss_scale if cfg.loss_scale == "dynamic" else cfg.loss_scale) \
            if self.fp16 else 1.0
        self._dynamic = self.fp16 and cfg.loss_scale == "dynamic"
        self._good_steps = 0
        self._num_threads = cfg.num_threads
        self._stepped_early: Dict[int, bool] = {}   # units updated during backward this step
        self._closing = False                        # this backward ran last-window work (see the Note)
        self._reducing: List[Unit] = []              # stages 2-3: full gradients still being reduced
        # Gradients go through a reduction under data parallelism, and under
        # any ZeRO stage even for one rank: it fills the shard the update reads.
        self._needs_reduce = engine.sharding.world > 1 or engine.zero > 0
        self._root_prefetch = None                   # host job reading the root's state ahead (NVMe)
        self._pending: List = []                     # delayed mode: updates in flight
        self._pending_units: List[Unit] = []
        self._stat_lock = threading.Lock()
        self.last_grad_norm: Optional[float] = None

    # -- loss scaling -----------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (1 unless dtype is fp16)."""
        return loss * self.loss_scale if self.fp16 else loss

    # -- hooks from the engine ------------------------------------------------------------

    # At most this many units' full gradients wait for their reduction (stages
    # 2 and 3 free them only after it): with the unit whose gradients arrive,
    # two units' worth, what the host budget sets aside (Engine._place).
    _MAX_REDUCING = 1

    def _reduce(self, u: Unit) -> None:
        """ZeRO: starts summing ``u``'s gradients over the ranks into its own
        shard (see [Note: ZeRO shards in infinity]), asynchronously, so backward
        goes on meanwhile. The ticket joins ``u.flush_tickets``: whatever reads
        or frees the gradients waits for it (``Engine.wait_grads``); stages 2
        and 3 free the full buffer once it is done."""
        eng = self.engine
        eng.wait_grads(u)
        if u.grad is None:
            # Spilled to NVMe (read back), or no gradient on this rank (contribute zeros).
            spilled = u.grad_on_nvme
            eng.acquire_grad(u)
            if not spilled:
                u.grad.zero_()
        if not eng.zero:  # plain data parallelism: every rank keeps the summed gradients
            t = eng.sharding.all_reduce_(u.grad, async_op=True)
        else:
            t = eng.sharding.reduce_scatter(u.grad_shard, u.grad, async_op=True)
        u.flush_tickets.append(t)
        u.grad_reduced = True
        if eng.zero >= 2:
            self._reducing.append(u)
            while len(self._reducing) > self._MAX_REDUCING:
                self._release_reduced(self._reducing.pop(0))

    def _release_reduced(self, u: Unit) -> None:
        """Stages 2-3: frees ``u``'s full gradients once their reduction is done
        (an early update may have freed them already)."""
        if u.opt_ticket is not None and u.grad_claimed:
            return  # the update job frees them
        self.engine.release_grad(u)

    def _finish_reductions(self) -> None:
        for u in self._reducing:
            self._release_reduced(u)
        self._reducing = []

    def _on_unit_grads(self, u: Unit) -> None:
        eng = self.engine
        last = eng.micro_batches + 1 == eng.config.grad_accumulation_steps
        if self._needs_reduce and eng.zero != 1 and last and u.trainable_numel and not u.grad_reduced:
            self._closing = True  # See [Note: the accumulation window]
            self._reduce(u)  # in program order on every rank
        early = (self.overlap == "backward" and self.max_grad_norm is None and not self.fp16
                 and last and eng.zero != 1
                 and u.index not in self._stepped_early and u.opt_ticket is None)
        if not early:
            if eng.opt_nvme and not eng.zero:
                eng.spill_grads(u)  # bounded host memory until step()
            return
        self._closing = True
        self._stepped_early[u.index] = True
        grad, written = (u.grad_shard if eng.zero else u.grad), list(u.grad_written)
        scale = 1.0 / eng.sharding.world  # gradients are sums over the data-parallel ranks
        if eng.opt_nvme:
            u.grad_claimed = not eng.zero

            def job() -> None:
                eng.wait_grads(u)
                for h in eng.opt_load(u):
                    h.wait()
                self._unit_step(u, grad, written, eng.opt_out(u, all(written)), scale)
                eng.opt_store(u)
                eng.release_grad(u)
        else:
            def job() -> None:
                eng.wait_grads(u)
                self._update_unit(u, grad, written, scale)

        u.opt_ticket = eng.mover.host_job(job)
        if eng.opt_nvme:
            self._prefetch_next_state()

    def _prefetch_next_state(self) -> None:
        """Reads the optimizer state of the unit whose gradients complete next
        (the next unit in the backward trace, finally the root) while the
        current one is updated. The root's update runs after backward ends,
        on the step's critical path: its state is read one unit earlier, on
        the host thread, evicting compute copies this pass is done with if the
        host budget has no room."""
        eng = self.engine
        nxt: List[Unit] = []
        for idx in eng.trace.upcoming(16):
            v = eng.units[idx]
            if v.trainable_numel and idx not in self._stepped_early and v not in nxt:
                nxt.append(v)
                if len(nxt) == 2:
                    break
        root = eng.units[0]
        if len(nxt) < 2 and root.trainable_numel and root.index not in self._stepped_early and root not in nxt:
            nxt.append(root)
        if nxt:
            eng.opt_prefetch(nxt[0])
        if nxt and nxt[-1] is root and root.opt_pending is None and self._root_prefetch is None:
            # Queued behind the update just submitted, so it never takes that update's buffers.
            self._root_prefetch = eng.mover.host_job(lambda: eng.opt_prefetch(root, evict_done=True))

    def _on_backward_end(self) -> None:
        eng = self.engine
        if self._closing:
            eng.window_closed = True
        if eng.opt_nvme and not eng.zero:
            for u in eng.units:  # units some of whose parameters got no gradient
                if u.grad is not None and not u.grad_claimed:
                    eng.spill_grads(u)

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Updates every unit; returns when each unit's new compute copy is in
        its home tier (delayed mode: when this step's update is queued)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, g in enumerate(self.param_groups):
            lr = float(g["lr"])
            check_hyperparameters(lr, g["betas"], g["eps"], g["weight_decay"])
        eng = self.engine
        if eng._in_pass and eng._pass_grad:
            eng.end_pass()  # step() without a finished backward: release the pass
        if self.overlap == "delayed":
            self._step_delayed()
        else:
            self._step_now()
        eng.micro_batches = 0
        eng.window_closed = self._closing = False
        eng.after_step()
        eng.stats.end_step_window()
        return loss

    def _global_scale(self, units_grads) -> Tuple[bool, float]:
        """(skip, grad_scale): unscaling, clipping and the fp16 overflow check,
        over all gradients. ``units_grads`` is a list of (unit, grad buffer, written)."""
        eng = self.engine
        world = eng.sharding.world  # ZeRO: the gradients are sums over the ranks
        inv = (1.0 / self.loss_scale if self.fp16 else 1.0) / world
        if self.max_grad_norm is None and not self.fp16:
            return False, inv
        parts = []  # per unit, the sum of squares (float64, where the gradients live)
        for u, grad, written in units_grads:
            if grad is None and eng.opt_nvme:
                eng.load_grad(u)  # spilled: read back for the norm (and dropped again)
                grad = u.grad
            if grad is None:
                continue
            runs = [ab for ab in (self._local(u, a, b, grad) for a, b in self._written_runs(u, written))
                    if ab is not None]
            if runs:
                norms = torch._foreach_norm([grad[a:b] for a, b in runs], 2, dtype=torch.float32)
                parts.append(torch.stack(norms).double().square().sum())
            if eng.opt_nvme:
                eng.drop_loaded_grad(u)
        # One read of the result: on CUDA each float() would be a sync.
        sq = float(torch.stack(parts).sum()) if parts else 0.0
        norm = math.sqrt(eng.sharding.sum_shards(sq)) / world
        if not math.isfinite(norm):
            self.last_grad_norm = norm
            return True, inv
        norm /= self.loss_scale if self.fp16 else 1.0
        self.last_grad_norm = norm
        scale = inv
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + 1e-6)
            scale *= min(coef, 1.0)
        return False, scale

    def _after_overflow_check(self, skip: bool) -> None:
        if not self.fp16:
            return
        if skip:
            self.engine.stats.skipped_steps += 1
            self._good_steps = 0
            if self._dynamic:
                self.loss_scale = max(self.loss_scale / 2.0, float(self.engine.config.min_loss_scale))
        else:
            self._good_steps += 1
            if self._dynamic and self._good_steps % self.engine.config.loss_scale_growth_interval == 0:
                self.loss_scale *= 2.0

    def _step_now(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        if self._root_prefetch is not None:
            self._root_prefetch.wait()
            self._root_prefetch = None
        for u in eng.units:
            if u.opt_ticket is not None:
                u.opt_ticket.wait()
                u.opt_ticket = None
        eng.stats.optimizer_wait_seconds += time.perf_counter() - t0
        eng.drain_grads()
        if self._needs_reduce:
            for u in eng.units:  # same order on every rank
                if u.trainable_numel and not u.grad_reduced and u.index not in self._stepped_early:
                    self._reduce(u)
            eng.drain_grads()  # the reductions
            self._finish_reductions()
        todo = [u for u in eng.units if u.index not in self._stepped_early and u.trainable_numel]
        skip, scale = self._global_scale([(u, u.grad_shard if eng.zero else u.grad, u.grad_written)
                                          for u in todo])
        if skip and self._stepped_early:
            raise RuntimeError("internal: overflow after early updates")  # early updates exclude fp16
        self._after_overflow_check(skip)
        if not skip:
            if eng.opt_nvme:
                self._step_pipeline(todo, scale)
            else:
                for u in todo:
                    self._update_unit(u, u.grad_shard if eng.zero else u.grad, list(u.grad_written), scale)
            if eng.zero in (1, 2):  # every rank gets the new compute copies of every shard
                for u in eng.units:
                    if u.trainable_numel:
                        comp = eng.opt_out(u)  # NVMe home: the cached copy, read back if evicted
                        eng.sharding.all_gather_(comp[:u.trainable_numel])
                        eng.compute_written(u)
                        eng.values_changed(u)
            eng.stats.steps += 1
        for u in eng.units:
            self._consume(u)
        self._stepped_early = {}
        if not skip:
            self._refresh_compute_copies()

    def _step_pipeline(self, todo: List[Unit], scale: float) -> None:
        """NVMe optimizer state: while unit i is updated, unit i+1's master,
        moments and gradients are being read and unit i-1's are being written
        (see [Note: NVMe homes and the host cache])."""
        eng = self.engine

        def load(u: Unit) -> list:
            hs = [] if eng.zero else [h for h in (eng.load_grad(u, wait=False),) if h is not None]
            return hs + eng.opt_load(u)

        pending = load(todo[0]) if todo else []
        for i, u in enumerate(todo):
            for h in pending:
                h.wait()
            pending = load(todo[i + 1]) if i + 1 < len(todo) else []
            grad = u.grad_shard if eng.zero else u.grad
            if grad is not None:
                self._unit_step(u, grad, list(u.grad_written), eng.opt_out(u, all(u.grad_written)), scale)
                eng.opt_store(u)
            else:  # no gradient this step: put the untouched state back
                eng.opt_store_unchanged(u)
            eng.release_grad(u)

    def _refresh_compute_copies(self) -> None:
        eng = self.engine
        if not eng.host_optimizer:
            # The optimizer ran on the device: write the new compute copies.
            for u in eng.units:
                tn = u.trainable_numel
                if not tn:
                    continue
                if u.permanent:
                    u.dev_compute[:tn].copy_(u.master)
                else:
                    t = eng.mover.d2h(u.host_compute[:tn], u.master.to(eng.dtype)) if eng.mover.is_cuda \
                        else u.host_compute[:tn].copy_(u.master)
                    if eng.mover.is_cuda:
                        t.wait()
        eng.invalidate_device_copies()

    def _update_unit(self, u: Unit, grad: torch.Tensor, written: List[bool], scale: float) -> None:
        """One unit's update with the optimizer state in memory (host or
        device). With NVMe homes of the parameters the new compute copy goes
        through the host cache (``opt_out``/``compute_written``), so it is
        marked dirty and written back when evicted, never lost."""
        eng = self.engine
        if not any(written):
            return  # no gradient this step: nothing changes
        out = eng.opt_out(u, all(written)) if eng.host_optimizer else None
        try:
            self._unit_step(u, grad, written, out, scale)
        finally:
            if eng.host_optimizer:
                eng.compute_written(u)

    def _consume(self, u: Unit) -> None:
        if self.engine.opt_nvme or self.engine.zero >= 2:
            self.engine.release_grad(u)
        u.grad_reduced = False
        if u.grad_state is not GradState.CLEAN:
            u.grad_state = transition(u.name, "grad", u.grad_state, GradState.CONSUMED)
            u.grad_state = transition(u.name, "grad", u.grad_state, GradState.CLEAN)
        u.grad_written = [False] * len(u.grad_written)

    def _step_delayed(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        for t in self._pending:
            t.wait()
        eng.stats.optimizer_wait_seconds += time.perf_counter() - t0
        if self._pending:
            self._apply_pending()
        eng.drain_grads()
        work = []
        for u in eng.units:
            if not u.trainable_numel:
                continue
            grad, written = u.grad, list(u.grad_written)
            u.grad, u.next_grad = u.next_grad, u.grad  # the next backward fills the other buffer
            work.append((u, grad, written))
        skip, scale = self._global_scale(work)
        self._after_overflow_check(skip)
        for u in eng.units:
            self._consume(u)
        if skip:
            return
        eng.stats.steps += 1
        for u, grad, written in work:
            out = u.next_compute

            def job(u=u, grad=grad, written=written, out=out) -> None:
                self._unit_step(u, grad, written, out, scale)

            self._pending.append(eng.mover.host_job(job))
            self._pending_units.append(u)

    def flush(self) -> None:
        """Delayed mode: wait for the queued update and apply it now (before
        evaluation, checkpointing or the end of training). No-op otherwise."""
        if self.overlap != "delayed" or not self._pending:
            return
        for t in self._pending:
            t.wait()
        self._apply_pending()

    def _apply_pending(self) -> None:
        """Delayed mode, after the queued updates finished: their compute
        copies become the home copies; device copies are refreshed."""
        self._pending = []
        for u in self._pending_units:
            u.host_compute, u.next_compute = u.next_compute, u.host_compute
            self.engine.values_changed(u)
        self._pending_units = []
        self.engine.invalidate_device_copies()

    # -- one unit -----------------------------------------------------------------------------

    def _clip_to_shard(self, u: Unit, a: int, b: int) -> Tuple[int, int]:
        """Global range [a, b) cut to the own ZeRO shard (unchanged without ZeRO)."""
        if not self.engine.zero:
            return a, b
        lo, hi = self.engine.sharding.shard(u.trainable_numel)
        return max(a, lo), min(b, hi)

    def _local(self, u: Unit, a: int, b: int, buf: torch.Tensor) -> Optional[Tuple[int, int]]:
        """Indices into ``buf`` for global range [a, b): ``buf`` is either the
        full buffer, or (ZeRO) the own shard, then the range is cut to it (None
        when empty)."""
        if buf.numel() == u.trainable_numel:
            return a, b
        lo = self.engine.sharding.shard(u.trainable_numel)[0]
        a2, b2 = self._clip_to_shard(u, a, b)
        return (a2 - lo, b2 - lo) if a2 < b2 else None

    @staticmethod
    def _runs(u: Unit, written: List[bool], key=lambda s: None) -> Dict[object, List[Tuple[int, int]]]:
        """Element ranges of runs of consecutive trainable slots that got
        gradients and share ``key(slot)``, grouped by key. Padding between
        slots is zero in every buffer, so a run may span it."""
        runs: Dict[object, List[Tuple[int, int]]] = {}
        cur_key, cur = None, None
        for ti, s in enumerate(u.layout.trainable_slots):
            k = key(s) if written[ti] else None
            if written[ti] and cur is not None and k == cur_key:
                cur[1] = s.offset + s.numel
                continue
            if cur is not None:
                runs.setdefault(cur_key, []).append((cur[0], cur[1]))
            cur_key, cur = k, ([s.offset, s.offset + s.numel] if written[ti] else None)
        if cur is not None:
            runs.setdefault(cur_key, []).append((cur[0], cur[1]))
        return runs

    @classmethod
    def _written_runs(cls, u: Unit, written: List[bool]) -> List[Tuple[int, int]]:
        """Element ranges covering runs of consecutive trainable slots that got gradients."""
        return [r for rs in cls._runs(u, written).values() for r in rs]

    def _unit_step(self, u: Unit, grad: torch.Tensor, written: List[bool], out: Optional[torch.Tensor],
                   grad_scale: float) -> None:
        """AdamW on one unit: one kernel call per (param group, step count) run
        of consecutive slots that received gradients. Padding between slots is
        zero in every buffer, so runs may span it."""
        t0 = time.perf_counter()
        slots = u.layout.trainable_slots
        runs = self._runs(u, written, key=lambda s: (s.group, s.step))
        eng = self.engine
        # NVMe optimizer state: when one call updates the whole buffers, it
        # also takes their sums for the write-back ([Note: sums from the
        # producer] in native/src/adam.cpp). Padding is zero in every buffer
        # and stays zero under the update, so the call may span all of it.
        chunk = eng.nvme.sum_chunk_bytes if eng.opt_nvme and u.master.device.type == "cpu" else None
        whole = chunk is not None and len(runs) == 1 and all(written)
        u.opt_sums = {}
        for (gi, step), global_ranges in runs.items():
            if whole:
                global_ranges = [(0, u.trainable_numel)]
            g = self.param_groups[gi]
            beta1, beta2 = g["betas"]
            # ZeRO: only the part inside the own shard; state buffers are shard-local.
            ranges = [(a, b) for a, b in global_ranges if self._local(u, a, b, u.master) is not None]
            if not ranges:
                continue
            st = [self._local(u, a, b, u.master) for a, b in ranges]
            gr = [self._local(u, a, b, grad) for a, b in ranges]
            ranges = [self._clip_to_shard(u, a, b) for a, b in ranges]
            ps = [u.master[a:b] for a, b in st]
            gs = [grad[a:b] for a, b in gr]
            ms = [u.exp_avg[a:b] for a, b in st]
            vs = [u.exp_avg_sq[a:b] for a, b in st]
            if out is not None and self.engine.zero == 3:
                outs = [out[a:b] for a, b in st]  # the home copy is the shard, trainable part first
            else:
                outs = [out[a:b] for a, b in ranges] if out is not None else None
            if u.master.device.type == "cuda":
                self._device_step(ps, gs, ms, vs, step + 1, g, grad_scale)
            else:
                sums = whole and len(st) == 1 and st[0] == (0, u.master.numel())
                got = adamw_step_(ps, gs, ms, vs, step=step + 1, lr=float(g["lr"]), beta1=float(beta1),
                                  beta2=float(beta2), eps=float(g["eps"]), weight_decay=float(g["weight_decay"]),
                                  adamw_mode=g.get("adamw_mode", True), grad_scale=grad_scale, outs=outs,
                                  num_threads=self._num_threads, validate=False,
                                  sum_chunk_bytes=chunk if sums else None)
                if got:
                    u.opt_sums = dict(zip(("master", "exp_avg", "exp_avg_sq"), got[0]))
        for ti, s in enumerate(slots):
            if written[ti]:
                s.step += 1
        if self.overlap != "delayed":  # delayed: the new values become live in _apply_pending
            eng.values_changed(u, [s for ti, s in enumerate(slots) if written[ti]])
        with self._stat_lock:
            self.engine.stats.optimizer_seconds += time.perf_counter() - t0

    @staticmethod
    def _device_step(ps, gs, ms, vs, step, g, grad_scale) -> None:
        """The same update on CUDA buffers with torch's fused AdamW."""
        if grad_scale != 1.0:
            torch._foreach_mul_(gs, grad_scale)
        # One step tensor for all (the fused kernels only read it): no
        # pageable copy and stream sync per tensor.
        steps = [torch.full((), float(step), dtype=torch.float32, device=ps[0].device)] * len(ps)
        beta1, beta2 = g["betas"]
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=float(g["lr"]), beta1=float(beta1), beta2=float(beta2),
                            weight_decay=float(g["weight_decay"]), eps=float(g["eps"]), amsgrad=False,
                            maximize=False) if g.get("adamw_mode", True) else \
            torch._fused_adam_(ps, gs, ms, vs, [], steps, lr=float(g["lr"]), beta1=float(beta1),
                               beta2=float(beta2), weight_decay=float(g["weight_decay"]), eps=float(g["eps"]),
                               amsgrad=False, maximize=False)

    # -- zero_grad, state ------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets accumulated gradients (the buffers are overwritten by the
        next backward rather than zeroed)."""
        eng = self.engine
        if self._stepped_early:
            # See [Note: the accumulation window].
            raise RuntimeError(
                "optimizer.zero_grad() before optimizer.step(), after a backward whose updates already ran "
                "(overlap='backward' updates each unit during the last backward of the accumulation window): "
                "the gradients cannot be discarded any more. Call optimizer.step() first, or use "
                "overlap='step' to decide after backward whether to step")
        eng.window_closed = self._closing = False
        eng.drain_grads()
        for u in eng.units:
            if u.opt_ticket is None:
                self._consume(u)
            for s in u.layout.slots:
                s.param.grad = None

    def state_dict(self) -> dict:
        """torch.optim.AdamW-format state (``step``, ``exp_avg``, ``exp_avg_sq``
        per parameter, CPU fp32 copies) and param groups."""
        self.flush()
        index = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                index[id(p)] = len(index)
        state = {}
        eng = self.engine
        for u in eng.units:
            if not any(s.step for s in u.layout.trainable_slots):
                continue
            m, v = eng.read_kind(u, "exp_avg"), eng.read_kind(u, "exp_avg_sq")
            for s in u.layout.trainable_slots:
                if s.step == 0:
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                state[index[id(s.param)]] = {
                    "step": torch.tensor(float(s.step)),
                    "exp_avg": m[sl].detach().to("cpu", copy=True).view(s.shape),
                    "exp_avg_sq": v[sl].detach().to("cpu", copy=True).view(s.shape),
                }
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [index[id(p)] for p in g["params"]]
            groups.append(d)
        return {"state": state, "param_groups": groups}
