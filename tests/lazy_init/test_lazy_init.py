"""infinity.init: lazy construction equals eager construction bit for bit,
trains like it, and never holds the whole model in RAM."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.init import trunc_normal_  # imported by name, as timm-style code does

import infinity
from infinity.models import GPT, GPTConfig

from engine_utils import assert_params_close, batches

CFG = dict(device="cpu", dtype="fp32")


def small_gpt_cfg(tie: bool) -> GPTConfig:
    return GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=32, tie_weights=tie,
                     qkv_bias=False)


class RandnBlock(nn.Module):
    """Parameters straight from factories and arithmetic, a masked buffer, a
    partially written parameter."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / math.sqrt(d))
        self.b = nn.Parameter(torch.zeros(d))
        self.g = nn.Parameter(torch.ones(d))
        with torch.no_grad():
            self.g[: d // 2].mul_(0.5)          # partial in-place write
        self.register_buffer("mask", torch.tril(torch.ones(d, d)))

    def forward(self, x):
        return x + torch.tanh(x @ (self.w * self.mask) + self.b) * self.g


class RandnModel(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, n: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)   # padding row zero-filled after normal_
        self.blocks = nn.ModuleList(RandnBlock(d) for _ in range(n))
        self.scale = nn.Parameter(torch.rand(d) * 0.1 + 1.0)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.out(x * self.scale)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _manual_trunc_normal_(t: torch.Tensor, std: float) -> None:
    """The inverse-CDF truncated normal (uniform_, erfinv_, mul_, add_, clamp_),
    as older timm versions write it: a chain of in-place updates."""
    with torch.no_grad():
        lo, hi = (1 + math.erf(-2 / math.sqrt(2))) / 2, (1 + math.erf(2 / math.sqrt(2))) / 2
        t.uniform_(2 * lo - 1, 2 * hi - 1)
        t.erfinv_()
        t.mul_(std * math.sqrt(2.0))
        t.add_(0.0)
        t.clamp_(min=-2 * std, max=2 * std)


class TruncBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)
        trunc_normal_(self.fc.weight, std=0.02)
        _manual_trunc_normal_(self.proj.weight, std=0.02)
        nn.init.constant_(self.proj.bias, 0.01)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class TruncModel(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 32, n: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        nn.init.trunc_normal_(self.emb.weight, std=0.02, a=-0.04, b=0.04)
        self.blocks = nn.ModuleList(TruncBlock(d) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 1.0, 0.02)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt_loss(m, x, y):
    return m(x, y)


MODELS = {
    "gpt_tied": lambda: GPT(small_gpt_cfg(True)),
    "gpt_untied": lambda: GPT(small_gpt_cfg(False)),
    "randn": RandnModel,
    "trunc_normal": TruncModel,
}


def build_pair(make, seed: int = 7):
    """(eager model, lazy model initialised through infinity, optimizer,
    eager RNG draw after construction, lazy draw after initialize)."""
    torch.manual_seed(seed)
    eager = make()
    eager_next = torch.rand(4)
    torch.manual_seed(seed)
    config = infinity.Config(**CFG)
    with infinity.init(config):
        lazy = make()
    assert all(p.is_meta for p in lazy.parameters())
    model, opt = infinity.initialize(lazy, config, lr=1e-3, weight_decay=0.1)
    lazy_next = torch.rand(4)
    return eager, model, opt, eager_next, lazy_next


@pytest.mark.parametrize("name", sorted(MODELS))
def test_lazy_equals_eager_bitwise(name):
    eager, model, _, eager_next, lazy_next = build_pair(MODELS[name])
    ref = eager.state_dict()
    got = infinity.full_state_dict(model)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].shape == v.shape, k
        assert torch.equal(got[k], v.float()), f"{name}: {k} differs from eager (max diff " \
                                               f"{(got[k] - v).abs().max().item():.3e})"
    # The program's random stream after construction (and initialize) is eager's.
    assert torch.equal(lazy_next, eager_next)


@pytest.mark.parametrize("name", ["gpt_tied", "randn", "trunc_normal"])
def test_lazy_trains_like_eager(name):
    eager, model, opt, _, _ = build_pair(MODELS[name])
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    for step, (x, y) in enumerate(batches(4, seed=3)):
        loss = model(x, y)
        loss.backward()
        ref = eager(x, y)
        ref.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), (step, loss.item(), ref.item())
    assert_params_close(infinity.full_state_dict(model), eager.state_dict(), rtol=1e-5)


