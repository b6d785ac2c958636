"""``infinity train RUN_FILE``: train a model described by a TOML/JSON run
file (or a DeepSpeed JSON plus ``--data``) through infinity.

SIGINT (Ctrl-C) finishes the current step, saves a checkpoint when the run
file has a ``[checkpoint]`` section, closes the engine (swap files removed)
and exits with status 130; a second SIGINT interrupts at once.

``MemoryPressureError`` (RAM is running out and infinity has nothing left to
give back) is raised at the end of ``optimizer.step()``, after the update:
that step is whole. The command finishes its bookkeeping, saves a checkpoint
of it when the run file has a ``[checkpoint]`` section, closes the engine and
exits with status 1 naming the error (and where the checkpoint is).

Under ``torchrun`` every rank runs the command: see [Note: infinity train on
several ranks] in launch.py.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from typing import Any, Dict, Optional

import torch

import infinity

from ..api import engine_of
from ..config.runtime import Config
from ..config.schedules import Schedule
from ..progress import model_flops_per_token, peak_tflops
from .common import CLIError, UsageError
from .data import Sampler, open_tokens
from .launch import Ranks, agree, start
from .metrics import Metrics
from .model import build_model, param_groups
from .runfile import RunFile, load_run_file

EXIT_INTERRUPTED = 130


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model from a run file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run file (.toml/.json; see docs/cli.md) or a DeepSpeed JSON")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--data", help="override data.path (needed with a DeepSpeed JSON)")
    p.add_argument("--metrics", help="override log.metrics (JSONL path)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", nargs="?", const="", metavar="DIR",
                   help="resume from the latest checkpoint in DIR (default: checkpoint.dir)")
    p.set_defaults(run=run)


def _overrides(args: argparse.Namespace) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in (("train.steps", args.steps), ("data.path", args.data), ("log.metrics", args.metrics)):
        if value is not None:
            out[key] = value
    if args.no_progress:
        out["log.progress"] = False
    return out


def _schedule(run: RunFile) -> Optional[Schedule]:
    if run.extra_schedule is not None:
        return run.extra_schedule
    s = run.schedule
    if s is None:
        return None
    total = run.train.steps if s.decay != "constant" else None
    if total is not None and total <= s.warmup_steps:
        raise UsageError(f"{run.source}: 'schedule.warmup_steps'={s.warmup_steps} must be below "
                         f"train.steps={total}")
    return Schedule(s.decay, s.warmup_steps, s.warmup_type, 0.0, total, s.min_lr_ratio)


class _Interrupt:
    """SIGINT sets a flag the loop reads after each step (see the module doc)."""

    def __init__(self) -> None:
        self.hit = False
        self._old = None

    def __enter__(self) -> "_Interrupt":
        self._old = signal.signal(signal.SIGINT, self._on)
        return self

    def _on(self, signum, frame) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once
        sys.stderr.write("\ninfinity train: SIGINT: finishing this step, then stopping (Ctrl-C again to abort)\n")

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._old)


def run(args: argparse.Namespace) -> int:
    """Runs the command; returns the exit status (0, or 130 when interrupted)."""
    runf = load_run_file(args.config, _overrides(args))
    ck = runf.checkpoint
    resume_dir = None
    if args.resume is not None:
        resume_dir = args.resume or ck.dir
        if not resume_dir:
            raise CLIError("--resume needs a directory: give --resume DIR or checkpoint.dir in the run file")
    return _train(runf, resume_dir)


def _setup(runf: RunFile, ranks: Ranks):
    d = runf.data
    if runf.train.torch_threads:
        # On a small machine torch's intra-op pool competes with infinity's
        # own threads: 1 measured 15 ms/step against 1.2 s with 2 on 2 cores.
        torch.set_num_threads(runf.train.torch_threads)
    tokens, vocab_hint = open_tokens(d.path, d.format, d.dtype)
    model, loss_fn, vocab = build_model(runf.model, runf.config, d.seq_len, vocab_hint, runf.train.seed)
    sampler = Sampler(tokens, d.seq_len, d.micro_batch, d.seed, vocab, ranks.rank, ranks.world)
    if runf.deepspeed_report is not None:
        # Again with the model: its "auto" sizes (stage3_prefetch_bucket_size) resolve from it.
        runf.config = Config.from_deepspeed(runf.source, model=model)
        runf.deepspeed_report = runf.config.report
        if ranks.lead:
            print(runf.deepspeed_report.text(), file=sys.stderr)
    o = runf.optimizer
    groups = param_groups(model, o.weight_decay, o.no_decay_norm_and_bias)
    model, optimizer = infinity.initialize(model, runf.config, param_groups=groups, lr=o.lr, betas=tuple(o.betas),
                                           eps=o.eps, weight_decay=o.weight_decay)
    if runf.model.weights:
        infinity.load_pretrained(model, runf.model.weights)
    sched = _schedule(runf)
    scheduler = sched.build(optimizer) if sched is not None else None
    return model, optimizer, scheduler, sampler, loss_fn


def _save(runf: RunFile, model, optimizer, scheduler, step: int, sampler: Sampler) -> int:
    """Saves a checkpoint of ``step`` (the number of steps done); returns ``step``."""
    infinity.save_checkpoint(runf.checkpoint.dir, model, optimizer, lr_scheduler=scheduler,
                             extra={"step": step, "sampler": sampler.state_dict()},
                             keep_last=runf.checkpoint.keep_last)
    return step


def _save_under_pressure(runf: RunFile, model, optimizer, scheduler, step: int, sampler: Sampler):
    """(``step``, "") once saved, or (None, why not): a save that fails for
    want of memory is said beside the MemoryPressureError, which stays the
    error the command exits with."""
    try:
        return _save(runf, model, optimizer, scheduler, step, sampler), ""
    except Exception as exc:  # noqa: BLE001 - said, then the pressure error is raised
        return None, f"{type(exc).__name__}: {exc}"


def _step(optimizer) -> Optional[BaseException]:
    """``optimizer.step()``; returns the MemoryPressureError it raised, else None.

    The engine raises it at the end of the step, after the update ([Note:
    memory pressure]): the step is whole, so the loop counts it, saves it and
    then stops, where letting it propagate would lose it."""
    try:
        optimizer.step()
    except infinity.MemoryPressureError as exc:
        return exc
    return None


def _train(runf: RunFile, resume_dir: Optional[str]) -> int:
    ranks = start(runf.config.resolve_device())
    try:
        predicted = _predict(runf, ranks)  # before the model is built and seeded: see predict_run
        model, optimizer, scheduler, sampler, loss_fn = _setup(runf, ranks)
        try:
            if predicted is not None:
                infinity.set_step_prediction(model, predicted)
            first = 0
            if resume_dir:
                extra = infinity.load_checkpoint(resume_dir, model, optimizer, lr_scheduler=scheduler) or {}
                first = int(extra.get("step", 0))
                if "sampler" in extra:
                    sampler.load_state_dict(extra["sampler"])
                if ranks.lead:
                    _say_restored_hyper(runf, optimizer, resume_dir)
            return _loop(runf, model, optimizer, scheduler, sampler, loss_fn, first, ranks)
        finally:
            infinity.close(model)
    finally:
        ranks.close()


def _predict(runf: RunFile, ranks: Ranks):
    """The step predicted on ``log.profile`` before the run (None without
    one), said on stderr by the lead rank; computed once, off the steps."""
    if not runf.log.profile:
        return None
    from .estimate_time import predict_run
    pred, why = predict_run(runf, ranks.world)
    if ranks.lead:
        print(f"infinity train: predicted step {pred.seconds:.3f} s on {runf.log.profile} (bound {pred.bound})"
              if pred is not None else f"infinity train: no step prediction: {why}", file=sys.stderr)
    return pred


def _say_restored_hyper(runf: RunFile, optimizer, resume_dir: str) -> None:
    """On stderr: the run file's optimizer values that differ from the ones
    the checkpoint restored. The restored ones win, as in torch and Hugging
    Face (the schedule goes on from its saved base values), so a value
    edited in the run file before ``--resume`` is not silently dropped."""
    o, g = runf.optimizer, optimizer.param_groups[0]  # group 0: the decayed one (cli/model.py param_groups)
    wanted = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    restored = {"lr": g.get("initial_lr", g["lr"]), "betas": tuple(g["betas"]), "eps": g["eps"],
                "weight_decay": g["weight_decay"]}
    diff = [f"optimizer.{k} = {wanted[k]} in the run file, {restored[k]} restored" for k in wanted
            if wanted[k] != restored[k]]
    if diff:
        print(f"infinity train: --resume from {resume_dir}: " + "; ".join(diff) + ". The checkpoint's values "
              "win, as in torch and Hugging Face (the schedule goes on from them); to train with the new ones, "
              "start a new run from the checkpoint's weights (infinity consolidate, then model.weights)",
              file=sys.stderr)


def _one_step(runf: RunFile, model, optimizer, scheduler, sampler: Sampler, loss_fn):
    """One optimizer step of ``grad_accumulation`` micro-batches: (this
    rank's loss, the lr it used, the MemoryPressureError it raised or None)."""
    dev, accum = runf.config.resolve_device(), runf.data.grad_accumulation
    total = 0.0
    for _ in range(accum):
        x, y = sampler.next_batch()
        loss = loss_fn(model, x.to(dev), y.to(dev)) / accum
        optimizer.scale_loss(loss).backward()
        total += float(loss.detach())
    lr = optimizer.param_groups[0]["lr"]
    pressure = _step(optimizer)
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return total, lr, pressure


def _loop(runf: RunFile, model, optimizer, scheduler, sampler: Sampler, loss_fn, first: int, ranks: Ranks) -> int:
    d, ck = runf.data, runf.checkpoint
    metrics = Metrics(runf.log.metrics if ranks.lead else None, runf.log.every, runf.train.steps, first,
                      d.micro_batch * ranks.world * d.seq_len * d.grad_accumulation, runf.log.progress and ranks.lead,
                      model_flops_per_token(model), peak_tflops(runf.config.resolve_device(),
                                                                engine_of(model).modes.dtype), ranks.world)
    step, recs, pressure, saved_at, unsaved = first, [], None, None, ""
    stopping = pressed = False  # agreed by every rank after each step
    try:
        with _Interrupt() as stop:
            while step < runf.train.steps and not stopping and not pressed:
                total, lr, pressure = _one_step(runf, model, optimizer, scheduler, sampler, loss_fn)
                total, _, pressed = agree(ranks, total, False, pressure is not None)
                step += 1
                rec = metrics.record(step, total, lr, infinity.stats(model))
                recs = [recs[0] if recs else rec, rec]  # the first and the latest
                if ck.dir and ck.every and step % ck.every == 0 and not pressed:
                    saved_at = _save(runf, model, optimizer, scheduler, step, sampler)
                stopping = agree(ranks, 0.0, stop.hit, False)[1]  # a Ctrl-C up to now stops after this step
            if ck.dir and saved_at != step and (stopping or pressed or not ck.every or step % ck.every):
                if not pressed:
                    saved_at = _save(runf, model, optimizer, scheduler, step, sampler)
                else:
                    saved_at, unsaved = _save_under_pressure(runf, model, optimizer, scheduler, step, sampler)
            interrupted = stopping
    finally:
        metrics.close()
    if recs and ranks.lead:
        _summary(recs[0], recs[-1], metrics.step_times)
    if pressed and pressure is None:  # another rank ran short: this one stops with it
        print(f"infinity train: rank {ranks.rank}: stopping after step {step}: memory pressure on another rank",
              file=sys.stderr)
        return 1
    if pressure is not None:
        print(f"infinity train: memory pressure after step {step}: " +
              (f"checkpoint of step {step} in {ck.dir} (resume with --resume)" if saved_at == step else
               f"the checkpoint of step {step} could not be saved ({unsaved})" if unsaved else
               "no [checkpoint] section in the run file, so nothing was saved"), file=sys.stderr)
        raise pressure
    if interrupted:
        print(f"infinity train: interrupted after step {step}" + (f"; checkpoint in {ck.dir}" if ck.dir else ""),
              file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _summary(first: Dict[str, Any], last: Dict[str, Any], step_times) -> None:
    """One line on stderr: steps, loss first -> last, time, and each tier's
    peak against its budget; with a prediction, the measured step beside it."""
    print(f"infinity train: step {last['step']}, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
          f"{last['elapsed_s']:.1f} s; " + Metrics.postfix(last).split(" s/step ", 1)[-1], file=sys.stderr)
    pred = last.get("predicted_s")
    if pred and step_times:
        # The first step pays for the trace's recording and warm caches: the median of the rest.
        ts = step_times[1:] or step_times
        med = statistics.median(ts)
        print(f"infinity train: step time measured {med:.3f} s (median of {len(ts)}), predicted {pred:.3f} s "
              f"({100 * (pred / med - 1):+.1f}%)", file=sys.stderr)
