"""``/v1/responses``: OpenAI's Responses API, served as a view over a chat completion, with stored
responses.

A request becomes a chat request (:mod:`pagedllm.entrypoints.openai.responses_input`) that the chat
handler answers in process; its JSON body becomes a Response object and its server-sent chunks the
Responses events (:mod:`pagedllm.entrypoints.openai.responses_output`).

Responses are stored unless ``store`` is false (:mod:`pagedllm.entrypoints.openai.response_store`):
each with the input items it answered, so that ``previous_response_id`` continues a conversation
(the earlier input and output come before the new input; the earlier ``instructions`` do not carry
over, as in OpenAI's API), and ``GET``/``DELETE /v1/responses/{id}``, ``/input_items`` and
``/cancel`` find it through any front-end. ``background: true`` answers at once with a queued
response; a task of this front-end generates it and stores the result, polling the store so that a
cancel or delete made through another front-end stops it. ``conversation`` is refused, as are the
other fields this server cannot honour (see :func:`check_served`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.field_checks import FieldRule, check_fields
from pagedllm.entrypoints.openai.protocol_responses import (
    InputItemList,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
)
from pagedllm.entrypoints.openai.response_store import ResponseStore, owner_of
from pagedllm.entrypoints.openai.responses_input import ChatTranslation, stored_items, to_chat_request
from pagedllm.entrypoints.openai.responses_output import (
    ResponseTemplate,
    StreamTranslator,
    TranslatedStream,
    new_id,
    response_from_chat,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import error_from_exception

# Seconds between a background response's looks at the store for a cancel or delete.
CANCEL_POLL_S = 0.25

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
    if request.background:
        if request.store is False:
            raise OpenAIError(
                "background: a background response is stored to be polled; send store true or leave it out.",
                param="background",
            )
        if request.stream:
            raise OpenAIError(
                "stream: background responses are not streamed here; poll GET /v1/responses/{id}.",
                param="stream",
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
    if request.max_tool_calls is not None:
        raise OpenAIError("max_tool_calls is not supported; leave it out.", param="max_tool_calls")


# ---------------------------------------------------------------------------------------------- handler


async def _never_disconnects() -> dict[str, Any]:
    """The ``receive`` of a background response's request: its client never goes away."""
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}  # pragma: no cover - never reached


def request_owner(raw_request: Request) -> str:
    """The owner of the responses a request stores and may read: its API key's digest."""
    return owner_of(getattr(raw_request.state, "api_key", None))


