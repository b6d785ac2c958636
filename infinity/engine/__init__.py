"""The offload engine. ``core.py`` builds the parts once and tells the four
flows of a step in a few lines each; each subfolder is one layer.

| folder | what it holds | may import (inside engine/) |
|---|---|---|
| model/ | the managed model as torch sees it: hooks, param_guard, state_dict, torch_guards | everything below |
| core.py | the :class:`Engine`: builds the parts, the four flows | step, adapt, values, owners, mechanism, plan |
| step/ | when and how updates run: schedule, update, scaling, the optimizer facade | owners, mechanism, plan |
| adapt/ | budgets that change during a run: device_budget, pressure | owners, mechanism, plan |
| values.py | a unit's values into and out of every tier, for code outside the step | owners, mechanism, plan |
| owners/ | one per piece of a unit's state (the table below) | mechanism, plan |
| mechanism/ | holds and moves bytes: tiers (budgets and the shared host pool), mover, nvme, zero | plan |
| plan/ | decided once, pure: units, placement, trace, policy, state tables, limits, estimator | (nothing above) |
| faults.py, stats.py, fence.py | the failure state, the counters, and the fence a background save installs, used by every layer | io/ |

| owner | file | holds |
|---|---|---|
| residency | owners/residency.py | the device copy: arena ranges, pins, fetch, evict, ``.data`` |
| host cache | owners/host_cache.py | a unit's host record: homes, the NVMe compute cache, write-back, spill |
| gradients | owners/grads.py | off the device, accumulate, reduce, spill, claim, release, the norm |
| optimizer state | owners/optstate.py | master and moments: resident, or checked out from NVMe |
| saved tensors | owners/saved.py | saved activations that alias a unit's arena range |

Below engine/ it may import optim/, io/, lazy_init/, system/ and config/;
never checkpoint/ or api.py (they are above it). The layer table is checked
by tests/test_layout.py.
"""
