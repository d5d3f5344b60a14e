"""Native CPU kernels, compiled from ``pagedllm/kernels/csrc/*.c`` with the system C compiler on first use.

The shared library is built once per source version and CPU (``-O3 -march=native -fopenmp``) into
pagedllm's cache directory and loaded with ctypes; calls release the GIL. It links the OpenMP
runtime by its usual soname, which torch has already loaded, so kernels and torch share one thread
pool (sized by ``torch.set_num_threads``).

If no compiler is found or the build fails, :func:`load_library` raises :class:`KernelBuildError`
with the compiler's message; :func:`kernels_available` reports that once as a warning, and callers
fall back to pure torch.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent.parent / "csrc").glob("*.c"))
# -ffast-math lets the compiler vectorise expf (glibc's libmvec) and reassociate sums; it is given
# to the compile step only, so that the link does not add crtfastmath.o (which would set
# flush-to-zero for the whole process).
_COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# Argument types of every exported function (see the C sources for their meaning).
_SIGNATURES: dict[str, list[Any]] = {
    "paged_decode_attention_f32": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64]
    + [_I64] * 6
    + [_F32],
    "paged_prefill_attention_f32": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64]
    + [_I64] * 5
    + [_F32],
    "rms_norm_f32": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _F32],
    "silu_and_mul_f32": [_PTR, _I64, _PTR, _I64, _I64, _I64],
    "rotary_f32": [_PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64],
    "max_logsumexp_f32": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR],
    "softmax_row_f32": [_PTR, _I64],
    "apply_token_bitmask_f32": [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64],
    "panel_weight_floats": [_I64, _I64],
    "pack_panels_f32": [_PTR, _I64, _I64, _PTR],
    "panel_linear_f32": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64],
    "llama_decode_layers_f32": [_I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR]
    + [_I64] * 6
    + [_F32, _F32]
    + [_PTR] * 5
    + [_I64, _PTR, _I64, _I64, _I64, _PTR],
    "quant_matmul_f32": [_I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    "quant_matmul_f32_portable": [_I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    "quant_dequantize_f32": [_I64, _PTR, _I64, _I64, _I64, _PTR],
    "quant_gather_rows_f32": [_I64, _PTR, _PTR, _I64, _I64, _PTR],
    "quant_kernel_isa": [],
    "amx_quant_available": [],
    "amx_quant_matmul_f32": [_I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    "moe_expert_panel_floats": [_I64, _I64, _I64],
    "moe_experts_panels_f32": [_PTR, _I64, _I64, _I64, _I64, _I64, _I64] + [_PTR] * 8,
}
_RETURNS: dict[str, Any] = {
    "paged_decode_attention_f32": ctypes.c_int,
    "paged_prefill_attention_f32": ctypes.c_int,
    "llama_decode_layers_f32": ctypes.c_int,
    "panel_linear_f32": ctypes.c_int,
    "panel_weight_floats": ctypes.c_int64,
    "quant_matmul_f32": ctypes.c_int64,
    "quant_matmul_f32_portable": ctypes.c_int64,
    "quant_dequantize_f32": ctypes.c_int64,
    "quant_gather_rows_f32": ctypes.c_int64,
    "quant_kernel_isa": ctypes.c_int64,
    "amx_quant_available": ctypes.c_int64,
    "amx_quant_matmul_f32": ctypes.c_int64,
    "moe_expert_panel_floats": ctypes.c_int64,
    "moe_experts_panels_f32": ctypes.c_int,
}


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


def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU as Linux lists them (``avx512_bf16``, ...); empty elsewhere."""
    for line in _cpu_signature().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelBuildError("no C compiler found (set CC or install gcc).")
    return cc


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelBuildError(f"building the CPU kernels failed ({' '.join(cmd)}):\n{result.stderr.strip()}")


def _build(cc: str, target: Path) -> None:
    """Compile and link the library to ``target``, once among concurrent processes: the first takes
    a lock beside the target and builds; the others wait on the lock and then find the file. The
    file is built beside the target and renamed, so no process ever loads a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects = []
            for source in _SOURCES:
                obj = os.path.join(tmp, source.stem + ".o")
                _run([cc, *_COMPILE_FLAGS, "-c", str(source), "-o", obj])
                objects.append(obj)
            built = os.path.join(tmp, "kernels.so")
            _run([cc, *_LINK_FLAGS, *objects, "-o", built, "-lm"])
            os.replace(built, target)
    logger.info("Built the CPU kernels: %s", target)


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (if needed) and load the kernel library; raises :class:`KernelBuildError`."""
    cc = _compiler()
    key = hashlib.sha256(" ".join([cc, *_COMPILE_FLAGS, *_LINK_FLAGS]).encode())
    key.update(_cpu_signature().encode())
    for source in _SOURCES:
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    target = cache_root() / "kernels" / f"pagedllm-cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        _build(cc, target)
    torch.get_num_threads()  # make sure torch (and its OpenMP runtime) is initialised first
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RETURNS.get(name)
    return lib


@functools.cache
def kernels_available() -> bool:
    """Whether the library builds and loads here (a warning says why not, once)."""
    try:
        load_library()
    except (KernelBuildError, OSError) as exc:
        logger.warning("Native CPU kernels unavailable, using torch code instead: %s", exc)
        return False
    return True
