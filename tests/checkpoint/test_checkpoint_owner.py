"""A checkpoint folder is owned like a swap folder, and the newest checkpoint
is chosen with care (issue 34, items 2 and 3): made 0700; an existing one
must be ours and not writable by group or others; step folders not ours are
ignored with a warning; one saver at a time (a flock); partial folders of a
live saver are left; a file in a partial folder's place is named. A bad
manifest in one step folder is named and skipped, an I/O error while
scanning is an error naming the path, a load falls back from a newest
checkpoint that is not whole, and keep_last never raises after a commit."""

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_checkpoint import HERE_AND_TESTS, data, make, train
from owner_utils import foreign

import infinity
from infinity.checkpoint import direct_stream, layout, owner
from infinity.checkpoint.owner import CheckpointLockedError
from infinity.engine.faults import UsageError


@pytest.fixture
def run(tmp_path):
    m, o, _ = make(tmp_path, "src", "host", "host")
    train(m, o, None, data(1))
    yield m, o
    infinity.close(m)


def _save(run, root, step, **kw):
    m, o = run
    return infinity.save_checkpoint(root, m, o, step=step, extra={"step": step}, **kw)


def test_a_new_checkpoint_folder_is_private_whatever_the_umask(run, tmp_path):
    old = os.umask(0)
    try:
        _save(run, tmp_path / "parent" / "ck", 1)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "parent" / "ck").st_mode & 0o777 == 0o700


@pytest.mark.parametrize("what", ["group-writable", "other-writable", "not ours"])
def test_an_unsafe_checkpoint_folder_is_refused_by_save_and_load(run, tmp_path, monkeypatch, what):
    root = tmp_path / "ck"
    path = _save(run, root, 1)
    if what == "not ours":
        foreign(monkeypatch, root)
        match = "owned by uid .*chown"
    else:
        os.chmod(root, 0o770 if what == "group-writable" else 0o702)
        match = f"has mode .*chmod 700 '{root}'"
    m, o = run
    with pytest.raises(UsageError, match=match):
        infinity.save_checkpoint(root, m, o, step=2)
    assert sorted(os.listdir(root)) == [owner.LOCK_NAME, path.name]  # nothing written
    with pytest.raises(UsageError, match=match):
        infinity.load_checkpoint(root, m, o)


def test_a_step_folder_not_ours_is_ignored_with_a_warning(run, tmp_path, monkeypatch):
    root = tmp_path / "ck"
    _save(run, root, 1)
    newest = _save(run, root, 2)
    foreign(monkeypatch, newest)
    m, o = run
    with pytest.warns(RuntimeWarning, match=f"{newest.name} is skipped: .*owned by uid"):
        assert infinity.load_checkpoint(root, m, o) == {"step": 1}
    with pytest.warns(RuntimeWarning, match="owned by uid"):
        _save(run, root, 3, keep_last=1)  # pruning leaves the foreign folder alone too
    assert newest.exists()


