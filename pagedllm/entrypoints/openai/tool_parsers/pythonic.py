"""The pythonic format of Llama 3.2 and Llama 4: the whole output is a Python list of calls::

    [get_weather(city="Paris", unit="c"), get_time(zone="CET")]

It is parsed with :mod:`ast`, never evaluated. A call is a plain name with keyword arguments only,
whose values are literals: strings, numbers (finite; ``-`` allowed), ``True``/``False``/``None``,
lists, tuples (sent as lists) and dicts with string keys, nested. Anything else (positional arguments,
``**kwargs``, names, expressions, f-strings, bytes) is not a tool call and makes the output malformed
(see :mod:`.base`). Only output that starts (after whitespace) with ``[`` and a name followed by ``(``
is taken for tool calls; anything else is content. Only whitespace may follow the closing ``]``.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from typing import Any, Literal

from pagedllm.entrypoints.openai.tool_parsers.base import Bad, Call, Done, More, Skip, Step, ToolParser

_IDENT = r"[^\W\d]\w*"
_STARTS_CALLS = re.compile(rf"\s*\[\s*{_IDENT}\s*\(")
_MAY_START_CALLS = re.compile(rf"\s*(\[\s*({_IDENT}\s*)?)?")
_CALL_HEAD = re.compile(rf"({_IDENT})\s*\(")
_MAY_BE_HEAD = re.compile(rf"({_IDENT}\s*)?")


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    """The JSON-able value of a literal node; raises ``_NotLiteral`` for anything else."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = node.operand
        number = operand.value if isinstance(operand, ast.Constant) else None
        if type(number) in (int, float):
            assert isinstance(number, int | float)
            signed = -number if isinstance(node.op, ast.USub) else number
            if math.isfinite(signed):
                return signed
        raise _NotLiteral
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise _NotLiteral
            result[key.value] = _literal(item)
        return result
    raise _NotLiteral


def parse_call(source: str) -> tuple[str, str] | None:
    """``(name, arguments)`` for one call ``name(key=literal, ...)``, or ``None``."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        return None
    arguments: dict[str, Any] = {}
    try:
        for keyword in call.keywords:
            if keyword.arg is None:
                return None
            arguments[keyword.arg] = _literal(keyword.value)
        return call.func.id, json.dumps(arguments, ensure_ascii=False)
    except (_NotLiteral, RecursionError, ValueError):
        return None


class _CallScanner:
    """Finds the ``)`` that closes a call whose ``(`` is at ``start``, skipping Python strings (with
    triple quotes and escapes), one chunk at a time."""

    def __init__(self, start: int) -> None:
        self._i = start
        self._depth = 0
        self._quote: str | None = None

    def advance(self, text: str, final: bool) -> int | None:
        i, depth, quote = self._i, self._depth, self._quote
        end = None
        while i < len(text):
            c = text[i]
            if quote is not None:
                if c == "\\":
                    if i + 1 == len(text):
                        break  # the escaped character has not arrived
                    i += 2
                elif text.startswith(quote, i):
                    i += len(quote)
                    quote = None
                elif len(quote) == 3 and c == quote[0] and len(text) - i < 3 and not final:
                    break  # maybe the start of the closing triple quote
                else:
                    i += 1
                continue
            if c in "'\"":
                if len(text) - i < 3 and not final:
                    break  # a triple quote or not
                quote = c * 3 if text.startswith(c * 3, i) else c
                i += len(quote)
                continue
            i += 1
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth <= 0:
                    end = i
                    break
        self._i, self._depth, self._quote = i, depth, quote
        return end


class PythonicToolParser(ToolParser):
    """``[name(key=value, ...), ...]``, the whole output."""

    name = "pythonic"

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory)
        self._decided = False
        self._state: Literal["open", "call", "inside", "after", "closed"] = "open"
        self._scanner: _CallScanner | None = None
        self._call_start = 0
        self._name: str | None = None

    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        if self._decided:
            return len(text), None
        if _STARTS_CALLS.match(text):
            return 0, 0
        if not final and _MAY_START_CALLS.fullmatch(text):
            return 0, None
        self._decided = True
        return len(text), None

    def _step(self, final: bool) -> Step:
        text = self._text
        if self._state == "inside":
            assert self._scanner is not None
            end = self._scanner.advance(text, final)
            if end is None:
                return More(self._name)
            parsed = parse_call(text[self._call_start : end])
            self._state = "after"
            return Bad() if parsed is None else Call(parsed[0], parsed[1], end)
        i = self._skip_ws(self._pos)
        if self._state == "open":  # ``_locate`` saw the ``[``
            self._state = "call"
            return Skip(i + 1)
        if i == len(text):
            return Done() if final and self._state == "closed" else More()
        if self._state == "call":
            if text[i] == "]" and self._calls:  # a trailing comma
                self._state = "closed"
                return Skip(i + 1)
            head = _CALL_HEAD.match(text, i)
            if head is None:
                return More() if _MAY_BE_HEAD.fullmatch(text, i) else Bad()
            self._state = "inside"
            self._name = head.group(1)
            self._call_start = i
            self._scanner = _CallScanner(head.end() - 1)
            return Skip(head.end())
        if self._state == "after" and text[i] in ",]":
            self._state = "call" if text[i] == "," else "closed"
            return Skip(i + 1)
        return Bad()
