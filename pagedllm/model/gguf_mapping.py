"""GGUF weights kept in place: views of the file's read-only memory map instead of copies.

:func:`map_file_bytes` gives a file's bytes as one uint8 tensor (the reader's mapping, no copy) from
which the loader slices each quantized weight; :func:`is_file_mapped` tells such views from copies
(for the start-up memory log); :func:`release_file_pages` drops from the process the pages of a
tensor the loader had to copy (the llama q/k projections, whose rows it reorders; tensors
dequantized to float32), so that they are not resident twice. Dropping is always safe: the map is
shared and read-only, so a page read again comes back from the file.
"""

from __future__ import annotations

import logging
import mmap

import torch
from gguf import GGUFReader

from pagedllm.kernels.cpu.quant import mapped_bytes

logger = logging.getLogger(__name__)

# Start addresses of the file mappings whose bytes quantized weights are views of.
_MAPPED_STORAGES: set[int] = set()


def map_file_bytes(reader: GGUFReader) -> torch.Tensor:
    """All bytes of ``reader``'s file as a uint8 tensor over its memory map (kept open while any
    view of it lives)."""
    file_bytes = mapped_bytes(reader.data)
    _MAPPED_STORAGES.add(file_bytes.untyped_storage().data_ptr())
    return file_bytes


def is_file_mapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a GGUF file's memory map (a weight kept in place, not copied)."""
    return tensor.untyped_storage().data_ptr() in _MAPPED_STORAGES


def release_file_pages(reader: GGUFReader, offset: int, length: int) -> None:
    """Unmap from this process the pages of file bytes ``[offset, offset + length)`` that were read
    to make a copy (they stay in the page cache): what the copy replaces is then not resident twice.
    Whole pages inside the range only; best effort (``madvise``, where Python offers it)."""
    mapping = getattr(reader.data, "_mmap", None)
    page = mmap.PAGESIZE
    begin, end = -(-offset // page) * page, (offset + length) // page * page
    if mapping is None or end <= begin or not hasattr(mapping, "madvise"):
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)
    except (OSError, ValueError) as exc:
        logger.debug("madvise(DONTNEED) of file bytes %d-%d failed: %s", begin, end, exc)
