"""What ``infinity train`` records: one JSON line per logged step (the
metrics file ``infinity report`` plots) and a tqdm progress bar."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from ..config.runtime import format_bytes

TIERS = ("device", "host", "nvme")


def _rss() -> Optional[int]:
    """This process's resident bytes."""
    from ..system.sysinfo import rss_bytes
    return rss_bytes()


class Metrics:
    """Per-step figures from the loop and ``infinity.stats(model)``; writes
    every ``every``-th step to ``path`` (JSONL) and drives the bar."""

    def __init__(self, path: Optional[str], every: int, total_steps: int, start_step: int, tokens_per_step: int,
                 progress: bool, flops_per_token: int = 0, peak_tflops: Optional[float] = None, world: int = 1):
        self.path, self.every, self.tokens_per_step = path, every, tokens_per_step
        # See [Note: model FLOPs] in infinity/progress.py.
        self.flops_per_token, self.peak_tflops, self.world = flops_per_token, peak_tflops, world
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        self._t0 = self._last_t = time.perf_counter()
        self._last_step = start_step
        self._last = {"stall_seconds": 0.0, "optimizer_wait_seconds": 0.0, "optimizer_seconds": 0.0}
        self.step_times = []  # stats' step_seconds of every step recorded
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def record(self, step: int, loss: float, lr: float, stats: Dict[str, Any]) -> Dict[str, Any]:
        """The record of ``step`` (1-based, after its optimizer step); written and shown when due."""
        now = time.perf_counter()
        n = max(1, step - self._last_step)
        dt = (now - self._last_t) / n
        per = {k: (stats[k] - self._last[k]) / n for k in self._last}
        rec = {
            "step": step, "loss": loss, "lr": lr, "s_per_step": dt, "tokens_per_s": self.tokens_per_step / dt,
            "elapsed_s": now - self._t0,
            "stall_s": per["stall_seconds"], "optimizer_wait_s": per["optimizer_wait_seconds"],
            "optimizer_s": per["optimizer_seconds"],
            "compute_s": max(0.0, dt - per["stall_seconds"] - per["optimizer_wait_seconds"]),
            "peak_bytes": stats["peak_bytes"], "budget_bytes": stats["budget_bytes"],
            "step_bytes_moved": stats["step_bytes_moved"], "loss_scale": stats["loss_scale"],
            "skipped_steps": stats["skipped_steps"], "rss_bytes": _rss(),
            # optimizer state as the tiers hold it (Config.master_dtype, moment_dtype)
            "state_bytes_per_parameter": stats.get("state_bytes_per_parameter"),
        }
        pred = stats.get("predicted_step")
        rec["step_s"] = stats.get("step_seconds")
        rec["predicted_s"] = pred["seconds"] if pred else None
        self.step_times.append(rec["step_s"])
        rec["tflops"] = self.flops_per_token * self.tokens_per_step / self.world / dt / 1e12
        rec["mfu"] = rec["tflops"] / self.peak_tflops if self.peak_tflops else None
        self._last_t, self._last_step = now, step
        self._last = {k: stats[k] for k in self._last}
        if self._file is not None and (step % self.every == 0 or step == 1):
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix(rec), refresh=False)
            self.bar.update(1)
        return rec

    @staticmethod
    def postfix(rec: Dict[str, Any]) -> str:
        """``loss, tokens/s, s/step`` and each tier's peak against its budget."""
        tiers = []
        for t in TIERS:
            peak, budget = rec["peak_bytes"].get(t, 0), rec["budget_bytes"].get(t)
            if peak or budget:
                tiers.append(f"{t} {format_bytes(peak)}" + (f"/{format_bytes(budget)}" if budget else ""))
        mfu = f" MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
        pred = f" (predicted {rec['predicted_s']:.3f})" if rec.get("predicted_s") else ""
        return (f"loss {rec['loss']:.4f} {rec['tokens_per_s']:.0f} tok/s {rec.get('tflops', 0.0):.3g} TFLOPS{mfu} "
                f"{rec['s_per_step']:.3f} s/step{pred} " + " ".join(tiers))

    def close(self) -> None:
        """Closes the file and the bar."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
