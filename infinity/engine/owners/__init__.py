"""One owner per piece of a unit's state, each the only writer of its record
on the unit: residency (``u.dev``), host_cache (``u.host``), grads
(``u.grads``), optstate (``u.opt``), saved (activations that alias the arena).

May import: engine/mechanism, engine/plan, engine/faults, engine/stats, and
below engine/. An owner calls another only through what it was handed at
construction.
"""
