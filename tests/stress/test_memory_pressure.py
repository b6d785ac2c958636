"""A runtime that gives way under memory pressure (issue 21): under a
simulated pressure signal the host cache is capped and its pages returned,
prefetch depth drops, training goes on with parity against plain PyTorch,
and it grows back when the pressure eases; with nothing left to give the
step raises MemoryPressureError with the state whole."""

import pytest
import torch
from paging_zoo import Chain, base_config

import infinity


def model():
    torch.manual_seed(0)
    return Chain([32] * 16)  # many equal units: the cache holds far more than the placement needs


def data(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(n)]


def assert_matches(m, ref):
    """The managed model's values equal plain PyTorch's (AdamW kernels differ in rounding only)."""
    got = infinity.full_state_dict(m)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


class Signal:
    """RAM left to the process, as the test says."""

    def __init__(self):
        self.free = 64 << 30

    def __call__(self):
        return self.free


def test_cache_gives_way_and_grows_back_with_parity(tmp_path):
    cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                        host_memory="64MiB", prefetch_depth=2, swap_paths=[str(tmp_path)],
                                        swap_block_size=4096))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    eng = o.engine
    sig = Signal()
    eng.pressure.available = sig
    ref = model()
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    used = []
    for i, (x, y) in enumerate(data(16)):
        if i == 3:
            sig.free = 100 << 20          # pressure: below the margin
        if i == 6:
            sig.free = 64 << 30           # eased
        for net, opt in ((m, o), (ref, ro)):
            loss = net(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        used.append(sum(u.host.buf is not None for u in eng.units))  # compute copies cached
    actions = [e["action"] for e in infinity.stats(m)["pressure_events"]]
    assert "cap host cache" in actions and "lower prefetch depth" in actions and "grow back" in actions
    capped = [e for e in infinity.stats(m)["pressure_events"] if e["action"] == "cap host cache"]
    assert capped[0]["evicted"] > 0 and capped[0]["released"] > 0
    assert max(used[3:6]) < used[2] and used[-1] > max(used[3:6]), used  # fewer copies cached, then more again
    assert eng.room.cap_bytes is None and eng.residency.depth_limit is None  # all grown back
    assert_matches(m, ref)
    infinity.close(m)


def test_nothing_left_to_give_raises_between_steps_with_the_state_whole(tmp_path):
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20,
                                        prefetch_depth=1))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    o.engine.pressure.available = lambda: 10 << 20  # below the critical level
    x, y = data(1)[0]
    m(x, y).backward()
    with pytest.raises(infinity.MemoryPressureError, match="save a checkpoint now"):
        o.step()  # the first step gives what it can (prefetch depth) ...
        o.zero_grad()
        m(x, y).backward()
        o.step()  # ... the next has nothing left
    o.zero_grad()
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)  # the state is whole and can be saved
    assert infinity.verify_checkpoint(path)
    infinity.close(m)


@pytest.mark.parametrize("overlap,dtype", [("step", "fp32"), ("backward", "fp32"), ("backward", "bf16")])
def test_host_homes_spill_to_nvme_and_come_back_with_parity(tmp_path, overlap, dtype):
    """Parameters homed on the host, optimizer state on NVMe: under pressure
    the host homes spill to the swap files (pool use drops, pages returned),
    values read while spilled are the true ones, every unit goes home again
    when the pressure eases, and not one bit differs from the same run
    without pressure (which, in fp32, matches plain PyTorch)."""
    def run(pressure):
        cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="nvme", device_memory=1 << 20,
                                            host_memory="64MiB", prefetch_depth=2, swap_block_size=4096,
                                            swap_paths=[str(tmp_path / str(pressure))], overlap=overlap,
                                            dtype=dtype))
        m, o = infinity.initialize(model(), cfg, lr=1e-2)
        eng, sig = o.engine, Signal()
        eng.pressure.available = sig
        spilled, used, mid = [], [], None
        for i, (x, y) in enumerate(data(16)):
            sig.free = (100 << 20) if pressure and 3 <= i < 6 else (64 << 30)
            m(x.to(m_dtype(dtype)), y.to(m_dtype(dtype))).backward()
            o.step()
            o.zero_grad()
            spilled.append(sum(u.host.spilled for u in eng.units))
            used.append(eng.room.tier.used_bytes)
            if i == 5:
                mid = infinity.full_state_dict(m)  # read while spilled
        out = (infinity.full_state_dict(m), mid, spilled, used, infinity.stats(m)["pressure_events"],
               all(u.host.compute is not None and not u.host.spilled for u in eng.units))
        infinity.close(m)
        return out

    got, mid, spilled, used, events, home = run(True)
    want, want_mid, *_ = run(False)
    spills = [e for e in events if e["action"] == "spill to NVMe"]
    assert spills and spills[0]["bytes"] > 0 and spills[0]["released"] > 0
    assert max(spilled[3:6]) > 0 and min(used[3:6]) < used[2], (spilled, used)
    assert sum(e.get("taken_home", 0) for e in events) == max(spilled) and spilled[-1] == 0 and home
    for k in want:
        assert torch.equal(mid[k], want_mid[k]) and torch.equal(got[k], want[k]), k
    if dtype == "fp32":
        ref = model()
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for x, y in data(16):
            ref(x, y).backward()
            ro.step()
            ro.zero_grad()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)  # got: the spilled run's values


def m_dtype(dtype):
    return torch.float32 if dtype == "fp32" else torch.bfloat16


def _flaky_fetches(eng, failures):
    """The next ``failures[0]`` copies up to the device fail as a full CUDA device would."""
    real = eng.residency._fresh_h2d

    def h2d(dst, src):
        if failures[0] > 0:
            failures[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (simulated)")
        return real(dst, src)
    eng.residency._fresh_h2d = h2d


def test_device_oom_in_a_fetch_lowers_prefetch_depth_and_retries_with_parity():
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20,
                                        prefetch_depth=2))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    ref = model()
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    failures = [0]
    _flaky_fetches(o.engine, failures)
    for i, (x, y) in enumerate(data(6)):
        if i == 2:
            failures[0] = 1
        for net, opt in ((m, o), (ref, ro)):
            net(x, y).backward()
            opt.step()
            opt.zero_grad()
    ev = [e for e in infinity.stats(m)["pressure_events"] if e["action"] == "device out of memory in a fetch"]
    assert len(ev) == 1 and ev[0]["depth"] == 1 and o.engine.residency.depth() == 1
    assert_matches(m, ref)
    infinity.close(m)


def test_device_oom_twice_in_a_fetch_is_a_named_error_and_the_last_checkpoint_resumes(tmp_path):
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20,
                                        prefetch_depth=2))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    x, y = data(1)[0]
    m(x, y).backward()
    o.step()
    o.zero_grad()
    before = infinity.full_state_dict(m)
    ck = infinity.save_checkpoint(tmp_path / "ck", m, o)
    _flaky_fetches(o.engine, [2])
    with pytest.raises(torch.OutOfMemoryError, match=r"fetching unit .* twice.*device_memory=\d+ bytes") as e:
        m(x, y)
    assert isinstance(e.value, infinity.DeviceOutOfMemoryError)
    with pytest.raises(infinity.EngineFailedError, match="DeviceOutOfMemoryError"):
        o.step()  # one clear error from then on, never a half-fetched model
    infinity.close(m)
    m2, o2 = infinity.initialize(model(), cfg, lr=1e-2)
    infinity.load_checkpoint(ck, m2, o2)
    after = infinity.full_state_dict(m2)
    assert all(torch.equal(before[k], after[k]) for k in before)
    infinity.close(m2)
