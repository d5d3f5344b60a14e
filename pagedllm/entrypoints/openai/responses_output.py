"""The output side of ``POST /v1/responses``: Response objects from chat completion bodies, and the
Responses events from a chat completion's server-sent chunks.

Invariants: output items come in the order reasoning, message, function calls (the tool parsers put
content before calls), and a streamed response ends with exactly the output the same request gets
answered at once (ids aside); a response is ``incomplete`` iff the chat reply finished with
``length``, and then its last item, when it is a message or reasoning, is ``incomplete`` too; the
events of a stream carry ``sequence_number`` 0, 1, 2, ... without gaps.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

from pagedllm.entrypoints.openai.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    TextConfig,
    TextFormatText,
)
from pagedllm.entrypoints.openai.serving_engine import error_from_exception


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


ItemKind = Literal["reasoning", "message", "function_call"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


@dataclass
class OutputState:
    """One output item as it is built: ``text`` is the reasoning, the message text or the arguments."""

    kind: ItemKind
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    status: ItemStatus = "in_progress"

    def model(self) -> OutputItem:
        if self.kind == "reasoning":
            return OutputReasoning(
                id=self.id, status=self.status, content=[OutputReasoningText(text=self.text)]
            )
        if self.kind == "message":
            return OutputMessage(id=self.id, status=self.status, content=[OutputText(text=self.text)])
        return OutputFunctionCall(
            id=self.id, status=self.status, call_id=self.call_id, name=self.name, arguments=self.text
        )


def new_item(kind: ItemKind, text: str = "", call_id: str = "", name: str = "") -> OutputState:
    prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
    return OutputState(kind, new_id(prefix), text, call_id, name)


def item_status(items: list[OutputState], index: int, incomplete: bool) -> ItemStatus:
    """Every item is completed, but the last message or reasoning item of an incomplete response."""
    last = index == len(items) - 1
    return "incomplete" if incomplete and last and items[index].kind != "function_call" else "completed"


def usage_from_chat(usage: dict[str, Any] | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ResponseUsage(
        input_tokens=usage["prompt_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
    )


@dataclass
class ResponseTemplate:
    """What every Response object of one request says besides its status, output and usage."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest
    temperature: float
    top_p: float

    def build(
        self,
        status: ResponseStatus,
        output: list[OutputItem],
        usage: ResponseUsage | None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        request = self.request
        text = request.text if request.text is not None else TextConfig()
        if text.format is None:
            text = TextConfig(format=TextFormatText(type="text"))
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if status == "incomplete"
            else None,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            model=self.model,
            output=output,
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            store=request.store is not False,
            background=bool(request.background),
            temperature=self.temperature,
            top_p=self.top_p,
            text=text,
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=list(request.tools or []),
            truncation=request.truncation or "disabled",
            usage=usage,
            user=request.user,
            metadata=dict(request.metadata or {}),
        )


