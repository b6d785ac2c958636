"""Streaming reader and writer of safetensors files, with a CRC32C per tensor.

[Note: streamed safetensors]
A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the bytes. Every
shape is known before a checkpoint is written, so the header is written
first and the tensors follow one at a time, in the declared order, straight
from wherever they live: the writer never holds more than the tensor it is
given. The files stay readable by the ``safetensors`` package. Each tensor's
CRC32C (the native one of infinity.io) is taken as it is written and kept in
the checkpoint's manifest; the reader checks it as it reads. A tensor of more
than ``CHUNK_BYTES`` also gets a CRC32C per chunk of that size, so a rank
that loads only its shard of a tensor reads and checks only the chunks the
shard touches (:func:`read_range`).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..io.engine import crc32c
from .chunk_sums import chunk_sums, combine_chunks
from .direct_stream import DirectStream, aligned_empty
from .safe_files import MAX_HEADER_BYTES, CorruptCheckpointError, open_member, parse_json, read_error

__all__ = ["DTYPES", "Entry", "nbytes", "split_shards", "ShardWriter", "read_tensor", "read_range", "read_header",
           "CorruptCheckpointError", "CHUNK_BYTES", "record_dtype", "start_tensor", "start_range", "TensorRead",
           "page_phase"]

DTYPES: Dict[torch.dtype, str] = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}
ALIGN = 4096  # the header is padded (spaces, as the format allows): the data starts on a page (DirectStream)
CHUNK_BYTES = 4 << 20  # per-chunk CRC32C of larger tensors (ranged reads verify what they read)


Entry = Tuple[str, torch.dtype, Tuple[int, ...]]  # name, dtype, shape


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty(0, dtype=dtype).element_size()


def split_shards(entries: Sequence[Tuple], limit: int) -> List[List[Tuple]]:
    """``entries`` (name, dtype, shape, ...) in order, cut into runs of at most
    ``limit`` bytes (a larger tensor alone); at least one run."""
    shards, cur, size = [], [], 0
    for e in entries:
        n = nbytes(e[1], e[2])
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    return shards + [cur] if cur or not shards else shards


class ShardWriter:
    """Writes one safetensors file of ``entries`` (name, dtype, shape), in
    that order, at ``path`` (created new, 0600). :meth:`write` each tensor in
    order; :meth:`close` flushes and fsyncs. ``records`` then lists, per
    tensor, what the manifest keeps (offset and length in bytes in the file,
    CRC32C)."""

    def __init__(self, path: str, entries: Sequence[Entry], metadata: Optional[Dict[str, str]] = None):
        self.path = path
        header: Dict[str, object] = {}
        off = 0
        self._order: List[Tuple[str, int]] = []
        for name, dtype, shape in entries:
            n = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [off, off + n]}
            self._order.append((name, n))
            off += n
        if metadata:
            header["__metadata__"] = dict(metadata)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % ALIGN)
        self.data_start = 8 + len(raw)
        self.nbytes = self.data_start + off
        self.records: List[dict] = []
        self._next = 0
        self._f = DirectStream(path)  # [Note: checkpoint writes without the page cache]
        self._f.write_bytes(struct.pack("<Q", len(raw)) + raw)
        self._pos = self.data_start

    def write(self, name: str, t: torch.Tensor) -> None:
        """Appends tensor ``name`` (the next one declared), from any CPU tensor."""
        want, n = self._order[self._next]
        if name != want:
            raise RuntimeError(f"internal: {self.path}: tensor {name!r} written where {want!r} is next")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.numel() * t.element_size() != n:
            raise RuntimeError(f"internal: {self.path}: tensor {name!r} has {t.numel() * t.element_size()} bytes, "
                               f"{n} declared")
        crc, sums = chunk_sums(t.data_ptr(), n, CHUNK_BYTES) if n else (0, [])
        rec = {"name": name, "offset": self._pos, "length": n, "crc32c": crc}
        if n > CHUNK_BYTES:
            rec["chunks"] = {"bytes": CHUNK_BYTES, "crc32c": sums}
        if n:
            self._f.write(t)
        self.records.append(rec)
        self._pos += n
        self._next += 1

    def settle(self) -> None:
        """Waits until no write still reads a written tensor's memory (see
        DirectStream.settle): call before that memory may change."""
        self._f.settle()

    def close(self) -> None:
        """Flushes and fsyncs the file; raises if a declared tensor was not written."""
        try:
            if self._next != len(self._order):
                raise RuntimeError(f"internal: {self.path}: {len(self._order) - self._next} tensors not written")
            self._f.close()
        finally:
            self._f.abort()

    def abort(self) -> None:
        """Closes without checks (the partial file is removed by the caller)."""
        try:
            self._f.abort()
        except OSError:
            pass


def read_header(ckpt: str, fname: str) -> Tuple[dict, int]:
    """(header dict, data start in bytes) of the checkpoint's safetensors file
    ``fname`` (opened through safe_files.open_member; its announced header
    length checked against the file and ``MAX_HEADER_BYTES`` before reading)."""
    path = os.path.join(ckpt, fname)
    fd, size = open_member(ckpt, fname)
    try:
        head = _pread(fd, path, 8, 0)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: {len(head)} bytes, not a safetensors file (truncated?)")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CorruptCheckpointError(f"{path}: header of {n} bytes announced, the file has {size - 8} after the "
                                         f"length and a header may have {MAX_HEADER_BYTES} (truncated or corrupt)")
        raw = _pread(fd, path, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise CorruptCheckpointError(f"{path}: header of {n} bytes announced, {len(raw)} present (truncated)")
    header = parse_json(path, raw)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    return header, 8 + n


def _pread(fd: int, path: str, n: int, pos: int) -> bytes:
    try:
        return os.pread(fd, n, pos)
    except OSError as exc:
        raise read_error(path, exc, pos) from None


def read_tensor(f, path: str, rec: dict, dtype: torch.dtype, shape: Sequence[int],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reads the tensor of manifest record ``rec`` from ``f`` (a
    :class:`~.direct_stream.DirectReader` of ``path``, read ahead: for
    reading a file front to back) into ``out`` (or a new CPU tensor) and checks its CRC32C."""
    t = _target(path, rec, dtype, shape, out)
    if rec["length"]:
        _check_tensor(path, rec, t, f.read_into(rec["offset"], t))
    return t


