"""How the engine's process uses host memory when the model runs on the CPU (Linux, glibc).

torch's CPU allocator takes every tensor straight from ``malloc`` and returns it on release. With
glibc's defaults, blocks above a (moving) threshold are fresh ``mmap`` regions and freed memory at
the top of the heap is given back to the kernel, so the activations of each layer, which a forward
allocates and frees hundreds of times, are page-faulted in anew every time: about a fifth of a
small decode step and of a large prefill GEMM on the CPUs measured (see docs/PERFORMANCE.md).
:func:`keep_freed_memory` makes ``malloc`` keep freed blocks for reuse instead, and :func:`trim_freed_memory` gives them back
once the engine is idle (so that an idle server holds its weights, KV cache and little else).

The paged KV cache is read block by block at scattered addresses; :func:`advise_huge_pages` asks
for transparent huge pages for it, so that those reads miss the TLB far less often.

Both are best effort: elsewhere (another C library, another OS) they do nothing.

:func:`weight_memory` and :func:`anonymous_resident_bytes` account for the start-up log's split of
memory into weights (mapped from the GGUF file or copied), KV cache and the rest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import logging
import sys

import torch
from torch import nn

logger = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the heap and are reused after release (prefill activations are
# tens of MiB); bigger ones (the KV cache) keep their own mapping.
_MMAP_THRESHOLD_BYTES = 256 << 20
# Free memory at the top of the heap kept rather than returned to the kernel.
_TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc ``malloc`` reuse freed memory instead of unmapping it (once per process).

    Sets fixed thresholds (``M_MMAP_THRESHOLD`` 256 MiB, ``M_TRIM_THRESHOLD`` 1 GiB), which also
    stops glibc from adjusting them. The process's resident memory then stays at its high-water
    mark. Returns whether both settings were taken.
    """
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )
    if not ok:
        logger.debug("malloc thresholds not set; freed activations are returned to the kernel.")
    return ok


def trim_freed_memory() -> bool:
    """Give the free memory that :func:`keep_freed_memory` keeps (freed activations) back to the
    kernel (``malloc_trim``), for a process that has gone idle; returns whether any was released."""
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except AttributeError:  # not glibc
        return False


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s memory with transparent huge pages (call before first touch).

    Where transparent huge pages are set to ``madvise`` (a common default) only advised memory gets
    them. Covers the 2 MiB-aligned part of the tensor; returns whether the advice was taken.
    """
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    length = (end - aligned) // _HUGE_PAGE * _HUGE_PAGE
    if length <= 0:
        return False
    return bool(libc.madvise(aligned, length, _MADV_HUGEPAGE) == 0)


@dataclasses.dataclass(frozen=True)
class WeightMemory:
    """Bytes of a model's weights: ``mapped`` are views of the checkpoint file's memory map (resident
    as they are read, shared with the page cache), ``copied`` live in the process's own memory."""

    mapped: int
    copied: int

    @property
    def total(self) -> int:
        return self.mapped + self.copied


def weight_memory(model: nn.Module) -> WeightMemory:
    """The bytes of ``model``'s parameters and quantized blocks, each tensor counted once (a tied LM
    head and its embedding share their blocks)."""
    from pagedllm.kernels.cpu.quant_linear import QuantEmbedding, QuantLinear
    from pagedllm.model.gguf_mapping import is_file_mapped

    tensors: list[torch.Tensor] = [p for p in model.parameters()]
    for module in model.modules():
        if isinstance(module, QuantLinear):
            tensors.extend(part.blocks for part in module.parts)
        elif isinstance(module, QuantEmbedding):
            tensors.append(module.table.blocks)
    seen: set[tuple[int, int]] = set()
    mapped = copied = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if (t.data_ptr(), size) in seen or t.device.type != "cpu":
            continue
        seen.add((t.data_ptr(), size))
        if is_file_mapped(t):
            mapped += size
        else:
            copied += size
    return WeightMemory(mapped, copied)


def anonymous_resident_bytes() -> int | None:
    """This process's resident anonymous memory (``RssAnon``), or None where Linux's /proc is not."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
