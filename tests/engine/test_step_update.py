"""step/update.py built without an Engine: one unit's AdamW on small flat
buffers, against torch.optim.AdamW(foreach=False) on the same parameters and
gradients (atol 1e-6, as tests/optim/test_adam_parity.py) and bitwise against the native
kernel called per parameter.

Real neighbours: the unit and its layout (plan/units.py), its placement
(plan/placement.py), the optimizer state owner holding master and moments
resident (owners/optstate.py), Sharding and Stats. Faked: the engine's
``values_changed`` (a recorder)."""

import copy

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.engine.mechanism.zero import Sharding
from infinity.engine.owners.optstate import KINDS, OptimizerState
from infinity.engine.plan.placement import modes_of, place_unit
from infinity.engine.plan.units import build_units
from infinity.engine.stats import Stats
from infinity.engine.step.update import Updater
from infinity.io.engine import crc32c
from infinity.optim.functional import adamw_step_

LR, BETAS, EPS = 1e-2, (0.9, 0.95), 1e-8
SCALE = 0.25  # the gradients are handed scaled by 4 (exact), the update unscales


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 20)
        self.norm = nn.LayerNorm(20)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])


def setup(dtype, wd, frozen=False):
    """The block's unit placed, its state resident, an Updater over two param
    groups (decay: the weights, none: the biases) and a torch reference."""
    torch.manual_seed(0)
    model = Net()
    if frozen:
        model.blocks[0].norm.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    config = infinity.Config(device="cpu", dtype=dtype, offload_params="host", offload_optimizer="host")
    modes = modes_of(config, 1, torch.device("cpu"))
    blk = model.blocks[0]
    decay = [blk.lin.weight, blk.norm.weight]
    group_of = {id(p): (0 if any(p is q for q in decay) else 1) for p in model.parameters()}
    units = build_units(model, None, group_of, 1)
    for u in units:
        u.place = place_unit(u.layout, modes)
    u = units[1]
    stats = Stats()
    opt = OptimizerState(units, modes, None, None, None, Sharding(0, stats))  # resident: no pool, no NVMe
    tn = u.place.trainable_numel
    master = torch.zeros(tn)
    for s in u.layout.trainable_slots:
        master[s.offset:s.offset + s.numel] = s.param.detach().reshape(-1)
    opt.set_resident(u, master, torch.zeros(tn), torch.zeros(tn))
    groups = [dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=wd), dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)]
    changed = []
    # Fake values_changed: Updater calls it as values_changed(unit, slots) when ``live``.
    upd = Updater(modes, Sharding(0, stats), groups, stats, None, 1, lambda unit, slots: changed.append((unit, slots)))
    rblk = ref.blocks[0]
    rdecay = [p for p in (rblk.lin.weight, rblk.norm.weight)]
    rnodecay = [p for p in (rblk.lin.bias, rblk.norm.bias) if p.requires_grad]
    torch_opt = torch.optim.AdamW([dict(params=rdecay, weight_decay=wd), dict(params=rnodecay, weight_decay=0.0)],
                                  lr=LR, betas=BETAS, eps=EPS, foreach=False)
    rparam = dict(ref.named_parameters())
    return u, upd, groups, changed, modes, stats, torch_opt, rparam


