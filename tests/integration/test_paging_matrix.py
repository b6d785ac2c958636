"""Paging correctness against plain PyTorch where it is hardest: units of
unequal size at the engine's minimum budgets (and a little above), every
placement pair, prefetch depths 0, 1 and 4, two backward passes per step,
and models whose structure the engine must follow (tests/paging_zoo.py).
Each case fails on main at 5147b56 (stale saved views, lost compute-copy
updates, dropped gradients or a BudgetError at the advertised minimum)."""

import itertools

import pytest
import torch

import infinity
from paging_zoo import ZOO, Chain, base_config, make, minimum, train_against_torch, unequal

PLACEMENTS = [(p, o) for p, o in itertools.product(["none", "host", "nvme"], ["none", "host", "nvme"])
              if not (p == "nvme" and o == "none")]


def budgets(model_fn, cfg, device_extra=0, host_extra=0) -> dict:
    """``cfg`` with device_memory (and host_memory, where the host holds
    anything) at the engine's own minimum plus the extras (bytes)."""
    m = model_fn()
    out = dict(cfg)
    out["device_memory"] = minimum(m, "device", **cfg) + device_extra
    host = minimum(m, "host", **cfg)
    if host:
        out["host_memory"] = host + host_extra
    return out


@pytest.mark.parametrize("overlap", ["step", "backward"])
@pytest.mark.parametrize("params,opt", [("host", "host"), ("nvme", "nvme"), ("nvme", "host")])
@pytest.mark.parametrize("extra", [0, 4096, 16384])
def test_unequal_units_at_minimum_device_budget(tmp_path, params, opt, overlap, extra):
    # The saved weight.t() of every Linear must follow its unit to whatever
    # range backward fetches it into (see [Note: saved tensors follow their unit]).
    cfg = base_config(offload_params=params, offload_optimizer=opt, overlap=overlap, swap_paths=[str(tmp_path)])
    cfg = budgets(unequal, cfg, device_extra=extra)
    train_against_torch(unequal, cfg, steps=5)


@pytest.mark.parametrize("depth", [0, 1, 4])
@pytest.mark.parametrize("params,opt", PLACEMENTS)
@pytest.mark.parametrize("overlap", ["step", "backward"])
@pytest.mark.parametrize("slack", [0, 1])
def test_every_placement_at_minimum_budgets(tmp_path, params, opt, overlap, depth, slack):
    # slack 1: a little above both minimums (8 KiB of host, half a unit of device).
    cfg = base_config(offload_params=params, offload_optimizer=opt, overlap=overlap, prefetch_depth=depth,
                      swap_paths=[str(tmp_path)])
    cfg = budgets(unequal, cfg, device_extra=slack * 8704, host_extra=slack * 8192)
    train_against_torch(unequal, cfg, steps=3)


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("params,opt,overlap", [("host", "host", "step"), ("host", "host", "backward"),
                                                ("nvme", "nvme", "backward"), ("nvme", "host", "step")])
@pytest.mark.parametrize("depth", [0, 1])
def test_model_structures_at_minimum_device_budget(tmp_path, name, params, opt, overlap, depth):
    cfg = base_config(offload_params=params, offload_optimizer=opt, overlap=overlap, prefetch_depth=depth,
                      swap_paths=[str(tmp_path)])
    model_fn = lambda: make(name)  # noqa: E731
    first = budgets(model_fn, cfg)
    try:
        train_against_torch(model_fn, first, steps=4)
    except infinity.BudgetError as e:
        # A unit used outside its forward is found in the first pass; the
        # error names the budget that holds it, and that budget works.
        assert name == "outside" and "used outside their own forward" in str(e), e
        need = int(str(e).split("at least ")[1].split(" bytes")[0])
        train_against_torch(model_fn, dict(first, device_memory=need), steps=4)


@pytest.mark.parametrize("overlap", ["step", "backward", "delayed"])
@pytest.mark.parametrize("params,opt", [("host", "host"), ("none", "host"), ("nvme", "nvme"), ("host", "none")])
def test_two_backward_calls_per_step(tmp_path, params, opt, overlap):
    """Two backward() calls before one step() with grad_accumulation_steps=1:
    accumulated as torch does, or (where the update already ran during the
    first) an error naming the fix, with the run still usable."""
    if overlap == "delayed" and (opt != "host" or params == "nvme"):
        pytest.skip("delayed needs the host optimizer and no NVMe")
    cfg = base_config(offload_params=params, offload_optimizer=opt, overlap=overlap, swap_paths=[str(tmp_path)],
                      device_memory=1 << 20)
    if overlap == "step":
        train_against_torch(unequal, cfg, steps=3, calls=2)
        return
    if overlap == "backward":
        with pytest.raises(RuntimeError, match="grad_accumulation_steps"):
            train_against_torch(unequal, cfg, steps=3, calls=2)
        # Told how many backward passes make a step, it matches torch.
        train_against_torch(unequal, dict(cfg, grad_accumulation_steps=2), steps=3, calls=2)
        return
    _delayed_two_backwards(cfg)


