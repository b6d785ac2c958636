"""Checkpoints (issue 19): exact resume across placements, overlap modes,
dtypes, schedulers, accumulation and clipping; a new process resumes
exactly (RNG included); the layout, keep_last and latest resolution."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from paging_zoo import Chain, base_config

import infinity

# A child process imports this folder's tests and the shared helpers in tests/.
HERE_AND_TESTS = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from infinity.checkpoint import layout, owner


def model(dropout=0.0):
    torch.manual_seed(0)
    m = Chain([32, 16, 64, 8])
    if dropout:
        m.inp = torch.nn.Sequential(m.inp, torch.nn.Dropout(dropout))
    return m


def data(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(n)]


def make(tmp_path, tag, params, opt, overlap="step", dtype="fp32", accum=1, clip=None, sched=False):
    cfg = infinity.Config(**base_config(offload_params=params, offload_optimizer=opt, overlap=overlap, dtype=dtype,
                                        device_memory=1 << 20, swap_paths=[str(tmp_path / f"swap-{tag}")],
                                        swap_block_size=4096, grad_accumulation_steps=accum, max_grad_norm=clip))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    s = torch.optim.lr_scheduler.LambdaLR(o, lambda k: min(1.0, (k + 1) / 3) * 0.9 ** k) if sched else None
    return m, o, s


def train(m, o, s, batches, accum=1, flush_after=None):
    losses = []
    for i in range(0, len(batches), accum):
        if flush_after is not None and i == flush_after:
            o.flush()  # delayed mode: a save applies the queued update (as a flush does)
        for x, y in batches[i:i + accum]:
            loss = m(x.to(o.engine.modes.dtype), y.to(o.engine.modes.dtype))
            o.scale_loss(loss).backward()
            losses.append(loss.item())
        o.step()
        o.zero_grad()
        if s is not None:
            s.step()
    return losses


def resume_matches(tmp_path, steps=3, **kw):
    accum = kw.get("accum", 1)
    batches = data(2 * steps * accum)
    m, o, s = make(tmp_path, "ref", **kw)
    ref = train(m, o, s, batches, accum, flush_after=steps * accum)
    ref_sd = infinity.full_state_dict(m)
    infinity.close(m)
    m, o, s = make(tmp_path, "a", **kw)
    first = train(m, o, s, batches[:steps * accum], accum)
    path = infinity.save_checkpoint(tmp_path / "ckpt", m, o, lr_scheduler=s, extra={"batch": steps * accum})
    infinity.close(m)
    m, o, s = make(tmp_path, "b", **kw)
    extra = infinity.load_checkpoint(tmp_path / "ckpt", m, o, lr_scheduler=s)
    assert extra == {"batch": steps * accum}
    rest = train(m, o, s, batches[extra["batch"]:], accum)
    sd = infinity.full_state_dict(m)
    infinity.close(m)
    assert first + rest == ref, (first + rest, ref)
    for k in ref_sd:
        assert torch.equal(sd[k], ref_sd[k]), k
    return path


PLACEMENTS = [("none", "host"), ("host", "host"), ("nvme", "nvme"), ("nvme", "host"), ("host", "nvme"),
              ("host", "none")]


@pytest.mark.parametrize("params,opt", PLACEMENTS)
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_resume_is_bit_exact_across_placements(tmp_path, params, opt, overlap):
    if opt == "none" and overlap == "backward":
        pytest.skip("overlap='backward' needs a host optimizer")
    resume_matches(tmp_path, params=params, opt=opt, overlap=overlap)


@pytest.mark.parametrize("params,opt", [("nvme", "nvme"), ("host", "host"), ("host", "nvme")])
def test_resume_is_bit_exact_when_units_are_loaded_one_at_a_time(tmp_path, monkeypatch, params, opt):
    """Units larger than unit_loads.AHEAD_BYTES are read in turn, values and
    each moment through one shared buffer ([Note: staged unit loads])."""
    from infinity.checkpoint import unit_loads
    monkeypatch.setattr(unit_loads, "AHEAD_BYTES", 0)
    resume_matches(tmp_path, params=params, opt=opt, dtype="bf16")


@pytest.mark.parametrize("kw", [
    {"dtype": "bf16", "params": "nvme", "opt": "nvme", "overlap": "backward"},
    {"dtype": "bf16", "params": "host", "opt": "host"},
    {"dtype": "fp16", "params": "host", "opt": "host"},
    {"dtype": "fp16", "params": "nvme", "opt": "nvme"},
    {"params": "nvme", "opt": "nvme", "sched": True, "accum": 2, "clip": 0.05},
    {"params": "host", "opt": "host", "overlap": "backward", "sched": True, "accum": 2},
    {"params": "host", "opt": "host", "overlap": "delayed", "sched": True},
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_resume_is_bit_exact_with_dtypes_schedules_accumulation_clipping(tmp_path, kw):
    resume_matches(tmp_path, **kw)


def test_fp16_loss_scaler_state_is_restored(tmp_path):
    m, o, _ = make(tmp_path, "a", "host", "host", dtype="fp16")
    train(m, o, None, data(2))
    o.loss_scale, o.scaling.good_steps = 1024.0, 7
    infinity.save_checkpoint(tmp_path / "ck", m, o)
    infinity.close(m)
    m, o, _ = make(tmp_path, "b", "host", "host", dtype="fp16")
    infinity.load_checkpoint(tmp_path / "ck", m, o)
    assert (o.loss_scale, o.scaling.good_steps) == (1024.0, 7)
    infinity.close(m)


CHILD = textwrap.dedent("""
    import json, random, sys
    sys.path[:0] = {tests!r}
    import torch, infinity
    from test_checkpoint import model, data
    from paging_zoo import base_config
    mode, root, swap = sys.argv[1], sys.argv[2], sys.argv[3]
    random.seed(1)
    cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", overlap="backward",
                                        device_memory=1 << 20, swap_paths=[swap], swap_block_size=4096))
    m, o = infinity.initialize(model(dropout=0.2), cfg, lr=1e-2)
    batches = data(6)
    start = 0
    if mode == "resume":
        start = infinity.load_checkpoint(root, m, o)["next"]
    losses = []
    for i in range(start, 6):
        x, y = batches[i]
        noise = random.random()  # python's generator: restored too
        loss = m(x * (1 + noise), y)
        loss.backward(); o.step(); o.zero_grad()
        losses.append(loss.item())
        if mode == "first" and i == 2:
            infinity.save_checkpoint(root, m, o, extra={{"next": 3}})
            break
    print(json.dumps(losses))
    infinity.close(m)
