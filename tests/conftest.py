import os
import shutil
import subprocess

import pytest
import torch

import infinity


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts seeded and with torch's thread count as it found it:
    a test that sets threads (``infinity train``'s ``torch_threads``) must not
    change the rounding of the tests after it."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def simd_params():
    """Every ISA variant this CPU and build support, plus the torch fallback."""
    return infinity.system.native.simd_levels() + ["fallback"]


@pytest.fixture
def backend(request, monkeypatch):
    """Selects a kernel variant for the duration of a test ("fallback" = pure torch)."""
    level = request.param
    if level == "fallback":
        monkeypatch.setattr(infinity.system.native, "available", lambda: False)
        yield level
    else:
        with infinity.system.native.use_simd(level):
            yield level


@pytest.fixture
def ext4(tmp_path):
    """A fresh loop-mounted ext4 of 56 MiB, unmounted (lazily) afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to loop-mount an ext4 image")
    if not shutil.which("mkfs.ext4"):
        pytest.skip("mkfs.ext4 is not installed")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(img, "wb") as f:
        f.truncate(56 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    mnt.mkdir()
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot loop-mount an ext4 image here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
