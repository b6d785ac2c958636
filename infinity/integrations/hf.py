"""Hugging Face ``transformers.Trainer`` on a model managed by infinity.

``InfinityTrainer`` is a ``Trainer`` whose model is handed to
``infinity.initialize`` before the Trainer sees it. The changes to the
Trainer's loop are the ones infinity needs:

- the optimizer is infinity's AdamW, with the Trainer's own hyper-parameters
  (``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay``,
  none on biases and norms, as the Trainer does) and any LR scheduler the
  Trainer builds;
- clipping is ``Config.max_grad_norm`` (from ``args.max_grad_norm`` when the
  config leaves it unset; two different values raise), over all units
  before any update, and ``Config.grad_accumulation_steps`` is the Trainer's
  ``gradient_accumulation_steps``; the logged
  ``grad_norm`` is the norm infinity measured (``optimizer.last_grad_norm``),
  not torch's ``clip_grad_norm_`` over ``p.grad`` (None on managed parameters);
  without clipping (``max_grad_norm=0``) the engine measures no norm, so for
  the steps the Trainer will log it measures one with a bound that never
  clips (see ``_measure_norm``);
- with clipping (the Trainer's default ``max_grad_norm=1.0``) or fp16,
  ``overlap="backward"`` keeps the updates behind backward by speculating
  ([Note: speculative updates] in engine/step/speculate.py), and each
  training log gets ``replay_rate``: the share of the steps speculated since
  the last log that were rolled back and redone (clipped or skipped);
- checkpoints keep the Trainer's folder layout; the optimizer, scheduler and
  fp32 master state go through ``infinity.save_checkpoint`` into
  ``checkpoint-N/infinity/`` (streamed unit by unit, crash-safe), and
  ``resume_from_checkpoint`` loads it with ``infinity.load_checkpoint``;
  a ``checkpoint-N`` folder is trusted as infinity's own checkpoint folders
  are (see ``_check_resumable``), and one that is not is refused before the
  Trainer reads anything from it;
- the model is not moved: its parameters live in infinity's tiers
  (``Config.device``), and mixed precision is ``Config.dtype``, so the
  Trainer's ``fp16``/``bf16`` flags are refused;
- under ``torchrun`` the model is not wrapped in DDP: infinity reduces the
  gradients over the ranks itself (any ``Config.zero_stage``), and the
  Trainer's distributed sampler gives each rank its share of the batch.

See docs/huggingface.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import stat
from typing import Optional

from transformers import Trainer
from transformers.trainer_utils import IntervalStrategy
from transformers.trainer_pt_utils import get_parameter_names

from ..api import engine_of, initialize, stats
from ..checkpoint import layout, load_checkpoint, owner, save_checkpoint
from ..config.runtime import Config
from ..engine.faults import UsageError

__all__ = ["InfinityTrainer", "CHECKPOINT_SUBDIR", "EIGHT_BIT_OPTIMS"]

log = logging.getLogger("infinity")
# The Trainer's 8-bit AdamW choices (TrainingArguments.optim): infinity's AdamW with int8 moments.
EIGHT_BIT_OPTIMS = ("adamw_bnb_8bit", "adamw_torch_8bit", "adamw_8bit", "paged_adamw_8bit")

CHECKPOINT_SUBDIR = "infinity"  # inside the Trainer's checkpoint-N folder
# A clipping bound no finite norm reaches: the clip coefficient min(bound / (norm + 1e-6), 1)
# is exactly 1, so the update is unchanged and only the norm is measured.
MEASURE_ONLY_NORM = 1e30


class InfinityTrainer(Trainer):
    """``transformers.Trainer`` over infinity; takes the Trainer's arguments
    plus ``infinity_config`` (an :class:`infinity.Config`; default ``Config()``)."""

    def __init__(self, model=None, args=None, *, infinity_config: Optional[Config] = None, **kwargs):
        if args is None:
            raise UsageError("InfinityTrainer: give args=TrainingArguments(...)")
        if args.fp16 or args.bf16:
            raise UsageError("InfinityTrainer: TrainingArguments(fp16/bf16) would autocast on top of infinity's "
                             "own precision; set infinity.Config(dtype='bf16' or 'fp16') instead")
        if "optimizers" in kwargs or "optimizer_cls_and_kwargs" in kwargs:
            raise UsageError("InfinityTrainer: the optimizer is infinity's AdamW; set its hyper-parameters in "
                             "TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, weight_decay)")
        cfg = _with_trainer_args(infinity_config if infinity_config is not None else Config(), args)
        model, optimizer = initialize(model, cfg, param_groups=_decay_groups(model, args.weight_decay),
                                      lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_epsilon, weight_decay=args.weight_decay)
        self.infinity_optimizer = optimizer
        # Without clipping or fp16 the engine measures no norm; the plain Trainer logs one anyway.
        self._norm_on_demand = not optimizer.scaling.waits_for_step
        super().__init__(model=model, args=args, optimizers=(optimizer, None), **kwargs)
        # Accelerate would round-trip the optimizer's whole state through its
        # state_dict to "place" it, and move the model: neither applies here.
        self.accelerator.device_placement = False
        # Nor wrap it in DDP on several ranks: infinity reduces the gradients
        # itself (ZeRO or data parallelism over the same process group), and
        # DDP's first act, broadcasting every parameter, reads ZeRO-3 shards.
        self.accelerator.prepare_model = functools.partial(_unwrapped, self.accelerator.prepare_model, model)

    def _move_model_to_device(self, model, device):
        return None  # its parameters live in infinity's tiers (Config.device); see the module doc

    # -- gradients: clipped and measured by infinity -------------------------------------------

    def _clip_grad_norm(self, model):
        return None  # Config.max_grad_norm clips inside optimizer.step()

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known after step(); logged in _maybe_log_save_evaluate

    def training_step(self, model, inputs, *args, **kwargs):
        # Before the backward: with overlap="backward" the updates start during it.
        self._measure_norm(self._norm_on_demand and self._logs_after_this_step())
        return super().training_step(model, inputs, *args, **kwargs)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        norm = self.infinity_optimizer.last_grad_norm
        self._measure_norm(False)
        return super()._maybe_log_save_evaluate(tr_loss, norm, *args, **kwargs)

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:  # a training log: see the module doc
            logs = dict(logs, **self._speculation_logs())
        return super().log(logs, *args, **kwargs)

    def _speculation_logs(self) -> dict:
        """``{"replay_rate": r}``: of the steps speculated since the last call,
        the share rolled back (clipped or skipped); empty when none was."""
        s = stats(self.model)["speculation"]
        last = getattr(self, "_spec_logged", None) or {k: 0 for k in ("steps", "replayed", "skipped")}
        self._spec_logged = s
        steps = s["steps"] - last["steps"]
        if steps <= 0:
            return {}
        return {"replay_rate": (s["replayed"] - last["replayed"] + s["skipped"] - last["skipped"]) / steps}

    def _measure_norm(self, on: bool) -> None:
        """Makes the next ``optimizer.step()`` measure the global gradient norm
        (``optimizer.last_grad_norm``, unscaled) without clipping, or stops
        measuring (``on`` False; the norm left from the last measured step is
        cleared so it is never logged for another step). Measuring costs one
        pass over the gradients, and with overlap="backward" the step's updates
        wait for ``step()``, so it is on only for steps the Trainer logs."""
        if not self._norm_on_demand:
            return  # clipping or fp16: the engine measures every step itself
        opt = self.infinity_optimizer
        if not on and opt.scaling.max_grad_norm is not None:
            opt.scaling.last_grad_norm = None
        opt.scaling.max_grad_norm = MEASURE_ONLY_NORM if on else None
        opt.schedule.early_ok = not on  # the norm needs every gradient before any update

    def _logs_after_this_step(self) -> bool:
        """Whether the Trainer's default flow (DefaultFlowCallback) logs after
        the optimizer step now accumulating; with the epoch strategy, every step
        may end an epoch, so every step is measured."""
        a, nxt = self.args, self.state.global_step + 1
        if a.logging_strategy == IntervalStrategy.EPOCH:
            return True
        steps = a.logging_strategy == IntervalStrategy.STEPS and nxt % max(1, int(self.state.logging_steps)) == 0
        return (nxt == 1 and bool(a.logging_first_step)) or steps

    # -- checkpoints through infinity ----------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.args.should_save:  # the process that made it (the others may get here first)
            os.chmod(output_dir, 0o700)  # what resumes from it must be ours alone: see _check_resumable
        save_checkpoint(os.path.join(output_dir, CHECKPOINT_SUBDIR), self.model, self.infinity_optimizer,
                        lr_scheduler=self.lr_scheduler, step=self.state.global_step, keep_last=1)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # The Trainer's first read of the checkpoint (its weights, then its state): the folder is judged before.
        _check_resumable(resume_from_checkpoint)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_SUBDIR)  # judged by _check_resumable when the resume began
        load_checkpoint(path, self.model, self.infinity_optimizer, lr_scheduler=self.lr_scheduler)

    def _save_scaler(self, output_dir: str) -> None:
        return None  # fp16's loss scale is in infinity's checkpoint

    def _load_scaler(self, checkpoint) -> None:
        return None

    @property
    def infinity_engine(self):
        """The engine managing the model (``infinity.stats(trainer.model)`` reads its counters)."""
        return engine_of(self.model)


def _check_resumable(checkpoint: str) -> None:
    """Raises UsageError naming ``checkpoint`` (a Trainer's ``checkpoint-N``
    folder) unless it is ours to resume from: a folder, not a link, owned by
    this process's uid and not writable by group or others, holding an
    ``infinity/`` checkpoint folder of ours with a complete checkpoint of ours.
    A resume picks the highest ``checkpoint-N`` (``resume_from_checkpoint=True``),
    so whoever may plant one in a shared output folder would otherwise choose
    the run's weights: see [Note: a checkpoint folder is owned like a swap folder]
    in checkpoint/owner.py. Nothing is read from the folder before this."""
    who = "InfinityTrainer: resume_from_checkpoint"
    try:
        st = os.lstat(checkpoint)
    except FileNotFoundError:
        raise UsageError(f"{who}: {checkpoint!r} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{who}: {checkpoint!r} is not a folder (a link or a file); infinity resumes only from a "
                         "checkpoint folder of its own, and follows no link to one")
    if not owner.owned_by_us(st):
        raise UsageError(f"{who}: {checkpoint!r} is owned by uid {st.st_uid}, not by this process's uid "
                         f"{os.geteuid()}: another user's (or a planted) folder is not this run's checkpoint. Remove "
                         f"it, or chown {os.geteuid()} '{checkpoint}' if you trust its files")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise UsageError(f"{who}: {checkpoint!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may write "
                         f"into it and choose what this run resumes from. Make it private (chmod 700 '{checkpoint}') "
                         "if you trust its files")
    path = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
    if not os.path.isdir(path):
        raise UsageError(f"{who}: {path} does not exist: resume_from_checkpoint needs a checkpoint written by "
                         "InfinityTrainer (its optimizer and fp32 master state)")
    owner.check_root(path, who)
    if not layout.is_checkpoint(path) and not layout.complete_checkpoints(path):
        raise UsageError(f"{who}: {checkpoint!r} holds no complete checkpoint of this user's in {path} (each "
                         "step folder skipped is named in a warning above); nothing was loaded")


def _unwrapped(prepare_model, managed, model, device_placement=None, evaluation_mode=False):
    """Accelerate's ``prepare_model``, with no DDP wrapper for ``managed``
    (infinity's model): see ``InfinityTrainer.__init__``."""
    return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode or model is managed)


