"""What every data-file stream of a save shares: DCP's items cut at ``tell``, aligned starts, the file's CRC.

DCP asks the stream for its position (``tell``) right before and right
after each item it writes, so the segments between two ``tell`` calls are
exactly DCP's items. With an alignment, a ``tell`` that follows another with
nothing written between them (the start of an item) first pads the file
with zeros to a multiple of it: a segment of its own, in the file's checksum
but in no item. The local stream (``dcp_io``) and the byte writer's
(``byte_client``) keep their segments differently and share this.
"""

from __future__ import annotations

from typing import Any

from .crc_combine import crc32c_combine


class ItemBoundaries:
    """Mixin: ``tell`` as DCP's item boundary. The class provides ``size``, ``write``, ``_cut`` (close the
    current segment), ``_align`` and ``_wrote`` (set by ``write``)."""

    size: int
    _align: int
    _wrote: bool

    def _cut(self) -> None:
        raise NotImplementedError

    def write(self, b: Any) -> int:
        raise NotImplementedError

    def tell(self) -> int:
        if self._align and not self._wrote and self.size % self._align:
            self._cut()
            self.write(bytes(self._align - self.size % self._align))
        self._cut()
        self._wrote = False
        return self.size


def combined_crc(segments: list[tuple[int, int, int]]) -> int:
    """The CRC32C of a file from its segments' (offset, length, crc32c), in file order."""
    crc = 0
    for _offset, length, seg_crc in segments:
        crc = crc32c_combine(crc, seg_crc, length)
    return crc
