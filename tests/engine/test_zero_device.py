"""ZeRO gradients reduced on the device ([Note: where gradients are reduced]
in infinity/engine/plan/placement.py) on 2 gloo ranks (and 4): bit for bit the host
path's training, and each rank's bytes per link exactly as theory says."""

import pytest
import torch
import torch.multiprocessing as mp

from infinity.engine.plan.placement import host_gather_reason, host_reduction_reason

from engine_utils import assert_params_close
import zero_worker
from test_zero import CASES4 as REFERENCE_CASES4, LR, check_four_ranks, reference, rendezvous

WORLD = 2

# Each case runs twice in one spawn: as placement.py decides, and with the
# reduction forced onto the host (the existing path, the reference).
CI_CASES = [
    dict(stage=2, steps=2, model="unequal"),
    dict(stage=2, steps=2, model="unequal", params="none", opt="nvme", overlap="backward"),
    dict(stage=3, steps=2, model="unequal"),
    dict(stage=3, steps=2, model="unequal", opt="nvme", overlap="backward"),
    dict(stage=0, steps=2, model="unequal"),
    dict(stage=1, steps=2, model="unequal"),
    dict(stage=0, steps=2, model="unequal", params="none", overlap="backward"),
    dict(stage=1, steps=2, model="unequal", params="none", opt="nvme", overlap="backward"),
    dict(stage=2, steps=2, model="unequal", params="none"),  # copies gathered on the device, in step()
]
STAGE0_OF = {8: 6}  # a case whose final bits must be stage 0's (the CI case at the value): params on the device

# stages 0-3 x params none/host (stage 3: host/nvme) x optimizer host/nvme x overlap step/backward
MATRIX = [dict(stage=st, steps=3, model="unequal", params=pa, opt=op, overlap=ov)
          for st in (0, 1, 2, 3) for pa in (("host", "nvme") if st == 3 else ("none", "host"))
          for op in ("host", "nvme") for ov in ("step", "backward")]


def _run_both(tmp_path, cases):
    both = [dict(c, reduce=r) for c in cases for r in (None, "host")]
    mp.spawn(zero_worker.run, args=(WORLD, rendezvous(tmp_path), both, str(tmp_path)), nprocs=WORLD, join=True)
    return [tuple(torch.load(tmp_path / f"case{2 * i + k}.pt") for k in (0, 1)) for i in range(len(cases))]


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory):
    return _run_both(tmp_path_factory.mktemp("zero_device"), CI_CASES)


def _on_device(case, world=WORLD) -> bool:
    return host_reduction_reason(case["stage"], world, 1, case.get("opt", "host"), case.get("overlap", "step")) is None


def _gathers_on_device(case, world=WORLD) -> bool:
    return host_gather_reason(case["stage"], world, case.get("params", "host")) is None


def _assert_same_bits(case, dev, host, world=WORLD):
    assert dev["stats"]["reduce_on_device"] is _on_device(case, world), case
    assert host["stats"]["reduce_on_device"] is False, case
    assert dev["stats"]["gather_on_device"] is _gathers_on_device(case, world), case
    assert host["stats"]["gather_on_device"] is False, case
    assert dev["losses"] == host["losses"], (case, dev["losses"], host["losses"])
    for k, v in host["state"].items():
        assert torch.equal(dev["state"][k], v), (case, k)
        # fp32: the compute copies torch reads are the masters (every rank's shards, not stale ones)
        assert torch.equal(dev["seen"][k], v), (case, k)


@pytest.mark.parametrize("ci", range(len(CI_CASES)))
def test_device_reduction_trains_bit_for_bit_as_the_host_path(ci_results, ci):
    dev, host = ci_results[ci]
    _assert_same_bits(CI_CASES[ci], dev, host)
    ref_losses, ref_state = reference(CI_CASES[ci])
    assert_params_close(dev["state"], ref_state, global_scale=True, lr_steps=LR * CI_CASES[ci]["steps"])


@pytest.mark.parametrize("ci", sorted(STAGE0_OF))
def test_stages_1_2_end_with_stage_0s_bits(ci_results, ci):
    """On 2 ranks a sum of two is the same in any order, and each element's
    update does not depend on the shard it is in: the copies gathered on
    the device give stage 0's losses and weights bit for bit."""
    (dev, _), (zero, _) = ci_results[ci], ci_results[STAGE0_OF[ci]]
    assert CI_CASES[STAGE0_OF[ci]]["stage"] == 0 and dev["stats"]["gather_on_device"]
    assert dev["losses"] == zero["losses"], (dev["losses"], zero["losses"])
    for k, v in zero["state"].items():
        assert torch.equal(dev["state"][k], v), k


@pytest.mark.parametrize("ci", [0, 1, 2, 4, 5, 7, 8])
def test_bytes_per_link_per_rank_equal_theory(ci_results, ci):
    """See _assert_bytes_equal_theory, on 2 ranks."""
    dev, host = ci_results[ci]
    _assert_bytes_equal_theory(CI_CASES[ci], dev, host, WORLD)


# docs/distributed.md "What each rank moves" at N = 4: stage 1 (reduce-scatter
# on the device, copies all-gathered on the host) and stage 3 (both on the device).
CASES4 = [dict(stage=1, steps=2, model="unequal"), dict(stage=3, steps=2, model="unequal")]


