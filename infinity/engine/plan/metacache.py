"""Meta ops answered from a cache: the shape of what an op returns on meta
tensors depends only on its arguments' shapes, strides, dtypes and the
other arguments, so an op seen before need not run its meta kernel again.

[Note: a meta pass from a cache]
The planner runs the model's forward and backward on the meta device (the op
costs in costs.py, the saved activations in activations.py). Nothing is
computed there, yet an 8 B model's pass took seconds: most aten ops' meta
kernels are Python references (``torch._refs``, decompositions) costing
~0.1-1 ms each, and a transformer repeats the same ops block after block.
:class:`MetaCache` is a dispatch mode that keys each op by its overload and
its arguments (tensors by shape, stride, storage offset, dtype and device;
the rest by value) and, on a hit, returns fresh meta tensors of the recorded
shapes and strides instead of running the kernel. Only ops whose results are
new tensors are answered so: views, in-place and ``out=`` ops (their results
alias an argument), ops whose schema declares any alias or mutation, and ops
with an argument that is not a plain meta tensor or a hashable value always
run. The values are the same as running the kernel: a meta tensor has
nothing but its metadata. The entries hold shapes only and do not depend
on the model, so the planner's passes share one process-wide cache
(:data:`SHARED`): the activations' passes and the op counting of one
``infinity estimate`` run the meta kernel of each distinct op once.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MetaCache", "op_key", "SHARED"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNCACHED = object()
# The planner's cache, shared by its passes (a few thousand entries for a transformer: distinct op signatures).
SHARED: Dict[Tuple, Any] = {}


def _leaf_key(x) -> Any:
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
        if x.device.type != "meta":
            return _UNCACHED
        return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, _PLAIN):
        return (type(x), x)
    return _UNCACHED


def _cacheable(func) -> bool:
    """Ops whose results are new tensors: no view, no alias or mutation in the schema."""
    ok = getattr(func, "_infinity_cacheable", None)
    if ok is None:
        s = func._schema
        ok = (not func.is_view and not s.is_mutable
              and all(a.alias_info is None for a in list(s.arguments) + list(s.returns)))
        try:
            func._infinity_cacheable = ok
        except AttributeError:  # an overload that takes no attributes: decide each time
            pass
    return ok


def _key_of(x) -> Any:
    """A hashable stand-in of an argument (nested lists, tuples and dicts
    kept as nested tuples); ``_UNCACHED`` when one of its leaves has none.
    Written out rather than through pytree: it runs for every op."""
    if isinstance(x, (list, tuple)):
        ks = tuple(_key_of(v) for v in x)
        return _UNCACHED if any(k is _UNCACHED for k in ks) else (type(x), ks)
    if isinstance(x, dict):
        ks = tuple((k, _key_of(v)) for k, v in x.items())
        return _UNCACHED if any(k[1] is _UNCACHED for k in ks) else (dict, ks)
    return _leaf_key(x)


def op_key(func, args, kwargs) -> Optional[Tuple]:
    """The cache key of ``func(*args, **kwargs)`` on meta tensors, or None
    when the op is not answered from the cache ([Note: a meta pass from a cache])."""
    if not _cacheable(func):
        return None
    a, k = _key_of(args), _key_of(kwargs)
    return None if a is _UNCACHED or k is _UNCACHED else (func, a, k)


def _spec_of(out) -> Optional[Tuple]:
    leaves, spec = tree_flatten(out)
    specs = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor or x.device.type != "meta":
                return None
            if x.storage_offset() != 0:  # a fresh result starts its storage; anything else runs
                return None
            specs.append(("T", tuple(x.shape), x.stride(), x.dtype))
        elif isinstance(x, _PLAIN):
            specs.append(("V", x))
        else:
            return None
    return spec, tuple(specs)


def _rebuild(entry):
    spec, specs = entry
    out = []
    for s in specs:
        if s[0] == "T":
            _, shape, stride, dtype = s
            out.append(torch.empty_strided(shape, stride, dtype=dtype, device="meta"))
        else:
            out.append(s[1])
    return tree_unflatten(out, spec)


class MetaCache(TorchDispatchMode):
    """Answers repeated meta ops from a cache; see [Note: a meta pass from a
    cache]. ``cache``: a dict to share between passes (the entries hold
    shapes only). ``hits`` and ``misses`` count the ops answered and run.
    Subclasses override :meth:`seen` to learn of every op (a hit included)."""

    def __init__(self, cache: Optional[Dict[Tuple, Any]] = None):
        super().__init__()
        self.cache: Dict[Tuple, Any] = {} if cache is None else cache  # shared by passes over one model
        self.hits = self.misses = 0

    def seen(self, func, args, kwargs, out, key) -> None:
        """Called for every op with its result and key (None: not cacheable)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = op_key(func, args, kwargs)
        entry = self.cache.get(key) if key is not None else None
        if entry is not None:
            self.hits += 1
            out = _rebuild(entry)
        else:
            out = func(*args, **kwargs)
            if key is not None:
                self.misses += 1
                spec = _spec_of(out)
                if spec is not None:
                    self.cache[key] = spec
        self.seen(func, args, kwargs, out, key)
        return out
