"""The native kernel itself: ISA variants, threads, GIL, environment variables."""

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from infinity.system import native
from infinity.optim import adamw_step_

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

AWKWARD = [1, 15, 16, 17, 31, 33, 4097, 65536 + 5, 2**20 + 3]


def _problem(n, gdtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    g = torch.randn(n, generator=gen).to(gdtype)
    g[: min(n, 3)] = torch.tensor([0.0, -0.0, 1e-30])[: min(n, 3)].to(gdtype)
    return p, g, m, v


@pytest.mark.parametrize("level", [l for l in native.simd_levels() if l != "scalar"])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("odtype", [None, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_simd_variant_bit_identical_to_scalar(level, gdtype, odtype, adamw_mode):
    # See [Note: one op sequence for all ISAs] in native/src/adam_kernel.inc.
    for n in AWKWARD:
        results = {}
        for lvl in ("scalar", level):
            p, g, m, v = _problem(n, gdtype)
            out = torch.empty(n, dtype=odtype) if odtype is not None else None
            with native.use_simd(lvl):
                for step in (1, 2, 3):
                    adamw_step_([p], [g], [m], [v], step=step, lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.1, adamw_mode=adamw_mode, outs=[out] if out is not None else None)
            results[lvl] = (p, m, v, out)
        for a, b, name in zip(results["scalar"], results[level], ("param", "exp_avg", "exp_avg_sq", "out")):
            if a is None:
                continue
            assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                               b.view(torch.int16 if b.element_size() == 2 else torch.int32)), \
                f"{level} {name} differs from scalar at n={n}"


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_thread_count_does_not_change_results(threads):
    sizes = [5, 70000, 1, 33, 200000, 4097]
    base = [_problem(n, torch.float32, seed=i) for i, n in enumerate(sizes)]
    ref = [[t.clone() for t in prob] for prob in base]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    ref_outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]

    def run(probs, o, nt):
        adamw_step_([x[0] for x in probs], [x[1] for x in probs], [x[2] for x in probs], [x[3] for x in probs],
                    step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, outs=o, num_threads=nt)

    run(ref, ref_outs, 1)
    run(base, outs, threads)
    for a, b in zip(ref, base):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(ref_outs, outs):
        assert torch.equal(x, y)


def _key_sums(t, chunk):
    """The swap store's chunk rule over ``t``'s bytes, by inf_crc32c."""
    from infinity.io.engine import crc32c
    n = t.numel() * t.element_size()
    aligned, p = n // 4096 * 4096, t.data_ptr()
    sums = [crc32c(p + o, min(o + chunk, aligned) - o) for o in range(0, aligned, chunk)]
    return sums + ([crc32c(p + aligned, n - aligned)] if n > aligned else [])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("chunk", [4096, 256 * 1024])
def test_step_with_sums_same_update_and_store_rule_sums(threads, chunk):
    """sum_chunk_bytes: the update is bit-identical to the plain call (tiles
    and the split by chunk change nothing), and the returned sums are the
    store's rule over each updated buffer, for any mix of sizes and threads."""
    sizes = [5, 70000, 1, 1024, 200000, 4097, 65536 * 4]
    base = [_problem(n, torch.bfloat16, seed=i) for i, n in enumerate(sizes)]
    ref = [[t.clone() for t in prob] for prob in base]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    ref_outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    kw = dict(step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, num_threads=threads)
    cols = lambda probs: [[x[k] for x in probs] for k in range(4)]
    adamw_step_(*cols(ref), outs=ref_outs, **kw)
    sums = adamw_step_(*cols(base), outs=outs, sum_chunk_bytes=chunk, **kw)
    for a, b in zip(ref + [ref_outs], base + [outs]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert len(sums) == len(sizes)
    for (p, _, m, v), got in zip(base, sums):
        assert [list(s) for s in got] == [_key_sums(t, chunk) for t in (p, m, v)]


@pytest.mark.parametrize("backend", [l for l in native.simd_levels()] + ["fallback"])
@pytest.mark.parametrize("odtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keep_outs", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_step_with_saves_same_update_and_the_old_bytes(backend, odtype, keep_outs, threads, monkeypatch):
    """saves= (a speculative update's undo state, [Note: the undo state
    saved in the step's pass] in native/src/adam.cpp): the update is the
    plain call's bit for bit, on every ISA and thread count, and the save
    buffers hold each buffer's bytes from before the step (the outs' only
    where asked: ``keep_outs``)."""
    if not keep_outs and odtype is None:
        pytest.skip("no outs")
    sizes = [5, 70000, 1, 4096 * 3 + 17, 200000]
    base = [_problem(n, torch.bfloat16, seed=i) for i, n in enumerate(sizes)]
    outs = [torch.randn(n).to(odtype) for n in sizes] if odtype is not None else None
    ref = [[t.clone() for t in prob] for prob in base]
    ref_outs = [t.clone() for t in outs] if outs is not None else None
    old = [[t.clone() for t in (p, m, v)] for p, _, m, v in base]
    old_outs = [t.clone() for t in outs] if outs is not None else None
    saves = tuple([torch.full_like(x[k], float("nan")) for x in old] for k in range(3)) + (
        [torch.zeros_like(t) for t in outs] if outs is not None and keep_outs else None,)
    kw = dict(step=2, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, num_threads=threads)
    cols = lambda probs: [[x[k] for x in probs] for k in range(4)]
    if backend == "fallback":  # saved by copies before the torch ops
        monkeypatch.setattr(native, "available", lambda: False)
    with contextlib.nullcontext() if backend == "fallback" else native.use_simd(backend):
        adamw_step_(*cols(base), outs=outs, saves=saves, **kw)
        adamw_step_(*cols(ref), outs=ref_outs, **kw)
    for a, b in zip(ref + ([ref_outs] if outs is not None else []), base + ([outs] if outs is not None else [])):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for k in range(3):
        assert all(torch.equal(s, o[k]) for s, o in zip(saves[k], old))
    if outs is not None and keep_outs:
        assert all(torch.equal(s, o) for s, o in zip(saves[3], old_outs))


def test_step_with_saves_bad_buffers_are_named():
    p, g, m, v = _problem(10, torch.float32)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    good = [torch.empty(10)]
    with pytest.raises(ValueError, match=r"saves of exp_avgs\[0\] must be a contiguous CPU torch.float32"):
        adamw_step_([p], [g], [m], [v], saves=(good, [torch.empty(9)], good, None), **kw)
    with pytest.raises(ValueError, match="outs None without outs"):
        adamw_step_([p], [g], [m], [v], saves=(good, good, good, good), **kw)
    with pytest.raises(ValueError, match="saves and sum_chunk_bytes"):
        adamw_step_([p], [g], [m], [v], saves=(good, good, good, None), sum_chunk_bytes=4096, **kw)


def test_step_with_sums_bad_chunk_is_named():
    p, g, m, v = _problem(10, torch.float32)
    for bad in (1000, 4096 + 4096 // 2, 0):
        with pytest.raises(ValueError, match=f"sum_chunk_bytes={bad}"):
            adamw_step_([p], [g], [m], [v], step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, sum_chunk_bytes=bad)


def test_native_call_releases_gil():
    """While a native call runs, another Python thread runs. With a switch
    interval far longer than a call, a thread holding the GIL through the
    call leaves the main thread's counter where it was; one that releases it
    lets the main thread count during the call. Judged on the state seen (the
    counter before and after a call), not on timings, and tried over up to
    200 calls (the first that sees it ends the test): on a loaded machine
    the main thread may not be scheduled within one call, but it is within
    some."""
    n = 1 << 24  # ~0.5 GB of traffic per call: tens of milliseconds
    p, g, m, v = _problem(n, torch.float32)
    done, counter, moved = threading.Event(), [0], []

    def worker():
        try:
            for step in range(1, 201):
                before = counter[0]
                adamw_step_([p], [g], [m], [v], step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                            weight_decay=0.0)
                moved.append(counter[0] - before)
                if moved[-1]:
                    break
        finally:
            done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced GIL hand-over during a call: only a release lets main run
    try:
        th = threading.Thread(target=worker)
        th.start()
        while not done.is_set():
            counter[0] += 1
            time.sleep(0)  # releases the GIL between counts, so the worker can take it to start and return
        th.join()
    finally:
        sys.setswitchinterval(old)
    assert any(moved), f"the main thread never ran during any of {len(moved)} native calls: the GIL is held"


def _run_py(code, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_env_var_forces_simd_level():
    for level in native.simd_levels():
        r = _run_py("import infinity; print(infinity.system.native.info()['simd'])", {"INFINITY_SIMD": level})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == level


def test_env_var_bad_level_is_named():
    r = _run_py("import infinity; infinity.system.native.info()", {"INFINITY_SIMD": "sse9"})
    assert r.returncode != 0
    assert "INFINITY_SIMD" in r.stderr and "sse9" in r.stderr


def test_unsupported_level_raises():
    unsupported = [l for l in native.ISA_NAMES if l not in native.simd_levels()]
    if not unsupported:
        pytest.skip("every level is supported here")
    with pytest.raises(ValueError, match=unsupported[0]):
        with native.use_simd(unsupported[0]):
            pass


def test_fallback_warns_once_and_matches_torch():
    code = """
import warnings, torch, infinity
warnings.simplefilter('always')
with warnings.catch_warnings(record=True) as w:
    p = torch.randn(100, requires_grad=True); ref = p.detach().clone().requires_grad_()
    opt = infinity.CPUAdamW([p], lr=1e-2); opt_ref = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    for _ in range(10):
        g = torch.randn(100); p.grad = g.clone(); ref.grad = g.clone(); opt.step(); opt_ref.step()
    print(sum('native library unavailable' in str(x.message) for x in w))
    print((p - ref).abs().max().item())
print(infinity.system.native.info()['backend'])
"""
    r = _run_py(code, {"INFINITY_NATIVE": "0"})
    assert r.returncode == 0, r.stderr
    count, diff, backend = r.stdout.split()
    assert count == "1"
    assert float(diff) == 0.0  # same torch ops, same order as foreach=False
    assert backend == "fallback"


def test_info_fields():
    i = native.info()
    assert i["backend"] == "native"
    assert i["simd"] in native.simd_levels()
    assert i["simd"] == native.simd_levels()[-1]  # best by default
    assert i["threads"] >= 1
    assert "-mavx2" in i["build"] or "neon" in i["build"] or "scalar" in i["build"]
    assert "march=native" not in i["build"]


def test_probe_runs_and_changes_buffers():
    import ctypes
    n = 1000
    p, g, m, v = _problem(n, torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    p0 = p.clone()
    ptrs = (ctypes.c_int64 * 5)(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), out.data_ptr())
    rc = native.lib().inf_probe_step(-1, 1, ptrs, (ctypes.c_int64 * 1)(n), native.DT_BF16, native.DT_BF16, 2)
    assert rc == 0
    assert not torch.equal(p, p0) and torch.isfinite(p).all()
    assert torch.equal(out, p.to(torch.bfloat16))