def _delayed_two_backwards(cfg):
    """overlap="delayed": the update applied at step t is torch's update with
    the gradients accumulated over both backward passes of step t-1."""
    import copy
    ref = unequal()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    model, opt = infinity.initialize(model, infinity.Config(**cfg), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    pending = None
    for step in range(3):
        for _ in range(2):
            x, y = torch.randn(6, 16, generator=gen), torch.randn(6, 16, generator=gen)
            a, b = model(x, y) / 2, ref(x, y) / 2
            a.backward()
            b.backward()
            assert abs(a.item() - b.item()) <= 1e-5 * abs(b.item())
        opt.step()
        opt.zero_grad()
        grads = [p.grad.clone() for p in ref.parameters()]
        ref_opt.zero_grad()
        if pending is not None:
            for p, g in zip(ref.parameters(), pending):
                p.grad = g
            ref_opt.step()
            ref_opt.zero_grad()
        pending = grads
    infinity.close(model)


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_zero_grad_after_early_update_raises(overlap):
    model, opt = infinity.initialize(unequal(), infinity.Config(**base_config(overlap=overlap,
                                                                              device_memory=1 << 20)))
    x = torch.randn(4, 16)
    model(x, x).backward()
    if overlap == "backward":
        with pytest.raises(RuntimeError, match="step"):
            opt.zero_grad()
        opt.step()
    opt.zero_grad()
    model(x, x).backward()
    opt.step()
    infinity.close(model)


def test_retain_graph_backward_after_step_raises_as_torch():
    """A graph kept with retain_graph=True, then step(), then backward again:
    torch raises its in-place modification error; so does infinity (its
    saved-tensor hooks do the check autograd can no longer do)."""
    ref = unequal()
    x = torch.randn(4, 16)
    ref_opt = torch.optim.AdamW(ref.parameters())
    loss = ref(x, x)
    loss.backward(retain_graph=True)
    ref_opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    model, opt = infinity.initialize(unequal(), infinity.Config(**base_config(device_memory=1 << 20)))
    loss = model(x, x)
    loss.backward(retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    infinity.close(model)


def test_hf_model_with_unequal_blocks(tmp_path):
    """T5: two stacks, the first block of each larger (relative attention
    bias), the decoder's larger than the encoder's (cross-attention)."""
    transformers = pytest.importorskip("transformers")
    conf = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=2,
                                 num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)

    class T5Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.t5 = transformers.T5ForConditionalGeneration(conf)

        def forward(self, x, y):
            ids = (x.abs() * 40).long().clamp(max=63)[:, :8].contiguous()
            labels = (y.abs() * 40).long().clamp(max=63)[:, :6].contiguous()
            return self.t5(input_ids=ids, labels=labels).loss

    for params, overlap in [("host", "step"), ("nvme", "backward")]:
        cfg = base_config(offload_params=params, offload_optimizer=params, overlap=overlap, prefetch_depth=0,
                          swap_paths=[str(tmp_path)])
        train_against_torch(T5Loss, budgets(T5Loss, cfg), steps=4)


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_lagging_copies_change_nothing(tmp_path, monkeypatch, overlap):
    """Every copy and gradient transfer of the CPU mover finishes late (as a
    busy device's would): compute must wait for each one, so the numbers are
    those of plain torch, at the minimum budget with unequal units."""
    import time
    from infinity.engine.mechanism import mover as mv

    def late(fn):
        def run(*a, **kw):
            time.sleep(0.002)
            return fn(*a, **kw)
        return run

    real_h2d, real_grad = mv.CpuMover.h2d, mv.CpuMover.grad_out
    monkeypatch.setattr(mv.CpuMover, "h2d", lambda self, dst, src, fresh=False:
                        mv.FutureTicket(self._h2d.submit(late(dst.copy_), src)))
    monkeypatch.setattr(mv.CpuMover, "grad_out", lambda self, dst, g, acc:
                        mv.FutureTicket(self._d2h.submit(late(mv._cast_into), dst, g.reshape(-1), acc)))
    cfg = base_config(offload_params="nvme", offload_optimizer="nvme", overlap=overlap, prefetch_depth=2,
                      swap_paths=[str(tmp_path)])
    train_against_torch(unequal, budgets(unequal, cfg), steps=3)
    assert real_h2d is not mv.CpuMover.h2d and real_grad is not mv.CpuMover.grad_out


def test_backward_on_another_thread_waits_for_the_optimizer_instead_of_failing(tmp_path, monkeypatch):
    """On CUDA, backward hooks run on autograd's device thread, not the main
    one. A gradient buffer that finds the host pool full must wait for the
    optimizer's update in flight (which frees buffers) there too, not raise
    (main at 5147b56 raised BudgetError: "nothing left to evict")."""
    import threading
    import time
    from infinity.engine.step.update import Updater
    real = Updater.run

    def slow(self, *a, **kw):  # updates hold their buffers a while
        time.sleep(0.02)
        return real(self, *a, **kw)

    monkeypatch.setattr(Updater, "run", slow)
    model_fn = lambda: Chain([32] * 8)  # noqa: E731
    cfg = base_config(offload_params="host", offload_optimizer="nvme", overlap="backward", prefetch_depth=1,
                      swap_paths=[str(tmp_path)])
    cfg = budgets(model_fn, cfg)
    errors = []

    def train():
        try:
            train_against_torch(model_fn, cfg, steps=3)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=train, name="autograd-like")
    t.start()
    t.join()
    assert not errors, errors