def _not_found(response_id: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(
        f"Response with id {response_id!r} not found.", status_code=404, param=param, code=code
    )


class OpenAIServingResponses:
    """Handles ``/v1/responses`` through ``chat`` (the server's chat completions handler), keeping
    responses in ``store``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self._background: set[asyncio.Task[None]] = set()

    # -- creating -------------------------------------------------------------------------------

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        check_served(request)
        owner = request_owner(raw_request)
        prior = await self._prior(owner, request.previous_response_id)
        translation = to_chat_request(request, prior)
        context = prior + stored_items(request)
        defaults = self.chat.default_sampling(translation.chat)
        template = ResponseTemplate(
            id=new_id("resp"),
            created_at=int(time.time()),
            model=self.chat.model_name,
            request=request,
            temperature=float(defaults["temperature"]),
            top_p=float(defaults["top_p"]),
        )
        store = request.store is not False
        if request.background:
            queued = template.build("queued", [], None)
            await asyncio.to_thread(self.store.put, owner, queued.model_dump(mode="json"), context)
            detached = Request(raw_request.scope, receive=_never_disconnects)
            task = asyncio.create_task(self._run_background(owner, template, translation, detached))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return JSONResponse(queued.model_dump(mode="json"))
        inner = await self._chat(translation, raw_request)
        if request.stream:
            if inner.status_code != 200 or not inner.media_type or "event-stream" not in inner.media_type:
                return inner

            async def keep(final: ResponseObject) -> None:
                await asyncio.to_thread(self.store.put, owner, final.model_dump(mode="json"), context)

            translator = StreamTranslator(template, translation.param)
            return TranslatedStream(inner, translator, keep if store else None)
        if not isinstance(inner, JSONResponse) or inner.status_code != 200:
            return inner  # the client went away (499)
        response = response_from_chat(template, json.loads(bytes(inner.body))).model_dump(mode="json")
        if store:
            await asyncio.to_thread(self.store.put, owner, response, context)
        return JSONResponse(response)

    async def _prior(self, owner: str, previous_id: str | None) -> list[dict[str, Any]]:
        """The items before a request's input: the stored previous response's input and output."""
        if previous_id is None:
            return []
        previous = await asyncio.to_thread(self.store.get, owner, previous_id)
        if previous is None:
            raise OpenAIError(
                f"Previous response with id {previous_id!r} not found.",
                status_code=404,
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if previous.status not in ("completed", "incomplete"):
            raise OpenAIError(
                f"previous_response_id: response {previous_id!r} is {previous.status}; only a completed or "
                "incomplete response can be continued.",
                param="previous_response_id",
            )
        return previous.context + list(previous.response["output"])

    async def _chat(self, translation: ChatTranslation, raw_request: Request) -> Response:
        """The chat handler's answer; with ``truncation: "auto"`` input items are dropped, oldest
        first, until the rest fits."""
        request = translation.request
        while True:
            try:
                return await self.chat.create_chat_completion(translation.chat, raw_request)
            except OpenAIError as exc:
                if not (
                    request.truncation == "auto"
                    and exc.code == "context_length_exceeded"
                    and translation.drop_oldest_item()
                ):
                    raise translation.error(exc) from None

    async def _run_background(
        self, owner: str, template: ResponseTemplate, translation: ChatTranslation, raw_request: Request
    ) -> None:
        """Generate a background response and store the result, unless it is cancelled or deleted
        (through any front-end: the store is polled) first."""
        running = template.build("in_progress", [], None).model_dump(mode="json")
        if not await asyncio.to_thread(self.store.finish, owner, running):
            return
        generation = asyncio.ensure_future(self._chat(translation, raw_request))
        try:
            while not (await asyncio.wait({generation}, timeout=CANCEL_POLL_S))[0]:
                if await asyncio.to_thread(self.store.should_stop, template.id):
                    generation.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await generation
                    return
        finally:
            if not generation.done():  # this task was cancelled (the server stops)
                generation.cancel()
        try:
            inner = generation.result()
            if not isinstance(inner, JSONResponse) or inner.status_code != 200:
                raise OpenAIError(f"the chat handler answered {inner.status_code}", status_code=500)
            final = response_from_chat(template, json.loads(bytes(inner.body)))
        except Exception as exc:  # noqa: BLE001 - the failure is the stored response's error
            error = error_from_exception(exc)
            code = error.code if isinstance(error.code, str) else error.type
            final = template.build("failed", [], None, ResponseError(code=code, message=error.message))
        await asyncio.to_thread(self.store.finish, owner, final.model_dump(mode="json"))

    async def shutdown(self) -> None:
        """Stop the background responses of this front-end (the server stops)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- reading, cancelling, deleting ----------------------------------------------------------

    async def retrieve(self, response_id: str, raw_request: Request) -> Response:
        if raw_request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise OpenAIError(
                "stream: a stored response is returned whole here; leave stream out.", param="stream"
            )
        found = await asyncio.to_thread(self.store.get, request_owner(raw_request), response_id)
        if found is None:
            raise _not_found(response_id)
        return JSONResponse(found.response)

    async def input_items(self, response_id: str, raw_request: Request) -> Response:
        """OpenAI's list of the input items a response answered (``order`` desc by default,
        ``limit`` 1-100, ``after``/``before`` an item id)."""
        query = raw_request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise OpenAIError(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
        limit_text = query.get("limit", "20")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            raise OpenAIError(f"limit must be an integer in [1, 100], got {limit_text!r}.", param="limit")
        found = await asyncio.to_thread(self.store.get, request_owner(raw_request), response_id)
        if found is None:
            raise _not_found(response_id)
        items = found.context if order == "asc" else found.context[::-1]
        ids = [item["id"] for item in items]
        for name in ("after", "before"):
            anchor = query.get(name)
            if anchor is None:
                continue
            if anchor not in ids:
                raise OpenAIError(f"{name}: no input item {anchor!r} in this response.", param=name)
            cut = ids.index(anchor)
            items, ids = (items[cut + 1 :], ids[cut + 1 :]) if name == "after" else (items[:cut], ids[:cut])
        page = items[: int(limit_text)]
        listing = InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > len(page),
        )
        return JSONResponse(listing.model_dump(mode="json"))

    async def cancel(self, response_id: str, raw_request: Request) -> Response:
        # Only background responses are ever stored while running, so the store's cancel leaves any
        # other entry as it is and the check below can follow it.
        found = await asyncio.to_thread(self.store.cancel, request_owner(raw_request), response_id)
        if found is None:
            raise _not_found(response_id)
        if not found.response.get("background"):
            raise OpenAIError(
                f"Response {response_id!r} was not created in the background; only background responses "
                "can be cancelled.",
                param="response_id",
            )
        return JSONResponse(found.response)  # cancelled, or as it ended before the cancel

    async def delete(self, response_id: str, raw_request: Request) -> Response:
        if not await asyncio.to_thread(self.store.delete, request_owner(raw_request), response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
