"""`infinity doctor`: a good path, a missing parent, a parent that is a file,
a read-only filesystem, tmpfs, a disk too small, a locked path, a CONFIG's need."""

import errno
import os
import subprocess

import pytest

from cli_utils import cli, run_file
from infinity.cli import doctor_checks
from infinity.io import SwapStore

FAST = ("--probe-bytes", "8MiB")




def _status(out, path, check):
    for line in out.splitlines():
        if line.startswith(f"{path} ") and f" {check} " in line:
            return line.split(f" {check} ", 1)[1].split()[0]
    raise AssertionError(f"no row {check} for {path} in:\n{out}")


def test_good_path_leaves_nothing(tmp_path, capsys):
    p = tmp_path / "swap"
    p.mkdir(mode=0o700)
    assert cli("doctor", "--swap-path", p, *FAST) == 0
    out = capsys.readouterr().out
    for check in ("path", "filesystem", "O_DIRECT", "free space", "bandwidth", "lock"):
        assert _status(out, p, check) in ("OK", "WARN"), check
    assert _status(out, p, "path") == "OK" and "MB/s" in out
    assert "memlock limit" in out and "native library" in out and "CUDA" in out
    assert list(p.iterdir()) == []


def test_missing_parent_is_created_later_and_nothing_now(tmp_path, capsys):
    p = tmp_path / "a" / "b" / "swap"
    assert cli("doctor", "--swap-path", p, *FAST) == 0
    out = capsys.readouterr().out
    assert _status(out, p, "path") == "WARN" and "will create it" in out
    assert list(tmp_path.iterdir()) == []  # neither the parents nor a probe left behind


