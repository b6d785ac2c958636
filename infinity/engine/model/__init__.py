"""The managed model as torch sees it: module hooks that fetch and release
units (hooks.py), the guard that keeps parameters honest outside forward
(param_guard.py), ``state_dict``/``load_state_dict`` (state_dict.py) and the
torch calls that need special care (torch_guards.py).

May import: engine/core and everything below it.
"""
