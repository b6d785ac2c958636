"""A checkpoint is input from someone else (issue 34, item 1): every file a
manifest names is read inside the checkpoint folder only (no absolute name,
no '..', no symbolic link out; a FIFO refused at once), sizes and offsets
are checked before any read, headers and manifests are bounded, malformed
fields are a CorruptCheckpointError naming the file and field, and no
error echoes what was read. load_checkpoint, verify_checkpoint and
consolidate each refuse an escape before opening the file outside."""

import json
import os
import shutil
import struct
import sys
import threading

import pytest
import torch
from test_checkpoint import data, make, train
from test_checkpoint_faults import flip_byte

import infinity
from infinity.checkpoint import consolidate

# Every open(2) of the process (builtins.open, os.open, with or without
# dir_fd) is an audit event; a test records the paths opened while it runs.
_OPENED: list = []
_RECORDING = [False]


def _audit(event, args):
    if _RECORDING[0] and event == "open" and args and isinstance(args[0], (str, bytes)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def opened():
    """The paths opened while the test's block runs (reset at its start)."""
    _OPENED.clear()
    _RECORDING[0] = True
    yield _OPENED
    _RECORDING[0] = False


SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture
def saved(tmp_path):
    m, o, _ = make(tmp_path, "src", "host", "host")
    train(m, o, None, data(2))
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)
    infinity.close(m)
    return path


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path, m):
    (path / "manifest.json").write_text(json.dumps(m))


def _load(path, tmp_path):
    m, o, _ = make(tmp_path, "dst", "host", "host")
    before = infinity.full_state_dict(m)
    try:
        infinity.load_checkpoint(path, m, o)
    finally:
        after = infinity.full_state_dict(m)  # nothing changed, and the engine still serves
        infinity.close(m)
        assert all(torch.equal(before[k], after[k]) for k in before)


def _verify(path, tmp_path):
    infinity.verify_checkpoint(path)


def _consolidate(path, tmp_path):
    consolidate(path, tmp_path / "hf", dtype="fp32")


READERS = {"load": _load, "verify": _verify, "consolidate": _consolidate}


def _escape(path, tmp_path, how):
    """Makes the checkpoint's model shard point outside the folder ``how``;
    returns the outside file (a true copy: following the name would work)."""
    outside = tmp_path / "outside" / "secret.safetensors"
    outside.parent.mkdir()
    shutil.copy(path / SHARD, outside)
    if how == "symlink":
        os.unlink(path / SHARD)
        os.symlink(outside, path / SHARD)
        return outside
    name = "../outside/secret.safetensors" if how == "relative" else str(outside)
    m = _manifest(path)
    m["files"][name] = m["files"].pop(SHARD)
    for rec in m["tensors"].values():
        if rec["file"] == SHARD:
            rec["file"] = name
    _write_manifest(path, m)
    return outside


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_a_name_leaving_the_folder_is_refused_before_the_file_outside_is_opened(saved, tmp_path, opened, how,
                                                                                 reader):
    outside = _escape(saved, tmp_path, how)
    opened.clear()  # (the copy above opened it)
    match = "symbolic link" if how == "symlink" else "not a plain file name inside the checkpoint folder"
    with pytest.raises(infinity.CorruptCheckpointError, match=match):
        READERS[reader](saved, tmp_path)
    assert not [p for p in opened if os.path.realpath(p) == str(outside)], opened
    assert not (tmp_path / "hf").exists() or not os.listdir(tmp_path / "hf")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_an_extra_escaping_entry_in_files_is_refused(saved, tmp_path, opened, reader):
    m = _manifest(saved)
    m["files"]["../../etc-passwd"] = 0
    _write_manifest(saved, m)
    with pytest.raises(infinity.CorruptCheckpointError, match="not a plain file name"):
        READERS[reader](saved, tmp_path)


