"""The rows of scripts/gpu/bench_gpu.py, and the raw probes they are judged against.

A row is one way to train the same GPT on the same batches, driven one step at
a time so that bench_gpu.py can interleave the rows (one step of each, then
the next round). Each builder returns a :class:`Row` or raises :class:`Skip`
with the reason (a baseline not installed, not enough host memory).

Rows:
  torch     plain PyTorch, the model in device memory, torch.optim.AdamW(fused=True);
            bf16 through torch.autocast (fp32 weights, as a user runs it)
  inf-opt   infinity, optimizer on the host (offload_params="none", overlap="backward"):
            ZeRO-Offload's and torchao's placement
  inf-all   infinity, parameters and optimizer on the host
  inf-nvme  infinity, optimizer on NVMe (swap files under --swap-dir), parameters on the device
  torchao   torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW, fused, offload_gradients=True);
            torchao is not on the GPU machine's image: carried as a wheel (scripts/gpu/carry_wheels.sh)
  fsdp2     FSDP2 fully_shard(offload_policy=CPUOffloadPolicy()) per block and at the root, a world
            of one (NCCL on CUDA, gloo on the CPU, where the policy cannot pin)
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from typing import Callable, Optional

import torch

import infinity
from infinity.cli.estimate import estimate
from infinity.cli.perf import optimizer_time
from infinity.models import GPT, GPTConfig

# In the order they are built: when building takes too long (first touch of
# tens of GB of host memory), the ones left out are the least needed.
ROWS = ("torch", "inf-opt", "inf-all", "torchao", "fsdp2", "inf-nvme")
LR, WD = 1e-4, 0.1


class Skip(Exception):
    """A row that cannot run here; the message says why."""


@dataclasses.dataclass
class Shape:
    """The model and batch: GPT blocks, width, heads, vocabulary; tokens per sequence, sequences per batch."""
    layers: int
    embd: int
    heads: int
    vocab: int
    seq: int
    batch: int

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads,
                         n_embd=self.embd, tie_weights=True)

    def flops_per_step(self, n_params: int) -> float:
        """Model FLOPs of one forward+backward: 6 N per token plus attention's
        12 x layers x width x seq per token (the PaLM count)."""
        return self.batch * self.seq * (6 * n_params + 12 * self.layers * self.embd * self.seq)


@dataclasses.dataclass
class Ctx:
    """What every row is built against."""
    device: torch.device
    dtype: str  # "bf16" or "fp32"
    shape: Shape
    template: GPT  # the initial weights every row copies
    swap_dir: str
    host_margin: int  # bytes of MemAvailable a row must leave free

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bf16")

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.template.parameters())


@dataclasses.dataclass
class Row:
    """One training setup: ``step(x, y)`` runs one step and returns its seconds
    ({"wall", and "compute"/"opt" where the row can split them});
    ``counters()`` the cumulative engine counters (infinity rows) or {}."""
    name: str
    step: Callable[[torch.Tensor, torch.Tensor], dict]
    close: Callable[[], None]
    counters: Callable[[], dict] = dict
    host_bytes: int = 0  # host memory planned for the row
    resident_bytes: int = 0  # device bytes the row holds between steps (measured)
    pinned_bytes: int = 0  # page-locked host bytes the row holds (measured)
    transfer_modelled: Optional[dict] = None  # {"h2d", "d2h"} bytes a step, for rows without counters
    times: list = dataclasses.field(default_factory=list)
    step_extra: list = dataclasses.field(default_factory=list)  # device bytes above resident, per step
    error: str = ""
    build_s: float = 0.0


def now() -> float:
    return time.perf_counter()


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, bytes (0 when unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_host(ctx: Ctx, name: str, need: int) -> None:
    """Skip when ``need`` bytes of host memory would leave less than the margin free."""
    avail = mem_available()
    if avail and need + ctx.host_margin > avail:
        raise Skip(f"{name} needs about {need / 2**30:.1f} GiB of host memory; MemAvailable is "
                   f"{avail / 2**30:.1f} GiB (margin {ctx.host_margin / 2**30:.1f} GiB)")


def pinned_now() -> int:
    """Bytes torch's caching host allocator holds now (CUDA; 0 elsewhere)."""
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    return 0


