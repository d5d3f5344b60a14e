"""``POST /v1/responses``: OpenAI's Responses API, stateless, served as a view over a chat completion.

A request becomes a :class:`ChatCompletionRequest` (``instructions`` a leading system message, input
items messages, flat function tools chat tools, ``text.format`` ``response_format``,
``max_output_tokens`` ``max_completion_tokens``) that the chat handler answers in process. Its JSON
body becomes a Response object; its server-sent chunks become the Responses events. Errors the chat
handler raises name chat fields; they are renamed to the request's own (``messages[2]`` is the item
``input[1]`` when ``instructions`` took the first message).

Nothing is kept: ``previous_response_id``, ``store: true``, ``background: true`` and ``conversation``
are refused, as are the other fields this server cannot honour (see :func:`check_served`).

The Response objects and events are built by :mod:`pagedllm.entrypoints.openai.responses_output`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.field_checks import FieldRule, check_fields
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    ChatToolCall,
    FunctionCallModel,
    FunctionDefinition,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
)
from pagedllm.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputTextPart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
    TextFormatJsonSchema,
)
from pagedllm.entrypoints.openai.responses_output import (
    ResponseTemplate,
    StreamTranslator,
    TranslatedStream,
    new_id,
    response_from_chat,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

# ---------------------------------------------------------------------------------------------- refusals


def _unless(accepted: Callable[[Any], bool], reason: str) -> FieldRule:
    return lambda value: None if accepted(value) else reason


# Responses fields of OpenAI's API that the request model does not declare: None when the server
# honours the value as documented, else why not.
RESPONSES_FIELDS: dict[str, FieldRule] = {
    # Identifiers and caching hints with no effect on the answer: prefix caching is automatic here.
    "prompt_cache_key": lambda value: None,
    "prompt_cache_retention": lambda value: None,
    "safety_identifier": lambda value: None,
    "service_tier": _unless(
        lambda v: v in (None, "auto", "default"), 'service_tier must be "auto" or "default" on this server.'
    ),
    "prompt": _unless(lambda v: v is None, "prompt templates are not kept by this server; send input."),
    "top_logprobs": _unless(lambda v: v is None, "logprobs are not included in responses by this server."),
    "stream_options": _unless(lambda v: v is None, "stream options are not supported."),
    "context_management": _unless(lambda v: v is None, "context management is not supported."),
}


def check_served(request: ResponsesRequest) -> None:
    """A 400 naming the field for what this stateless server does not do (unknown fields, with their
    path inside items, included)."""
    check_fields(request, RESPONSES_FIELDS)
    if request.previous_response_id is not None:
        raise OpenAIError(
            "previous_response_id: responses are not kept by this server (it stores nothing); send the "
            "whole conversation in input.",
            param="previous_response_id",
        )
    if request.store:
        raise OpenAIError("store: responses are not stored; send store false.", param="store")
    if request.background:
        raise OpenAIError(
            "background: responses are not run in the background (nothing is kept to poll); send background "
            "false.",
            param="background",
        )
    if request.conversation is not None:
        raise OpenAIError(
            "conversation: conversations are not kept by this server; send the whole conversation in input.",
            param="conversation",
        )
    if request.include:
        raise OpenAIError(
            f"include: this server cannot include {request.include[0]!r} (it includes nothing).",
            param="include",
        )
    if request.reasoning is not None:
        if request.reasoning.effort is not None:
            raise OpenAIError(
                "reasoning.effort: the reasoning effort is not configurable here; leave it out.",
                param="reasoning.effort",
            )
        if request.reasoning.summary is not None or request.reasoning.generate_summary is not None:
            raise OpenAIError(
                "reasoning.summary: reasoning is not summarized here; the reasoning item carries the text.",
                param="reasoning.summary",
            )
    if request.text is not None and request.text.verbosity is not None:
        raise OpenAIError("text.verbosity is not configurable here; leave it out.", param="text.verbosity")
    if request.truncation == "auto":
        raise OpenAIError(
            'truncation "auto" is not supported: an input longer than the context is refused.',
            param="truncation",
        )
    if request.max_tool_calls is not None:
        raise OpenAIError("max_tool_calls is not supported; leave it out.", param="max_tool_calls")


# ---------------------------------------------------------------------------------------------- requests

# Chat fields named by the chat handler's errors, as this request names them.
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "structured_outputs": "text.format",
    "prompt": "input",
}
_MESSAGE_PARAM = re.compile(r"^messages(?:\[(\d+)\](?:\.tool_calls\[(\d+)\])?)?")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function(\.\S*)?$")


@dataclass
class ChatTranslation:
    """A Responses request as a chat request, with the request field each chat message came from."""

    chat: ChatCompletionRequest
    # Per chat message: "instructions", "input" (a string input) or "input[i]" (its first item).
    message_params: list[str]
    # (chat message, tool call) -> the function_call item it came from.
    call_params: dict[tuple[int, int], str] = field(default_factory=dict)

    def param(self, name: str | None) -> str | None:
        """The request field a chat field name stands for."""
        if name is None:
            return None
        m = _MESSAGE_PARAM.match(name)
        if m is not None:
            if m.group(1) is None:
                return "input"
            index = int(m.group(1))
            if m.group(2) is not None:
                return self.call_params.get((index, int(m.group(2))), "input")
            return self.message_params[index] if index < len(self.message_params) else "input"
        m = _TOOL_PARAM.match(name)
        if m is not None:
            return f"tools[{m.group(1)}]{m.group(2) or ''}"
        return _RENAMED.get(name, name)

    def error(self, exc: OpenAIError) -> OpenAIError:
        """``exc`` (from the chat handler) naming this request's fields."""
        old = exc.param
        exc.param = self.param(old)
        if old is not None and exc.param != old and exc.message.startswith(old):
            exc.message = str(exc.param) + exc.message[len(old) :]
        for chat_name in ("max_completion_tokens", "max_tokens"):
            if exc.message.startswith(chat_name + " "):
                exc.message = "max_output_tokens" + exc.message[len(chat_name) :]
        return exc


