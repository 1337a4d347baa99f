"""CRC32C of a concatenation from the CRC32Cs of its parts (zlib's ``crc32_combine``, for CRC32C).

The writer hashes every DCP item on its own as it streams by; a file's CRC32C
is then combined from its items' in microseconds instead of hashing every byte
a second time.
"""

from __future__ import annotations

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _table() -> list[int]:
    p = 1 << 30  # x^1
    out = [p]
    for _ in range(1, 32):
        p = _multmodp(p, p)
        out.append(p)
    return out


_X2N = _table()


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: the shift of ``n`` zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``a + b`` given ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
