"""Constants that must agree, defined once.

[Note: limits that must agree]
Each constant here is used in two places: where the memory is planned
(placement.py, the estimator) and where it is used (the tiers, the schedule,
the gradient owner, the NVMe tier). Defined apart they drifted; here one
follows from another where it does, so changing one changes both sides.
"""

__all__ = ["DEVICE_ALIGN", "POOL_ALIGN", "MAX_QUEUED", "BUFFERS_PER_UPDATE", "PIPELINE_BUFFERS", "PIPELINE_GRAD_BUFFERS",
           "PIPELINE_STATE_BUFFERS", "STREAM_GRAD_BUFFERS", "STATE_KINDS", "MAX_REDUCING",
           "ZERO_REDUCING_UNITS", "STAGING_PER_PATH", "GRAD_BUCKET_BYTES", "GRAD_STAGING_BLOCKS", "GRAD_STAGING_BLOCK_BYTES", "RUNTIME_THREADS_CUDA", "optimizer_threads"]

DEVICE_ALIGN = 512   # bytes; device arena ranges start here (tiers.DeviceTier), one per unit in the device need
POOL_ALIGN = 4096    # bytes; host buffers start on pages (O_DIRECT, pinning)

# NVMe optimizer state during backward: at most MAX_QUEUED unit updates are
# queued or running (schedule._bound_queue), each holding master, exp_avg,
# exp_avg_sq and the gradient in fp32; plus the gradients of the unit whose
# backward runs. The host budget sets aside PIPELINE_GRAD_BUFFERS gradient
# buffers of the largest unit and PIPELINE_STATE_BUFFERS state buffers of at
# most one chunk (Config.state_chunk_bytes; the largest unit's state if smaller):
# a unit larger than a chunk is streamed through them ([Note: state streamed
# in chunks] in owners/optstate.py), so with chunks no larger than the largest
# unit, PIPELINE_BUFFERS of the largest unit as before.
MAX_QUEUED = 2
BUFFERS_PER_UPDATE = 4
STATE_KINDS = BUFFERS_PER_UPDATE - 1  # master, exp_avg, exp_avg_sq
PIPELINE_GRAD_BUFFERS = MAX_QUEUED + 1
PIPELINE_STATE_BUFFERS = MAX_QUEUED * STATE_KINDS
PIPELINE_BUFFERS = PIPELINE_GRAD_BUFFERS + PIPELINE_STATE_BUFFERS
# Gradients streamed in chunks ([Note: gradients streamed in chunks] in
# owners/grad_chunks.py): an update's stream holds the gradient chunk being
# updated and the next one being read (OptimizerState.stream).
STREAM_GRAD_BUFFERS = 2

# ZeRO stages 2-3 free a unit's full gradients only after their reduction: at
# most MAX_REDUCING units wait for it (grads.Gradients), besides the one whose
# gradients arrive; the host budget sets aside that many at the minimum.
MAX_REDUCING = 1
ZERO_REDUCING_UNITS = MAX_REDUCING + 1

STAGING_PER_PATH = 2  # NVMe staging buffers of swap_block_size per swap path (NvmeTier, the estimator)

# Gradients leaving the device in buckets (owners/grad_buckets.py): a bucket
# spans at most this many bytes of a unit's gradients, and at most a quarter
# of the device's gradient reserve (placement.DeviceNeed.grad_reserve), so
# one bucket fills while earlier ones cross to the host.
GRAD_BUCKET_BYTES = 32 << 20

# CUDA: gradients added or upcast on the host cross through this many pinned
# blocks of this size (mechanism/grad_staging.py); the estimator counts them.
GRAD_STAGING_BLOCKS = 4
GRAD_STAGING_BLOCK_BYTES = 16 << 20

# [Note: the optimizer's thread budget]
# On CUDA the native AdamW runs while backward does: the main thread launches
# the backward's kernels and the gradient thread upcasts or adds gradients
# that crossed PCIe (mover.py). An AdamW on every core would leave those two
# runnable threads waiting for a core, and a kernel launch late by a time
# slice stalls the GPU. So on CUDA the optimizer takes the cores minus
# RUNTIME_THREADS_CUDA (at least one). On the CPU device compute is the main
# thread's own torch work and the kernels share the cores as before.
# Config.num_threads (or INFINITY_NUM_THREADS) overrides either default.
RUNTIME_THREADS_CUDA = 2


def optimizer_threads(configured, cores: int, is_cuda: bool, env_set: bool = False) -> int:
    """Threads of the optimizer kernel: ``configured`` (Config.num_threads)
    if set, else ``cores`` (the affinity mask, or INFINITY_NUM_THREADS when
    ``env_set``), less the runtime's own threads on CUDA unless the
    environment chose the count."""
    if configured is not None:
        return int(configured)
    if is_cuda and not env_set:
        return max(1, cores - RUNTIME_THREADS_CUDA)
    return max(1, cores)

