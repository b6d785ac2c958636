"""Budgets that change during a run: the default device budget and its growth
after the first step (device_budget.py), giving way under host memory
pressure (pressure.py), and the memory cgroup's limit checked against the
run's floor at start-up (floor.py).

May import: engine/owners, engine/mechanism, engine/plan, engine/faults, and
below.
"""
