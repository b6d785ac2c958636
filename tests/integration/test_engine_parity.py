"""The offload engine against plain PyTorch (torch.optim.AdamW, no offload),
same model and data, fp32: losses every step and final parameters within
1e-5 relative."""

import itertools

import pytest
import torch

import infinity
from engine_utils import VOCAB, assert_params_close, batches, small_gpt, train_pair, train_steps, unit_bytes

UB = unit_bytes(small_gpt())


def cfg(**kw) -> infinity.Config:
    base = dict(device="cpu", dtype="fp32", host_memory="256MiB", prefetch_depth=2)
    base.update(kw)
    if "device_memory" not in base:
        # Small enough to page: the root, ~6 of 8 blocks, gradients in flight,
        # plus the optimizer state when it lives on the device.
        extra = 0 if base.get("offload_optimizer", "host") != "none" else 4 << 20
        base["device_memory"] = 8 * UB + extra if base.get("offload_params", "host") != "none" else 64 << 20
    return infinity.Config(**base)


@pytest.mark.parametrize("offload_params,offload_optimizer,overlap",
                         list(itertools.product(["none", "host"], ["none", "host"], ["step", "backward"])))
def test_parity_matrix(offload_params, offload_optimizer, overlap):
    model, opt, _, _ = train_pair(small_gpt, cfg(offload_params=offload_params,
                                                 offload_optimizer=offload_optimizer, overlap=overlap))
    s = infinity.stats(model)
    assert s["steps"] == 20
    if offload_params == "host":
        assert s["bytes_moved"]["h2d"] > 0 and s["evictions"] > 0
    if overlap == "backward":
        assert s["overlap"] > 0.5, s  # most optimizer time ran during backward


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_gradient_accumulation(overlap):
    train_pair(small_gpt, cfg(overlap=overlap, grad_accumulation_steps=3), steps=8, accum=3)


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_gradient_clipping(overlap):
    model, opt, _, _ = train_pair(small_gpt, cfg(overlap=overlap, max_grad_norm=0.05), steps=12, clip=0.05)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05  # clipping was active


def test_lr_scheduler():
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))
    train_pair(small_gpt, cfg(), steps=10, scheduler=sched)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(tie):
    train_pair(lambda: small_gpt(tie_weights=tie), cfg(), steps=10)


def test_frozen_block():
    def make():
        m = small_gpt()
        m.blocks[2].requires_grad_(False)
        m.wpe.requires_grad_(False)
        return m

    model, opt, _, _ = train_pair(make, cfg(offload_params="host"), steps=10)
    eng = infinity.api.engine_of(model)
    unit = next(u for u in eng.units if u.name == "blocks.2")
    assert unit.trainable_numel == 0 and unit.opt.master is None  # paged, but no optimizer state


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_activation_checkpointing(overlap):
    train_pair(lambda: small_gpt(checkpoint=True), cfg(overlap=overlap), steps=10)


def test_out_of_order_and_repeated_blocks():
    order = [0, 2, 1, 3, 3, 5, 4, 7, 6, 1]
    fwd = lambda m, x, y: m(x, y, order=order)
    model, _, _, _ = train_pair(small_gpt, cfg(), steps=10, forward=fwd)
    assert infinity.stats(model)["trace_invalidations"] == 0


def test_order_change_invalidates_trace_and_stays_correct():
    orders = [list(range(8))] * 4 + [[7, 6, 5, 4, 3, 2, 1, 0]] * 3 + [list(range(8))] * 3
    fwd_state = {"i": 0}

    def fwd(m, x, y):
        return m(x, y, order=orders[fwd_state["i"] // 2 % len(orders)])

    def between(model, ref, step):
        fwd_state["i"] = 2 * (step + 1)

    # The same order for both models in a step: the counter advances per step.
    model, _, _, _ = train_pair(small_gpt, cfg(), steps=10, forward=fwd, between=between)
    assert infinity.stats(model)["trace_invalidations"] >= 2


class ExternalUse(torch.nn.Module):
    """Uses a block's parameter outside that block's forward."""

    def __init__(self):
        super().__init__()
        self.gpt = small_gpt(n_layer=4)

    def forward(self, x, y):
        g = self.gpt
        h = g.wte(x) + g.wpe(torch.arange(x.shape[1]))
        for blk in g.blocks:
            h = blk(h)
        h = h * g.blocks[1].ln2.weight  # parameter of blocks.1, outside its forward
        logits = g.head(g.ln_f(h))
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def test_parameters_used_outside_their_module():
    with pytest.warns(RuntimeWarning, match="blocks.1"):
        model, _, _, _ = train_pair(ExternalUse, cfg(device_memory=6 * UB), steps=8)
    eng = infinity.api.engine_of(model)
    assert [u.name for u in eng.units if u.dev.external] == ["gpt.blocks.1"]


def test_eval_and_no_grad_inference_between_steps():
    data = batches(3, seed=7)

    def between(model, ref, step):
        model.eval()
        ref.eval()
        with torch.no_grad():
            for x, _ in data:
                a, b = model(x), ref(x)
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
        model.train()
        ref.train()

    train_pair(small_gpt, cfg(), steps=6, between=between)


def test_race_tiny_compute_deep_prefetch():
    # Tiny blocks (little compute per unit), deep prefetch, many steps: a
    # missing wait on a copy shows up as a wrong number.
    make = lambda: small_gpt(n_layer=12, n_embd=16, n_head=2)
    ub = unit_bytes(make())
    model, _, _, _ = train_pair(make, cfg(device_memory=12 * ub, prefetch_depth=6, overlap="backward"),
                                steps=40, lr=3e-3)
    s = infinity.stats(model)
    assert s["prefetches"] > 100 and s["evictions"] > 100


def test_param_groups_without_weight_decay():
    ref = small_gpt()
    import copy
    model = copy.deepcopy(ref)
    decay = lambda m: [p for n, p in m.named_parameters() if p.dim() >= 2]
    no_decay = lambda m: [p for n, p in m.named_parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW([{"params": decay(ref)}, {"params": no_decay(ref), "weight_decay": 0.0}],
                                lr=1e-3, weight_decay=0.1, foreach=False)
    model, opt = infinity.initialize(model, cfg(), lr=1e-3, weight_decay=0.1,
                                     param_groups=[{"params": decay(model)},
                                                   {"params": no_decay(model), "weight_decay": 0.0}])
    train_steps(model, opt, 8)
    train_steps(ref, ref_opt, 8)
    assert_params_close(infinity.full_state_dict(model), ref.state_dict())
