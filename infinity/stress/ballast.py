"""RAM ballast for the stress test's squeeze from outside:
``python -m infinity.stress.ballast LEAVE_BYTES``.

Takes (and touches) anonymous memory until the machine's MemAvailable is at
most ``LEAVE_BYTES``, prints ``READY <bytes taken>``, and holds it until
its stdin closes. It marks itself the OOM killer's first choice
(oom_score_adj 1000): should the squeeze go too far, the kernel ends the
ballast, never the training run or anything else on the machine; the
scenario then reports that the kernel acted.
"""

from __future__ import annotations

import mmap
import sys

CHUNK = 64 << 20  # bytes taken per step


def mem_available() -> int:
    """The kernel's MemAvailable (bytes)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main() -> int:
    leave = int(sys.argv[1])
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    held, blob = [], b"\x01" * CHUNK
    while mem_available() - CHUNK > leave:
        m = mmap.mmap(-1, CHUNK)
        m.write(blob)  # touched: resident, not a promise
        held.append(m)
    print(f"READY {len(held) * CHUNK}", flush=True)
    sys.stdin.read()  # hold until the scenario closes the pipe
    return 0


if __name__ == "__main__":
    sys.exit(main())
