"""What moves when, as pure functions of the trace: which unit to evict
(device arena and host cache alike), which units to prefetch, whose
optimizer state to read ahead, and in which order host memory is reclaimed.

Nothing here moves a byte or changes a state; the owners ask and act.
See [Note: trace, replay, invalidate] in trace.py for where the next uses
come from.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional, Sequence, TypeVar

from .trace import NEVER, Trace

__all__ = ["victim", "prefetch_plan", "state_read_ahead", "HOST_ROOM_LADDER"]

T = TypeVar("T")

# The order in which the host cache frees memory when a buffer does not fit
# (HostCache.acquire runs the steps it is given in this order).
HOST_ROOM_LADDER = (
    "release_finished_writes",  # write-backs already done: their buffers are free
    "evict_cached_copy",        # the cached compute copy needed furthest ahead (written back if dirty)
    "wait_oldest_write",        # a write-back still in flight
    "wait_running_update",      # an optimizer update on the host thread, which frees its buffers
    "drop_state_read_ahead",    # optimizer state read ahead and not claimed yet (read again later)
)


def victim(candidates: Iterable[T], trace: Trace, index: Callable[[T], int], last_used: Callable[[T], int],
           held: Callable[[T], bool] = lambda _: False, protect_before: float = NEVER) -> Optional[T]:
    """Belady's choice among ``candidates``: the one whose next use in the
    trace is furthest away, the least recently used among equals (without a
    trace every next use is NEVER: plain LRU). Candidates ``held`` come after
    every free one. Those needed before ``protect_before`` (a trace index)
    are not chosen."""
    best, best_key = None, None
    for c in candidates:
        nu = trace.next_use(index(c))
        if protect_before != NEVER and nu <= protect_before:
            continue
        key = (not held(c), nu, -last_used(c))
        if best_key is None or key > best_key:
            best, best_key = c, key
    return best


def prefetch_plan(upcoming: Sequence[int], depth: int, cap_bytes: Optional[int], absent: Callable[[int], bool],
                  size: Callable[[int], int]) -> List[int]:
    """Units (indexes) to bring up ahead of compute, in order: the next
    ``depth`` distinct units of the trace that are absent, within
    ``cap_bytes`` in all (None: no cap). The caller stops at the first that
    finds no room."""
    plan: List[int] = []
    seen = set()
    ahead = 0
    for idx in upcoming:
        if len(seen) >= depth:
            break
        if idx in seen:
            continue
        seen.add(idx)
        if not absent(idx):
            continue
        nb = size(idx)
        if cap_bytes is not None and ahead + nb > cap_bytes:
            break
        plan.append(idx)
        ahead += nb
    return plan


def state_read_ahead(upcoming: Sequence[int], trainable: Callable[[int], bool], done: Callable[[int], bool],
                     root: int = 0) -> List[int]:
    """Units whose optimizer state to read next during backward: the next
    two trainable units of the trace not updated yet, then the root (updated
    last, after backward ends, so its read goes ahead one unit early)."""
    nxt: List[int] = []
    for idx in upcoming:
        if trainable(idx) and not done(idx) and idx not in nxt:
            nxt.append(idx)
            if len(nxt) == 2:
                break
    if len(nxt) < 2 and trainable(root) and not done(root) and root not in nxt:
        nxt.append(root)
    return nxt
