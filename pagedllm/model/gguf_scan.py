"""Stepping through GGUF metadata values in a buffer without building an object per value.

``gguf.GGUFReader`` makes a NumPy array of every part of every value: two per vocabulary string,
one per merge, per token type and per score, about 250,000 for a 49k-token vocabulary, which is most
of the time taken to open a small model's file. :class:`GGUFScanner` reads values with ``struct``
at a position it advances, and steps over those it is not asked to decode.
"""

from __future__ import annotations

import struct
from typing import Any

from gguf import GGUFValueType

SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class GGUFScanner:
    """Reads GGUF values from ``data`` (any buffer: a memory map, a byte array) at ``pos``, advancing
    it; ``order`` is ``struct``'s byte order (``<`` or ``>``)."""

    def __init__(self, data: Any, order: str, pos: int) -> None:
        self.data, self.order, self.pos = data, order, pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += struct.calcsize(self.order + fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        text = bytes(self.data[self.pos : self.pos + size]).decode("utf-8")
        self.pos += size
        return text

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item = GGUFValueType(self.scalar("I"))
            return [self.value(item) for _ in range(self.scalar("Q"))]
        return self.scalar(SCALAR_FORMATS[kind])

    def skip(self, kind: GGUFValueType) -> None:
        if kind == GGUFValueType.STRING:
            size = self.scalar("Q")
            self.pos += size
        elif kind == GGUFValueType.ARRAY:
            item = GGUFValueType(self.scalar("I"))
            count = self.scalar("Q")
            if item in SCALAR_FORMATS:
                self.pos += count * struct.calcsize(self.order + SCALAR_FORMATS[item])
            elif item == GGUFValueType.STRING:  # the vocabulary: one length read per string
                length = struct.Struct(self.order + "Q").unpack_from
                data, pos = self.data, self.pos
                for _ in range(count):
                    pos += 8 + length(data, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip(item)
        else:
            self.pos += struct.calcsize(self.order + SCALAR_FORMATS[kind])


__all__ = ["SCALAR_FORMATS", "GGUFScanner"]