def flat_of(u, tensors, n, dtype=torch.float32):
    out = torch.zeros(n, dtype=dtype)
    for s in u.layout.trainable_slots:
        if s.name in tensors:
            out[s.offset:s.offset + s.numel] = tensors[s.name].reshape(-1)
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("frozen", [False, True])
def test_three_steps_match_torch_adamw(dtype, wd, frozen):
    u, upd, groups, changed, modes, stats, torch_opt, rparam = setup(dtype, wd, frozen)
    slots, tn, n = u.layout.trainable_slots, u.place.trainable_numel, u.place.compute_numel
    assert [s.group for s in slots] == sorted(s.group for s in slots) and len(slots) == (3 if frozen else 4)
    # The direct kernel reference: each parameter's own tensors, fp32.
    kref = {s.name: [s.param.detach().reshape(-1).clone(), torch.zeros(s.numel), torch.zeros(s.numel)]
            for s in slots}
    out = torch.full((n,), 7.0, dtype=modes.dtype)  # the compute copy written by the update (its home)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        # Step 2 leaves two slots without a gradient, the first of its group's run and one inside
        # it (norm.weight: the run of lin.weight must stop before it): torch skips them, so must the update.
        skip = {"blocks.0.lin.bias", "blocks.0.norm.weight"} if step == 1 else set()
        written = [s.name not in skip for s in slots]
        g = {s.name: torch.randn(s.shape, generator=gen).to(modes.grad_dtype).float()
             for s in slots if s.name not in skip}
        grad = flat_of(u, {k: v / SCALE for k, v in g.items()}, tn, modes.grad_dtype)
        before = {k: getattr(u.opt, k).clone() for k in KINDS}
        sums = upd.run(u, grad, written, out, SCALE)
        assert sums is None  # no NVMe state: no checksums asked for
        for name, p in rparam.items():
            p.grad = g[name].clone() if name in g else None
        torch_opt.step()
        for s in slots:
            if s.name in g:
                gi = 0 if s.group == 0 else 1
                m, ea, eas = kref[s.name]
                adamw_step_([m], [g[s.name].reshape(-1)], [ea], [eas], step=s.step, lr=LR, beta1=BETAS[0],
                            beta2=BETAS[1], eps=EPS,
                            weight_decay=groups[gi]["weight_decay"])
        # Step counts, per slot, as torch keeps them.
        for s in slots:
            assert s.step == int(torch_opt.state[rparam[s.name]]["step"]), s.name
        assert changed[-1][0] is u and [s.name for s in changed[-1][1]] == [s.name for s in slots
                                                                           if s.name not in skip]
        for s in slots:
            a, b = s.offset, s.offset + s.numel
            st = torch_opt.state[rparam[s.name]]
            for kind, ref, k in (("master", rparam[s.name], 0), ("exp_avg", st["exp_avg"], 1),
                                 ("exp_avg_sq", st["exp_avg_sq"], 2)):
                got = getattr(u.opt, kind)[a:b]
                assert torch.equal(got, kref[s.name][k]), (step, s.name, kind)  # bitwise: the kernel itself
                torch.testing.assert_close(got, ref.detach().reshape(-1), rtol=0, atol=1e-6)
            # The compute copy: the master rounded to the compute dtype (bf16: nearest even).
            assert torch.equal(out[a:b], u.opt.master[a:b].to(modes.dtype)), (step, s.name)
            if s.name in skip:  # untouched, bit for bit
                for kind in KINDS:
                    assert torch.equal(getattr(u.opt, kind)[a:b], before[kind][a:b]), (s.name, kind)
        # Padding stays zero in every buffer.
        mask = torch.ones(tn, dtype=torch.bool)
        for s in slots:
            mask[s.offset:s.offset + s.numel] = False
        for kind in KINDS:
            assert not getattr(u.opt, kind)[mask].any(), kind
    assert (out[tn:] == 7.0).all()  # the frozen part beyond the trainable range is not the update's
    assert stats.optimizer_seconds > 0


def test_not_live_leaves_values_changed_and_hyper_snapshot_wins():
    """The delayed mode's update: no values_changed, and the hyper-parameters as given
    (an LR scheduler's next value in param_groups must not apply)."""
    u, upd, groups, changed, modes, _, torch_opt, rparam = setup("fp32", 0.1)
    slots, tn = u.layout.trainable_slots, u.place.trainable_numel
    hyper = copy.deepcopy(groups)
    for g in groups:
        g["lr"] = 123.0  # what a scheduler would have set after step()
    g = {s.name: torch.randn(s.shape) for s in slots}
    upd.run(u, flat_of(u, {k: v / SCALE for k, v in g.items()}, tn), [True] * len(slots), None, SCALE,
            live=False, hyper=hyper)
    assert changed == []
    for name, p in rparam.items():
        p.grad = g[name]
    torch_opt.step()
    for s in slots:
        torch.testing.assert_close(u.opt.master[s.offset:s.offset + s.numel], rparam[s.name].detach().reshape(-1),
                                   rtol=0, atol=1e-6)


def test_whole_buffer_call_returns_the_write_back_checksums():
    """With a swap chunk size (NVMe optimizer state) and every slot of one group
    written, one call spans the whole buffers and returns their CRC32C sums."""
    u, upd, groups, *_ = setup("fp32", 0.1)
    groups[1]["weight_decay"] = 0.1
    for s in u.layout.trainable_slots:
        s.group = 0  # one group: one run
    upd.sum_chunk_bytes = 4096
    tn = u.place.trainable_numel
    assert tn * 4 <= 4096  # one chunk per buffer
    grad = flat_of(u, {s.name: torch.randn(s.shape) for s in u.layout.trainable_slots}, tn)  # zero padding
    sums = upd.run(u, grad, [True] * len(u.layout.trainable_slots), None, 1.0)
    assert set(sums) == set(KINDS)
    for kind in KINDS:
        t = getattr(u.opt, kind)
        assert list(sums[kind]) == [crc32c(t.data_ptr(), t.numel() * 4)], kind
    # A slot without a gradient: the runs are cut, no sums.
    assert upd.run(u, grad, [True, False, True, True], None, 1.0) is None
