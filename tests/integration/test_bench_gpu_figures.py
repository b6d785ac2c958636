"""The figures of scripts/gpu/bench_gpu.py that no CPU run can reach: the CUDA
bound (review R3: compute, the CPU AdamW and each copy direction overlap on a
GPU, so the bound is their max, not a sum) and the GPU idle fraction's union
of kernel intervals; and the format check that fails a report missing a row."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))
from bench_gpu import kernel_busy  # noqa: E402
from bench_report import FIELDS, bound_of, check_report  # noqa: E402

PROBES = {"copy": {"h2d_GBps": 50.0, "d2h_GBps": 40.0, "duplex_GBps_each": 25.0}}


def test_bound_is_the_max_on_cuda_and_compute_plus_adam_on_the_cpu():
    row = {"cpu_adam_s": 0.3, "h2d_bytes": 5e9, "d2h_bytes": 10e9}
    # CUDA: copies at the duplex rate, each on its own engine: max(0.2, 0.3, 0.2, 0.4).
    assert bound_of(row, 0.2, PROBES, cuda=True) == pytest.approx(0.4)
    row["d2h_bytes"] = 1e9
    assert bound_of(row, 0.2, PROBES, cuda=True) == pytest.approx(0.3)  # the CPU AdamW
    # CPU: compute and AdamW share the cores; the copies at the slower direction's rate, one after the other.
    assert bound_of(row, 0.2, PROBES, cuda=False) == pytest.approx(max(0.5, 6e9 / 40e9))
    assert bound_of({"cpu_adam_s": None, "h2d_bytes": 0, "d2h_bytes": 0}, 0.2, PROBES, cuda=True) is None


def ev(name, start_us, end_us, device="DeviceType.CUDA"):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_kernel_busy_is_the_union_of_kernels_without_copies():
    prof = SimpleNamespace(events=lambda: [
        ev("gemm", 0, 100), ev("softmax", 50, 150),  # overlapping: 150 us
        ev("Memcpy HtoD (Pinned -> Device)", 150, 900),  # a copy, not compute
        ev("aten::mm", 0, 1000, device="DeviceType.CPU"),  # host side
        ev("adam", 400, 500)])
    assert kernel_busy(prof) == pytest.approx(250e-6)
    assert kernel_busy(SimpleNamespace(events=lambda: [ev("aten::mm", 0, 5, "DeviceType.CPU")])) is None


def test_check_report_names_a_missing_row_and_field():
    full = dict.fromkeys(FIELDS, 1.0) | {"error": "", "step_s": 0.5}
    report = {"phases": {"bf16": {"rows": {"torch": full, "inf-opt": {"step_s": 0.7}},
                                  "skipped": {"torchao": "SKIP: no torchao"}}}}
    plan = [("bf16", ["torch", "inf-opt", "torchao", "fsdp2"]), ("fp32", ["torch"])]
    bad = check_report(report, plan, strict=False)
    assert any("inf-opt: fields missing" in b for b in bad)
    assert any("fsdp2: neither run nor skipped" in b for b in bad)
    assert any("fp32: phase not run" in b for b in bad)
    assert not any("torchao" in b for b in bad)  # skipped with a reason
