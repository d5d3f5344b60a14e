"""No request field is silently ignored: a field the server does not declare is a 400 naming it,
unless it is an OpenAI field whose documented meaning holds here (listed below, with the values the
server can honour).

Request models accept unknown fields at parse time (``extra="allow"``) so that this check, not
pydantic, decides, and so that it can name the field with its full path (``messages[2].refusal``).
A ``null`` unknown field inside a nested object is accepted: clients that send a previous response's
message back in the history include OpenAI's ``null`` fields (``refusal``, ``annotations``,
``audio``, ``function_call``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import OpenAIError

# An OpenAI field the request model does not declare: the problem with its value, or None when the
# server honours it as documented.
FieldRule = Callable[[Any], str | None]


def _refused_unless(accepted: Callable[[Any], bool], reason: str) -> FieldRule:
    return lambda value: None if accepted(value) else reason


def _always(value: Any) -> str | None:
    return None


# Chat completion fields of OpenAI's API that the chat request model does not declare.
CHAT_FIELDS: dict[str, FieldRule] = {
    "functions": _refused_unless(
        lambda v: not v, "functions is deprecated and not supported; send tools instead."
    ),
    "function_call": _refused_unless(
        lambda v: v in (None, "none", "auto"),
        "function_call is deprecated and not supported; send tool_choice instead.",
    ),
    "audio": _refused_unless(lambda v: v is None, "audio output is not supported."),
    "modalities": _refused_unless(
        lambda v: v in (None, ["text"]), 'only the modality ["text"] is supported.'
    ),
    "store": _refused_unless(lambda v: not v, "completions are not stored by this server; send store false."),
    "metadata": _refused_unless(
        lambda v: not v, "metadata is kept with stored completions, and this server stores none."
    ),
    "prediction": _refused_unless(lambda v: v is None, "predicted outputs are not supported."),
    "reasoning_effort": _refused_unless(
        lambda v: v is None, "reasoning_effort is not configurable on this server."
    ),
    "verbosity": _refused_unless(lambda v: v is None, "verbosity is not configurable on this server."),
    "web_search_options": _refused_unless(lambda v: v is None, "web search is not available."),
    "service_tier": _refused_unless(
        lambda v: v in (None, "auto", "default"), 'service_tier must be "auto" or "default" on this server.'
    ),
    # Identifiers and hints with no effect on the answer: prefix caching is automatic here.
    "prompt_cache_key": _always,
    "safety_identifier": _always,
}


def check_fields(request: BaseModel, documented: dict[str, FieldRule] | None = None) -> None:
    """Raise a 400 naming the first field of ``request`` that the server would otherwise ignore."""
    documented = documented or {}
    for name, value in sorted((request.model_extra or {}).items()):
        rule = documented.get(name)
        if rule is None:
            raise OpenAIError(_unknown(name), param=name)
        problem = rule(value)
        if problem is not None:
            raise OpenAIError(f"{name}: {problem}", param=name)
    for path, value in _nested_extras(request, ""):
        if value is not None:
            raise OpenAIError(_unknown(path), param=path)


def _unknown(path: str) -> str:
    return f"{path}: unknown field; this server does not implement it (remove it from the request)."


def _nested_extras(model: BaseModel, prefix: str) -> list[tuple[str, Any]]:
    """``(path, value)`` of every unknown field below ``model`` (its own are not included)."""
    found: list[tuple[str, Any]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if not isinstance(item, BaseModel):
                continue
            path = f"{prefix}{name}" if index is None else f"{prefix}{name}[{index}]"
            extras = item.audited_extras() if hasattr(item, "audited_extras") else item.model_extra
            found += [(f"{path}.{key}", v) for key, v in sorted((extras or {}).items())]
            found += _nested_extras(item, path + ".")
    return found
