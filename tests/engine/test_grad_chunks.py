"""Gradients streamed in chunks ([Note: gradients streamed in chunks] in
engine/owners/grad_chunks.py): a unit larger than ``Config.state_chunk_bytes``
sends its gradients to NVMe chunk by chunk and its update reads them back
chunk by chunk; the bytes are those of whole gradient buffers, and the host
holds the new, smaller minimum (counted by the host tier)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import infinity
from infinity.engine.plan import placement as pl
from infinity.engine.plan.estimator import estimate_peaks, placed
from engine_utils import UnequalNet, batches, train_states

CHUNK = 256 << 10  # 64 Ki fp32 elements
HIDDEN = (8000, 40, 3000)  # units of 264016 (five chunks), 1336 and 99016 (two) elements; the root 8192
LR, WD = 1e-3, 0.1


class SkipNet(UnequalNet):
    """UnequalNet whose forward may stop after ``upto`` blocks (the rest get no gradient)."""

    def forward(self, idx, targets, upto=None):
        x = self.wte(idx)
        for blk in self.blocks[:upto]:
            x = blk(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def make():
    torch.manual_seed(11)
    return SkipNet(hidden=HIDDEN)


def config(tmp_path, name: str, **kw) -> infinity.Config:
    base = dict(device="cpu", dtype="bf16", offload_params="nvme", offload_optimizer="nvme", host_memory="256MiB",
                swap_paths=[str(tmp_path / name)], state_chunk_bytes=CHUNK)
    base.update(kw)
    return infinity.Config(**base)


def minimum(cfg, stream: bool) -> int:
    """The host minimum of ``make()`` under ``cfg``, the gradients streamed or (``stream=False``) kept whole."""
    _, modes, places = placed(make(), cfg)
    if not stream:
        modes = dataclasses.replace(modes, stream_grads=False)
        places = [dataclasses.replace(p, grad_chunked=False) for p in places]
    return pl.host_need(places, modes).minimum


def assert_same(a, b):
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    for i, st in a[1]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], b[1]["state"][i][k]), (i, k)


def test_streaming_is_decided_by_the_placement(tmp_path):
    """Streamed where nothing needs the gradients whole; kept whole with
    clipping, fp16 or ZeRO, on several ranks, and for units within one chunk."""
    _, modes, places = placed(make(), config(tmp_path, "a"))
    assert modes.stream_grads and [p.grad_chunked for p in places] == [False, True, False, True]
    for kw in (dict(max_grad_norm=1.0), dict(dtype="fp16"), dict(zero_stage=1)):
        assert pl.grad_streaming(config(tmp_path, "a", **kw), 1) is not None, kw
        assert not any(p.grad_chunked for p in placed(make(), config(tmp_path, "a", **kw))[2]), kw
    assert pl.grad_streaming(config(tmp_path, "a"), 2) is not None


@pytest.mark.parametrize("overlap,accum", [("step", 1), ("step", 2), ("backward", 1), ("backward", 2)])
@pytest.mark.parametrize("md", ["fp32", "int8"])
def test_streamed_gradients_give_the_whole_buffers_bytes(tmp_path, overlap, accum, md):
    """Chunked state with streamed gradients against whole units (the default
    chunk holds every unit), bf16 gradients summed over two micro-batches too,
    at a host budget of the streamed minimum, below the minimum with whole
    gradients; the host tier's peak stays within it."""
    streamed_cfg = config(tmp_path, "s", overlap=overlap, moment_dtype=md, grad_accumulation_steps=accum)
    budget = minimum(streamed_cfg, True) + CHUNK
    whole_grads = minimum(streamed_cfg, False)
    # Whole gradients (three buffers of the largest unit, bf16 without accumulation) would be refused.
    assert budget < whole_grads
    assert estimate_peaks(make(), streamed_cfg)["host"]["minimum"] == minimum(streamed_cfg, True)
    whole = train_states(make(), config(tmp_path, "w", overlap=overlap, moment_dtype=md, grad_accumulation_steps=accum,
                                        state_chunk_bytes="64MiB"), 3, accum, LR, WD)
    streamed = train_states(make(), dataclasses.replace(streamed_cfg, host_memory=budget), 3, accum, LR, WD)
    assert_same(streamed, whole)
    assert streamed[2]["peak_bytes"]["host"] <= budget


def test_kept_zero_gradients_land_in_the_chunks(tmp_path):
    """zero_grad(set_to_none=False), then a backward that reaches only part of
    part of the model: the zeros torch keeps for the rest are written into
    the chunks of a streamed unit, and the update matches whole buffers'."""
    def run(cfg):
        model, opt = infinity.initialize(make(), cfg, lr=LR, weight_decay=WD)
        (x, y), (x2, y2) = batches(2)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        model(x2, y2, upto=1).backward()  # blocks 1 (within a chunk) and 2 (two chunks) keep zeros
        opt.step()
        out = ({k: v.clone() for k, v in infinity.full_state_dict(model).items()}, opt.state_dict())
        infinity.close(model)
        return out

    assert_same(run(config(tmp_path, "s")), run(config(tmp_path, "w", state_chunk_bytes="64MiB")))