def test_consolidate_checks_the_file_sizes_first(saved, tmp_path):
    m = _manifest(saved)
    m["files"][SHARD] += 1  # the file is shorter than the manifest says (truncated)
    _write_manifest(saved, m)
    with pytest.raises(infinity.CorruptCheckpointError, match=f"{SHARD}: .* bytes, the manifest says"):
        consolidate(saved, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _in_thread(fn):
    """Runs ``fn`` on a thread; its exception (or 'hung': a regression that
    blocks in open(2)) once it ends or 300 s pass (far beyond a loaded
    machine's load of this small checkpoint: only a hang reaches it)."""
    out = {}

    def run():
        try:
            fn()
            out["result"] = None
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(300)
    return "hung" if t.is_alive() else out.get("error")


def _unblock(fifo):
    """Opens ``fifo`` for writing without blocking: a reader stuck in open(2) goes on."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_fifo_in_place_of_a_shard_is_refused_at_once(saved, tmp_path, reader):
    os.unlink(saved / SHARD)
    os.mkfifo(saved / SHARD)
    try:
        err = _in_thread(lambda: READERS[reader](saved, tmp_path))
    finally:
        _unblock(saved / SHARD)
    assert isinstance(err, infinity.CorruptCheckpointError) and "not a regular file" in str(err), err


def test_a_fifo_manifest_is_skipped_with_a_warning_not_a_hang(saved, tmp_path):
    root = saved.parent
    newer = root / "step-00000009"
    newer.mkdir(mode=0o700)
    os.mkfifo(newer / "manifest.json")
    try:
        with pytest.warns(RuntimeWarning, match="step-00000009.*not a regular file"):
            err = _in_thread(lambda: infinity.verify_checkpoint(root))
        assert err is None, err  # the newest whole one (saved) was verified
        err = _in_thread(lambda: infinity.verify_checkpoint(newer))  # named explicitly: refused, named
    finally:
        _unblock(newer / "manifest.json")
    assert isinstance(err, infinity.CorruptCheckpointError) and "not a regular file" in str(err), err


def test_a_huge_header_length_is_a_named_error(saved, tmp_path):
    with open(saved / SHARD, "r+b") as f:
        f.write(struct.pack("<Q", 2 ** 63 - 1))
    with pytest.raises(infinity.CorruptCheckpointError, match=f"{SHARD}: header of {2 ** 63 - 1} bytes announced"):
        infinity.verify_checkpoint(saved)


@pytest.mark.parametrize("where", ["top", "inside"])
def test_a_manifest_nested_200000_deep_is_a_named_error(saved, tmp_path, where):
    deep = "[" * 200_000 + "]" * 200_000
    if where == "top":
        (saved / "manifest.json").write_text(deep)
    else:
        text = json.dumps(_manifest(saved))
        (saved / "manifest.json").write_text(text[:-1] + ', "extra": ' + deep + "}")
    for reader in READERS.values():
        with pytest.raises(infinity.CorruptCheckpointError, match="manifest.json: JSON nested too deep"):
            reader(saved, tmp_path)


def test_an_oversized_manifest_is_refused_before_it_is_read(saved, monkeypatch):
    from infinity.checkpoint import manifest
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(infinity.CorruptCheckpointError, match=r"manifest.json: \d+ bytes, over the 100"):
        infinity.verify_checkpoint(saved)


def _first(m):
    return sorted(m["tensors"].items(), key=lambda kv: (kv[1]["file"], kv[1]["offset"]))[0]


def _set(m, field, value):
    name, rec = _first(m)
    if field == "tensors":
        m["tensors"] = value
    elif field == "files":
        m["files"] = value
    elif field == "chunks.bytes":
        rec["chunks"] = {"bytes": value, "crc32c": []}
    else:
        rec[field] = value
    return name


BAD_FIELDS = [
    ("tensors", [], "'tensors' must be a JSON object"),
    ("files", ["x"], "'files' must be a JSON object"),
    ("chunks.bytes", 0, r"\.chunks must be"),
    ("offset", "4096", r"\.offset must be an int"),
    ("offset", -8, r"\.offset must be an int"),
    ("offset", 1.5e9, r"\.offset must be an int"),
    ("offset", 1 << 40, "past the .* bytes the manifest gives"),
    ("length", 3, r"\.length must be the bytes of its shape"),
    ("shape", ["8"], r"\.shape must be a list of ints"),
    ("dtype", "SECRET-VALUE", r"\.dtype must be one of"),
    ("crc32c", "0", r"\.crc32c must be a 32-bit"),
    ("file", "not-listed.safetensors", r"\.file must be one of the files"),
]


@pytest.mark.parametrize("field,value,match", BAD_FIELDS, ids=[f"{f}={v!r}"[:30] for f, v, _ in BAD_FIELDS])
def test_a_malformed_field_is_a_corrupt_checkpoint_error_naming_it(saved, tmp_path, field, value, match):
    m = _manifest(saved)
    _set(m, field, value)
    _write_manifest(saved, m)
    for name, reader in READERS.items():
        with pytest.raises(infinity.CorruptCheckpointError, match=match) as e:
            reader(saved, tmp_path)
        assert "manifest.json" in str(e.value) and "SECRET-VALUE" not in str(e.value), (name, e.value)


def test_a_crc_mismatch_names_the_place_not_the_bytes_read(saved, tmp_path):
    m = _manifest(saved)
    name, rec = _first(m)
    flip_byte(saved / rec["file"], rec["offset"] + 1)
    for reader in (_consolidate, _verify):
        with pytest.raises(infinity.CorruptCheckpointError, match=f"{name}.*offset {rec['offset']}") as e:
            reader(saved, tmp_path)
        assert "0x" not in str(e.value) and f"{rec['crc32c']:08x}" not in str(e.value), str(e.value)
