"""A load is all or nothing (issue 34, item 4): every manifest scalar and
type, the param groups, the scheduler's presence, the RNG and loss-scaler
shapes and every file's size are checked before the first byte is written
into the engine, so a bad one changes nothing (weights, moments, step
counts, hyper-parameters, loss scale, scheduler and RNG bit-identical, the
engine still serving); a failure after that point fails the engine, which
refuses further use: a mix is never served."""

import base64
import json
import math
import random

import pytest
import torch
from test_checkpoint import data, make, train

import infinity
from infinity.checkpoint import load as load_mod
from infinity.engine.faults import EngineFailedError


@pytest.fixture
def saved(tmp_path):
    """A checkpoint saved with an LR scheduler, and one saved without."""
    out = {}
    for tag, sched in (("with", True), ("without", False)):
        m, o, s = make(tmp_path, f"src-{tag}", "host", "host", sched=sched)
        train(m, o, s, data(3))
        out[tag] = infinity.save_checkpoint(tmp_path / f"ck-{tag}", m, o, lr_scheduler=s)
        infinity.close(m)
    return out


def _snapshot(m, o, s):
    """Everything a load may change, copied."""
    sd = o.state_dict()
    return {
        "weights": {k: v.clone() for k, v in infinity.full_state_dict(m).items()},
        "moments": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                    for i, st in sd["state"].items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
        "scale": (o.scaling.loss_scale, o.scaling.good_steps),
        "sched": s.state_dict() if s is not None else None,
        "rng": (torch.get_rng_state().clone(), random.getstate()),
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@pytest.fixture
def target(tmp_path):
    """A run that has trained (moments, steps and schedule not at their start)."""
    m, o, s = make(tmp_path, "dst", "host", "host", sched=True)
    train(m, o, s, data(2, seed=7))
    yield m, o, s
    infinity.close(m)


def _edit(path, fn):
    mpath = path / "manifest.json"
    m = json.loads(mpath.read_text())
    fn(m)
    mpath.write_text(json.dumps(m))


def _first_tensor(m):
    return sorted(m["tensors"].values(), key=lambda r: (r["file"], r["offset"]))[0]


def _set_steps(v):
    return lambda m: m["param_steps"].update({k: v for k in m["param_steps"]})


def _b64(n):
    return base64.b64encode(bytes(n)).decode()


BAD = {
    "param_steps=-1": (_set_steps(-1), infinity.CorruptCheckpointError, "param_steps"),
    "param_steps='3'": (_set_steps("3"), infinity.CorruptCheckpointError, "param_steps"),
    "param_steps=1.5": (_set_steps(1.5), infinity.CorruptCheckpointError, "param_steps"),
    "param_steps=NaN": (_set_steps(float("nan")), infinity.CorruptCheckpointError, "param_steps"),
    "param_steps=true": (_set_steps(True), infinity.CorruptCheckpointError, "param_steps"),
    "param_steps=[]": (lambda m: m.update(param_steps=[]), infinity.CorruptCheckpointError, "param_steps"),
    "dtype": (lambda m: _first_tensor(m).update(dtype="complex64"), infinity.CorruptCheckpointError, "dtype"),
    "offset='4096'": (lambda m: _first_tensor(m).update(offset="4096"), infinity.CorruptCheckpointError, "offset"),
    "offset=4096.0": (lambda m: _first_tensor(m).update(offset=4096.0), infinity.CorruptCheckpointError, "offset"),
    "lr='x'": (lambda m: m["param_groups"][0].update(lr="x"), ValueError, r"param_groups\[0\]\['lr'\]"),
    "lr=NaN": (lambda m: m["param_groups"][0].update(lr=float("nan")), infinity.CorruptCheckpointError,
               "param_groups"),
    "lr=-1": (lambda m: m["param_groups"][0].update(lr=-1.0), ValueError, r"param_groups\[0\].*\['lr'\] out of range"),
    "betas=[0.9]": (lambda m: m["param_groups"][0].update(betas=[0.9]), ValueError, "betas"),
    "amsgrad=true": (lambda m: m["param_groups"][0].update(amsgrad=True), ValueError, "amsgrad"),
    "group params": (lambda m: m["param_groups"][0].update(params=["nope"]), ValueError, "param group"),
    "loss_scale=NaN": (lambda m: m["loss_scaler"].update(loss_scale=float("nan")), infinity.CorruptCheckpointError,
                       "loss_scale"),
    "loss_scale=-1": (lambda m: m["loss_scaler"].update(loss_scale=-1), infinity.CorruptCheckpointError,
                      "loss_scale"),
    "good_steps='1'": (lambda m: m["loss_scaler"].update(good_steps="1"), infinity.CorruptCheckpointError,
                       "good_steps"),
    "rng torch_cpu": (lambda m: m["rng"]["0"].update(torch_cpu=_b64(10)), infinity.CorruptCheckpointError,
                      "torch_cpu"),
    "rng python": (lambda m: m["rng"]["0"].update(python=[3, [1, 2], None]), infinity.CorruptCheckpointError,
                   "python"),
    "rng not an object": (lambda m: m["rng"].update({"0": 7}), infinity.CorruptCheckpointError, "rng"),
    "lr_scheduler=[1]": (lambda m: m.update(lr_scheduler=[1]), infinity.CorruptCheckpointError, "lr_scheduler"),
    "lr_scheduler keys": (lambda m: m.update(lr_scheduler={"foo": 1}), ValueError, "another kind of scheduler"),
    "file size": (lambda m: m["files"].update({k: v + 4096 for k, v in m["files"].items()}),
                  infinity.CorruptCheckpointError, "the manifest says"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_manifest_value_is_refused_before_anything_changes(saved, target, case):
    edit, err, match = BAD[case]
    _edit(saved["with"], edit)
    m, o, s = target
    before = _snapshot(m, o, s)
    with pytest.raises(err, match=match):
        infinity.load_checkpoint(saved["with"], m, o, lr_scheduler=s)
    assert not o.engine.faults.failed
    assert _same(_snapshot(m, o, s), before)


def test_a_scheduler_given_for_a_checkpoint_saved_without_one_changes_nothing(saved, target):
    m, o, s = target
    before = _snapshot(m, o, s)
    with pytest.raises(ValueError, match="lr_scheduler was given but .* saved without one"):
        infinity.load_checkpoint(saved["without"], m, o, lr_scheduler=s)
    assert not o.engine.faults.failed and _same(_snapshot(m, o, s), before)


def test_a_checkpoint_with_a_scheduler_loaded_without_one(saved, target):
    m, o, s = target
    before = _snapshot(m, o, s)
    with pytest.raises(ValueError, match="holds an LR scheduler's state but no lr_scheduler was given"):
        infinity.load_checkpoint(saved["with"], m, o)
    assert not o.engine.faults.failed and _same(_snapshot(m, o, s), before)
    with pytest.warns(RuntimeWarning, match="strict=False: its state is not loaded"):
        infinity.load_checkpoint(saved["with"], m, o, strict=False)
    assert not _same(_snapshot(m, o, s)["weights"], before["weights"])  # loaded, the schedule left as it was
    assert _snapshot(m, o, s)["sched"] == before["sched"]


@pytest.mark.parametrize("last", ["rng", "scheduler"])
def test_a_load_whose_last_part_fails_fails_the_engine(saved, target, monkeypatch, last):
    m, o, s = target
    if last == "rng":
        def boom(_):
            raise RuntimeError("injected: restoring the RNG failed")
        monkeypatch.setattr(load_mod.rng, "restore", boom)
    else:
        def boom(self, _):
            raise RuntimeError("injected: the scheduler's load_state_dict failed")
        monkeypatch.setattr(type(s), "load_state_dict", boom)
    with pytest.raises(RuntimeError, match="injected"):
        infinity.load_checkpoint(saved["with"], m, o, lr_scheduler=s)
    assert o.engine.faults.failed  # the weights were written: the run refuses to go on
    with pytest.raises(EngineFailedError, match="load_checkpoint"):
        infinity.full_state_dict(m)
    with pytest.raises(EngineFailedError):
        o.step()


def test_a_whole_load_still_resumes_everything(saved, target):
    m, o, s = target
    infinity.load_checkpoint(saved["with"], m, o, lr_scheduler=s)
    assert not o.engine.faults.failed
    manifest = json.loads((saved["with"] / "manifest.json").read_text())
    assert s.state_dict()["last_epoch"] == manifest["lr_scheduler"]["last_epoch"]
    assert o.param_groups[0]["lr"] == manifest["param_groups"][0]["lr"]
