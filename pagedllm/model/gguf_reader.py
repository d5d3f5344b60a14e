"""Opening GGUF files: metadata parsed fast (long arrays stepped over until read), once per process.

:class:`FastGGUFReader` gives ``gguf.GGUFReader``'s fields, parts and tensors; :func:`open_gguf`
caches one per file; :func:`read_metadata` decodes a field.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType, ReaderField

from pagedllm.model.gguf_scan import SCALAR_FORMATS, GGUFScanner

# Arrays of at least this many scalars or strings (the vocabulary, its merges, scores and types)
# are stepped over when a file is opened and made into parts only if something asks for them.
LAZY_ARRAY_ITEMS = 64


ARRAY_HEADER_BYTES = 4 + 8  # an array value's item type (uint32) and item count (uint64)


class LazyArrayParts(Sequence[Any]):
    """The ``parts`` of an array field as ``GGUFReader`` would list them, built at the first use;
    :meth:`values` decodes the items straight from the file's bytes without building them."""

    def __init__(
        self, reader: FastGGUFReader, offset: int, value_offset: int, item: GGUFValueType, count: int
    ):
        self._reader = reader
        self._offset = offset  # where the field starts (its key)
        self._value_offset = value_offset  # where its value (the array's item type) starts
        self.item = item
        self.num_items = count
        self._parts: list[npt.NDArray[Any]] | None = None

    def _built(self) -> list[npt.NDArray[Any]]:
        if self._parts is None:
            reader = self._reader
            klen, kdata = reader._get_str(self._offset)
            raw_type = reader._get(self._offset + int(klen.nbytes + kdata.nbytes), np.uint32)
            _, field_parts, _, _ = GGUFReader._get_field_parts(
                reader, self._value_offset, GGUFValueType.ARRAY
            )
            self._parts = [klen, kdata, raw_type, *field_parts]
        return self._parts

    def __len__(self) -> int:
        return len(self._built())

    def __getitem__(self, index: Any) -> Any:
        return self._built()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._built())

    def values(self) -> list[Any]:
        """The items, decoded as ``GGUFReader``'s parts decode (strings as text, numbers as Python
        numbers)."""
        items_start = self._value_offset + ARRAY_HEADER_BYTES
        scan = GGUFScanner(self._reader.plain_data, self._reader.struct_order, items_start)
        if self.item == GGUFValueType.STRING:
            return [scan.string() for _ in range(self.num_items)]
        dtype = np.dtype(self._reader.struct_order + SCALAR_FORMATS[self.item])
        return np.frombuffer(self._reader.plain_data, dtype, self.num_items, scan.pos).tolist()


class FastGGUFReader(GGUFReader):
    """``GGUFReader`` that parses metadata faster, with the same fields, parts and tensors:

    * it slices a plain ndarray view of the file mapping (slicing an ``np.memmap`` runs Python-level
      ``__array_finalize__`` hooks, about 4x slower);
    * long arrays of scalars or strings (the tokenizer's vocabulary, merges, scores, token types:
      about 250,000 values for a 49k vocabulary) are stepped over, their parts built only when read
      (:class:`LazyArrayParts`; their ``data`` indices are a ``range``). Loading a model reads none
      of them, so opening the file costs a few milliseconds instead of a large part of a second.

    The arrays handed out are still zero-copy views of the same read-only mapping.
    """

    @property
    def plain_data(self) -> npt.NDArray[np.uint8]:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self._plain_data = self.data.view(np.ndarray)
        return plain

    @property
    def struct_order(self) -> str:
        """The file's byte order for ``struct``."""
        little = (self.byte_order == "I") == (sys.byteorder == "little")
        return "<" if little else ">"

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: Any = None
    ) -> npt.NDArray[Any]:
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = self.plain_data[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        scan = GGUFScanner(self.plain_data, self.struct_order, offs)
        for _ in range(count):
            start = scan.pos = offs
            key = scan.string()
            kind = scan.scalar("I")
            value_offset = scan.pos
            if kind == GGUFValueType.ARRAY:
                item, items = scan.scalar("I"), scan.scalar("Q")
                if items >= LAZY_ARRAY_ITEMS and (item in SCALAR_FORMATS or item == GGUFValueType.STRING):
                    scan.pos = value_offset
                    scan.skip(GGUFValueType.ARRAY)
                    item_type = GGUFValueType(item)
                    parts = LazyArrayParts(self, start, value_offset, item_type, items)
                    first, step = (6, 2) if item_type == GGUFValueType.STRING else (5, 1)
                    field = ReaderField(
                        start,
                        key,
                        parts,  # type: ignore[arg-type]
                        range(first, first + step * items, step),  # type: ignore[arg-type]
                        [GGUFValueType.ARRAY, item_type],
                    )
                    self._push_field(field, skip_sum=True)
                    offs = scan.pos
                    continue
            offs = super()._build_fields(start, 1)
        return offs


def open_gguf(path: str) -> GGUFReader:
    """Open a GGUF file for reading (metadata parsed eagerly, tensor data memory-mapped).

    A process parses each file once: the reader (its metadata and its read-only mapping, which
    nothing writes to) is shared by every engine of the process that loads the same file, as long
    as the file's size and modification time are unchanged (a few files are kept).
    """
    st = os.stat(path)
    return _open_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return FastGGUFReader(path)
    except Exception:
        # Fall back to the stock reader; it raises the meaningful error for a malformed file.
        return GGUFReader(path)


def field_value(field: ReaderField) -> Any:
    """Decode a scalar, string or array metadata field."""
    if isinstance(field.parts, LazyArrayParts):
        return field.parts.values()
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def read_metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (decoded), or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field_value(field)


__all__ = [
    "LAZY_ARRAY_ITEMS",
    "FastGGUFReader",
    "LazyArrayParts",
    "field_value",
    "open_gguf",
    "read_metadata",
]
