"""Checkpoints under faults (issue 19): a kill at any point of a save leaves
the previous checkpoint loadable and never makes the partial one the latest;
a full disk gives a named error, leaves nothing behind and the run goes on;
corrupt, truncated, missing or mismatched files give named errors and
nothing half-loaded is served."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from test_checkpoint import data, make, train

import infinity

# A child process imports this folder's tests and the shared helpers in tests/.
HERE_AND_TESTS = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from infinity.checkpoint import layout, owner, save
from infinity.engine.faults import EngineFailedError

KILLER = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = {tests!r}
    import infinity
    from infinity.checkpoint import save
    from test_checkpoint import data, make, train
    import pathlib
    tmp, point, nth = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    m, o, _ = make(tmp, "kill", "nvme", "nvme")
    train(m, o, None, data(2))
    infinity.save_checkpoint(tmp / "ck", m, o)          # the previous checkpoint (step 2)
    ref = {{k: v.tolist() for k, v in infinity.full_state_dict(m).items()}}
    import json; (tmp / "ref.json").write_text(json.dumps(ref))
    train(m, o, None, data(3)[2:])
    seen = [0]
    def hook(p):
        if p == point:
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
    save.test_hook = hook
    infinity.save_checkpoint(tmp / "ck", m, o)          # killed part-way (step 3)
    print("not killed")
""")

POINTS = [("tensor", 1), ("tensor", 7), ("tensor", 25), ("tensor", 50), ("manifest", 1), ("commit", 1)]


@pytest.mark.parametrize("point,nth", POINTS)
def test_a_kill_during_save_leaves_the_previous_checkpoint(tmp_path, point, nth):
    code = KILLER.format(tests=HERE_AND_TESTS)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), point, str(nth)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert layout.step_dir_name(2) in names and layout.step_dir_name(3) not in names, names
    assert layout.resolve(tmp_path / "ck").endswith(layout.step_dir_name(2))
    ref = json.loads((tmp_path / "ref.json").read_text())
    m, o, _ = make(tmp_path, "after", "nvme", "nvme")
    infinity.load_checkpoint(tmp_path / "ck", m, o)
    got = infinity.full_state_dict(m)
    assert all(got[k].tolist() == v for k, v in ref.items())
    # The next save cleans the partial folder up.
    train(m, o, None, data(3)[2:])
    infinity.save_checkpoint(tmp_path / "ck", m, o)
    layout.wait_removals(str(tmp_path / "ck"))  # (deleted in the background)
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".") and n != owner.LOCK_NAME]
    infinity.close(m)


def _saved(tmp_path, params="host", opt="host"):
    m, o, _ = make(tmp_path, "src", params, opt)
    train(m, o, None, data(2))
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)
    infinity.close(m)
    return path


def _fresh(tmp_path, tag="dst", params="host", opt="host"):
    m, o, _ = make(tmp_path, tag, params, opt)
    return m, o, infinity.full_state_dict(m)


def flip_byte(path, offset, mask=0x40):
    """Flips the bits ``mask`` of the byte at ``offset`` of the file ``path`` (a bad disk)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def test_a_flipped_byte_is_named_and_nothing_half_loaded_is_served(tmp_path):
    path = _saved(tmp_path)
    m = json.loads((path / "manifest.json").read_text())
    name, rec = sorted(m["tensors"].items(), key=lambda kv: (kv[1]["file"], kv[1]["offset"]))[5]
    flip_byte(path / rec["file"], rec["offset"] + 3)
    with pytest.raises(infinity.CorruptCheckpointError, match=f"{name}.*offset {rec['offset']}"):
        infinity.verify_checkpoint(path)
    model, opt, _ = _fresh(tmp_path)
    with pytest.raises(infinity.CorruptCheckpointError, match=name):
        infinity.load_checkpoint(path, model, opt)
    with pytest.raises(EngineFailedError, match="load_checkpoint"):
        infinity.full_state_dict(model)  # part of it was loaded: the run refuses to go on
    infinity.close(model)


@pytest.mark.parametrize("damage", ["truncate", "missing_manifest", "missing_file", "bad_json"])
def test_damaged_checkpoints_are_named_and_nothing_changes(tmp_path, damage):
    path = _saved(tmp_path)
    shard = path / "optimizer-00001-of-00001.safetensors"
    if damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) - 100)
        err, match = infinity.CorruptCheckpointError, "optimizer-00001.*truncated"
    elif damage == "missing_manifest":
        os.unlink(path / "manifest.json")
        err, match = FileNotFoundError, "no complete checkpoint"
    elif damage == "missing_file":
        os.unlink(shard)
        err, match = infinity.CorruptCheckpointError, "optimizer-00001.*missing"
    else:
        (path / "manifest.json").write_text("{ not json")
        err, match = FileNotFoundError, "no complete checkpoint"
    model, opt, before = _fresh(tmp_path)
    with pytest.raises(err, match=match):
        infinity.load_checkpoint(tmp_path / "ck", model, opt)
    after = infinity.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    infinity.close(model)


def test_a_model_of_other_shapes_is_refused_before_anything_loads(tmp_path):
    from paging_zoo import Chain, base_config
    path = _saved(tmp_path)
    torch.manual_seed(0)
    other = Chain([32, 16, 64, 9])
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20))
    model, opt = infinity.initialize(other, cfg, lr=1e-2)
    before = infinity.full_state_dict(model)
    with pytest.raises(ValueError, match=r"is \(9, 16\) in .*\(8, 16\) in the model|\(8.*\(9"):
        infinity.load_checkpoint(path, model, opt)
    after = infinity.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    infinity.close(model)


def test_a_full_disk_is_named_the_partial_removed_and_the_run_goes_on(ext4, tmp_path, monkeypatch):  # noqa: F811
    from paging_zoo import Chain, base_config
    torch.manual_seed(0)
    big = Chain([65536, 65536, 65536])  # 6.5 M parameters: a 78 MB checkpoint, on a 56 MiB filesystem
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=64 << 20,
                                        host_memory="512MiB"))
    m, o = infinity.initialize(big, cfg, lr=1e-3)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    m(x, y).backward()
    o.step()
    o.zero_grad()
    with pytest.raises(infinity.CheckpointSpaceError, match="bytes.*free.*needs"):
        infinity.save_checkpoint(ext4 / "ck", m, o)  # refused before writing: the need is known
    assert os.listdir(ext4 / "ck") == [owner.LOCK_NAME]
    monkeypatch.setattr(save, "_check_space", lambda root, plan: None)  # now the disk fills while writing
    with pytest.raises(infinity.CheckpointSpaceError, match="filled up while writing"):
        infinity.save_checkpoint(ext4 / "ck", m, o)
    assert os.listdir(ext4 / "ck") == [owner.LOCK_NAME], "the partial checkpoint was removed"
    m(x, y).backward()  # the run goes on
    o.step()
    infinity.close(m)
