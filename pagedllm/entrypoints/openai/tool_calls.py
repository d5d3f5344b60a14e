"""How a chat request's ``tools`` and ``tool_choice`` are served: a :class:`ToolPlan` per request.

``tool_choice`` (default ``"auto"`` when tools are declared, else ``"none"``):

* ``"none"``: the tools are not shown to the model and its output is plain content.
* ``"auto"``: the tools are rendered by the chat template; the model decides, and the server's
  ``--tool-call-parser`` finds calls in its output (needs ``--enable-auto-tool-choice`` too).
* ``"required"``: the output is constrained by a JSON-schema grammar to a non-empty array of
  ``{"name": <declared function>, "parameters": <its arguments>}`` objects (one only when
  ``parallel_tool_calls`` is false), so every call names a declared function and its arguments
  validate against that function's schema.
* a named function: the output is constrained to that function's arguments object.

The constrained forms are parsed by the two parsers below, which follow the streaming rules of
:mod:`.tool_parsers.base`: a call's id and name go out as soon as they are known, its arguments when
the call is complete, and output that does not parse (a reply cut short by ``max_tokens``) comes back
as content.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.base import (
    Bad,
    Call,
    CallObjectScanner,
    Done,
    JsonScanner,
    More,
    Skip,
    Step,
    normalize_arguments,
)
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured.schema_grammar import compact_json_ebnf

ToolMode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a chat request's tool fields make of it."""

    mode: ToolMode
    # OpenAI tool objects for the chat template's ``tools`` variable (None: render no tools).
    template_tools: list[dict[str, Any]] | None = None
    # The grammar that enforces ``required`` and named choices (None: unconstrained).
    constraint: StructuredOutputsParams | None = None
    # Makes the parser of one response's output (None: the output is plain content).
    parser_factory: Callable[[], ToolParser] | None = None
    # False: only the first call of the output is returned.
    parallel: bool = True

    def new_parser(self) -> ToolParser | None:
        return self.parser_factory() if self.parser_factory is not None else None


def plan_tools(
    request: ChatCompletionRequest, *, tool_parser: str | None, enable_auto_tool_choice: bool
) -> ToolPlan:
    """The plan for ``request``; a 400 naming the field when its tool fields cannot be served."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan(mode="none")
    if not tools:
        raise OpenAIError(f"tool_choice {_describe(choice)} needs tools to be given.", param="tool_choice")
    names = [tool.function.name for tool in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise OpenAIError(f"tools declares the function {duplicate!r} twice.", param="tools")
    if request.structured_outputs is not None or (
        request.response_format is not None and request.response_format.type != "text"
    ):
        field = "structured_outputs" if request.structured_outputs is not None else "response_format"
        raise OpenAIError(
            f'{field} cannot be combined with tool_choice {_describe(choice)}; send tool_choice "none".',
            param=field,
        )
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    parameters = {
        tool.function.name: _parameters(tool.function.parameters, i) for i, tool in enumerate(tools)
    }
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_parser):
            raise OpenAIError(
                'tool_choice "auto" needs the server to be started with --enable-auto-tool-choice and '
                "--tool-call-parser NAME (hermes, llama3_json, mistral or pythonic); "
                'tool_choice "required" or a named function work without them.',
                param="tool_choice",
            )
        parser_cls = get_tool_parser(tool_parser)
        return ToolPlan(
            mode="auto",
            template_tools=template_tools,
            parser_factory=parser_cls,
            parallel=request.parallel_tool_calls,
        )
    if choice == "required":
        schema = required_schema(parameters, parallel=request.parallel_tool_calls)
        return ToolPlan(
            mode="required",
            template_tools=template_tools,
            constraint=_constraint(schema),
            parser_factory=JsonArrayToolParser,
            parallel=request.parallel_tool_calls,
        )
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in parameters:
        raise OpenAIError(
            f"tool_choice names the function {name!r}, which tools does not declare "
            f"(declared: {', '.join(names)}).",
            param="tool_choice",
        )
    return ToolPlan(
        mode="named",
        template_tools=template_tools,
        constraint=_constraint(parameters[name]),
        parser_factory=lambda: NamedToolParser(name),
        parallel=False,
    )


def required_schema(parameters: dict[str, dict[str, Any]], *, parallel: bool) -> dict[str, Any]:
    """The JSON schema of a ``required`` reply: an array of calls to the declared functions."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in parameters.items()
    ]
    array: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": calls} if len(calls) > 1 else calls[0],
    }
    if not parallel:
        array["maxItems"] = 1
    return array


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(grammar=compact_json_ebnf(schema))
    except ValueError as exc:
        raise OpenAIError(f"tools: a function's parameters are an {exc}", param="tools") from None


def _parameters(schema: dict[str, Any] | None, index: int) -> dict[str, Any]:
    if schema is None:
        return copy.deepcopy(EMPTY_PARAMETERS)
    if schema.get("type", "object") != "object":
        raise OpenAIError(
            "function.parameters must be a JSON schema of type object.",
            param=f"tools[{index}].function.parameters",
        )
    return schema


def _describe(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"naming the function {choice.function.name!r}"
    return repr(choice).replace("'", '"')


class JsonArrayToolParser(ToolParser):
    """The ``required`` reply: ``[{"name": ..., "parameters": {...}}, ...]`` and nothing else."""

    name = "required"

    def __init__(self, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory)
        self._state: Literal["open", "item", "inside", "after"] = "open"
        self._call: CallObjectScanner | None = None

    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        return 0, 0

    def _step(self, final: bool) -> Step:
        text = self._text
        if self._state == "inside":
            assert self._call is not None
            step = self._call.step(text)
            if not isinstance(step, More):
                self._state = "after"
            return step
        i = self._skip_ws(self._pos)
        if i == len(text):
            return More()
        c = text[i]
        if self._state == "open":
            if c != "[":
                return Bad()
            self._state = "item"
            return Skip(i + 1)
        if self._state == "after":
            if c == ",":
                self._state = "item"
                return Skip(i + 1)
            if c != "]":
                return Bad()
            if text[i + 1 :].strip():
                return Bad()
            return Done() if final else More()
        if c != "{":
            return Bad()
        self._state = "inside"
        self._call = CallObjectScanner(i)
        return Skip(i)


class NamedToolParser(ToolParser):
    """A named choice's reply: the arguments object of the one function, and nothing else."""

    name = "named"

    def __init__(self, function: str, id_factory: Callable[[], str] | None = None) -> None:
        super().__init__(id_factory)
        self._function = function
        self._scanner: JsonScanner | None = None
        self._called = False

    def _fresh(self) -> ToolParser:
        return NamedToolParser(self._function, self._id_factory)

    def _locate(self, text: str, start: int, final: bool) -> tuple[int, int | None]:
        return 0, 0

    def _step(self, final: bool) -> Step:
        text = self._text
        if self._called:
            if text[self._pos :].strip():
                return Bad()
            return Done() if final else More()
        if self._scanner is None:
            i = self._skip_ws(self._pos)
            if i == len(text):
                return More(self._function)
            if text[i] != "{":
                return Bad()
            self._scanner = JsonScanner(i)
        end = self._scanner.advance(text)
        if end is None:
            return More(self._function)
        arguments = normalize_arguments(text[self._scanner.start : end])
        self._called = True
        return Bad() if arguments is None else Call(self._function, arguments, end)
