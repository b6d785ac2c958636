"""The values of a DeepSpeed config, checked as DeepSpeed reads them: the
types of its keys, its batch arithmetic, its Adam defaults and the aliases
of its ZeRO keys. Used by :mod:`infinity.config.deepspeed`.

[Note: DeepSpeed's types]
DeepSpeed reads ``zero_optimization`` (and the offload, aio and precision
tables) with pydantic models in lax mode: a count may be written ``5e8``
(a float with a whole value) and ``"stage": "3"`` is taken as 3. The batch
keys it reads with plain ``dict.get``, so only numbers (or the Hugging Face
integration's ``"auto"``) make sense there. Each check below takes what
DeepSpeed takes and refuses the rest with the key path, the value and what
is expected, as a ValueError/TypeError the mapper turns into a
ConfigFileError naming the file. Sources: deepspeedai/DeepSpeed
``deepspeed/runtime/zero/config.py`` (commit 1b88ac3),
``deepspeed/runtime/config.py`` (``_set_batch_related_parameters``,
``_batch_assertion``) and ``deepspeed/ops/adam/cpu_adam.py``/``fused_adam.py``
(commit a9a6188).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from . import validate as V

__all__ = ["AUTO", "table", "ds_int", "ds_real", "ds_bool", "betas", "check_kind", "batch_sizes",
           "adam_defaults", "ZERO_ALIASES", "KINDS"]

AUTO = "auto"

# DeepSpeed's ZeRO config takes each stage3_* key under a second name too
# (pydantic aliases, populate_by_name): canonical alias -> infinity's key.
ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
    "partition_stream_chunk_size": "stage3_partition_stream_chunk_size",
}


def table(path: str, value: Any, optional: bool = True) -> Dict[str, Any]:
    """``value`` if it is a JSON object ({} for null when ``optional``)."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{path}={value!r}: must be a JSON object ({{...}}), not {type(value).__name__}")
    return value


def ds_int(path: str, value: Any, lo: int = 0, hi: int = V.MAX_COUNT, numeric_str: bool = False) -> int:
    """An int as DeepSpeed's pydantic takes it: an int or a whole float
    (``5e8``), and with ``numeric_str`` a string of digits (``"3"``)."""
    if numeric_str and isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    return V.whole(path, value, lo, hi)


