"""Budgets that change during a run: the default device budget and its growth
after the first step (device_budget.py), and giving way under host memory
pressure (pressure.py).

May import: engine/owners, engine/mechanism, engine/plan, engine/faults, and
below.
"""