def test_buffers_become_real():
    _, model, _, _, _ = build_pair(RandnModel)
    for b in model.blocks:
        assert not b.mask.is_meta
        assert torch.equal(b.mask, torch.tril(torch.ones(32, 32)))


def test_manual_seed_inside_context_is_honoured():
    def make():
        torch.manual_seed(99)   # a model that seeds itself
        return RandnModel()

    torch.manual_seed(1)
    eager = make()
    after = torch.rand(3)
    torch.manual_seed(1)
    config = infinity.Config(**CFG)
    with infinity.init(config):
        lazy = make()
    assert torch.equal(torch.rand(3), after)
    model, _ = infinity.initialize(lazy, config)
    got = infinity.full_state_dict(model)
    for k, v in eager.state_dict().items():
        assert torch.equal(got[k], v), k


def test_seed_argument():
    torch.manual_seed(123)
    eager = RandnModel()
    torch.manual_seed(5)  # overridden by seed=
    config = infinity.Config(**CFG, seed=123)
    with infinity.init(config, seed=config.seed):
        lazy = RandnModel()
    model, _ = infinity.initialize(lazy, config)
    got = infinity.full_state_dict(model)
    assert all(torch.equal(got[k], v) for k, v in eager.state_dict().items())


def test_refuses_what_it_cannot_replay():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(NotImplementedError, match="generator"):
        with infinity.init():
            lin = nn.Linear(4, 4)
            nn.init.normal_(lin.weight, generator=g)
    with pytest.raises(NotImplementedError, match="multinomial"):
        with infinity.init():
            nn.Parameter(torch.multinomial(torch.ones(4), 2).float())
    with pytest.raises(NotImplementedError, match="real CPU tensor"):
        with infinity.init():
            nn.Parameter(torch.randn(4, device="cpu"))
    with pytest.raises(NotImplementedError, match="get_rng_state"):
        with infinity.init():
            with torch.random.fork_rng():   # would restore an un-advanced state
                nn.Linear(4, 4)
    # The context is closed cleanly after a refusal: the next one works.
    with infinity.init():
        lin = nn.Linear(4, 4)
    assert lin.weight.is_meta
    assert torch.get_rng_state().numel() > 0 and not torch.nn.init.trunc_normal_(torch.zeros(3)).is_meta


def test_uninitialised_empty_warns_and_is_zero():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])
            self.raw = nn.Parameter(torch.empty(3, 3))   # never initialised

        def forward(self, x):
            return self.blocks[0](x).sum() + self.raw.sum()

    config = infinity.Config(**CFG)
    with infinity.init(config):
        m = Raw()
    with pytest.warns(RuntimeWarning, match="never overwritten"):
        model, _ = infinity.initialize(m, config)
    assert torch.equal(infinity.full_state_dict(model)["raw"], torch.zeros(3, 3))


def test_sink_sees_units_progressively():
    """Drives the Recorder directly: each unit is delivered once, and the
    values of at most a few units are alive while the replay runs."""
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=6, n_head=2, n_embd=64, tie_weights=False)
    torch.manual_seed(0)
    eager = GPT(cfg)
    torch.manual_seed(0)
    with infinity.init() as rec:
        lazy = GPT(cfg)
    units = [list(b.parameters()) for b in lazy.blocks] + [[lazy.wte.weight, lazy.wpe.weight, lazy.ln_f.weight,
                                                              lazy.ln_f.bias, lazy.head.weight]]
    names = {id(p): n for n, p in lazy.named_parameters()}
    unit_names = [[names[id(p)] for p in u] for u in units]
    seen = []
    ref = eager.state_dict()
    block_bytes = sum(p.numel() for p in eager.blocks[0].parameters()) * 4

    def sink(i, values):
        seen.append(i)
        for n, v in zip(unit_names[i], values):
            assert torch.equal(v.reshape(ref[n].shape), ref[n]), n

    rec.materialize(units, sink)
    assert sorted(seen) == list(range(len(units)))
    # Blocks are due in order as GPT._init walks them; the root unit last.
    assert seen[:-1] == sorted(seen[:-1]) and seen[-1] == len(units) - 1
    # At most the root's early parameters, two blocks and the head were held at once.
    root_bytes = sum(p.numel() * 4 for p in units[-1])
    assert rec.peak_held_bytes <= 2 * block_bytes + root_bytes, (rec.peak_held_bytes, block_bytes, root_bytes)