def test_parent_is_a_file_fails(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    p = tmp_path / "f" / "swap"
    assert cli("doctor", "--swap-path", p, *FAST) == 1
    out = capsys.readouterr().out
    assert _status(out, p, "path") == "FAIL" and "is not a directory" in out and "fixes:" in out


def test_read_only_bind_mount_fails(tmp_path, capsys):
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    made = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    if made and subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode:
        subprocess.run(["umount", str(ro)])
        made = False
    if not made:
        pytest.skip("cannot make a read-only bind mount here (needs root with CAP_SYS_ADMIN); "
                    "test_read_only_filesystem_fails covers the check with a patched statvfs")
    try:
        assert cli("doctor", "--swap-path", ro / "swap", *FAST) == 1
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    out = capsys.readouterr().out
    assert _status(out, ro / "swap", "writable") == "FAIL" and "read-only filesystem" in out
    assert "mount -o remount,rw" in out


def test_read_only_filesystem_fails(tmp_path, capsys, monkeypatch):
    # A chmod 0500 directory is writable for root, and a read-only mount needs
    # privileges a test cannot count on: statvfs reports the flag instead.
    real = os.statvfs

    class RO:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return getattr(self._st, name)

        @property
        def f_flag(self):
            return self._st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(doctor_checks.os, "statvfs", lambda p: RO(real(p)))
    assert cli("doctor", "--swap-path", tmp_path, *FAST) == 1
    out = capsys.readouterr().out
    assert _status(out, tmp_path, "writable") == "FAIL" and "remount it read-write" in out


def test_tmpfs_warns(capsys):
    if doctor_checks.mount_of("/dev/shm")[1] != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    p = "/dev/shm/infinity-doctor-test-swap"
    assert not os.path.exists(p)
    assert cli("doctor", "--swap-path", p, *FAST) == 0
    out = capsys.readouterr().out
    assert _status(out, p, "filesystem") == "WARN" and "RAM-backed" in out
    assert not os.path.exists(p)


def test_no_o_direct_warns(tmp_path, capsys, monkeypatch):
    real = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT and str(path).endswith("odirect.probe"):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(doctor_checks.os, "open", no_direct)
    assert cli("doctor", "--swap-path", tmp_path, *FAST) == 0
    out = capsys.readouterr().out
    assert _status(out, tmp_path, "O_DIRECT") == "WARN" and "page cache" in out


def test_too_small_fails(tmp_path, capsys):
    assert cli("doctor", "--swap-path", tmp_path, "--need", "1000TiB", *FAST) == 1
    out = capsys.readouterr().out
    assert _status(out, tmp_path, "free space") == "FAIL" and "the run needs 1000.00 TiB" in out


def test_config_need_from_the_model(tmp_path, capsys):
    p = run_file(tmp_path, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"')
    p.write_text(p.read_text().replace('size = "tiny"', 'size = "xl"'))
    assert cli("doctor", p, *FAST) in (0, 1)
    out = capsys.readouterr().out
    from infinity.cli.estimate import load_for_estimate
    from infinity.cli.estimate import estimate
    from infinity.config.runtime import format_bytes
    config, model = load_for_estimate(str(p))
    n = sum(q.numel() for q in model.parameters())
    need = estimate(model, config)["nvme"]["capacity"]
    # fp32 with both homes on NVMe: the compute copy is the master (aliased), + gradient and two moments
    assert 16 * n <= need < 16 * n * 1.01
    assert f"NVMe need {format_bytes(need)} over 1 path(s)" in out
    assert str(tmp_path / "swap") in out


def test_locked_path_fails(tmp_path, capsys):
    with SwapStore([str(tmp_path / "swap")], capacity_bytes=1 << 20, block_size=1 << 20):
        assert cli("doctor", "--swap-path", tmp_path / "swap", *FAST) == 1
    out = capsys.readouterr().out
    assert _status(out, tmp_path / "swap", "lock") == "FAIL" and f"pid {os.getpid()}" in out


def test_bad_need_is_a_usage_error(tmp_path):
    assert cli("doctor", "--swap-path", tmp_path, "--need", "lots") == 2


def test_dangling_symlink_fails_naming_its_target(tmp_path, capsys):
    """It said "missing; infinity will create it", exit 0, measured the parent; initialize then failed."""
    link = tmp_path / "swap"
    link.symlink_to(tmp_path / "gone")
    assert cli("doctor", "--swap-path", link, *FAST) == 1
    out = capsys.readouterr().out
    assert _status(out, link, "path") == "FAIL" and f"a symbolic link to '{tmp_path / 'gone'}', which does not " \
        "exist" in out and "bandwidth" not in out
    assert not (tmp_path / "gone").exists()


def test_symlink_to_a_folder_is_followed_and_checked_there(tmp_path, capsys):
    real = tmp_path / "disk"
    real.mkdir(mode=0o700)
    link = tmp_path / "swap"
    link.symlink_to(real)
    assert cli("doctor", "--swap-path", link, "--need", "1MiB", *FAST) == 0
    out = capsys.readouterr().out
    assert _status(out, link, "path") == "OK" and f"a symbolic link to '{real}'" in out and "allowed" in out
    assert _status(out, link, "free space") == "OK" and _status(out, link, "bandwidth") in ("OK", "WARN")
    assert os.listdir(real) == []  # the probes ran in the target and left nothing


def test_a_rank_folder_that_is_a_symlink_fails_as_the_store_refuses_it(tmp_path, capsys):
    p = tmp_path / "swap"
    p.mkdir(mode=0o700)
    (tmp_path / "elsewhere").mkdir()
    (p / "rank0").symlink_to(tmp_path / "elsewhere")
    assert cli("doctor", "--swap-path", p, *FAST) == 1
    out = capsys.readouterr().out
    assert _status(out, p, "lock") == "FAIL" and "is a symbolic link (to" in out and "SwapPathUnsafeError" in out
    import infinity
    from infinity.io.errors import SwapPathUnsafeError
    m = __import__("torch").nn.Sequential(__import__("torch").nn.Linear(4, 4))
    with pytest.raises(SwapPathUnsafeError):  # the rule the doctor reports is the store's
        infinity.initialize(m, infinity.Config(device="cpu", offload_params="nvme", offload_optimizer="nvme",
                                               swap_paths=[str(p)]), lr=1e-3)


def test_probe_fits_a_nearly_full_disk(tmp_path, capsys, monkeypatch):
    """The 64 MiB probe itself failed on a nearly full filesystem ("see the error")."""
    from infinity.cli import doctor
    p = tmp_path / "swap"
    p.mkdir(mode=0o700)
    for mod in (doctor, doctor_checks):
        monkeypatch.setattr(mod, "free_bytes", lambda where: 5 << 20)
    assert cli("doctor", "--swap-path", p, "--probe-bytes", "64MiB") == 0
    out = capsys.readouterr().out
    assert "(2.50 MiB, " in out and "probe shrunk from 64.00 MiB to half the free space" in out
    assert _status(out, p, "bandwidth") in ("OK", "WARN") and "5.00 MiB free" in out
    for mod in (doctor, doctor_checks):
        monkeypatch.setattr(mod, "free_bytes", lambda where: 6 << 10)
    assert cli("doctor", "--swap-path", p, "--probe-bytes", "64MiB") == 0
    out = capsys.readouterr().out
    assert _status(out, p, "bandwidth") == "WARN" and "not measured: 6.00 KiB free" in out
