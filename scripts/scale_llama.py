"""``scripts/scale_demo.py --shape llama3-8b``: a Llama-3-8B-shaped Hugging
Face model (hidden 4096, 32 layers, intermediate 14336, vocabulary 128256,
32 heads of which 8 KV heads, untied head: 8.03 B parameters) trained for a
few steps with NVMe homes, int8 moments and a bf16 master (~8 bytes a
parameter on disk), under a host budget of a few GiB.

The model is built under ``infinity.init`` (meta tensors: the host never
holds it whole), its need estimated by the engine's own arithmetic
(``estimate_peaks``: swap bytes, host minimum, peak RSS) before anything is
written, the free disk checked against the swap files' size, then it is
materialised unit by unit into the swap files and trained. The embedding
and the head (525 M parameters each) are their own paging units; their
optimizer state and gradients stream through the host in chunks
(``state_chunk_bytes``; [Note: gradients streamed in chunks] in
infinity/engine/owners/grad_chunks.py). ``prefetch_depth=0``: every cached
compute copy of a vocabulary-sized unit costs 1 GiB of the budget.

Measured here once (2 cores, 24 GiB RAM, one virtual disk; ``--steps 2 --seq
16 --host-memory 3.5GiB --device-memory 2GiB``): estimate host minimum 3.12
GiB, swap files 60.15 GiB; built in 288 s (the RNG replay), initialised in
344 s with a peak RSS of 8.94 GiB, step 1 in 1702 s moving 57.2 GiB from and
57.9 GiB to NVMe (disk-bound, ~72 MB/s in all); step 2 reached 8.00 GiB
(7.997) right after its forward and was stopped there for time.

What made those peaks (measured at 1 and 3 layers, ``--layers``, the same
settings; RSS sampled every 0.25 s with malloc's figures): initialise held,
beside the 3.5 GiB pool, the 2 GiB scratch of the embedding's discarded
construction draw (kept for the whole replay), the unit's 2 GiB of fp32
values and its whole 1 GiB bf16 master before it was written: 8.76 GiB (1
layer), 8.82 (3). Now the scratch is freed after its draw and the master
goes to NVMe chunk by chunk through the pool: 5.85 GiB (1 layer; the
estimate 5.82), ~6.0 at 32 layers (+6 MiB a layer, as before). Training
peaks in the head's backward, every step: torch's CPU gemm computes the
525 M-parameter head's bf16 weight gradient with an fp32 buffer of its
shape beside it (1 GiB gradient + 2 GiB), on top of the pool and the 1 GiB
device arena: 7.78 GiB (1 layer), 7.85 (3), so ~8.0 at 32 layers (the 7.997
above). The estimate counts it now (7.82 GiB at ``--host-memory 3.5GiB``).
Run the full shape with ``--host-memory 3.25GiB`` (the minimum is 3.12) to
stay ~0.25 GiB further below 8 GiB (estimate 7.57 GiB).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

import torch
import torch.nn.functional as F

import infinity
from infinity.config.runtime import format_bytes
from infinity.engine.plan.estimator import estimate_peaks
from _common import rss_bytes  # scripts/bench/_common.py (scale_demo put it on the path)

SHAPE = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
             rope_theta=500000.0, tie_word_embeddings=False)
DISK_MARGIN = 2 << 30  # free disk kept beyond the swap files (other writers, the file system's own)


def llama_config(args) -> infinity.Config:
    """The run's Config: NVMe homes, int8 moments, bf16 master, vocabulary units of their own."""
    return infinity.Config(device="cpu", dtype="bf16", offload_params="nvme", offload_optimizer="nvme",
                           moment_dtype="int8", master_dtype="bf16", host_memory=args.host_memory,
                           device_memory=args.device_memory, swap_paths=args.swap_dir or ["./infinity-swap"],
                           overlap="backward", prefetch_depth=0, state_chunk_bytes="16MiB",
                           unit_classes=["LlamaDecoderLayer", "Embedding", "Linear"])


