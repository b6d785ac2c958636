"""The DeepSpeed keys infinity has no counterpart for, each with why it is
ignored (the report's ``ignored`` table; docs/cli.md). Used by
:mod:`infinity.config.deepspeed`; the kinds of their values are checked by
:data:`infinity.config.deepspeed_values.KINDS`."""

from .deepspeed_values import ZERO_ALIASES

__all__ = ["TOP_IGNORED", "ZERO_IGNORED", "OFFLOAD_IGNORED", "AIO_IGNORED", "FP_IGNORED"]

# Why each DeepSpeed key with no infinity counterpart is ignored.
TOP_IGNORED = {
    "steps_per_print": "progress is logged by `infinity train`'s [log] section",
    "wall_clock_breakdown": "timings are in infinity.stats() and the metrics file",
    "zero_allow_untested_optimizer": "infinity always runs its own AdamW",
    "zero_force_ds_cpu_optimizer": "infinity always runs its own CPU AdamW",
    "activation_checkpointing": "use the model's own checkpointing (GPTConfig.checkpoint)",
    "flops_profiler": "no profiler in infinity", "tensorboard": "metrics go to a JSONL file ([log])",
    "wandb": "metrics go to a JSONL file ([log])", "csv_monitor": "metrics go to a JSONL file ([log])",
    "comms_logger": "no communication logger", "memory_breakdown": "peak bytes per tier are in infinity.stats()",
    "communication_data_type": "collectives run in the gradients' dtype",
    "prescale_gradients": "gradients are averaged once after reduction",
    "gradient_predivide_factor": "gradients are averaged once after reduction",
    "sparse_gradients": "no sparse gradients", "amp": "use bf16/fp16 (Config.dtype)",
    "checkpoint": "checkpoints: `infinity train`'s [checkpoint] section", "dump_state": "no state dump",
    "data_types": "gradient accumulation runs in the compute dtype or fp32 (docs/config.md)",
    "elasticity": "no elastic training", "compression_training": "no compression",
    "seed": "set runtime.seed / the run file", "dataloader_drop_last": "the sampler drops no batch",
}
ZERO_IGNORED = {
    "contiguous_gradients": "units keep gradients in flat buffers always",
    "reduce_scatter": "stage 2/3 always reduce-scatter", "allgather_partitions": "stage 3 always all-gathers",
    "allgather_bucket_size": "collectives move one paging unit at a time",
    "reduce_bucket_size": "collectives move one paging unit at a time",
    "overlap_comm": "gradient transfers and reductions always overlap backward; set runtime.overlap='backward' "
                    "to overlap the CPU optimizer too",
    "stage3_max_live_parameters": "the device budget (runtime.device_memory) bounds what is resident",
    "stage3_max_reuse_distance": "eviction follows the recorded trace (furthest next use)",
    "stage3_param_persistence_threshold": "parameters outside units (the root unit) stay resident",
    "stage3_gather_16bit_weights_on_model_save": "infinity.full_state_dict() gathers the weights",
    "sub_group_size": "the optimizer steps one paging unit at a time, NVMe state in chunks of "
                      "Config.state_chunk_bytes (set that instead)",
    "round_robin_gradients": "gradients move unit by unit", "elastic_checkpoint": "no elastic checkpoints",
    "load_from_fp32_weights": "checkpoints hold the fp32 master", "ignore_unused_parameters": "always",
    "memory_efficient_linear": "no effect in infinity", "zero_hpz_partition_size": "no hierarchical partitions",
    "zero_quantized_weights": "no quantized collectives", "zero_quantized_gradients": "no quantized collectives",
    "mics_shard_size": "no MiCS", "stage3_module_granularity_threshold": "units: runtime.unit_classes",
    "legacy_stage1": "no legacy stage 1",
    "stage3_model_persistence_threshold": "parameters outside units (the root unit) stay resident",
    "stage3_use_all_reduce_for_fetch_params": "stage 3 always all-gathers",
    "stage3_allgather_sequential": "collectives move one paging unit at a time",
    "stage3_partition_stream_chunk_size": "parameters are partitioned unit by unit at initialize",
    "use_multi_rank_bucket_allreduce": "collectives move one paging unit at a time",
    "zero_quantized_nontrainable_weights": "no quantized weights", "zeropp_loco_param": "no quantized collectives",
    "cpu_offload_use_pin_memory": "legacy name of offload_*.pin_memory: the host tier is pinned on CUDA",
    "stage3_gather_fp16_weights_on_model_save": "legacy name of stage3_gather_16bit_weights_on_model_save: "
                                                "infinity.full_state_dict() gathers the weights",
}
OFFLOAD_IGNORED = {
    "pin_memory": "the host tier is always pinned when the device is CUDA (HostPool)",
    "buffer_count": "staging is sized from swap_block_size and swap_queue_depth",
    "buffer_size": "staging is sized from swap_block_size and swap_queue_depth",
    "max_in_cpu": "the host tier caches what fits runtime.host_memory",
    "pipeline_read": "the NVMe optimizer always pipelines reads", "pipeline_write": "it always pipelines writes",
    "pipeline": "the NVMe optimizer always pipelines", "fast_init": "swap files are preallocated at initialize",
    "ratio": "the whole optimizer runs on the CPU (no partial offload)",
}
AIO_IGNORED = {
    "intra_op_parallelism": "the native engine's thread pool is sized by infinity",
    "thread_count": "old name of intra_op_parallelism; the engine's thread pool is sized by infinity",
    "single_submit": "requests are always submitted in batches",
    "overlap_events": "completions are always reaped while others are in flight",
    "use_gds": "no GPUDirect Storage (I/O goes through pinned host staging)",
}
FP_IGNORED = {
    "hysteresis": "the scale halves on every overflow (no hysteresis)",
    "consecutive_hysteresis": "the scale halves on every overflow (no hysteresis)",
    "auto_cast": "the model runs in Config.dtype", "fp16_master_weights_and_grads": "the master is fp32",
    "immediate_grad_update": "no effect", "check_grad_overflow": "overflow is checked in fp16 only",
}
# Every alias of a stage3_* key is ignored as the key is (DeepSpeed reads both names).
ZERO_IGNORED.update({a: ZERO_IGNORED[k] for a, k in ZERO_ALIASES.items() if k in ZERO_IGNORED})
