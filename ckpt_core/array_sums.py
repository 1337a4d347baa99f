"""Fingerprint sums and CRC32C of flat numpy arrays, in one pass over cache-sized blocks; no torch.

The fingerprint (``fingerprint``) sums float16/32/64 and bfloat16 tensors
here, and the byte writer process (``byte_writer``, which does not import
torch) sums staged tensors here while writing them: both get the same bits
for the same bytes.
"""

from __future__ import annotations

from typing import Optional

import crc32c
import numpy as np

CHUNK = 1 << 18
"""Elements per block: 1 MiB of float32 scratch, small enough to stay in cache between the passes over it."""
ROW = 4096
"""Columns of a block: each column sum (at most ``CHUNK / ROW`` = 64 values) is taken in float32, the column
sums are added in float64."""

NUMPY_NAMES = ("float16", "float32", "float64", "bfloat16")
"""The dtypes summed here, by torch's name; bfloat16 as its uint16 bits."""


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype an array of torch dtype ``name`` (one of ``NUMPY_NAMES``) is summed as."""
    return np.dtype(np.uint16 if name == "bfloat16" else name)


class SumsCrc:
    """(sum, sum of |x|) and, ``with_crc``, the CRC32C of an array fed in consecutive pieces.

    Pieces of a multiple of ``CHUNK`` elements (the last one excepted) give
    exactly the bits of one call over the whole array.
    """

    def __init__(self, dtype: np.dtype, size: int, with_crc: bool = True) -> None:
        wide = dtype == np.float64
        self._x = np.empty(min(size, CHUNK), dtype=np.float64 if wide else np.float32)
        self._abs = np.empty_like(self._x)
        self.s = self.sa = 0.0
        self.crc: Optional[int] = 0 if with_crc else None

    def update(self, a: np.ndarray) -> None:
        with np.errstate(all="ignore"):  # non-finite sums are data here (an unhealthy state), not errors
            for i in range(0, a.size, CHUNK):
                c = a[i : i + CHUNK]
                x = c if c.dtype == self._x.dtype else _as_float32(c, self._x[: c.size])
                self.s += block_sum(x)
                self.sa += block_sum(np.abs(x, out=self._abs[: c.size]))
                if self.crc is not None:
                    self.crc = crc32c.crc32c(c, self.crc)


def sums_crc(a: np.ndarray, with_crc: bool = True) -> tuple[float, float, Optional[int]]:
    """(sum, sum of |x|) of a flat float16/32/64 array (or bfloat16 bits as uint16) and, ``with_crc``, the
    CRC32C of its bytes, each block's taken right after its sums."""
    acc = SumsCrc(a.dtype, a.size, with_crc)
    acc.update(a)
    return acc.s, acc.sa, acc.crc


def _as_float32(c: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``c`` (float16, or bfloat16 bits as uint16) widened to float32 into ``out``."""
    if c.dtype == np.uint16:  # bfloat16 is the upper half of a float32
        bits = out.view(np.uint32)
        np.copyto(bits, c)
        np.left_shift(bits, 16, out=bits)
        return out
    np.copyto(out, c)
    return out


def block_sum(x: np.ndarray) -> float:
    """Sum of one block: its rows of ``ROW`` added down the columns in float32, the column sums and the
    tail in float64 (float64 throughout if a column sum overflows)."""
    if x.dtype == np.float64:
        return float(np.add.reduce(x))
    rows = x.size // ROW
    tail = float(np.add.reduce(x[rows * ROW :], dtype=np.float64))
    if not rows:
        return tail
    columns = np.add.reduce(x[: rows * ROW].reshape(rows, ROW), axis=0)
    if not np.isfinite(columns).all() and np.isfinite(x).all():
        return float(np.add.reduce(x, dtype=np.float64))
    return float(np.add.reduce(columns, dtype=np.float64)) + tail

