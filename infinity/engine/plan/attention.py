"""Attention in the planner's op count: one call of
``F.scaled_dot_product_attention`` counted as one op forward and one
backward, priced at the fused kernel's measured rate (step_time.py).

[Note: attention counted as the call]
On the meta device ``scaled_dot_product_attention`` falls back to its math
decomposition (two batched products, a softmax, their backwards), so a
count of the aten ops the meta pass runs prices the math path. The device
runs a fused kernel instead: on the CPU ``_scaled_dot_product_flash_attention
_for_cpu``, measured 4-8x slower than the math path's price at the bench
GPT's shapes (2.9 and 5.9 ms against 0.4 and 0.7 ms, forward and backward).
So while the ops are counted, a torch function mode (:class:`AttentionAsCall`)
takes each call and runs it through an autograd function that records one
``attention`` op (torch's FLOP formula of SDPA, the bytes of q, k, v and the
output) with the math path's aten ops left out, and in backward one
``attention_backward`` op. The profile measures the rate of the call on the
device, forward and backward (profile_measure.py), whatever kernel the
device picks; on real tensors the fused ops themselves are named so
(:data:`FUSED_ATTENTION`), which is how bench_ops.py prices them. Not under
activation checkpointing: the recomputation in backward runs outside torch
function modes and must save what the forward saved, so a checkpointed
block's attention is still counted as its math path (priced low on the CPU).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["AttentionAsCall", "attention_cost", "FUSED_ATTENTION"]

# The fused attention kernels' aten ops: forward (query, key, value first) and
# backward (grad_out, query, key, value first).
FUSED_ATTENTION = {
    f"_scaled_dot_product_{k}{b}" for k in ("flash_attention_for_cpu", "flash_attention", "efficient_attention",
                                             "cudnn_attention") for b in ("", "_backward")}


def attention_cost(qkv: Sequence[torch.Tensor], out, backward: bool):
    """The OpCost of one attention call (``backward``: its gradient) of
    ``qkv`` = (query, key, value), each (batch, heads, length, head dim);
    ``out``: the forward's output (or the fused op's outputs)."""
    from .costs import OpCost
    q, k, v = qkv
    shapes = [tuple(x.shape) for x in (q, k, v)]
    fl = sdpa_backward_flop_count(shapes[0], *shapes) if backward else sdpa_flop_count(*shapes)
    io = sum(x.numel() * x.element_size() for x in (q, k, v)) + q.numel() * q.element_size()
    return OpCost(int(fl), io * (2 if backward else 1), "attention_backward" if backward else "attention",
                  (int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1])), q.numel())


class _Attention(torch.autograd.Function):
    """SDPA run muted (its meta ops not counted), counted as one op each way."""

    @staticmethod
    def forward(ctx, counter, q, k, v, args, kwargs):
        with counter.muted():
            out = F.scaled_dot_product_attention(q, k, v, *args, **kwargs)
        counter.record(attention_cost((q, k, v), out, False))
        ctx.counter = counter
        ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with ctx.counter.muted():
            grads = [torch.empty_like(x) for x in (q, k, v)]
        ctx.counter.record(attention_cost((q, k, v), grad, True))
        return (None, *grads, None, None)


class AttentionAsCall(TorchFunctionMode):
    """While active, each ``F.scaled_dot_product_attention`` is counted by
    ``counter`` as one call ([Note: attention counted as the call]);
    ``counter`` has ``muted()`` (a context: its ops are not recorded) and ``record(cost)``."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Under saved-tensor hooks (activation checkpointing) the call runs as it is: the recomputation in
        # backward runs outside this mode and must save what the forward saved (the math path, then).
        if (func is F.scaled_dot_product_attention and len(args) >= 3
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
            q, k, v, *rest = args
            return _Attention.apply(self.counter, q, k, v, tuple(rest), kwargs)
        return func(*args, **kwargs)