def device_now(ctx: Ctx) -> int:
    return torch.cuda.memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0


def _plain_step(ctx: Ctx, model, opt):
    """One timed step of a model whose optimizer is a plain torch one: wall,
    compute (forward + backward) and optimizer seconds."""
    def step(x, y):
        t0 = now()
        with ctx.autocast():
            loss = model(x, y)
        loss.backward()
        ctx.sync()
        t1 = now()
        opt.step()
        opt.zero_grad()
        ctx.sync()
        return {"wall": now() - t0, "compute": t1 - t0, "opt": now() - t1}
    return step


def torch_row(ctx: Ctx) -> Row:
    """Plain PyTorch in device memory, fused AdamW."""
    model = copy.deepcopy(ctx.template).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    step = _plain_step(ctx, model, opt)

    return Row("torch", step, close=lambda: None)


INFINITY_PLACEMENTS = {"inf-opt": ("none", "host"), "inf-all": ("host", "host"), "inf-nvme": ("none", "nvme")}


def infinity_config(ctx: Ctx, name: str, model) -> infinity.Config:
    """The row's Config: its placement, overlap="backward", a device budget
    (all of the compute copy with parameters on the device, else half of it,
    never below the model's minimum) and a host budget of the estimate's need."""
    params, opt_home = INFINITY_PLACEMENTS[name]
    kw = dict(device=str(ctx.device), dtype=ctx.dtype, offload_params=params, offload_optimizer=opt_home,
              overlap="backward", prefetch_depth=2, swap_paths=[ctx.swap_dir])
    est = estimate(model, infinity.Config(**kw, device_memory=1 << 50, host_memory=1 << 50))
    dev = est["device"]
    budget = max(dev["minimum"], dev["everything"] if params == "none" else dev["everything"] // 2)
    host = int(est["host"]["capacity"] * 1.1) + (64 << 20)
    return infinity.Config(**kw, device_memory=budget, host_memory=host)


def infinity_row(ctx: Ctx, name: str) -> Row:
    """One of infinity's placements (INFINITY_PLACEMENTS)."""
    model = copy.deepcopy(ctx.template)
    cfg = infinity_config(ctx, name, model)
    check_host(ctx, name, cfg.host_memory)
    try:
        model, opt = infinity.initialize(model, cfg, lr=LR, weight_decay=WD)
    except infinity.BudgetError as e:
        raise Skip(f"refused by infinity: {str(e)[:300]}") from e

    def step(x, y):
        t0 = now()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ctx.sync()
        return {"wall": now() - t0}

    pool = infinity.api.engine_of(model).room.tier.pool
    pinned = pool.capacity_bytes if pool is not None and pool.pinned else 0
    return Row(name, step, close=lambda: infinity.api.close(model), counters=lambda: infinity.stats(model),
               host_bytes=cfg.host_memory, pinned_bytes=pinned)


def torchao_row(ctx: Ctx) -> Row:
    """torchao's CPUOffloadOptimizer: gradients down per parameter as they
    land, fused CPU AdamW per parameter in step(), parameters back up."""
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as e:
        raise Skip(f"torchao is not importable ({e}); carry its wheel: bash scripts/gpu/carry_wheels.sh") from e
    if ctx.device.type != "cuda":
        raise Skip("CPUOffloadOptimizer runs on CUDA or XPU only")
    n = ctx.n_params
    check_host(ctx, "torchao", 16 * n)
    model = copy.deepcopy(ctx.template).to(ctx.device)
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True, lr=LR,
                              weight_decay=WD, fused=True)

    step = _plain_step(ctx, model, opt)

    return Row("torchao", step, close=lambda: None, host_bytes=16 * n,
               transfer_modelled={"h2d": 4 * n, "d2h": 4 * n})