class TensorRead:
    """A tensor being read (:func:`start_tensor`): :meth:`wait` checks it and returns it."""

    def __init__(self, path: str, rec: dict, t: torch.Tensor, pending=None):
        self.path, self.rec, self.t, self._pending = path, rec, t, pending

    def wait(self) -> torch.Tensor:
        """The tensor, its length and CRC32C checked (raises CorruptCheckpointError)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            _check_tensor(self.path, self.rec, self.t, pending.result())
        return self.t


def start_tensor(f, path: str, rec: dict, dtype: torch.dtype, shape: Sequence[int],
                 out: Optional[torch.Tensor] = None) -> TensorRead:
    """Starts reading the tensor of ``rec`` straight into ``out`` (or a new
    CPU tensor) through ``f.submit``: several reads started before the first
    is waited for keep the disk busy. ``out`` is not to be touched until
    :meth:`TensorRead.wait`."""
    if out is None:
        es = torch.empty(0, dtype=dtype).element_size()
        out = aligned_empty(nbytes(dtype, shape), page_phase(rec["offset"], es)).view(dtype).view(tuple(shape))
    t = _target(path, rec, dtype, shape, out)
    return TensorRead(path, rec, t, f.submit(rec["offset"], t) if rec["length"] else None)


def page_phase(offset: int, es: int) -> int:
    """Where in its page a buffer to read file ``offset`` into should start
    (read straight, not bounced: DirectReader.submit), as long as the
    elements of ``es`` bytes stay aligned; else 0."""
    p = offset % 4096
    return p if p % es == 0 else 0


def _target(path: str, rec: dict, dtype: torch.dtype, shape: Sequence[int], out: Optional[torch.Tensor]):
    """``out`` (or a new tensor) after checking that it has the record's length in bytes."""
    n = rec["length"]
    t = out if out is not None else torch.empty(tuple(shape), dtype=dtype)
    if t.numel() * t.element_size() != n:
        raise CorruptCheckpointError(f"{path}: tensor {rec['name']!r} has {n} bytes in the manifest, "
                                     f"{t.numel() * t.element_size()} for shape {tuple(shape)} {dtype}")
    return t


def _check_tensor(path: str, rec: dict, t: torch.Tensor, got: int) -> None:
    """Checks that all of ``rec``'s bytes were read into ``t`` and their CRC32C (chunk by chunk where it has chunks)."""
    n = rec["length"]
    if got != n:
        raise CorruptCheckpointError(f"{path}: tensor {rec['name']!r} at offset {rec['offset']}: {got} of {n} bytes "
                                     "present (file truncated)")
    chunks = rec.get("chunks")
    if chunks is not None:  # the chunks' sums name the corrupt chunk; the whole one is combined from them
        _check_chunks(path, rec, t.reshape(-1).view(torch.uint8), 0, chunks)
    crc = _whole_sum(t, n, chunks)
    if crc != rec["crc32c"]:
        raise CorruptCheckpointError(f"{path}: tensor {rec['name']!r} at offset {rec['offset']} ({n} bytes): "
                                     "CRC32C differs from the manifest's (corrupt file)")


