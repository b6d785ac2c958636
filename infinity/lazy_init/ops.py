"""What ``infinity.init`` can record: operations classified by name.

The recorder sees each operation by the function torch dispatches
(``func.__name__``), so the classes below are sets of short names. They
decide whether an operation is recorded, replayed for its values, replayed
only to consume random numbers, ignored, or refused.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

# Random operations that overwrite their target whole: what they draw does
# not depend on what the target held, so a dead one can run on scratch to
# consume the same numbers.
RNG_WRITE = {"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
             "cauchy_", "trunc_normal_", "_no_grad_trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
             "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "_no_grad_uniform_",
             "_no_grad_normal_"}
RNG_CREATE = {"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like",
              "bernoulli"}
# Deterministic writes that overwrite a whole target without reading it.
FULL_WRITE = {"fill_", "zero_", "copy_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "_no_grad_fill_",
              "_no_grad_zero_"} | RNG_WRITE
# In-place on metadata only (views, autograd flags): no value changes.
META_ONLY = {"requires_grad_", "retain_grad", "share_memory_", "t_", "transpose_", "squeeze_", "unsqueeze_",
             "as_strided_", "detach_", "swapdims_", "swapaxes_", "rename_"}
REFUSED = {"multinomial", "poisson", "set_", "resize_", "resize_as_", "_standard_gamma", "binomial"}
# Name tokens ("kaiming_normal_" -> kaiming, normal) of random operations.
RNG_TOKENS = {"normal", "uniform", "bernoulli", "dropout", "multinomial", "poisson", "exponential", "cauchy",
              "geometric", "random", "binomial"}
EMPTY = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
INPLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                  "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                  "__imatmul__"}
# nn.init functions that return at once on meta tensors without any tensor
# operation the mode could see; patched while the context is open.
PATCHED_INIT = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def short(func: Callable) -> str:
    """The short name the op sets above are keyed by."""
    return getattr(func, "__name__", None) or type(func).__name__


def label(func: Callable) -> str:
    """The name a user would write (``torch.nn.init.normal_``,
    ``Tensor.uniform_``, ``torch.randn``), for messages."""
    mod = getattr(func, "__module__", None)
    qual = getattr(func, "__qualname__", short(func))
    if mod == "torch.nn.init":
        return f"torch.nn.init.{short(func)}"
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    return f"{mod}.{qual}" if mod else qual


def is_mutating(name: str, kwargs: Dict[str, Any]) -> bool:
    """Whether the operation writes into an existing tensor (``out=``,
    in-place dunders, the trailing-underscore convention)."""
    if isinstance(kwargs.get("out"), torch.Tensor):
        return True
    if name in INPLACE_DUNDER:
        return True
    return name.endswith("_") and not name.startswith("__")


def looks_random(name: str) -> bool:
    """Whether a name reads as a random operation, known or not: unknown
    ones are refused rather than recorded as deterministic."""
    tokens = [t for t in name.lower().split("_") if t]
    return any(t in RNG_TOKENS or t.startswith("rand") or t.endswith("dropout") for t in tokens)


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage: views of one storage share it."""
    return t.untyped_storage()._cdata