def _text(content: str | list[InputTextPart]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class _Conversation:
    """Chat messages built from input items: consecutive function calls (and the assistant message
    just before them) make one assistant message; a reasoning item becomes the reasoning of the
    assistant turn that follows it."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.params: list[str] = []
        self.call_params: dict[tuple[int, int], str] = {}
        self._call_ids: set[str] = set()
        self._reasoning: tuple[str, str] | None = None  # (text, item) waiting for its assistant turn

    def add(self, message: ChatMessage, param: str) -> None:
        self.messages.append(message)
        self.params.append(param)

    def item(
        self,
        item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
        param: str,
    ) -> None:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            text = "\n".join(part.text for part in parts)
            if self._reasoning is not None:
                text = self._reasoning[0] + "\n" + text
            self._reasoning = (text, param)
            return
        if isinstance(item, FunctionCallItem):
            self._call(item, param)
            return
        if isinstance(item, MessageItem) and item.role == "assistant":
            self.add(
                ChatMessage(role="assistant", content=_text(item.content), reasoning_content=self._take()),
                param,
            )
            return
        self._no_reasoning()
        if isinstance(item, MessageItem):
            self.add(ChatMessage(role=item.role, content=_text(item.content)), param)
            return
        if item.call_id not in self._call_ids:
            raise OpenAIError(
                f"{param}.call_id: no function_call item before this output has call_id {item.call_id!r}.",
                param=f"{param}.call_id",
            )
        self.add(ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)), param)

    def finish(self) -> None:
        self._no_reasoning()

    def _call(self, item: FunctionCallItem, param: str) -> None:
        call = ChatToolCall(
            id=item.call_id, function=FunctionCallModel(name=item.name, arguments=item.arguments)
        )
        self._call_ids.add(item.call_id)
        last = self.messages[-1] if self.messages else None
        if (
            self._reasoning is None
            and last is not None
            and last.role == "assistant"
            and self.params[-1] != "instructions"
        ):
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            self.add(ChatMessage(role="assistant", tool_calls=[call], reasoning_content=self._take()), param)
        self.call_params[(len(self.messages) - 1, len(self.messages[-1].tool_calls or []) - 1)] = param

    def _take(self) -> str | None:
        text = self._reasoning[0] if self._reasoning is not None else None
        self._reasoning = None
        return text

    def _no_reasoning(self) -> None:
        if self._reasoning is not None:
            raise OpenAIError(
                f"{self._reasoning[1]} is a reasoning item, which must be followed by an assistant message "
                "or a function_call item.",
                param=self._reasoning[1],
            )


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if isinstance(fmt, TextFormatJsonSchema):
        spec = JsonSchemaSpec(
            name=fmt.name, schema=fmt.json_schema, description=fmt.description, strict=fmt.strict
        )
        return ResponseFormat(type="json_schema", json_schema=spec)
    return ResponseFormat(type=fmt.type)


def to_chat_request(request: ResponsesRequest) -> ChatTranslation:
    """The chat request that answers ``request`` (which :func:`check_served` has accepted)."""
    convo = _Conversation()
    if request.instructions is not None:
        convo.add(ChatMessage(role="system", content=request.instructions), "instructions")
    if isinstance(request.input, str):
        convo.add(ChatMessage(role="user", content=request.input), "input")
    else:
        for i, item in enumerate(request.input):
            convo.item(item, f"input[{i}]")
        convo.finish()
    tools = None
    if request.tools is not None:
        tools = [
            ChatTool(
                type="function",
                function=FunctionDefinition(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    strict=tool.strict,
                ),
            )
            for tool in request.tools
        ]
    choice = request.tool_choice
    chat_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = (
        NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        if isinstance(choice, FunctionToolChoice)
        else choice
    )
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": convo.messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "priority": request.priority,
        "stream": request.stream,
        "stream_options": StreamOptions(include_usage=True) if request.stream else None,
        "tools": tools,
        "tool_choice": chat_choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _response_format(request.text),
        "user": request.user,
    }
    chat = ChatCompletionRequest.model_validate(fields)
    return ChatTranslation(chat, convo.params, convo.call_params)


# ---------------------------------------------------------------------------------------------- handler


class OpenAIServingResponses:
    """Handles ``POST /v1/responses`` through ``chat`` (the server's chat completions handler)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        check_served(request)
        translation = to_chat_request(request)
        defaults = self.chat.default_sampling(translation.chat)
        template = ResponseTemplate(
            id=new_id("resp"),
            created_at=int(time.time()),
            model=self.chat.model_name,
            request=request,
            temperature=float(defaults["temperature"]),
            top_p=float(defaults["top_p"]),
        )
        try:
            inner = await self.chat.create_chat_completion(translation.chat, raw_request)
        except OpenAIError as exc:
            raise translation.error(exc) from None
        if request.stream:
            if inner.status_code != 200 or not inner.media_type or "event-stream" not in inner.media_type:
                return inner
            return TranslatedStream(inner, StreamTranslator(template, translation.param))
        if not isinstance(inner, JSONResponse) or inner.status_code != 200:
            return inner  # the client went away (499)
        body = json.loads(bytes(inner.body))
        return JSONResponse(response_from_chat(template, body).model_dump(mode="json"))