def start_range(f, path: str, rec: dict, dtype: torch.dtype, start: int, stop: int, out: torch.Tensor):
    """:func:`read_range`, started: where the range is the whole tensor and
    ``out`` can take it, a :class:`TensorRead` straight into ``out``; else the
    range is read now (the handle returned is done). Call ``wait()`` on it."""
    es = torch.empty(0, dtype=dtype).element_size()
    if start == 0 and stop * es == rec["length"] and out.is_contiguous() and out.dtype == dtype:
        return start_tensor(f, path, rec, dtype, (stop,), out.view(-1))
    read_range(f, path, rec, dtype, start, stop, out)
    return TensorRead(path, rec, out)


def read_range(f, path: str, rec: dict, dtype: torch.dtype, start: int, stop: int, out: torch.Tensor) -> None:
    """Elements ``start:stop`` of the flat tensor of ``rec`` into ``out``
    (that many elements), reading and checking only the chunks they touch
    (the whole tensor where the record has no chunk sums)."""
    es = torch.empty(0, dtype=dtype).element_size()
    chunks = rec.get("chunks")
    whole = start == 0 and stop * es == rec["length"]
    if chunks is None or whole:
        into = whole and out.is_contiguous() and out.dtype == dtype  # straight into out, no temporary
        full = start_tensor(f, path, rec, dtype, (rec["length"] // es,), out.view(-1) if into else None).wait()
        if not into:
            out.copy_(full[start:stop])
        return
    c = chunks["bytes"]
    first, last = start * es // c, -(-stop * es // c)
    lo, hi = first * c, min(last * c, rec["length"])
    buf = aligned_empty(hi - lo, page_phase(rec["offset"] + lo, es))
    got = f.submit(rec["offset"] + lo, buf).result()
    if got != hi - lo:
        raise CorruptCheckpointError(f"{path}: tensor {rec['name']!r} at offset {rec['offset'] + lo}: {got} of "
                                     f"{hi - lo} bytes present (file truncated)")
    _check_chunks(path, rec, buf, first, chunks)
    out.view(-1).copy_(buf[start * es - lo:stop * es - lo].view(dtype))


def _check_chunks(path: str, rec: dict, buf: torch.Tensor, first: int, chunks: dict) -> None:
    """Checks the chunks ``first ..`` of ``rec`` that ``buf`` (uint8, from chunk ``first``'s start) holds."""
    c, ptr = chunks["bytes"], buf.data_ptr()
    lo = first * c
    for a in range(0, buf.numel(), c):
        k, b = first + a // c, min(a + c, buf.numel())
        crc = crc32c(ptr + a, b - a)
        if k >= len(chunks["crc32c"]) or crc != chunks["crc32c"][k]:
            why = "differs from the manifest's" if k < len(chunks["crc32c"]) else "has no sum in the manifest"
            raise CorruptCheckpointError(f"{path}: tensor {rec['name']!r}, chunk {k} at offset "
                                         f"{rec['offset'] + lo + a} ({b - a} bytes): CRC32C {why} (corrupt file)")


def _whole_sum(t: torch.Tensor, n: int, chunks: Optional[dict]) -> int:
    """The CRC32C of ``t``'s ``n`` bytes: combined from the chunks' (just checked) where there are chunks."""
    if chunks is None:
        return crc32c(t.data_ptr(), n)
    c = chunks["bytes"]
    if len(chunks["crc32c"]) != -(-n // c):
        raise CorruptCheckpointError(f"tensor of {n} bytes: {len(chunks['crc32c'])} chunk sums of {c} bytes in the "
                                     "manifest (corrupt manifest)")
    return combine_chunks(chunks["crc32c"], n, c)


_MANIFEST_DTYPES = {str(d).replace("torch.", ""): d for d in DTYPES}  # as save.py names them


def record_dtype(rec: dict) -> torch.dtype:
    """The torch dtype of a manifest record ("float32", "bfloat16", ...)."""
    try:
        return _MANIFEST_DTYPES[rec["dtype"]]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"tensor {rec.get('name')!r}: its dtype in the manifest is none of "
                                     f"{sorted(_MANIFEST_DTYPES)}") from None


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name ("F32", "BF16", ...)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CorruptCheckpointError(f"a tensor's dtype in a checkpoint is none of {sorted(_BY_NAME)}") from None
