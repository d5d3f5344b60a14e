"""The input side of ``POST /v1/responses``: a Responses request as the chat request that answers
it, and its input as the items stored with the response.

A request becomes a :class:`ChatCompletionRequest` (``instructions`` a leading system message, the
items of a previous response then the input items messages, flat function tools chat tools,
``text.format`` ``response_format``, ``max_output_tokens`` ``max_completion_tokens``). Errors the chat
handler raises name chat fields; :class:`ChatTranslation` renames them to the request's own
(``messages[2]`` is the item ``input[1]`` when ``instructions`` took the first message).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter

from pagedllm.entrypoints.openai.errors import OpenAIError
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
    InputItem,
    InputTextPart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
    TextFormatJsonSchema,
)
from pagedllm.entrypoints.openai.responses_output import new_id

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

    request: ResponsesRequest
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

    def drop_oldest_item(self) -> bool:
        """``truncation: "auto"``: the oldest message that came from ``input`` left out (with the tool
        results that would follow it without their call); False when only the last one is left."""
        messages = self.chat.messages
        inputs = [i for i, p in enumerate(self.message_params) if p != "instructions"]
        if len(inputs) <= 1:
            return False
        first = inputs[0]
        end = first + 1
        while end < len(messages) - 1 and messages[end].role == "tool":
            end += 1
        dropped = end - first
        del messages[first:end]
        del self.message_params[first:end]
        self.call_params = {
            (m - dropped if m >= end else m, c): item
            for (m, c), item in self.call_params.items()
            if not first <= m < end
        }
        return True

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


_ITEMS = TypeAdapter(list[InputItem])


def to_chat_request(request: ResponsesRequest, prior: list[dict[str, Any]] | None = None) -> ChatTranslation:
    """The chat request that answers ``request`` (which :func:`check_served` has accepted), after
    the items ``prior`` (a stored response's input and output, for ``previous_response_id``)."""
    convo = _Conversation()
    if request.instructions is not None:
        convo.add(ChatMessage(role="system", content=request.instructions), "instructions")
    for item in _ITEMS.validate_python(prior or []):
        convo.item(item, "previous_response_id")
    if isinstance(request.input, str):
        convo.item(MessageItem(role="user", content=request.input), "input")
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
    return ChatTranslation(request, chat, convo.params, convo.call_params)


def stored_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items OpenAI's ``input_items`` lists: each with an ``id``, a
    message's content as a list of parts (``input_text``, ``output_text`` for the assistant's)."""
    if isinstance(request.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": request.input}]
    else:
        items = [item.model_dump(mode="json", exclude_none=True) for item in request.input]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    for item in items:
        item.setdefault("type", "message")
        item.setdefault("id", new_id(prefixes[item["type"]]))
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item["content"], str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
    return items
