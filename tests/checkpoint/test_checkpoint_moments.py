"""Checkpoints of runs with bf16 and int8 Adam moments ([Note: moments in
their own dtype] in checkpoint/moment_loads.py): stored in their own dtype
with the int8 scales, resumed bit for bit across placements, converted with
one warning into a run of another moment_dtype; verify and consolidate."""

import json
import os
import warnings

import pytest
import torch
from paging_zoo import base_config, chain_data, small_chain

import infinity
from infinity.checkpoint.export import consolidate
from infinity.optim import moments as qmoments


model, data = small_chain, chain_data


def make(tmp_path, tag, md, params="host", opt="host", overlap="step"):
    cfg = infinity.Config(**base_config(offload_params=params, offload_optimizer=opt, overlap=overlap,
                                        moment_dtype=md, device_memory=1 << 20, swap_block_size=4096,
                                        swap_paths=[str(tmp_path / f"swap-{tag}")]))
    return infinity.initialize(model(), cfg, lr=1e-2)


def train(m, o, batches):
    for x, y in batches:
        m(x, y).backward()
        o.step()
        o.zero_grad()


def moments_of(o):
    return {i: (st["exp_avg"], st["exp_avg_sq"]) for i, st in o.state_dict()["state"].items()}


@pytest.mark.parametrize("md,saved,resumed", [
    ("int8", ("host", "host"), ("nvme", "nvme")),
    ("int8", ("nvme", "nvme"), ("none", "host")),
    ("bf16", ("host", "nvme"), ("host", "host")),
])
def test_resume_is_bit_exact_across_placements(tmp_path, md, saved, resumed):
    batches = data(6)
    m, o = make(tmp_path, "ref", md)
    train(m, o, batches)
    want, want_moments = infinity.full_state_dict(m), moments_of(o)
    infinity.close(m)
    m, o = make(tmp_path, "a", md, *saved)
    train(m, o, batches[:3])
    path = infinity.save_checkpoint(tmp_path / "ckpt", m, o)
    infinity.close(m)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["moment_dtype"] == md
    codes = {n: r["dtype"] for n, r in manifest["tensors"].items() if n.startswith("exp_avg")}
    if md == "int8":
        assert {d for n, d in codes.items() if "_scale." not in n} == {"uint8"}
        assert {d for n, d in codes.items() if "_scale." in n} == {"float32"}
    else:
        assert set(codes.values()) == {"bfloat16"}
    m, o = make(tmp_path, "b", md, *resumed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same moment_dtype: nothing to warn about
        infinity.load_checkpoint(tmp_path / "ckpt", m, o)
    train(m, o, batches[3:])
    got, got_moments = infinity.full_state_dict(m), moments_of(o)
    infinity.close(m)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for i in want_moments for a, b in zip(got_moments[i], want_moments[i]))
    assert infinity.verify_checkpoint(tmp_path / "ckpt")["tensors"] == len(manifest["tensors"])
    files = consolidate(tmp_path / "ckpt", tmp_path / "hf", dtype="fp32")
    from safetensors.torch import load_file
    names = {k for f in files for k in load_file(str(tmp_path / "hf" / f))}
    assert names == set(want)  # weights only: no moments, no scales


def test_a_checkpoint_loads_into_another_moment_dtype_with_one_warning(tmp_path):
    """int8 -> fp32: the moments load dequantised (what state_dict gives);
    fp32 -> int8: quantised as CPUAdamW's load_state_dict stores them."""
    m, o = make(tmp_path, "a", "int8")
    train(m, o, data(2))
    saved = moments_of(o)
    infinity.save_checkpoint(tmp_path / "q8", m, o)
    infinity.close(m)
    m, o = make(tmp_path, "b", "fp32")
    with pytest.warns(RuntimeWarning, match=r"moment_dtype='int8', this run keeps moment_dtype='fp32'") as rec:
        infinity.load_checkpoint(tmp_path / "q8", m, o)
    assert len([w for w in rec if "moment_dtype" in str(w.message)]) == 1
    got = moments_of(o)
    assert all(torch.equal(a, b) for i in saved for a, b in zip(got[i], saved[i]))
    train(m, o, data(1, seed=5))  # moves the fp32 moments off the int8 grid
    fp32 = moments_of(o)
    infinity.save_checkpoint(tmp_path / "f32", m, o)
    infinity.close(m)
    m, o = make(tmp_path, "c", "int8")
    with pytest.warns(RuntimeWarning, match=r"moment_dtype='fp32', this run keeps moment_dtype='int8'"):
        infinity.load_checkpoint(tmp_path / "f32", m, o)
    got = moments_of(o)
    infinity.close(m)
    for i, (ea, eas) in fp32.items():
        enc = qmoments.encode(ea, eas, "int8")
        want = qmoments.decode(enc)
        assert torch.equal(got[i][0], want[0]) and torch.equal(got[i][1], want[1])