def ds_real(path: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    """A finite float in ``lo..hi`` (NaN, Infinity and strings refused)."""
    return V.real(path, value, lo, hi, lo_open=lo_open)


def ds_bool(path: str, value: Any, auto: bool = False) -> Any:
    """True or False (or ``"auto"`` when ``auto``)."""
    if auto and value == AUTO:
        return value
    return V.boolean(path, value)


def betas(path: str, value: Any) -> Tuple[float, float]:
    """Adam's betas: two numbers in [0, 1)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{path}={value!r}: must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]")
    return tuple(V.real(f"{path}[{i}]", b, 0.0, 1.0, hi_open=True) for i, b in enumerate(value))


def _int0(p: str, v: Any) -> Any:
    return v if v == AUTO else ds_int(p, v, 0, 1 << 62)


def _int1(p: str, v: Any) -> Any:
    return ds_int(p, v, 1, V.MAX_COUNT)


def _tab(p: str, v: Any) -> Any:
    return table(p, v)


def _any(p: str, v: Any) -> Any:
    return v


# The kind of every key infinity ignores (it maps the others itself), so
# that a nonsense value is refused even where infinity does not use it.
KINDS = {
    **dict.fromkeys(
        ("contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
         "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters", "memory_efficient_linear",
         "zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
         "legacy_stage1", "cpu_offload_use_pin_memory", "stage3_gather_fp16_weights_on_model_save",
         "stage3_gather_16bit_weights_on_model_save", "stage3_use_all_reduce_for_fetch_params",
         "stage3_allgather_sequential", "use_multi_rank_bucket_allreduce", "pin_memory", "pipeline_read",
         "pipeline_write", "pipeline", "fast_init", "single_submit", "overlap_events", "use_gds",
         "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads", "immediate_grad_update",
         "bf16_master_weights_and_grads", "bf16_optimizer_states",
         "check_grad_overflow", "wall_clock_breakdown", "zero_allow_untested_optimizer",
         "zero_force_ds_cpu_optimizer", "memory_breakdown", "prescale_gradients", "sparse_gradients",
         "dataloader_drop_last", "dump_state", "torch_adam", "fused"), lambda p, v: ds_bool(p, v)),
    "overlap_comm": lambda p, v: None if v is None else ds_bool(p, v),
    **dict.fromkeys(("allgather_bucket_size", "reduce_bucket_size", "sub_group_size", "stage3_max_live_parameters",
                     "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
                     "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
                     "stage3_partition_stream_chunk_size", "zero_hpz_partition_size", "buffer_count", "buffer_size",
                     "max_in_cpu"), _int0),
    **dict.fromkeys(("intra_op_parallelism", "thread_count", "hysteresis", "steps_per_print"), _int1),
    "mics_shard_size": lambda p, v: ds_int(p, v, -1, V.MAX_COUNT),
    "ratio": lambda p, v: ds_real(p, v, 0.0, 1.0),
    "gradient_predivide_factor": lambda p, v: ds_real(p, v, 0.0, 1e30, lo_open=True),
    "seed": lambda p, v: ds_int(p, v, *V.SEED_RANGE),
    "communication_data_type": lambda p, v: None if v is None else V.choice(
        p, v, ("fp16", "bf16", "fp32", "float16", "bfloat16", "float32")),
    **dict.fromkeys(("activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
                     "comms_logger", "amp", "checkpoint", "data_types", "elasticity", "compression_training",
                     "zeropp_loco_param"), _tab),
}


def check_kind(path: str, key: str, value: Any) -> None:
    """Refuses ``value`` if it is not of the kind DeepSpeed takes for ``key``
    (keys without a known kind, e.g. unknown ones, pass)."""
    KINDS.get(key, _any)(path, value)


def batch_sizes(train: Optional[int], micro: Optional[int], accum: Optional[int],
                world: int) -> Tuple[Optional[int], Optional[int], int]:
    """``(train_batch_size, micro_batch, accumulation)`` as DeepSpeed derives
    them (None: not given or "auto"): any two give the third, one alone
    gives the other two with accumulation 1; then ``train == micro x
    accumulation x world`` must hold, else ValueError naming the numbers.
    With neither batch size there is none (micro None; the run file's
    data.micro_batch is used) and accumulation is as given, else 1."""
    if train is None and micro is None:
        return None, None, accum or 1
    if train is not None and micro is not None and accum is None:
        accum = train // micro // world
    elif train is not None and accum is not None and micro is None:
        micro = train // world // accum
    elif micro is not None and accum is not None and train is None:
        train = micro * accum * world
    elif train is not None and micro is None:
        accum, micro = 1, train // world
    elif micro is not None and train is None:
        accum, train = 1, micro * world
    if micro < 1 or accum < 1 or train != micro * accum * world:
        raise ValueError(f"train_batch_size={train} must equal train_micro_batch_size_per_gpu={micro} x "
                         f"gradient_accumulation_steps={accum} x world size {world} (= {micro * accum * world}), "
                         "each >= 1, as DeepSpeed requires; give two of them and let the third be derived")
    return train, micro, accum


def adam_defaults(torch_adam: bool, adamw_mode: bool) -> Dict[str, Any]:
    """The Adam hyper-parameters DeepSpeed uses for keys the config leaves
    out: DeepSpeedCPUAdam's and FusedAdam's (lr 1e-3, betas (0.9, 0.999),
    eps 1e-8, weight_decay 0), or with ``torch_adam`` torch.optim.Adam's
    (the same) and torch.optim.AdamW's (weight_decay 0.01)."""
    return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
            "weight_decay": 0.01 if (torch_adam and adamw_mode) else 0.0}


def finite_number(value: Any) -> bool:
    """True for a finite int or float that is not a bool."""
    return V.is_real(value) and math.isfinite(value)
