"""policy.py and the state tables on their own: the victim ranking and the
prefetch and read-ahead plans on hand-made traces, every transition table,
and that each unit record is written by its owner only."""

import pathlib
import re

import pytest

from infinity.engine.plan import policy
from infinity.engine.plan.state import (HostState, DeviceState, GradHome, GradState, IllegalTransition, OptState,
                                        transition, _LEGAL)
from infinity.engine.plan.trace import Trace


def replaying(seq, cursor=0) -> Trace:
    t = Trace()
    t.begin_pass("train")
    for u in seq:
        t.use(u)
    t.begin_pass("train")  # the recorded sequence replays from here
    for u in seq[:cursor]:
        t.use(u)
    assert t.has_trace
    return t


def test_victim_is_the_unit_needed_furthest_ahead():
    t = replaying([0, 1, 2, 3, 4, 3, 2, 1], cursor=3)  # next: 3, 4, 3, 2, 1
    pick = lambda cands, **kw: policy.victim(cands, t, lambda u: u, lambda u: 0, **kw)  # noqa: E731
    assert pick([1, 2, 3, 4]) == 1          # next used at position 7, the furthest
    assert pick([2, 3, 4]) == 2
    assert pick([0, 1, 2]) == 0             # never used again this pass
    # Held units come after every free one, whatever their next use.
    assert pick([0, 3], held=lambda u: u == 0) == 3
    # Not one needed before the unit being brought in.
    assert pick([3, 4], protect_before=4) is None
    assert pick([1, 2, 3], protect_before=5) == 1


def test_victim_without_a_trace_is_least_recently_used():
    t = Trace()
    last = {5: 30, 6: 10, 7: 20}
    assert policy.victim([5, 6, 7], t, lambda u: u, last.get) == 6


def test_prefetch_plan_takes_the_next_absent_units_within_depth_and_bytes():
    upcoming = [3, 4, 3, 5, 6, 7]
    absent = lambda i: i != 4  # noqa: E731
    size = lambda i: 100 * i  # noqa: E731
    assert policy.prefetch_plan(upcoming, 2, None, absent, size) == [3]         # 4 resident: counts toward depth
    assert policy.prefetch_plan(upcoming, 3, None, absent, size) == [3, 5]
    assert policy.prefetch_plan(upcoming, 5, 900, absent, size) == [3, 5]       # 6 would exceed 900 bytes
    assert policy.prefetch_plan([], 4, None, absent, size) == []


def test_state_read_ahead_next_two_trainable_then_the_root():
    trainable = lambda i: i != 2  # noqa: E731
    assert policy.state_read_ahead([5, 4, 2, 3], trainable, lambda i: False) == [5, 4]
    assert policy.state_read_ahead([5, 2], trainable, lambda i: False) == [5, 0]
    assert policy.state_read_ahead([5, 4], trainable, lambda i: i == 5) == [4, 0]
    assert policy.state_read_ahead([], trainable, lambda i: i == 0) == []


TABLES = {
    "device": (DeviceState, [("ABSENT", "FETCHING"), ("FETCHING", "RESIDENT"), ("FETCHING", "ABSENT"),
                             ("RESIDENT", "ABSENT")]),
    "host": (HostState, [("NONE", "CLEAN"), ("NONE", "HOME"), ("HOME", "NONE"), ("CLEAN", "DIRTY"),
                          ("CLEAN", "NONE"), ("CLEAN", "HOME"), ("DIRTY", "CLEAN"), ("DIRTY", "WRITING_BACK"),
                          ("DIRTY", "HOME"), ("WRITING_BACK", "NONE")]),
    "optimizer state": (OptState, [("NONE", "RESIDENT"), ("NONE", "HOME"), ("HOME", "READING_AHEAD"),
                                   ("HOME", "CHECKED_OUT"), ("READING_AHEAD", "CHECKED_OUT"),
                                   ("READING_AHEAD", "HOME"), ("CHECKED_OUT", "HOME")]),
    "grad": (GradState, [("CLEAN", "ACCUMULATING"), ("ACCUMULATING", "CLEAN")]),
    "grad home": (GradHome, [("NONE", "HOST"), ("NONE", "PERMANENT"), ("HOST", "SPILLED"), ("HOST", "CLAIMED"),
                             ("HOST", "NONE"), ("SPILLED", "HOST"), ("SPILLED", "LOADED"), ("SPILLED", "NONE"),
                             ("LOADED", "SPILLED"), ("LOADED", "NONE"), ("CLAIMED", "NONE"),
                             ("CLAIMED", "SPILLED")]),
}


@pytest.mark.parametrize("kind", sorted(TABLES))
def test_every_transition_table(kind):
    """Exactly the listed moves are legal; every other raises naming the unit."""
    enum, legal = TABLES[kind]
    legal = {(enum[a], enum[b]) for a, b in legal}
    for a in enum:
        for b in enum:
            if (a, b) in legal:
                assert transition("blocks.3", kind, a, b) is b
            else:
                with pytest.raises(IllegalTransition, match=r"unit 'blocks.3': illegal .* -> "):
                    transition("blocks.3", kind, a, b)
    assert all(_LEGAL[a] == {b for x, b in legal if x is a} for a in enum)


OWNERS = {"dev": ("residency.py",), "host": ("host_cache.py",), "grads": ("grads.py", "grad_kept.py"),
          "opt": ("optstate.py",)}


@pytest.mark.parametrize("record", sorted(OWNERS))
def test_each_unit_record_is_written_by_its_owner_only(record):
    """``u.<record>.<field> = ...`` (or ``+=``) appears only in the owner's files."""
    engine = pathlib.Path(__file__).resolve().parents[2] / "infinity" / "engine"
    target = r"\w+(?:\.\w+)*"
    write = re.compile(rf"^\s*(?:{target}\s*,\s*)*\w+\.{record}\.\w+(?:\s*,\s*{target})*\s*(?:=|\+=|-=)(?!=)")
    offenders = []
    files = list(engine.rglob("*.py"))
    assert all(any(f.name == o for f in files) for o in OWNERS[record]), OWNERS[record]
    for f in files:
        if f.name in OWNERS[record]:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if write.search(line.split("#")[0]):
                offenders.append(f"{f.relative_to(engine)}:{n}: {line.strip()}")
    assert not offenders, offenders
