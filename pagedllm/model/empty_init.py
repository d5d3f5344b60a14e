"""Building a model's modules without memory or initial values: the weights come from a checkpoint.

Within :func:`empty_modules`, every parameter a module registers is moved to the ``meta`` device
(no storage) and ``torch.nn.init``'s initialisers do nothing; buffers (rotary tables) are computed
for real, on the CPU. The caller then gives the parameters storage with :func:`to_empty` and
fills them with ``load_weights``.

Why not ``with torch.device("meta")`` and ``Module.to_empty``: many operations on meta tensors
(``arange``, ``normal_``, ``empty_like``) go through torch's Python decompositions, whose first use
imports ``torch._dynamo``: over a second of every start-up.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

# The initialisers that ``torch.nn`` modules' ``reset_parameters`` call (and ours).
_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)

_lock = threading.Lock()
T = TypeVar("T", bound=nn.Module)


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _register_on_meta(original: Callable[..., None]) -> Callable[..., None]:
    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            # A parameter already on meta (a tied weight assigned again) keeps its identity.
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    return register


@contextlib.contextmanager
def empty_modules() -> Iterator[None]:
    """Within the block, modules' parameters are created on the ``meta`` device, uninitialised.

    ``nn.Module.register_parameter`` and ``torch.nn.init``'s initialisers are class and module
    attributes, patched for the block's duration under a lock: two threads building models at once
    take turns, and no other code should create modules while a model is being built.
    """
    with _lock:
        saved_init = {name: getattr(nn.init, name) for name in _INITIALISERS}
        saved_register = nn.Module.register_parameter
        for name in _INITIALISERS:
            setattr(nn.init, name, _keep)
        nn.Module.register_parameter = _register_on_meta(saved_register)  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = saved_register  # type: ignore[method-assign]
            for name, fn in saved_init.items():
                setattr(nn.init, name, fn)


def to_empty(module: T, device: torch.device | str) -> T:
    """``module`` with every parameter and buffer given fresh, uninitialised storage on ``device``
    (what ``Module.to_empty`` does, without its Python path for meta tensors)."""
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    return module


__all__ = ["empty_modules", "to_empty"]