# ------------------------------------------------------------------ memory


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _PeakRSS:
    """Samples the process RSS every millisecond in a thread (the work being
    measured runs in torch kernels that release the GIL)."""

    def __enter__(self):
        self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def test_rss_stays_bounded_for_a_model_much_larger_than_a_unit():
    # ~151 MB of fp32 weights in 12 blocks of 12.6 MB.
    gc = GPTConfig(vocab_size=256, block_size=64, n_layer=12, n_head=8, n_embd=512, tie_weights=True)
    model_bytes = gc.num_params() * 4
    block_bytes = 12 * 512 * 512 * 4
    config = infinity.Config(**CFG, host_memory="2GiB")
    # The first meta/function-mode use in a process imports and sets up parts
    # of torch (~80 MB of RSS, once): warm them up before measuring.
    with infinity.init():
        GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    torch.manual_seed(0)
    before = _rss()
    with _PeakRSS() as build:
        with infinity.init(config):
            model = GPT(gc)
    # Construction holds no weights: only the tape and meta tensors, plus the
    # scratch of the largest tensor for the replay of the random draws.
    assert build.peak - before < 32 * 2**20, (build.peak - before, model_bytes)
    start = _rss()
    with _PeakRSS() as init:
        model, _ = infinity.initialize(model, config)
    settled = _rss()
    host = infinity.stats(model)["peak_bytes"]["host"]
    # The host tier holds the state for good (5 x the weights in fp32); beyond
    # it, initialize holds a few units (units in progress + scratch), never
    # anything near the whole model as an eager build would.
    transient = init.peak - max(settled, start + host)
    assert transient < model_bytes / 3, (transient, model_bytes, block_bytes)
    # Sanity of the measurement itself: the host tier did land in RSS.
    assert settled - start > host * 0.8, (settled - start, host)
    print(f"model {model_bytes / 2**20:.0f} MiB: build +{(build.peak - before) / 2**20:.1f} MiB, initialize "
          f"transient {transient / 2**20:.1f} MiB over the host tier's {host / 2**20:.0f} MiB")


class BigVocab(nn.Module):
    """An embedding unit much larger than everything else in the host
    budget, whose construction draw is discarded (re-drawn after, as Hugging
    Face's ``_init_weights`` does), and a small head."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, x):
        return self.proj(self.emb(x)).float().pow(2).mean()


def test_initialise_peak_of_a_unit_larger_than_the_budget_is_the_pool_and_that_unit(tmp_path):
    """NVMe homes, int8 moments, a bf16 master and 1 MiB state chunks: beside
    the pool, initialize holds the large unit's values as built (fp32) and
    nothing the size of it more: no scratch of the discarded draw kept, no
    whole master assembled before it is written ([Note: initialise's peak]
    in infinity/engine/plan/estimator.py). Before, it held 2.5x the unit."""
    from infinity.api import engine_of
    from infinity.engine.plan.estimator import estimate_peaks
    vocab, d = 32768, 512
    unit = vocab * d * 4  # 64 MiB of fp32
    config = infinity.Config(device="cpu", dtype="bf16", offload_params="nvme", offload_optimizer="nvme",
                             moment_dtype="int8", master_dtype="bf16", state_chunk_bytes="1MiB", prefetch_depth=0,
                             host_memory="160MiB", unit_classes=["Embedding", "Linear"],
                             swap_paths=[str(tmp_path / "swap")])
    with torch.device("meta"):
        est = estimate_peaks(BigVocab(vocab, d), config, lazy=True)
    assert est["rss"]["model_fp32_at_initialize"] == unit
    with infinity.init():  # warm up torch's meta and replay paths (see the test above)
        BigVocab(64, 8)
    torch.manual_seed(0)
    with infinity.init(config):
        model = BigVocab(vocab, d)
    start = _rss()
    with _PeakRSS() as init:
        model, _ = infinity.initialize(model, config)
    pool = engine_of(model).parts.room.tier.pool.capacity_bytes  # prefaulted (or locked) whole
    beyond = init.peak - start - pool
    infinity.close(model, keep_values=False)
    assert beyond <= unit + (24 << 20), (beyond / 2**20, unit / 2**20, pool / 2**20)
    print(f"initialize held {beyond / 2**20:.0f} MiB beyond the {pool / 2**20:.0f} MiB pool (unit {unit >> 20} MiB)")