def test_four_ranks_match_the_reference_and_move_the_bytes_theory_says(tmp_path):
    """Four gloo ranks in one spawn: test_zero's stages 1-3 against the
    single-process reference (check_four_ranks), and CASES4's each rank's
    D2H 1/4 of the flat gradients, the ring sending 3/4 of each buffer, bit
    for bit the host path's training. One spawn, as starting four ranks
    costs ~20 s on two loaded cores whatever the cases."""
    both = [dict(c, reduce=r) for c in CASES4 for r in (None, "host")]
    first = len(REFERENCE_CASES4)
    mp.spawn(zero_worker.run, args=(4, rendezvous(tmp_path), list(REFERENCE_CASES4) + both, str(tmp_path)),
             nprocs=4, join=True)
    check_four_ranks(tmp_path)
    for i, case in enumerate(CASES4):
        dev, host = (torch.load(tmp_path / f"case{first + 2 * i + k}.pt") for k in (0, 1))
        assert dev["stats"]["world_size"] == 4
        _assert_same_bits(case, dev, host, world=4)
        _assert_bytes_equal_theory(case, dev, host, 4)


def _assert_bytes_equal_theory(case, dev, host, world):
    """Per step on a rank (the last step's counters): at stages 1-3 the
    gradients cross D2H as the own shard only, 1/N of every unit's (padded)
    flat gradient, the reduce-scatter runs on the device group and sends
    (N-1)/N of each unit's gradient over the ring; at stage 0 the all-reduce
    runs there (twice that) and the whole sum crosses D2H. Stages 1-2's
    all-gather of the updated compute copies runs on the device group with
    the parameters there (each rank's shard goes up, the ring sends (N-1)/N
    of the trainable copy; nothing on the host group), else on the host
    group (then each copy goes up whole); stage 3's parameter gathers on the
    device group, each of them bringing only the own shard up H2D."""
    s, numels = dev["stats"], dev["stats"]["unit_numels"]
    grad_bytes = sum(4 * tn for tn, _ in numels)        # fp32 flat gradients, padded to the world
    compute_bytes = sum(4 * cn for _, cn in numels)
    step = s["step_bytes_moved"]
    ring = (world - 1) / world
    _assert_comm_times(s)
    if case["stage"] == 0:
        assert step["d2h"] == grad_bytes and step["all_reduce"] == 2 * grad_bytes, step
        assert step["net_device"] == 2 * grad_bytes * ring and step.get("net_host", 0) == 0, step
        assert step["h2d"] == compute_bytes                 # each updated compute copy up once, whole
        assert host["stats"]["step_bytes_moved"]["net_host"] == 2 * grad_bytes * ring  # the host path's all-reduce
        return
    assert step["d2h"] == grad_bytes // world, (step["d2h"], grad_bytes)
    assert step["reduce_scatter"] == grad_bytes
    if case["stage"] in (1, 2) and _gathers_on_device(case, world):
        # [Note: where the updated copies are gathered]: the own shard up, the trainable range gathered on the device.
        assert step["net_device"] == 2 * grad_bytes * ring                 # reduce-scatter + copies' gather (fp32)
        assert step.get("net_host", 0) == 0 and step["all_gather"] == grad_bytes, step
        assert step["h2d"] == grad_bytes // world                          # each copy's own shard up
    elif case["stage"] in (1, 2):
        assert step["net_device"] == grad_bytes * ring
        assert step["net_host"] == grad_bytes * ring           # the compute copies' all-gather (fp32)
        assert step["h2d"] == compute_bytes                    # each updated compute copy up once, whole
    else:
        assert step["all_gather"] == compute_bytes            # every unit gathered once (all fit the device)
        assert step["h2d"] == compute_bytes // world           # the own shard up, the rest over the ring
        assert step["net_device"] == (grad_bytes + compute_bytes) * ring
        assert step.get("net_host", 0) == 0
    # The host path moved every gradient over D2H (unpadded): N times the shard's bytes or more.
    assert s["bytes_moved"]["d2h"] * world <= host["stats"]["bytes_moved"]["d2h"] * 1.05
    assert s["bytes_moved"]["d2h"] <= (1 / world + 0.05) * host["stats"]["bytes_moved"]["d2h"]


def _assert_comm_times(s):
    """[Note: exposed communication time]: the collectives took time, the
    exposed part is within the totals, the hidden share a fraction. The clock
    thread times each collective when it gets the CPU, so which step's
    window a collective lands in depends on the machine's load: the run's
    total (every collective timed, zero_worker.run settles the clock) is
    what must be positive, not the last step's."""
    for k in ("comm_seconds", "comm_wait_seconds"):
        assert 0 <= s[k]["step"] <= s[k]["total"], (k, s[k])
    assert s["comm_seconds"]["total"] > 0, s["comm_seconds"]
    hidden = s["comm_hidden"]  # None where no collective landed in the last step's window
    assert (hidden is None) == (s["comm_seconds"]["step"] == 0) and (hidden is None or 0.0 <= hidden <= 1.0), s


@pytest.mark.slow
def test_device_reduction_matrix(tmp_path):
    """The whole matrix: bit for bit against the host path (stage 0 with NVMe
    optimizer state takes the host path by policy: the same bits trivially),
    and as the single-process reference within rounding."""
    for case, (dev, host) in zip(MATRIX, _run_both(tmp_path, MATRIX)):
        _assert_same_bits(case, dev, host)
        ref_losses, ref_state = reference(case)
        for i, (a, b) in enumerate(zip(dev["losses"], ref_losses)):
            assert abs(a - b) <= 1e-5 * abs(b), (case, i, a, b)
        assert_params_close(dev["state"], ref_state, global_scale=True, lr_steps=LR * case["steps"])
