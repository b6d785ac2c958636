"""Decided once, pure: how a model splits into units (units.py), what each
unit costs on each tier (placement.py), the recorded order of use (trace.py),
what to evict and prefetch (policy.py), the legal states of every owner
(state.py), constants that must agree (limits.py) and the estimate of peak
bytes before allocating (estimator.py).

Owns no buffers and moves no bytes. May import: config/, system/ (facts), and
nothing else of engine/.
"""
