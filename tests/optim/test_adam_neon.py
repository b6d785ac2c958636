"""The NEON variant, cross-compiled for AArch64 and run under qemu.

Skipped where the cross toolchain or qemu is missing
(apt-get install g++-aarch64-linux-gnu qemu-user).
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")
                         and shutil.which("cmake") and shutil.which("ninja")),
                    reason="needs aarch64-linux-gnu-g++, qemu-aarch64, cmake and ninja")
def test_neon_bit_identical_to_scalar_under_qemu(tmp_path):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "check_neon.sh"), str(tmp_path / "build")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "neon: 216 cases bit-identical to scalar" in r.stdout
    assert "all passed" in r.stdout
