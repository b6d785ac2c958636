"""A tensor's CRC32C and its per-chunk CRC32Cs in one pass over its bytes.

[Note: one pass for both sums]
A checkpoint records, for a tensor of more than ``CHUNK_BYTES``, the CRC32C of
the whole tensor and of each chunk (ranged loads check only the chunks they
read). Taking both as two passes cost a second read of every byte from
memory, which on these machines competes with the disk for bandwidth. So only
the chunks are summed, and the whole tensor's CRC is combined from them:
CRC(A || B) = shift(CRC(A), len(B)) xor CRC(B), where shift appends len(B)
zero bytes to the CRC register, a linear map over GF(2) (zlib's
``crc32_combine``). The maps for 2^k bytes are computed once; a shift by n
bytes applies those of n's set bits (at most 64 matrix-vector products of 32
words each).
"""

from __future__ import annotations

from typing import List, Tuple

from ..io.engine import crc32c

__all__ = ["crc32c_combine", "chunk_sums", "combine_chunks"]

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _times(mat: List[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: List[int]) -> List[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _byte_shift_maps(bits: int = 64) -> List[List[int]]:
    """Maps that append 2^k zero bytes to a CRC register, k = 0 .. bits-1."""
    one_bit = [_POLY] + [1 << (n - 1) for n in range(1, 32)]
    m = _square(_square(_square(one_bit)))  # 8 zero bits: one byte
    maps = [m]
    for _ in range(bits - 1):
        m = _square(m)
        maps.append(m)
    return maps


_MAPS = _byte_shift_maps()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A || B from ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B) and
    ``len2`` = len(B) in bytes."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_MAPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def chunk_sums(ptr: int, nbytes: int, chunk: int) -> Tuple[int, List[int]]:
    """(CRC32C of the ``nbytes`` bytes at address ``ptr``, the CRC32C of each
    ``chunk``-byte piece of them, the last one shorter), reading the bytes once."""
    sums = [crc32c(ptr + o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]
    return combine_chunks(sums, nbytes, chunk), sums


def combine_chunks(sums: List[int], nbytes: int, chunk: int) -> int:
    """The CRC32C of ``nbytes`` bytes from the CRC32Cs ``sums`` of their
    ``chunk``-byte pieces (one per piece, the last one shorter)."""
    full = 0
    for k, c in enumerate(sums):
        full = crc32c_combine(full, c, min(chunk, nbytes - k * chunk)) if k else c
    return full