HOLDER = textwrap.dedent("""
    import os, sys
    sys.path[:0] = {tests!r}
    from infinity.checkpoint import owner
    lock = owner.SaveLock(sys.argv[1])
    os.mkdir(os.path.join(sys.argv[1], ".step-00000005.partial"), 0o700)  # a live saver's partial folder
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


def test_a_second_saver_is_refused_while_the_first_holds_the_folder(run, tmp_path):
    root = tmp_path / "ck"
    _save(run, root, 1)
    p = subprocess.Popen([sys.executable, "-c", HOLDER.format(tests=HERE_AND_TESTS), str(root)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "held\n"
        with pytest.raises(CheckpointLockedError, match=f"{root}.*another save \\(pid {p.pid};"):
            _save(run, root, 2)
        assert (root / ".step-00000005.partial").is_dir()  # its saver is alive: left alone
    finally:
        p.stdin.close()
        p.wait(300)
    _save(run, root, 2)  # the holder is gone: the lock is free, and its partial folder is removed
    layout.wait_removals(str(root))
    assert not (root / ".step-00000005.partial").exists()


def test_two_savers_in_one_process_exclude_each_other(run, tmp_path):
    root = tmp_path / "ck"
    _save(run, root, 1)
    held = owner.SaveLock(str(root))
    try:
        with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}"):
            _save(run, root, 2)
    finally:
        held.release()
    _save(run, root, 2)


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_file_in_the_partial_folders_place_is_named(run, tmp_path, kind):
    root = tmp_path / "ck"
    _save(run, root, 1)
    partial = layout.partial_dir(str(root), 7)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    if kind == "file":
        with open(partial, "w") as f:
            f.write("not a folder")
    else:
        os.symlink(target, partial)
    with pytest.raises(UsageError, match=f"{partial}.* is in the way.*remove it"):
        _save(run, root, 7)
    assert os.path.lexists(partial) and (target / "keep").exists()
    _save(run, root, 8)  # other steps still save; prune leaves what is not a folder of ours
    layout.wait_removals(str(root))
    assert os.path.lexists(partial) and (target / "keep").exists()


def test_a_symlinked_lock_file_is_refused(run, tmp_path):
    root = tmp_path / "ck"
    _save(run, root, 1)
    os.unlink(root / owner.LOCK_NAME)
    os.symlink(tmp_path / "victim", root / owner.LOCK_NAME)
    with pytest.raises(UsageError, match="symbolic link"):
        _save(run, root, 2)
    assert not (tmp_path / "victim").exists()


# -- latest resolution (item 3) ---------------------------------------------------------

def _break(path, how):
    mpath = path / "manifest.json"
    if how == "bad json":
        mpath.write_text("{ not json")
    elif how == "truncated shard":
        shard = path / "optimizer-00001-of-00001.safetensors"
        os.truncate(shard, os.path.getsize(shard) - 100)
    else:  # a manifest that parses but whose field is malformed
        m = json.loads(mpath.read_text())
        m["param_steps"] = {k: -1 for k in m["param_steps"]}
        mpath.write_text(json.dumps(m))


@pytest.mark.parametrize("how", ["bad json", "truncated shard", "bad field"])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_whole_one(run, tmp_path, how):
    root = tmp_path / "ck"
    _save(run, root, 1)
    newest = _save(run, root, 2)
    _break(newest, how)
    why = {"bad json": "not valid JSON", "truncated shard": "truncated", "bad field": "param_steps"}[how]
    m, o, _ = make(tmp_path, "dst", "host", "host")
    with pytest.warns(RuntimeWarning, match=f"{newest.name}.*{why}"):
        assert infinity.load_checkpoint(root, m, o) == {"step": 1}
    infinity.close(m)


def test_no_whole_checkpoint_names_why_each_was_skipped(run, tmp_path):
    root = tmp_path / "ck"
    first = _save(run, root, 1)
    second = _save(run, root, 2)
    _break(first, "truncated shard")
    _break(second, "bad field")
    m, o, _ = make(tmp_path, "dst", "host", "host")
    before = infinity.full_state_dict(m)
    with pytest.raises(infinity.CorruptCheckpointError, match=f"no whole checkpoint.*{second.name}.*param_steps.*"
                                                              f"{first.name}.*truncated"):
        infinity.load_checkpoint(root, m, o)
    after = infinity.full_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    infinity.close(m)


def _eio_for(monkeypatch, module, name, bad):
    real = getattr(module, name)

    def failing(path, *a, **kw):
        if os.fspath(path) == os.fspath(bad):
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *a, **kw)
    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize("where", ["listing the folder", "reading a manifest"])
def test_an_io_error_while_scanning_names_the_path(run, tmp_path, monkeypatch, where):
    root = tmp_path / "ck"
    _save(run, root, 1)
    newest = _save(run, root, 2)
    if where == "listing the folder":
        _eio_for(monkeypatch, layout.os, "listdir", root)
        bad = root
    else:
        _eio_for(monkeypatch, layout, "read_member", newest)
        bad = newest / "manifest.json"
    m, o = run
    with pytest.raises(OSError, match=f"cannot read {bad} while looking for the newest checkpoint") as e:
        infinity.load_checkpoint(root, m, o)
    assert e.value.errno == errno.EIO and not isinstance(e.value, FileNotFoundError)


@pytest.mark.parametrize("reader", ["load", "verify"])
def test_an_io_error_mid_load_names_the_file_and_fails_the_engine(run, tmp_path, monkeypatch, reader):
    """EIO while the tensors are read (a disk failing under the load) is an
    OSError naming the checkpoint file and the offset, not a bare errno nor
    a corrupt checkpoint; a load it interrupts fails the engine."""
    ckpt = _save(run, tmp_path / "ck", 1)
    m, o, _ = make(tmp_path, "dst", "host", "host")

    def failing(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(direct_stream.os, "preadv", failing)
    with pytest.raises(OSError, match=f"cannot read checkpoint file {ckpt}/.*safetensors at byte \\d+: "
                                      "Input/output error") as e:
        if reader == "load":
            infinity.load_checkpoint(tmp_path / "ck", m, o)
        else:
            infinity.verify_checkpoint(ckpt)
    assert e.value.errno == errno.EIO and not isinstance(e.value, infinity.CorruptCheckpointError)
    monkeypatch.undo()
    if reader == "load":
        with pytest.raises(infinity.EngineFailedError):
            infinity.full_state_dict(m)
    infinity.close(m)


def test_keep_last_does_not_raise_after_the_commit(run, tmp_path, monkeypatch):
    root = tmp_path / "ck"
    first = _save(run, root, 1)
    _save(run, root, 2)
    _break(first, "bad json")
    with pytest.warns(RuntimeWarning, match=f"{first.name} is skipped"):
        third = _save(run, root, 3, keep_last=1)  # the bad one is named, neither counted nor removed
    assert third.is_dir() and first.is_dir()
    _eio_for(monkeypatch, layout, "read_member", first)  # now reading it fails outright
    with pytest.warns(RuntimeWarning, match="step-00000004 is saved, but removing older checkpoints failed"):
        fourth = _save(run, root, 4, keep_last=1)
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match=first.name):
        assert layout.resolve(str(root)) == str(fourth)


def test_a_step_folder_that_is_a_link_out_is_skipped(run, tmp_path):
    root = tmp_path / "ck"
    _save(run, root, 1)
    elsewhere = _save(run, tmp_path / "elsewhere", 2)  # a whole checkpoint outside the folder
    os.symlink(elsewhere, root / "step-00000009")
    m, o = run
    with pytest.warns(RuntimeWarning, match="step-00000009 is skipped: .*not a folder"):
        assert infinity.load_checkpoint(root, m, o) == {"step": 1}