def fsdp2_row(ctx: Ctx) -> Row:
    """FSDP2 with CPUOffloadPolicy over a world of one (NCCL on CUDA, gloo on
    the CPU), bf16 parameters through MixedPrecisionPolicy; fused AdamW on the
    host shards. The process group is made here and destroyed by close()."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    n = ctx.n_params
    check_host(ctx, "fsdp2", 16 * n)
    cuda = ctx.device.type == "cuda"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        if cuda:
            torch.cuda.set_device(ctx.device.index or 0)
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(ctx.device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if ctx.dtype == "bf16" else None,
                              reduce_dtype=torch.float32)
    policy = CPUOffloadPolicy(pin_memory=cuda)  # on the CPU there is nothing to pin with
    model = copy.deepcopy(ctx.template)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)

    def step(x, y):
        t0 = now()
        loss = model(x, y)
        loss.backward()
        ctx.sync()
        t1 = now()
        opt.step()
        opt.zero_grad()
        ctx.sync()
        return {"wall": now() - t0, "compute": t1 - t0, "opt": now() - t1}

    def close():
        if dist.is_initialized():
            dist.destroy_process_group()

    return Row("fsdp2", step, close=close, host_bytes=16 * n, transfer_modelled={"h2d": 4 * n, "d2h": 4 * n})


def build_row(ctx: Ctx, name: str) -> Row:
    """The row ``name`` (one of ROWS), its resident device bytes and pinned host bytes measured around the build."""
    builders = {"torch": torch_row, "torchao": torchao_row, "fsdp2": fsdp2_row}
    d0, p0 = device_now(ctx), pinned_now()
    row = builders[name](ctx) if name in builders else infinity_row(ctx, name)
    ctx.sync()
    row.resident_bytes = device_now(ctx) - d0
    row.pinned_bytes += pinned_now() - p0
    return row


def copy_probe(nbytes: int, device: torch.device, reps: int = 5) -> dict:
    """GB/s of pinned host<->device copies of ``nbytes``: each direction alone,
    then both at once on two streams (each direction has its own copy engine).
    On the CPU, plain copies one after the other."""
    from infinity.io import HostPool
    pool = HostPool(2 * nbytes, pin="auto")
    bufs = [pool.acquire(nbytes), pool.acquire(nbytes)]
    try:
        up, down = (b.view(torch.uint8) for b in bufs)
        up.fill_(1)
        dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev_b = torch.ones(nbytes, dtype=torch.uint8, device=device)
        out = {"bytes": nbytes, "pinned": pool.pinned}
        out["h2d_GBps"] = nbytes / _timed(lambda: dev_a.copy_(up, non_blocking=True), device, reps) / 1e9
        out["d2h_GBps"] = nbytes / _timed(lambda: down.copy_(dev_b, non_blocking=True), device, reps) / 1e9
        both = _timed(lambda: _duplex(dev_a, up, down, dev_b, device), device, reps)
        out["duplex_GBps_each"] = nbytes / both / 1e9
    finally:
        for b in bufs:
            b.release()
        pool.close()
    return out


def _duplex(dev_a, up, down, dev_b, device) -> None:
    """Both copies at once: H2D on one side stream, D2H on another (CUDA)."""
    if device.type != "cuda":
        dev_a.copy_(up)
        down.copy_(dev_b)
        return
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    s1.wait_stream(torch.cuda.current_stream(device))
    s2.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s1):
        dev_a.copy_(up, non_blocking=True)
    with torch.cuda.stream(s2):
        down.copy_(dev_b, non_blocking=True)
    torch.cuda.current_stream(device).wait_stream(s1)
    torch.cuda.current_stream(device).wait_stream(s2)


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median wall seconds of ``fn`` to a device synchronize, after one untimed call."""
    ts = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = now()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append(now() - t0)
    return statistics.median(ts[1:])


def adamw_probe(n: int, threads: Optional[int]) -> dict:
    """Gparam/s of one CPU AdamW step over ``n`` fp32 parameters: infinity's
    (native when built) at ``threads`` (None: its default), and torch's fused CPU AdamW."""
    native_s = optimizer_time(n, threads)
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=LR, weight_decay=WD, fused=True)
    torch_s = _timed(opt.step, torch.device("cpu"), 3)
    return {"params": n, "threads": threads, "infinity_Gparam_per_s": n / native_s / 1e9,
            "torch_fused_Gparam_per_s": n / torch_s / 1e9, "torch_threads": torch.get_num_threads()}
