"""Native CPU kernels, compiled from ``csrc/`` with the system C compiler on first use.

The shared library is built once per source version and CPU (``-O3 -march=native -fopenmp``) into
pagedllm's cache directory and loaded with ctypes; calls release the GIL. It links the OpenMP
runtime by its usual soname, which torch has already loaded, so kernels and torch share one thread
pool (sized by ``torch.set_num_threads``).

If no compiler is found or the build fails, :func:`load_library` raises :class:`KernelBuildError`
with the compiler's message; callers that can fall back to pure torch do so.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm.model.tokenizer import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.c"
# -ffast-math lets the compiler vectorise expf (glibc's libmvec) and reassociate dot products; it
# is given to the compile step only, so that the link does not add crtfastmath.o (which would set
# flush-to-zero for the whole process).
_COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


class KernelBuildError(RuntimeError):
    pass


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC or install gcc).")
    return cc


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (if needed) and load the kernel library; raises :class:`KernelBuildError`."""
    cc = _compiler()
    source = _SOURCE.read_bytes()
    flags = " ".join(_COMPILE_FLAGS + _LINK_FLAGS)
    key = hashlib.sha256(b"\0".join([source, flags.encode(), cc.encode(), _cpu_signature().encode()]))
    target = cache_root() / "kernels" / f"paged_decode_cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            obj, built = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.so")
            for cmd in (
                [cc, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", obj],
                [cc, *_LINK_FLAGS, obj, "-o", built, "-lm"],
            ):
                result = subprocess.run(cmd, capture_output=True, text=True)
                if result.returncode != 0:
                    raise KernelBuildError(
                        f"building {_SOURCE.name} failed ({' '.join(cmd)}):\n{result.stderr.strip()}"
                    )
            os.replace(built, target)
        logger.info("Built CPU attention kernels: %s", target)
    torch.get_num_threads()  # make sure torch (and its OpenMP runtime) is initialised first
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        i64,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
    ]
    fn.restype = ctypes.c_int
    return lib


def kernels_available() -> bool:
    try:
        load_library()
    except (KernelBuildError, OSError) as exc:
        logger.warning("CPU attention kernels unavailable, using the torch backend: %s", exc)
        return False
    return True


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V.

    ``query`` ``[S, H, D]`` float32 with a contiguous last dimension (other strides free);
    ``k_cache``/``v_cache`` ``[num_blocks, block_size, KVH, D]`` contiguous float32;
    ``block_tables`` ``[S, max_blocks]`` int32 with a contiguous last dimension; ``seq_lens`` ``[S]``
    int32 contiguous, each at least 1 and at most ``max_seq_len``. Returns (or fills ``out``)
    ``[S, H, D]``.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError("query and cache head shapes do not match.")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a float32 CPU tensor.")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and query.stride(-1) == 1):
        raise ValueError("caches must be contiguous and query contiguous along head_dim.")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be int32, contiguous along the last dimension.")
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be a contiguous int32 tensor.")
    if out is None:
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    if num_seqs == 0:
        return out
    rc = load_library().paged_decode_attention_f32(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_seq_len,
        scale,
    )
    if rc != 0:
        raise MemoryError("paged_decode_attention: out of memory for its score buffers.")
    return out