""")


def _child(tmp_path, mode):
    code = CHILD.format(tests=HERE_AND_TESTS)
    r = subprocess.run([sys.executable, "-c", code, mode, str(tmp_path / "ck"), str(tmp_path / f"swap-{mode}")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_new_process_resumes_exactly_with_dropout_and_python_rng(tmp_path):
    full = _child(tmp_path, "full")
    first = _child(tmp_path, "first")
    rest = _child(tmp_path, "resume")
    assert first + rest == full, (first, rest, full)


def test_layout_latest_and_keep_last(tmp_path):
    m, o, _ = make(tmp_path, "a", "host", "host")
    batches = data(4)
    paths = []
    for i in range(4):
        train(m, o, None, batches[i:i + 1])
        paths.append(infinity.save_checkpoint(tmp_path / "ck", m, o, keep_last=2))
    assert [p.name for p in paths] == [layout.step_dir_name(k) for k in (1, 2, 3, 4)]
    visible = [n for n in os.listdir(tmp_path / "ck") if not n.startswith(".")]
    assert sorted(visible) == [layout.step_dir_name(3), layout.step_dir_name(4)]  # the older ones gone at once
    layout.wait_removals(str(tmp_path / "ck"))  # and deleted in the background
    assert sorted(os.listdir(tmp_path / "ck")) == [owner.LOCK_NAME, layout.step_dir_name(3), layout.step_dir_name(4)]
    files = sorted(os.listdir(paths[-1]))
    assert files == ["manifest.json", "model-00001-of-00001.safetensors", "optimizer-00001-of-00001.safetensors"]
    assert layout.resolve(tmp_path / "ck") == str(paths[-1])
    # A partial folder (a save that was killed) is never the latest.
    os.mkdir(tmp_path / "ck" / ".step-00000009.partial")
    assert layout.resolve(tmp_path / "ck") == str(paths[-1])
    info = infinity.verify_checkpoint(tmp_path / "ck")
    n_params = len(list(m.named_parameters()))
    assert info["step"] == 4 and info["tensors"] == 3 * n_params + len(list(m.buffers())), info
    infinity.close(m)


def test_weights_are_plain_safetensors_by_parameter_name(tmp_path):
    from safetensors.torch import load_file
    m, o, _ = make(tmp_path, "a", "nvme", "nvme", dtype="bf16")
    train(m, o, None, data(2))
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)
    live = infinity.full_state_dict(m)
    weights = load_file(str(path / "model-00001-of-00001.safetensors"))
    assert sorted(weights) == sorted(live)
    for k, v in weights.items():
        assert v.dtype == torch.float32 and torch.equal(v, live[k]), k
    moments = load_file(str(path / "optimizer-00001-of-00001.safetensors"))
    assert sorted(moments) == sorted([f"exp_avg.{k}" for k in live] + [f"exp_avg_sq.{k}" for k in live])
    sd = o.state_dict()
    names = [n for n, _ in m.named_parameters()]
    for i, n in enumerate(names):
        assert torch.equal(moments[f"exp_avg.{n}"], sd["state"][i]["exp_avg"]), n
    infinity.close(m)


def test_save_in_the_middle_of_an_accumulation_window_is_refused(tmp_path):
    m, o, _ = make(tmp_path, "a", "host", "host", accum=2)
    x, y = data(1)[0]
    m(x, y).backward()
    with pytest.raises(infinity.engine.faults.UsageError, match="after optimizer.step"):
        infinity.save_checkpoint(tmp_path / "ck", m, o)
    assert not (tmp_path / "ck").exists() or not os.listdir(tmp_path / "ck")
    m(x, y).backward()
    o.step()
    infinity.save_checkpoint(tmp_path / "ck", m, o)
    infinity.close(m)


def test_exclude_frozen_saves_only_the_trainable_part_and_resumes(tmp_path):
    """An adapter on a frozen offloaded base: the checkpoint holds only the
    trainable parameters and their state; the base comes from its own init."""
    def frozen_model():
        m = model()
        for p in list(m.blocks[0].parameters()) + list(m.blocks[2].parameters()):
            p.requires_grad_(False)
        return m

    def run(tag):
        cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                            swap_paths=[str(tmp_path / f"swap-{tag}")], swap_block_size=4096))
        return infinity.initialize(frozen_model(), cfg, lr=1e-2)

    batches = data(6)
    m, o = run("ref")
    ref = train(m, o, None, batches)
    infinity.close(m)
    m, o = run("a")
    first = train(m, o, None, batches[:3])
    path = infinity.save_checkpoint(tmp_path / "ck", m, o, exclude_frozen=True)
    infinity.close(m)
    from safetensors import safe_open
    with safe_open(str(path / "model-00001-of-00001.safetensors"), "pt") as f:
        saved = set(f.keys())
    frozen = {n for n, p in frozen_model().named_parameters() if not p.requires_grad}
    assert frozen and not saved & frozen and saved
    m, o = run("b")
    infinity.load_checkpoint(tmp_path / "ck", m, o)
    rest = train(m, o, None, batches[3:])
    infinity.close(m)
    assert first + rest == ref


def test_strict_false_loads_the_common_names_and_says_which_it_skipped(tmp_path):
    """strict=False skipped names silently; torch returns them. Now a warning names both sides."""
    m, o, _ = make(tmp_path, "a", "host", "host")
    train(m, o, None, data(2))
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)
    want = infinity.full_state_dict(m)
    infinity.close(m)
    torch.manual_seed(5)
    other = Chain([32, 16, 64, 8, 12])  # one block more: its names are not in the checkpoint
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20))
    m2, o2 = infinity.initialize(other, cfg, lr=1e-2)
    before = infinity.full_state_dict(m2)
    with pytest.raises(KeyError, match="strict=False"):
        infinity.load_checkpoint(path, m2, o2)
    with pytest.warns(RuntimeWarning, match=r"blocks\.4\.a\.weight") as rec:
        infinity.load_checkpoint(path, m2, o2, strict=False)
    assert any("keep their current values" in str(w.message) for w in rec)
    got = infinity.full_state_dict(m2)
    for k, v in got.items():
        assert torch.equal(v, want[k] if k in want else before[k]), k
    infinity.close(m2)


def test_direct_reader_reads_backwards_too(tmp_path):
    """A load reads a unit's slots in their order, which may lie before the
    previous read in the file: a jump back of more than DEPTH blocks raised KeyError."""
    from infinity.checkpoint.direct_stream import BLOCK, DirectReader
    data = torch.randint(0, 255, (20 * BLOCK // 4,), dtype=torch.int32)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    r = DirectReader(str(path))
    try:
        for at in (10 * BLOCK, 0, 15 * BLOCK + 5, 3 * BLOCK + 7, 19 * BLOCK):
            out = torch.empty(BLOCK + 100, dtype=torch.uint8)
            n = r.read_into(at, out)
            assert torch.equal(out[:n], data.view(torch.uint8)[at:at + n]), at
    finally:
        r.close()
