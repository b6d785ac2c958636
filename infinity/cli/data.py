"""Token streams for ``infinity train`` and a deterministic, resumable sampler.

A text file is read as bytes (a byte-level tokenizer: vocabulary 256); a
``.bin`` file holds raw token ids of ``dtype`` (nanoGPT's uint16 layout) and a
``.npy`` file an array of them; both are memory-mapped, so a corpus larger
than RAM costs only the pages of the windows drawn.
"""

from __future__ import annotations

import os
from typing import Dict, Tuple

import numpy as np
import torch

from ..config.files import ConfigFileError

BYTE_VOCAB = 256


def open_tokens(path: str, fmt: str = "auto", dtype: str = "uint16") -> Tuple[np.ndarray, int]:
    """``(tokens, vocab_hint)``: a 1-D memory-mapped array of token ids and the
    vocabulary it implies (256 for text, else ``max id + 1`` of a sample)."""
    if not os.path.isfile(path):
        raise ConfigFileError(f"'data.path': {path} is not a file")
    if fmt == "auto":
        ext = os.path.splitext(path)[1].lower()
        fmt = {".bin": "bin", ".npy": "npy"}.get(ext, "text")
    try:
        if fmt == "text":
            return np.memmap(path, dtype=np.uint8, mode="r"), BYTE_VOCAB
        if fmt == "bin":
            arr = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        else:
            arr = np.load(path, mmap_mode="r")
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigFileError(f"'data.path': cannot read {path} as {fmt} (data.dtype={dtype!r}): {exc}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigFileError(f"'data.path': {path} must hold a 1-D array of integer token ids, got shape "
                              f"{arr.shape} dtype {arr.dtype}")
    sample = arr[: 1 << 20]
    return arr, int(sample.max()) + 1 if len(sample) else 1


class Sampler:
    """Non-overlapping windows of ``seq_len + 1`` tokens in a seeded random
    order per epoch. Its position (epoch, index) is saved in checkpoints and
    restored with :meth:`load_state_dict`, so a resumed run sees the same
    batches as an uninterrupted one."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int = 0, vocab: int = 0,
                 rank: int = 0, world: int = 1):
        # Every rank draws the global micro-batch (batch x world windows) and
        # keeps its rows: see [Note: infinity train on several ranks] in launch.py.
        self.tokens, self.seq_len, self.seed, self.vocab = tokens, seq_len, seed, vocab
        self.batch, self.rank, self.world = batch * world, rank, world
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < self.batch:
            raise ConfigFileError(f"'data.path' holds {len(tokens)} tokens: fewer than data.micro_batch={batch} "
                                  f"x {world} rank(s) windows of data.seq_len={seq_len} + 1; use a larger file or "
                                  "smaller values")
        self.epoch, self.index = 0, 0
        self._order = self._perm()

    def _perm(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.windows, generator=g)

    def next_batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 tensors of shape (batch, seq_len); y is x shifted by one token."""
        rows = []
        for _ in range(self.batch):
            if self.index >= self.windows:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._perm()
            start = int(self._order[self.index]) * self.seq_len
            rows.append(np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))
            self.index += 1
        t = torch.from_numpy(np.stack(rows))
        if self.vocab and int(t.max()) >= self.vocab:
            raise ValueError(f"token id {int(t.max())} in 'data.path' is >= the model's vocabulary size "
                             f"{self.vocab}: set model.vocab_size larger (or check data.dtype)")
        if self.world > 1:
            n = self.batch // self.world
            t = t[self.rank * n:(self.rank + 1) * n]
        return t[:, :-1], t[:, 1:]

    def state_dict(self) -> Dict[str, int]:
        """The position: ``{"epoch", "index", "seed", "windows"}``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "windows": self.windows}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restores a position of :meth:`state_dict`; raises if the data or seed differ."""
        if state.get("windows") != self.windows or state.get("seed") != self.seed:
            raise ValueError(f"the checkpoint's sampler ({state}) does not match this data (windows "
                             f"{self.windows}, seed {self.seed}): resume with the same data.path, seq_len and seed")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._perm()
