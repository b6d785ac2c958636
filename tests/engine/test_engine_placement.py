"""placement.py on its own: unit sizes, aliasing and the budget arithmetic,
against figures computed by hand for small layouts."""

import pytest
import torch
import torch.nn as nn

from infinity.engine.plan import placement as pl
from infinity.engine.plan.units import Layout

F32, BF16 = torch.float32, torch.bfloat16


def modes(params="host", optimizer="host", dtype=F32, zero=0, world=1, delayed=False, depth=2, accum=1,
          grad_dtype=None):
    return pl.Modes(torch.device("cpu"), dtype, grad_dtype or F32, params, optimizer, zero, world, delayed, depth,
                    accum)


def layout(*numels, frozen=(), pad_to=1):
    named = [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(numels)]
    for i in frozen:
        named[i][1].requires_grad_(False)
    return Layout(named, {}, pad_to)


def test_unit_sizes_and_shards():
    lay = layout(100, 50, frozen=(1,), pad_to=2)  # trainable 100 -> 128 (x2 ranks: 128); frozen 50
    assert lay.trainable_numel == 128 and lay.numel == 128 + 64
    p = pl.place_unit(lay, modes(zero=3, world=2))
    assert (p.compute_numel, p.trainable_numel, p.home_numel, p.state_numel) == (192, 128, 96, 64)
    assert p.compute_bytes == 192 * 4 and not p.aliased
    p = pl.place_unit(lay, modes(zero=1, world=2, dtype=BF16))
    assert (p.home_numel, p.state_numel, p.compute_bytes) == (192, 64, 192 * 2)


@pytest.mark.parametrize("kw,aliased", [
    (dict(params="nvme", optimizer="nvme"), True),
    (dict(params="nvme", optimizer="nvme", dtype=BF16), False),      # the master is fp32, the copy bf16
    (dict(params="nvme", optimizer="host"), False),                  # the master lives elsewhere
    (dict(params="nvme", optimizer="nvme", zero=1, world=2), False),  # the master is a shard
])
def test_master_aliasing_only_when_the_bits_are_the_same(kw, aliased):
    assert pl.place_unit(layout(64, 32), modes(**kw)).aliased is aliased
    assert not pl.place_unit(layout(64, 32, frozen=(1,)), modes(params="nvme", optimizer="nvme")).aliased


def test_device_need_counts_pass_units_and_depth():
    m = modes(depth=1)
    places = [pl.place_unit(layout(n), m) for n in (64, 256, 128, 32, 512)]  # the root first
    need = pl.device_need(places, [False] * 5, m)
    # root 256 B + the two largest others (2048 + 1024 B)
    assert need.arena_min == 256 + 2048 + 1024
    assert need.grad_reserve == 2048 and need.opt_fixed == 0 and need.largest_unit == 2048
    assert need.minimum == need.arena_min + 2048 + 512 * 6
    ext = pl.device_need(places, [False, False, False, True, False], m)  # unit 3 stays resident
    assert ext.arena_min == 256 + 128 + 2048 + 1024
    assert need.everything == 256 + 1024 + 512 + 128 + 2048 + 2048 + 512 * 6
    assert need.arena_bytes(10 ** 9) == need.all_compute + 512 * 6
    dev_opt = pl.device_need(places, [False] * 5, modes(optimizer="none", params="none"))
    assert dev_opt.opt_fixed == 4 * 4 * (64 + 256 + 128 + 32 + 512) and dev_opt.arena_min == dev_opt.all_compute


