"""A discrete-event simulation of tasks on resources: the time model behind
``infinity estimate --time`` (step_time.py lays a step out as tasks).

A *resource* is a stream: it runs its tasks one at a time, in the order they
were added (a CUDA stream, a worker thread, a disk queue). A *task* has a
resource, a duration at full speed (seconds), the tasks it waits for, and a
*part* (what it is, for the report: "compute", "h2d", "optimizer", ...).

[Note: interference between resources]
Resources may share hardware: on the CPU device compute, copies and the
optimizer share the cores and the memory bus; the read and write queues of
one disk share the drive. ``slow[(a, b)] = k`` says that while resource
``b`` is busy, a task on ``a`` runs at ``1 / (1 + sum k)`` of its speed
(summed over the busy resources it shares with). ``k = 1`` both ways is two
streams sharing one device equally. The profile measures these factors
(``infinity doctor --profile``); a GPU's compute and its copy engines have
none. Between events every running task keeps a constant rate, so the
simulation is exact for this fluid model.

The result names the step time (the makespan), the busy time of each
resource, and the *exposed* time of each part: the time during which the
part ran while no compute ran, split evenly among the parts running then
(compute's own exposed time is its busy time). A task starts as soon as its
dependencies end (no latency is modelled), so some task always runs and the
exposed times sum to the makespan. The *bound* is the part with the most
exposed time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Task", "Simulation", "SimResult", "COMPUTE"]

COMPUTE = "compute"   # the part whose idle time exposes the others
_EPS = 1e-15


@dataclass
class Task:
    """One piece of work: ``seconds`` at full speed on ``resource``, after ``deps`` (task ids)."""

    name: str
    resource: str
    seconds: float
    part: str
    deps: Tuple[int, ...] = ()
    start: float = -1.0    # filled by the simulation (seconds from 0)
    end: float = -1.0


@dataclass
class SimResult:
    """What a simulation found: ``makespan`` (s), ``busy`` (s per resource),
    ``exposed`` (s per part; they sum to the makespan), ``bound``
    (the part with the most exposed time) and the tasks with their times."""

    makespan: float
    busy: Dict[str, float]
    exposed: Dict[str, float]
    bound: str
    tasks: List[Task] = field(repr=False, default_factory=list)


class Simulation:
    """Tasks on resources, run by :meth:`run`; see the module docstring."""

    def __init__(self, slow: Optional[Dict[Tuple[str, str], float]] = None):
        self.tasks: List[Task] = []
        self.slow = dict(slow or {})

    def add(self, name: str, resource: str, seconds: float, part: str, deps: Sequence[Optional[int]] = ()) -> int:
        """Adds a task (``seconds`` >= 0 at full speed) after ``deps`` (ids; None
        entries are skipped); returns its id. Tasks on one resource run in the
        order they are added."""
        if not seconds >= 0:
            raise ValueError(f"task {name!r}: seconds={seconds} must be >= 0")
        ds = tuple(d for d in deps if d is not None)
        bad = [d for d in ds if not 0 <= d < len(self.tasks)]
        if bad:
            raise ValueError(f"task {name!r}: deps {bad} are not ids of tasks added before it")
        self.tasks.append(Task(name, resource, float(seconds), part, ds))
        return len(self.tasks) - 1

    def _rate(self, res: str, busy: Sequence[str]) -> float:
        k = sum(self.slow.get((res, b), 0.0) for b in busy if b != res)
        return 1.0 / (1.0 + k)

    def run(self) -> SimResult:
        """Runs every task to its end; see the module docstring for the result."""
        queues: Dict[str, List[int]] = {}
        for i, t in enumerate(self.tasks):
            queues.setdefault(t.resource, []).append(i)
        head = {r: 0 for r in queues}
        left = [t.seconds for t in self.tasks]
        running: Dict[str, int] = {}   # resource -> task id
        done = [False] * len(self.tasks)
        now, busy = 0.0, {r: 0.0 for r in queues}
        exposed: Dict[str, float] = {}
        finished = 0
        while finished < len(self.tasks):
            for r, q in queues.items():  # start every head whose deps are done
                if r not in running and head[r] < len(q) and all(done[d] for d in self.tasks[q[head[r]]].deps):
                    running[r] = q[head[r]]
                    head[r] += 1
                    self.tasks[running[r]].start = now
            if not running:
                stuck = [self.tasks[q[head[r]]].name for r, q in queues.items() if head[r] < len(q)]
                raise ValueError(f"the tasks wait for each other in a circle (or wait for a later task): {stuck}")
            active = list(running)
            rates = {r: self._rate(r, active) for r in active}
            dt = min(left[running[r]] / rates[r] for r in active)
            self._account(active, running, dt, busy, exposed)
            now += dt
            for r in active:
                i = running[r]
                left[i] -= dt * rates[r]
                if left[i] <= _EPS * max(1.0, self.tasks[i].seconds):
                    done[i], finished = True, finished + 1
                    self.tasks[i].end = now
                    del running[r]
        bound = max(exposed, key=lambda p: exposed[p], default=COMPUTE)
        return SimResult(now, busy, exposed, bound, self.tasks)

    def _account(self, active, running, dt: float, busy, exposed) -> None:
        """Charges ``dt`` seconds to the busy resources and the exposed parts."""
        parts = {self.tasks[running[r]].part for r in active}
        for r in active:
            busy[r] += dt
        if COMPUTE in parts:
            exposed[COMPUTE] = exposed.get(COMPUTE, 0.0) + dt
        else:
            for p in parts:
                exposed[p] = exposed.get(p, 0.0) + dt / len(parts)