def shape(args) -> dict:
    """SHAPE with ``args.layers`` decoder layers (None: 32): fewer layers keep
    the width and the 525 M-parameter embedding and head, the largest units."""
    return dict(SHAPE, num_hidden_layers=SHAPE["num_hidden_layers"] if args.layers is None else args.layers)


def build(lazy: bool, args):
    """The model under ``infinity.init`` (seeded), no weights in memory; not
    ``lazy``: plain meta tensors, for the estimate (its splits keep references
    to the parameters, which a lazy model's materialisation refuses)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    with infinity.init() if lazy else torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape(args)))


def hf_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def check(args, config) -> bool:
    """Prints the estimate; False (with the error printed) if the swap disk lacks room."""
    x = torch.zeros((args.batch, args.seq), dtype=torch.long, device="meta")
    peaks = estimate_peaks(build(lazy=False, args=args), config, lambda m: hf_loss(m, x, x), lazy=True)
    need = peaks["nvme"]["capacity"] + DISK_MARGIN
    paths = config.swap_paths
    for p in paths:
        os.makedirs(p, exist_ok=True)
    free = sum(shutil.disk_usage(p).free for p in {os.stat(p).st_dev: p for p in paths}.values())
    n = peaks["units"]["parameters"]
    print(f"model: Llama-3-8B shape ({shape(args)['num_hidden_layers']} layers), {n / 1e9:.2f} B parameters in "
          f"{peaks['units']['count']} paging units; "
          f"estimate: host minimum {format_bytes(peaks['host']['minimum'])}, peak RSS "
          f"{format_bytes(peaks['rss']['peak'])}, swap files {format_bytes(peaks['nvme']['capacity'])}", flush=True)
    print(f"disk: needs {format_bytes(need)} on {paths} (swap files + {format_bytes(DISK_MARGIN)} margin); "
          f"free {format_bytes(free)}", flush=True)
    if free < need:
        print(f"error: not enough free disk space in {paths}: {need} bytes needed, {free} free. Free space or pass "
              "--swap-dir on a larger disk", file=sys.stderr)
        return False
    return True


def reset_peak_rss() -> bool:
    """Resets the kernel's peak RSS (VmHWM) of this process, so the training's
    peak is measured apart from initialisation's; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main_llama(args, train) -> int:
    """The --shape llama3-8b run; ``train`` is scale_demo's loop. Exit status 0 when the loss is finite."""
    args.vocab = SHAPE["vocab_size"]
    config = llama_config(args)
    if not check(args, config):
        return 2
    t0 = time.perf_counter()
    model = build(lazy=True, args=args)
    print(f"built under infinity.init in {time.perf_counter() - t0:.1f} s; RSS {format_bytes(rss_bytes('VmRSS'))}",
          flush=True)
    t0 = time.perf_counter()
    model, opt = infinity.initialize(model, config, lr=args.lr, weight_decay=0.0)
    init_peak = rss_bytes()
    print(f"initialised into the tiers in {time.perf_counter() - t0:.1f} s; RSS {format_bytes(rss_bytes('VmRSS'))},"
          f" peak {format_bytes(init_peak)}", flush=True)
    reset = reset_peak_rss()
    _, _, losses, times = train(model, opt, args, hf_loss)
    s = infinity.stats(model)
    peak = rss_bytes()
    infinity.close(model, keep_values=False)  # keeping them would materialise the whole model in fp32
    print(f"\n{len(losses)} optimizer steps, {sum(times) / len(times):.1f} s/step (first {times[0]:.1f} s)")
    print("peak bytes per tier: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in s["peak_bytes"].items()))
    print("bytes moved in total: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in s["bytes_moved"].items()))
    print(f"peak RSS while initialising {format_bytes(init_peak)}, while training "
          + (f"{format_bytes(peak)}" if reset else "not measured apart (no /proc/self/clear_refs)")
          + f" (target <= 8 GiB: {'met' if max(peak, init_peak) <= 8 << 30 else 'MISSED'})")
    ok = all(torch.isfinite(torch.tensor(losses)))
    print("OK" if ok else "FAILED: loss not finite")
    return 0 if ok else 1
