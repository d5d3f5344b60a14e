"""Chat templates sent by clients, rendered in a guarded sandbox, and a time limit for any template.

A request's own ``chat_template`` is template code chosen by the client; the server refuses it unless
started with ``--trust-request-chat-template``. Even then it is rendered by :class:`GuardedEnvironment`,
Jinja's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` (no access to Python internals, no
mutation of the data it is given) with the globals and filters of transformers' chat-template
environment, plus bounds: no string, list or output larger than ``max_chars``
(``'x' * 10**9``, ``~`` concatenation, widths such as ``'x'|center(10**9)`` and ``'%999999999d'`` are
refused before they allocate), and a deadline (:func:`run_with_deadline`) that stops a template's
Python code, loops included, once its time is up.

The model's own template is rendered by its tokenizer (transformers also renders in an
``ImmutableSandboxedEnvironment``) under the same deadline, limited to the template's own code.
A template that breaks a bound fails with :class:`TemplateLimitError`.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from types import FrameType
from typing import Any, TypeVar

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

T = TypeVar("T")

_TEMPLATE_FILENAME = "<template>"  # the code filename of templates compiled from strings
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# printf-style and str.format specs with a width or precision of 5+ digits, or one taken from the arguments.
_WIDE_PERCENT = re.compile(r"%[^a-zA-Z%]*(\*|\d{5,})")
_WIDE_FORMAT = re.compile(r"\{[^{}]*:[^{}]*(\d{5,}|\{)")
_MAX_INT_BITS = 4096
_MAX_JSON_INDENT = 16


class TemplateLimitError(TemplateError):
    """A chat template exceeded its time or size bounds."""


class _Deadline:
    """A trace function that raises :class:`TemplateLimitError` in the traced thread once time is up."""

    def __init__(self, seconds: float, all_frames: bool) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.all_frames = all_frames
        self.events = 0

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise TemplateLimitError(f"rendering the chat template took longer than {self.seconds:g} s")

    def on_call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.all_frames or frame.f_code.co_filename == _TEMPLATE_FILENAME:
            self.check()
            return self.on_line
        return None

    def on_line(self, frame: FrameType, event: str, arg: Any) -> Any:
        self.events += 1
        if self.events & 0x3F == 0:
            self.check()
        return self.on_line


def run_with_deadline(fn: Callable[[], T], seconds: float, *, all_frames: bool) -> T:
    """Run ``fn`` in this thread, raising :class:`TemplateLimitError` from inside it after ``seconds``.

    Only template code is interrupted (``all_frames=False``: code compiled from a template string;
    ``True``: any Python code ``fn`` runs, for templates whose filters could loop); a single long
    C call (a huge allocation) is not, which is what the size bounds of :class:`GuardedEnvironment` are for.
    """
    deadline = _Deadline(seconds, all_frames)
    previous = sys.gettrace()
    sys.settrace(deadline.on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)


class _GuardedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to a size-checked join."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.guarded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """A sandbox for untrusted chat templates in which no value or output exceeds ``max_chars``."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.max_chars = max_chars
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guard_filter("tojson", _tojson)
        env = self

        class GuardedNamespace(Namespace):
            def __init__(*args: Any, **kwargs: Any) -> None:
                self, rest = args[0], args[1:]
                attrs = dict(*rest, **kwargs)
                for name, value in attrs.items():
                    env.check_name(name)
                    env.check_size(value)
                Namespace.__init__(self, attrs)

            def __setitem__(self, name: str, value: Any) -> None:
                env.check_name(name)
                env.check_size(value)
                Namespace.__setitem__(self, name, value)

        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=lambda fmt: datetime.now().strftime(str(fmt)[:64]),
            namespace=GuardedNamespace,
        )

    # ------------------------------------------------------------------ bounds

    def refuse(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(f"the chat template {what} (limit {self.max_chars} characters)")

    def check_size(self, value: Any) -> Any:
        if isinstance(value, str | list | tuple | dict | bytes) and len(value) > self.max_chars:
            raise self.refuse(f"built a value of {len(value)} items")
        return value

    @staticmethod
    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attributes must not start with an underscore, got {name!r}")

    def _check_ints(self, values: Iterable[Any]) -> None:
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.max_chars:
                raise self.refuse(f"passed the number {v} as a size")

    def guarded_concat(self, parts: tuple[Any, ...]) -> str:
        texts = [str(p) for p in parts]
        if sum(len(t) for t in texts) > self.max_chars:
            raise self.refuse("concatenated too much text")
        return "".join(texts)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        sized = (str, list, tuple, bytes)
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, sized) and isinstance(times, int) and len(seq) * times > self.max_chars:
                raise self.refuse("repeated a value too many times")
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            if len(left) + len(right) > self.max_chars:
                raise self.refuse("concatenated too much")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * abs(left).bit_length() > _MAX_INT_BITS:
                raise self.refuse("computed too large a power")
        elif operator == "%" and isinstance(left, str) and _WIDE_PERCENT.search(left):
            raise self.refuse("formatted with too wide a field")
        return self.check_size(super().call_binop(context, operator, left, right))

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        target = getattr(obj, "__wrapped__", obj)
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str | bytes | list | tuple):
            self._check_ints([*args, *kwargs.values()])
            name = getattr(target, "__name__", "")
            if name in ("format", "format_map") and isinstance(owner, str) and _WIDE_FORMAT.search(owner):
                raise self.refuse("formatted with too wide a field")
            if name == "join" and args and hasattr(args[0], "__len__"):
                if len(owner) * len(args[0]) > self.max_chars:
                    raise self.refuse("joined too much")
            if name == "replace" and len(args) >= 2 and isinstance(owner, str):
                self._check_replace(owner, args[0], args[1])
        for value in (*args, *kwargs.values()):
            self.check_size(value)
        return self.check_size(super().call(context, obj, *args, **kwargs))

    def _check_replace(self, text: Any, old: Any, new: Any) -> None:
        text, old, new = str(text), str(old), str(new)
        if len(text) + text.count(old) * max(0, len(new) - len(old)) > self.max_chars:
            raise self.refuse("replaced text into too long a string")

    def _guard_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The filter, with size bounds on its size arguments and its result."""
        skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            value: Any = args[skip] if len(args) > skip else None
            rest = args[skip + 1 :]
            self._check_ints([*rest, *kwargs.values()])
            if name == "join":
                sep = rest[0] if rest else kwargs.get("d", "")
                if hasattr(value, "__len__") and len(value) * len(str(sep)) > self.max_chars:
                    raise self.refuse("joined too much")
            elif name == "replace" and len(rest) >= 2:
                self._check_replace(value, rest[0], rest[1])
            return self.check_size(fn(*args, **kwargs))

        return guarded

    # ------------------------------------------------------------------ rendering

    def render_chat(
        self,
        source: str,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        variables: dict[str, Any],
    ) -> str:
        """Render ``messages`` with the template ``source`` as transformers would, within the bounds."""
        template = self.from_string(source)
        if continue_final_message:
            last = messages[-1]
            final = str(last.get("content") or "")
            messages = [*messages[:-1], {**last, "content": final + _CONTINUE_TAG}]
        context = {**variables, "messages": messages, "add_generation_prompt": add_generation_prompt}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        size = 0
        pieces: list[str] = []
        for piece in template.generate(**context):
            size += len(piece)
            if size > self.max_chars:
                raise self.refuse("rendered too much text")
            pieces.append(piece)
        text = "".join(pieces)
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                raise TemplateError("the chat template drops the final message, which cannot be continued")
            end = text.rindex(tag)
            text = text[:end] if text[end:].startswith(_CONTINUE_TAG) else text[:end].rstrip()
        return text


def _raise_exception(message: Any) -> None:
    raise TemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    if indent is not None and not 0 <= int(indent) <= _MAX_JSON_INDENT:
        raise TemplateLimitError(f"tojson indent must be in [0, {_MAX_JSON_INDENT}], got {indent}")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
