"""Decided once, pure: how a model splits into units (units.py), what each
unit costs on each tier (placement.py), which path its bytes take (paths.py), the recorded order of use (trace.py),
what to evict and prefetch (policy.py), the legal states of every owner
(state.py), constants that must agree (limits.py), the estimate of peak
bytes before allocating (estimator.py) and of the step's time: the ops'
costs on the meta device (costs.py), a machine's speeds (profile.py, with
hand-written ones in profiles/), the step laid out as tasks (step_time.py)
and their discrete-event simulation (simulate.py).

Owns no buffers and moves no bytes. May import: config/, system/ (facts), and
nothing else of engine/.
"""
