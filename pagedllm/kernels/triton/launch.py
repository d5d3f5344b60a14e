"""Launching Triton kernels anywhere: compiled on a GPU, interpreted on CPU tensors, compiled for a
target GPU on meta tensors (inside :func:`pagedllm.kernels.triton.aot.compile_for`).

Every Triton kernel of the engine is launched through :func:`launch`, so the interpreter (how CI tests
the kernels without a GPU) and the ahead-of-time compile path need no code of their own per kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
import triton


@functools.cache
def _interpreted(fn: Any) -> Any:
    """An interpreted twin of a ``@triton.jit`` function."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def is_interpreted(kernel: Any, device: torch.device) -> bool:
    """Whether launching ``kernel`` on ``device`` runs the Triton interpreter."""
    return device.type == "cpu" or not isinstance(kernel, triton.runtime.JITFunction)


@contextlib.contextmanager
def _interpreter_scope() -> Iterator[None]:
    """Settings for running our kernels in the interpreter.

    * Library functions (``tl.max``, ``tl.sum``) are decorated when triton is imported; if
      ``TRITON_INTERPRET`` was not set then, they are compiled-only objects that refuse direct calls.
      Route such calls to interpreted twins, undoing each call's patches of ``triton.language`` when it
      returns so compiled kernels are unaffected afterwards.
    * Skip the interpreter's integer-overflow checks (compiled kernels only check them in debug
      builds); they make up about a third of the interpretation cost.
    """
    from triton.runtime import interpreter

    jit_cls = triton.runtime.JITFunction
    original_call = jit_cls.__call__
    builder = interpreter.interpreter_builder
    original_options = builder.options

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        scope = interpreter._patch_lang(self.fn)
        try:
            return _interpreted(self.fn).rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    jit_cls.__call__ = call  # type: ignore[method-assign]
    builder.options = dataclasses.replace(original_options, sanitize_overflow=False)
    try:
        yield
    finally:
        jit_cls.__call__ = original_call  # type: ignore[method-assign]
        builder.options = original_options


def launch(kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel``: compiled on GPUs, interpreted on CPU tensors whatever ``TRITON_INTERPRET`` says.

    On meta tensors nothing runs; inside :func:`pagedllm.kernels.triton.aot.compile_for` the kernel
    is compiled for that scope's GPU.
    """
    if device.type == "meta":
        from pagedllm.kernels.triton import aot as triton_aot  # not needed on the GPU path

        triton_aot.compile_launch(kernel, grid, *args, **kwargs)
        return
    if not is_interpreted(kernel, device):
        kernel[grid](*args, **kwargs)
        return
    if isinstance(kernel, triton.runtime.JITFunction):
        kernel = _interpreted(kernel.fn)
    with _interpreter_scope():
        kernel[grid](*args, **kwargs)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU ``device`` (meta: the GPU being compiled for)."""
    if device.type == "meta":
        from pagedllm.kernels.triton import aot as triton_aot

        return (triton_aot.current_spec() or triton_aot.H200).num_sms
    return _cuda_num_sms(device.index or 0)


@functools.cache
def _cuda_num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it whose last dimension has unit stride (what the kernels index)."""
    return x if x.stride(-1) == 1 else x.contiguous()
