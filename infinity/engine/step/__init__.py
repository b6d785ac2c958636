"""When and how updates run: the schedules for overlap "step", "backward" and
"delayed" (schedule.py), one unit's AdamW call (update.py), loss scaling and
the step's gradient scale (scaling.py), and the torch.optim facade
(optimizer.py).

May import: engine/owners, engine/mechanism, engine/plan, engine/faults,
optim/, and below.
"""
