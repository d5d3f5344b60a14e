"""Compile the Triton kernels for a GPU without one: launches on ``meta`` tensors become compilations.

Meta tensors carry shapes, dtypes and strides but no data, so torch operations on them only work out
result shapes. :func:`compile_for` extends that to our Triton launches: inside it, a kernel launched
(through :func:`pagedllm.kernels.triton.attention.launch`) on meta tensors is specialised and compiled
by Triton's own JIT for the given GPU, down to the cubin that ``ptxas`` assembles, and nothing runs.
This catches, on a machine without a GPU, what the interpreter cannot: constructs the GPU compiler
rejects (``tl.dot`` tile shapes, dtype mixes) and tilings that need more shared memory than the GPU
has, which would otherwise only fail at the first launch on the device.

Running a model's forward on the meta device in this scope compiles every kernel variant the forward
launches, with the tilings chosen for that GPU (its SM count steers the split-K choice), and proves the
forward reads no device data on the host (any ``.item()``/``.tolist()`` of a meta tensor raises).
Outside :func:`compile_for`, launches on meta tensors do nothing.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver


@dataclass(frozen=True)
class GPUSpec:
    """What kernel compilation and tiling need to know about a GPU."""

    name: str
    compute_capability: int  # e.g. 90 for sm_90
    num_sms: int
    max_shared_bytes: int  # shared memory one block may use (opt-in maximum)
    warp_size: int = 32

    @property
    def target(self) -> GPUTarget:
        return GPUTarget("cuda", self.compute_capability, self.warp_size)


H200 = GPUSpec("NVIDIA H200", compute_capability=90, num_sms=132, max_shared_bytes=227 * 1024)


@dataclass(frozen=True)
class CompiledLaunch:
    """One kernel variant compiled inside :func:`compile_for`."""

    kernel: str
    grid: tuple[int, ...]
    constants: dict[str, Any]  # the launch's constexpr arguments
    num_warps: int
    num_stages: int
    shared_bytes: int  # static + dynamic shared memory per block
    asm: dict[str, Any]  # Triton's stages: "ttir", "ttgir", "llir", "ptx", "cubin"


class _AheadOfTimeDriver(DriverBase):
    """Stands in for the CUDA driver while compiling: names the target GPU and launches nothing."""

    def __init__(self, spec: GPUSpec) -> None:
        self.spec = spec

    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self) -> GPUTarget:
        return self.spec.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("nothing runs while compiling ahead of time")

    def get_device_interface(self) -> Any:
        raise NotImplementedError("nothing runs while compiling ahead of time")

    def get_empty_cache_for_benchmarking(self) -> Any:
        raise NotImplementedError("nothing runs while compiling ahead of time")

    def clear_cache(self, cache: Any) -> None:
        pass


@dataclass
class _Scope:
    spec: GPUSpec
    launches: list[CompiledLaunch]
    # Each kernel's JIT caches from before the scope: its compilations for the target GPU go to
    # fresh caches, dropped on exit, so a real GPU in the same process never runs them.
    saved_caches: dict[Any, Any] = field(default_factory=dict)


_scope: _Scope | None = None


def current_spec() -> GPUSpec | None:
    """The GPU that launches on meta tensors compile for, or None outside :func:`compile_for`."""
    return _scope.spec if _scope is not None else None


@contextlib.contextmanager
def compile_for(spec: GPUSpec = H200) -> Iterator[list[CompiledLaunch]]:
    """Within the block, kernel launches on meta tensors compile for ``spec``; yields the list of
    :class:`CompiledLaunch` records, one per launch, filled as the block runs.

    Compilation errors propagate. A variant whose shared memory exceeds ``spec.max_shared_bytes``
    raises ``RuntimeError`` naming the kernel, as its launch on the GPU would fail. Needs a process
    that imported triton without ``TRITON_INTERPRET=1`` (raises ``RuntimeError`` otherwise).
    """
    global _scope
    if _scope is not None:
        raise RuntimeError("compile_for scopes do not nest.")
    if not isinstance(tl.standard.sum, triton.runtime.JITFunction):
        raise RuntimeError(
            "triton was imported with TRITON_INTERPRET=1, which leaves its language functions "
            "interpreter-only in this process: compile for a GPU in a process without it."
        )
    launches: list[CompiledLaunch] = []
    previous = driver._active  # None until something asked for the real driver
    _scope = _Scope(spec, launches)
    driver.set_active(_AheadOfTimeDriver(spec))
    try:
        yield launches
    finally:
        for kernel, caches in _scope.saved_caches.items():
            kernel.device_caches = caches
        _scope = None
        driver._active = previous


def compile_launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Compile ``kernel[grid](*args, **kwargs)`` for the current scope's GPU (nothing outside one)."""
    if _scope is None:
        return
    if kernel not in _scope.saved_caches:
        _scope.saved_caches[kernel] = kernel.device_caches
        kernel.device_caches = defaultdict(kernel.create_binder)
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    meta = compiled.metadata
    names = list(kernel.arg_names)
    constants = {
        name: kwargs[name] if name in kwargs else args[names.index(name)]
        for name, param in zip(names, kernel.params, strict=True)
        if param.is_constexpr
    }
    launch = CompiledLaunch(
        kernel=kernel.fn.__name__,
        grid=tuple(int(g) for g in grid),
        constants=constants,
        num_warps=int(meta.num_warps),
        num_stages=int(meta.num_stages),
        shared_bytes=int(meta.shared),
        asm=dict(compiled.asm),
    )
    if launch.shared_bytes > _scope.spec.max_shared_bytes:
        raise RuntimeError(
            f"{launch.kernel} with {constants} needs {launch.shared_bytes} bytes of shared memory; "
            f"{_scope.spec.name} has {_scope.spec.max_shared_bytes} per block."
        )
    _scope.launches.append(launch)


def resource_usage(launch: CompiledLaunch) -> dict[str, int] | None:
    """Registers per thread and local memory (register spills) of a compiled variant, read from its
    cubin with the ``cuobjdump`` that ships with Triton; None when that tool is not installed."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(launch.asm["cubin"])
        cubin.flush()
        report = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True)
    # A line such as "  REG:95 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:672 TEXTURE:0 ...".
    for line in report.stdout.splitlines():
        fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
        if "REG" in fields and "LOCAL" in fields:
            return {"registers": int(fields["REG"]), "local_bytes": int(fields["LOCAL"])}
    raise RuntimeError(f"no resource usage for {launch.kernel} in cuobjdump's report: {report.stdout!r}")
