"""The planner's meta passes from a shape cache ([Note: a meta pass from a
cache] in infinity/engine/plan/metacache.py): every op returns what its meta
kernel returns, and a large model's step is predicted from the meta model
with the right work and bytes."""

import torch

from infinity.cli.estimate_time import predict
from infinity.engine.plan.metacache import MetaCache
from infinity.engine.plan.profile import load_profile
from infinity.models import GPT, GPTConfig
import infinity


class _NoStore(dict):
    def __setitem__(self, key, value):  # every op runs its kernel
        pass


class _Record(MetaCache):
    def __init__(self, cache):
        super().__init__(cache)
        self.ops = []

    def seen(self, func, args, kwargs, out, key):
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), [(tuple(o.shape), o.stride(), o.dtype) if isinstance(o, torch.Tensor) else o
                                     for o in outs]))


def _pass(cache, checkpoint):
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=3, n_head=2, n_embd=32, checkpoint=checkpoint))
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    rec = _Record(cache)
    with rec:
        m(x, x).backward()
    return rec, [tuple(p.grad.shape) for p in m.parameters()], [tuple(p.shape) for p in m.parameters()]


def test_cached_pass_returns_what_the_kernels_return():
    for ck in (False, True):
        ran, g0, shapes = _pass(_NoStore(), ck)
        cached, g1, _ = _pass({}, ck)
        assert cached.ops == ran.ops  # the same ops, the same shapes, strides and dtypes
        assert g1 == g0 == shapes
        assert cached.hits > 0.5 * (cached.hits + cached.misses) and ran.hits == 0


def test_large_model_prediction_from_the_meta_model(tmp_path):
    # A 32-layer, 4096-wide GPT (6.6 B parameters) at sequence 2048: nothing allocated.
    g = GPTConfig(vocab_size=32000, block_size=2048, n_layer=32, n_head=32, n_embd=4096)
    with torch.device("meta"):
        m = GPT(g)
    x = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    n = sum(p.numel() for p in m.parameters())
    cfg = infinity.Config(device="cuda", dtype="bf16", offload_params="host", offload_optimizer="host",
                          swap_paths=[str(tmp_path)])
    prof = load_profile("h200-pcie5-nvme")
    pr = predict(m, cfg, lambda mm: mm(x, x), prof)
    assert pr.bytes["h2d"] == 2 * n and pr.bytes["d2h"] == 2 * n  # each bf16 copy up, each bf16 gradient down
    # The products: 6 FLOPs a parameter a token, plus attention's scores (12 L T^2 d).
    costs = pr.sim.tasks
    compute = sum(t.seconds for t in costs if t.resource == "compute")
    dense = 6 * n * 2048 + 12 * g.n_layer * 2048 ** 2 * g.n_embd
    assert dense / 7e14 < compute < 10 * dense / 7e14  # at most the profile's best bf16 rate
    assert pr.busy["optimizer"] == sum(t.seconds for t in costs if t.resource == "optimizer")
    assert abs(pr.busy["optimizer"] - n / prof.adamw_rate("bf16")) < 1e-6 * pr.busy["optimizer"]
    assert pr.seconds >= max(pr.busy.values()) and abs(sum(pr.exposed.values()) - pr.seconds) < 1e-9 * pr.seconds
