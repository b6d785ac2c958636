"""The sum of squares of gradient ranges with fixed bits: the native
``inf_sum_squares`` (its order is the Note in native/src/sumsq_kernel.inc),
used for the clipping norm's host shares (engine/owners/grad_norm.py)."""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from ..system import native

__all__ = ["sum_of_squares", "DTYPES"]

_DT = {torch.float32: native.DT_F32, torch.bfloat16: native.DT_BF16, torch.float16: native.DT_F16}
DTYPES = tuple(_DT)  # the element types it reads


def sum_of_squares(tensors: Sequence[torch.Tensor], num_threads: int = 0) -> float:
    """The sum of the squares of every element of ``tensors`` (contiguous
    CPU tensors of one dtype: float32, bfloat16 or float16), as a float
    (float64, in the elements' units squared). Its bits depend only on the
    elements and their order: not on the ISA, ``num_threads`` (0: the
    library default; 1: the calling thread only) or the calling thread.
    No tensors, or only empty ones: 0.0. NaN and Inf propagate. Raises
    :class:`~infinity.system.native.NativeUnavailable` without the native
    library and ValueError for a tensor it cannot read."""
    ts = list(tensors)
    if not ts:
        return 0.0
    dtype = ts[0].dtype
    for i, t in enumerate(ts):
        if t.dtype != dtype or dtype not in _DT:
            raise ValueError(f"sum_of_squares: tensor {i} is {t.dtype}; all must be one of float32, bfloat16, "
                             f"float16 (the first is {dtype})")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"sum_of_squares: tensor {i} must be a contiguous CPU tensor "
                             f"(got device {t.device}, contiguous={t.is_contiguous()}); use torch's norm for others")
    n = len(ts)
    out = ctypes.c_double(0.0)
    rc = native.lib().inf_sum_squares(native.selected_isa(), n,
                                      native.carray(ctypes.c_int64, n)(*[t.data_ptr() for t in ts]),
                                      native.carray(ctypes.c_int64, n)(*[t.numel() for t in ts]),
                                      _DT[dtype], int(num_threads), ctypes.byref(out))
    if rc != 0:
        raise RuntimeError(f"inf_sum_squares failed with code {rc}")
    return out.value
