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
    assert eng.cache.cap_bytes is None and eng.residency.depth_limit is None  # all grown back
    got = infinity.full_state_dict(m)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
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
