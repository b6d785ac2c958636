"""Constants that must agree, defined once.

[Note: limits that must agree]
Each constant here is used in two places: where the memory is planned
(placement.py, the estimator) and where it is used (the tiers, the schedule,
the gradient owner, the NVMe tier). Defined apart they drifted; here one
follows from another where it does, so changing one changes both sides.
"""

__all__ = ["DEVICE_ALIGN", "POOL_ALIGN", "MAX_QUEUED", "BUFFERS_PER_UPDATE", "PIPELINE_BUFFERS", "MAX_REDUCING",
           "ZERO_REDUCING_UNITS", "STAGING_PER_PATH"]

DEVICE_ALIGN = 512   # bytes; device arena ranges start here (tiers.DeviceTier), one per unit in the device need
POOL_ALIGN = 4096    # bytes; host buffers start on pages (O_DIRECT, pinning)

# NVMe optimizer state during backward: at most MAX_QUEUED unit updates are
# queued or running (schedule._bound_queue), each holding master, exp_avg,
# exp_avg_sq and the gradient in fp32; plus the gradients of the unit whose
# backward runs. The host budget sets aside PIPELINE_BUFFERS of the largest unit.
MAX_QUEUED = 2
BUFFERS_PER_UPDATE = 4
PIPELINE_BUFFERS = MAX_QUEUED * BUFFERS_PER_UPDATE + 1

# ZeRO stages 2-3 free a unit's full gradients only after their reduction: at
# most MAX_REDUCING units wait for it (grads.Gradients), besides the one whose
# gradients arrive; the host budget sets aside that many at the minimum.
MAX_REDUCING = 1
ZERO_REDUCING_UNITS = MAX_REDUCING + 1

STAGING_PER_PATH = 2  # NVMe staging buffers of swap_block_size per swap path (NvmeTier, the estimator)