def test_host_need_host_homes():
    m = modes()
    places = [pl.place_unit(layout(n), m) for n in (1024, 2048)]
    need = pl.host_need(places, m)
    # per unit: compute copy + master + 2 moments (fp32) + fp32 grads, each rounded up to a page
    pages = lambda n: max(4096, -(-n // 4096) * 4096)  # noqa: E731
    per = lambda n: 5 * pages(4 * n)  # noqa: E731
    assert need.permanent == need.minimum == need.capacity == per(1024) + per(2048)
    delayed = pl.host_need(places, modes(delayed=True))
    assert delayed.permanent == need.permanent + pages(4096) + pages(8192) + pages(4096) + pages(8192)
    bf16 = modes(dtype=BF16, grad_dtype=BF16)
    half = pl.host_need([pl.place_unit(layout(2048), bf16)], bf16)
    assert half.permanent == pages(2 * 2048) + 3 * pages(4 * 2048) + pages(2 * 2048)  # bf16 copy and grads


def test_host_need_nvme_homes_minimum_and_capacity():
    m = modes(params="nvme", optimizer="nvme", depth=1)
    places = [pl.place_unit(layout(n), m) for n in (1024, 4096, 2048)]
    need = pl.host_need(places, m)
    c = [max(4096, 4 * n) for n in (1024, 4096, 2048)]  # compute copies, rounded to pages
    # Nothing permanent; the cache of (depth + 2) largest + the root's; the pipeline of 9 fp32 buffers + a copy.
    assert need.permanent == 0
    assert need.minimum == (1 + 2) * 16384 + c[0] + 9 * 16384 + 16384
    # Aliased: the master is the compute copy, so 3 fp32 buffers (2 moments + grads) per unit go to NVMe.
    assert need.nvme_bytes == sum(c) + 3 * sum(c)
    assert need.capacity == sum(c) + 3 * sum(c) + 9 * 16384 + 16384
    assert pl.nvme_capacity(need, 3, 2) == need.nvme_bytes + 2 * 4096 * 3 * 5 * 2 + 64 * 4096


def test_host_need_zero_stages():
    for zero, full_grads in ((1, True), (2, False)):
        m = modes(zero=zero, world=2)
        places = [pl.place_unit(layout(2048, pad_to=2), m)]
        need = pl.host_need(places, m)
        shard = 4096  # 1024 fp32 elements
        # compute copy (full) + grad shard (+ stage 1's full grads) + master and moments shards
        assert need.permanent == 8192 + shard + (8192 if full_grads else 0) + 3 * shard
        if zero == 2:  # full gradients of up to two units reducing at once
            assert need.minimum == need.permanent + 8192 and need.capacity == need.permanent + 8192


@pytest.mark.parametrize("stage, world, accum, opt, overlap, why", [
    (2, 2, 1, "host", "step", None), (3, 4, 1, "nvme", "backward", None), (1, 2, 1, "host", "step", None),
    (1, 2, 1, "nvme", "backward", None), (0, 2, 1, "host", "step", None), (0, 4, 1, "host", "backward", None),
    (2, 1, 1, "host", "step", "one rank"), (3, 2, 2, "host", "step", "grad_accumulation_steps=2"),
    (1, 2, 4, "host", "step", "grad_accumulation_steps=4"), (0, 2, 1, "nvme", "step", "offload_optimizer='nvme'"),
    (0, 2, 1, "none", "step", "offload_optimizer='none'"), (0, 2, 1, "host", "delayed", "overlap='delayed'"),
])
def test_where_gradients_are_reduced(stage, world, accum, opt, overlap, why):
    """[Note: where gradients are reduced]: on the device at every stage on
    several ranks without accumulation, but for stage 0's gradients kept off
    the host buffers' way (NVMe spills, the device optimizer, delayed
    updates); otherwise the reason names the setting."""
    got = pl.host_reduction_reason(stage, world, accum, opt, overlap)
    assert got is None if why is None else why in got, got


def test_device_reduction_at_stages_0_and_1():
    """Stage 0 all-reduces the flat buffer in place (no device shard: one
    unit's fp32 gradients a unit in the reserve); stage 1 reserves as stage 2
    does and keeps no full gradients on the host for good."""
    import dataclasses
    for zero, per_unit in ((0, 4096 * 4), (1, (4096 + 2048) * 4)):
        m = dataclasses.replace(modes(zero=zero, world=2), reduce_on_device=True)
        places = [pl.place_unit(layout(2048, pad_to=2), m), pl.place_unit(layout(4096, pad_to=2), m)]
        assert pl.device_need(places, [False, False], m).grad_reserve == 2 * per_unit
    host1, dev1 = modes(zero=1, world=2), dataclasses.replace(modes(zero=1, world=2), reduce_on_device=True)
    places = [pl.place_unit(layout(2048, pad_to=2), host1)]
    assert pl.host_need(places, host1).permanent - pl.host_need(places, dev1).permanent == 8192  # the full fp32 grads


def test_device_reduction_reserves_two_units_on_the_device_and_none_on_the_host():
    """Reduced on the device, a unit's full gradient and its shard (fp32) are
    transient device bytes, two units' worth (one filling, one reducing), and
    the host keeps no full gradients: only the shard."""
    import dataclasses
    m = dataclasses.replace(modes(zero=2, world=2, dtype=BF16), reduce_on_device=True)
    places = [pl.place_unit(layout(2048, pad_to=2), m), pl.place_unit(layout(4096, pad_to=2), m)]
    host = pl.device_need(places, [False, False], modes(zero=2, world=2, dtype=BF16))
    dev = pl.device_need(places, [False, False], m)
    assert host.grad_reserve == 4096 * 2                      # the largest unit's bf16 gradients
    assert dev.grad_reserve == 2 * (4096 + 2048) * 4           # two units' fp32 gradient + shard
    assert dev.minimum - host.minimum == dev.grad_reserve - host.grad_reserve
    need_host = pl.host_need(places, modes(zero=2, world=2, dtype=BF16))
    need_dev = pl.host_need(places, m)
    assert need_host.minimum - need_dev.minimum == (2048 + 4096) * 4  # both units' full fp32 gradients
    assert need_dev.permanent == need_host.permanent


def test_the_cuda_gradient_staging_ring_is_in_the_host_need():
    """[Note: the gradient staging ring]: on CUDA, where the host adds or upcasts gradients (accumulation,
    or fp32 host gradients under bf16 compute), the ring's pinned blocks are in the host pool's minimum and
    permanent bytes; a block holds at most the largest unit's gradients; none on the CPU device or where
    gradients go straight into their buffer."""
    import infinity
    from engine_utils import small_gpt
    from infinity.engine.plan.estimator import placed
    from infinity.engine.plan.limits import GRAD_STAGING_BLOCKS
    from infinity.engine.plan.placement import grad_staging, host_need, nbytes

    def need(device, **kw):
        cfg = infinity.Config(device=device, dtype="bf16", offload_params="host", offload_optimizer="host", **kw)
        _, modes, places = placed(small_gpt(), cfg)
        return grad_staging(places, modes), host_need(places, modes), modes, places

    (blocks, block), with_ring, modes, places = need("cuda", grad_accumulation_steps=2)
    largest = max(nbytes(p.trainable_numel, modes.dtype) for p in places if p.trainable)
    assert blocks == GRAD_STAGING_BLOCKS and largest <= block < largest + 4096
    (cpu_blocks, _), without, _, _ = need("cpu", grad_accumulation_steps=2)
    assert cpu_blocks == 0
    assert with_ring.minimum - without.minimum == with_ring.permanent - without.permanent == blocks * block
    assert need("cuda")[0] == (0, 0)  # bf16 gradients straight into bf16 host buffers: nothing staged