def response_from_chat(template: ResponseTemplate, body: dict[str, Any]) -> ResponseObject:
    """The Response object of a chat completion body (one choice)."""
    choice = body["choices"][0]
    message = choice["message"]
    items: list[OutputState] = []
    if message.get("reasoning_content"):
        items.append(new_item("reasoning", message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    if content or not (items or calls):
        items.append(new_item("message", content))
    for call in calls:
        function = call["function"]
        items.append(new_item("function_call", function["arguments"], call["id"], function["name"]))
    incomplete = choice.get("finish_reason") == "length"
    for i, item in enumerate(items):
        item.status = item_status(items, i, incomplete)
    status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
    return template.build(status, [item.model() for item in items], usage_from_chat(body.get("usage")))


# ---------------------------------------------------------------------------------------------- streaming


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class StreamTranslator:
    """Turns the chat handler's stream (``data: {chunk}`` events, then ``data: [DONE]``) into the
    Responses events: ``response.created`` and ``response.in_progress`` first, the items' events as
    their pieces arrive, ``response.completed`` (or ``response.incomplete``) last; a chat error event
    becomes an ``error`` event, after which nothing more is sent.

    An item is closed when the next one opens, but the message, which stays open until the end."""

    def __init__(self, template: ResponseTemplate, param: Callable[[str | None], str | None]) -> None:
        self.template = template
        self._param = param  # the request field a chat error's param stands for
        self.items: list[OutputState] = []
        self._open: list[int] = []  # indices of the items not yet closed
        self._calls: dict[int, int] = {}  # chat tool-call index -> item index
        self._message: int | None = None
        self._sequence = 0
        self._started = False
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self.ended = False
        self.final: ResponseObject | None = None  # the response of the last event, once sent
        self._buffer = b""

    # -- input ----------------------------------------------------------------------------------

    def feed_bytes(self, data: bytes) -> str:
        """The events for the next bytes of the chat stream (events may span calls)."""
        self._buffer += data
        out: list[str] = []
        while b"\n\n" in self._buffer and not self.ended:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            for line in raw.decode("utf-8").splitlines():
                if line.startswith("data: "):
                    out.extend(self.feed(line[len("data: ") :]))
        return "".join(out)

    def feed(self, payload: str) -> list[str]:
        """The events for one chat event's data."""
        if self.ended:
            return []
        out = self._start()
        if payload == "[DONE]":
            return out + self._finish()
        chunk = json.loads(payload)
        if "error" in chunk:
            return out + self.fail(chunk["error"])
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for piece in delta.get("tool_calls") or []:
                out += self._tool_piece(piece)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
        return out

    def fail(self, error: dict[str, Any]) -> list[str]:
        """An ``error`` event (the stream ends with it)."""
        out = self._start()
        self.ended = True
        return out + [
            self._event(
                "error",
                code=error.get("code"),
                message=error.get("message", ""),
                param=self._param(error.get("param")),
            )
        ]

    # -- events ---------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(event)

    def _start(self) -> list[str]:
        if self._started:
            return []
        self._started = True
        snapshot = self.template.build("in_progress", [], None).model_dump(mode="json")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open_item(self, item: OutputState) -> list[str]:
        out: list[str] = []
        for index in list(self._open):
            if index != self._message:
                out += self._close(index, "completed")
        self.items.append(item)
        index = len(self.items) - 1
        self._open.append(index)
        out.append(self._event("response.output_item.added", output_index=index, item=self._dump(item)))
        if item.kind != "function_call":
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=self._part(item),
                )
            )
        return out

    def _text(self, kind: Literal["reasoning", "message"], delta: str) -> list[str]:
        out: list[str] = []
        index = self._message if kind == "message" else None
        if kind == "reasoning" and self._open and self.items[self._open[-1]].kind == "reasoning":
            index = self._open[-1]
        if index is None:
            out += self._open_item(new_item(kind))
            index = len(self.items) - 1
            if kind == "message":
                self._message = index
        item = self.items[index]
        item.text += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(
            self._event(name, item_id=item.id, output_index=index, content_index=0, delta=delta, **extra)
        )
        return out

    def _tool_piece(self, piece: dict[str, Any]) -> list[str]:
        out: list[str] = []
        function = piece.get("function") or {}
        position = piece["index"]
        if position not in self._calls:
            out += self._open_item(
                new_item("function_call", "", piece.get("id") or "", function.get("name", ""))
            )
            self._calls[position] = len(self.items) - 1
        index = self._calls[position]
        arguments = function.get("arguments")
        if arguments:
            item = self.items[index]
            item.text += arguments
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=index,
                    delta=arguments,
                )
            )
        return out

    def _close(self, index: int, status: ItemStatus) -> list[str]:
        self._open.remove(index)
        item = self.items[index]
        item.status = status
        out: list[str] = []
        if item.kind == "function_call":
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    arguments=item.text,
                )
            )
        else:
            done = "response.output_text.done" if item.kind == "message" else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": []} if item.kind == "message" else {}
            out.append(
                self._event(
                    done, item_id=item.id, output_index=index, content_index=0, text=item.text, **extra
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=self._part(item),
                )
            )
        out.append(self._event("response.output_item.done", output_index=index, item=self._dump(item)))
        return out

    def _finish(self) -> list[str]:
        out: list[str] = []
        if not self.items:
            out += self._open_item(new_item("message"))
            self._message = 0
        incomplete = self._finish_reason == "length"
        for index in sorted(self._open):
            out += self._close(index, item_status(self.items, index, incomplete))
        self.ended = True
        status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
        final = self.final = self.template.build(
            status, [item.model() for item in self.items], usage_from_chat(self._usage)
        )
        out.append(self._event(f"response.{status}", response=final.model_dump(mode="json")))
        return out

    @staticmethod
    def _dump(item: OutputState) -> dict[str, Any]:
        if item.status != "in_progress":
            return item.model().model_dump(mode="json")
        # An item as it opens: no content yet (the content part follows in its own event).
        body = item.model().model_dump(mode="json")
        if item.kind != "function_call":
            body["content"] = []
        return body

    @staticmethod
    def _part(item: OutputState) -> dict[str, Any]:
        if item.kind == "message":
            return OutputText(text=item.text).model_dump(mode="json")
        return OutputReasoningText(text=item.text).model_dump(mode="json")


class TranslatedStream(Response):
    """The chat handler's streaming response with its body rewritten by a :class:`StreamTranslator`.

    The chat response runs as it is (its close hook aborts the engine request however the stream
    ends); only the body messages it sends are translated. ``on_final`` gets the finished response
    before its last event is sent (so a client that reads that event finds the response stored)."""

    def __init__(
        self,
        inner: Response,
        translator: StreamTranslator,
        on_final: Callable[[ResponseObject], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(media_type="text/event-stream")
        self.inner = inner
        self.translator = translator
        self.on_final = on_final

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        translator = self.translator

        async def translated(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            more = bool(message.get("more_body", False))
            try:
                text = translator.feed_bytes(message.get("body", b""))
                if not more and not translator.ended:
                    text += "".join(translator.fail(_UNFINISHED))
            except Exception as exc:  # noqa: BLE001 - reported in-band once the stream has started
                info = error_from_exception(exc).to_body().error.model_dump()
                text = "".join(translator.fail(info)) if not translator.ended else ""
            if translator.final is not None and self.on_final is not None:
                on_final, self.on_final = self.on_final, None
                await on_final(translator.final)
            if text or not more:
                await send({"type": "http.response.body", "body": text.encode("utf-8"), "more_body": more})

        await self.inner(scope, receive, translated)


_UNFINISHED = {"message": "The stream ended before the response was complete.", "code": None, "param": None}