def _with_trainer_args(cfg: Config, args) -> Config:
    """``cfg`` with the Trainer's clipping and accumulation where it leaves them
    at their defaults; a conflict between the two raises instead of one
    silently winning."""
    clip = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
    if cfg.max_grad_norm is not None and clip is not None and cfg.max_grad_norm != clip:
        raise UsageError(f"InfinityTrainer: Config.max_grad_norm={cfg.max_grad_norm} but "
                         f"TrainingArguments.max_grad_norm={args.max_grad_norm}; set one of them (the other to "
                         "None / 0)")
    accum = int(args.gradient_accumulation_steps)
    if cfg.grad_accumulation_steps not in (1, accum):
        raise UsageError(f"InfinityTrainer: Config.grad_accumulation_steps={cfg.grad_accumulation_steps} but "
                         f"TrainingArguments.gradient_accumulation_steps={accum}: the Trainer steps every {accum} "
                         "micro-batches; leave the Config's at 1 or make them equal")
    return dataclasses.replace(cfg, max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else clip,
                               grad_accumulation_steps=accum, moment_dtype=_moment_dtype(cfg, args))


def _moment_dtype(cfg: Config, args) -> str:
    """``Config.moment_dtype``, or "int8" for the Trainer's 8-bit AdamW
    (``TrainingArguments.optim`` in EIGHT_BIT_OPTIMS), said in a log line; a
    Config asking for other moments than the Trainer's raises."""
    optim = getattr(args.optim, "value", args.optim)
    if optim not in EIGHT_BIT_OPTIMS:
        return cfg.moment_dtype
    if cfg.moment_dtype not in ("fp32", "int8"):
        raise UsageError(f"InfinityTrainer: TrainingArguments.optim={optim!r} (8-bit moments) but "
                         f"Config.moment_dtype={cfg.moment_dtype!r}; set one of them")
    log.info("InfinityTrainer: TrainingArguments.optim=%r runs infinity's AdamW with Config.moment_dtype='int8' "
             "(block-scaled 8-bit moments on the host, see docs/config.md)", optim)
    return "int8"


def _decay_groups(model, weight_decay: float) -> list:
    """The Trainer's two groups: weight decay except on biases and norms."""
    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    import torch.nn as nn
    decay = set(get_parameter_names(model, [nn.LayerNorm], forbidden))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
