"""Tokenization and chat-template rendering of requests, on worker threads instead of the event loop.

One worker thread owns a private copy of the tokenizer (a fast tokenizer must not be used by two
threads at once) and tokenizes prompts and renders the model's chat template, so a long prompt or
conversation delays no other client's stream. Chat templates sent by clients (only accepted with
``--trust-request-chat-template``) are rendered on threads of their own by
:class:`~pagedllm.entrypoints.openai.chat_template.GuardedEnvironment`. Every template rendering
is bounded in time (``chat_template_timeout``) and its output in size (``max_prompt_bytes``
characters); a template over either bound is a 400.

The threads are daemon threads: Python cannot stop a thread, and one stuck in a long C call must
not keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pagedllm.entrypoints.openai.chat_template import GuardedEnvironment, run_with_deadline
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.model.tokenizer import shipped_template_for, template_handles_tools

logger = logging.getLogger("pagedllm.entrypoints.openai")

T = TypeVar("T")

TEMPLATE_THREADS = 4
# Parameters of ``apply_chat_template`` itself, which chat_template_kwargs must not set.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)
UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. Refused "
    "request with untrusted chat template."
)


class WorkerThreads(concurrent.futures.Executor):
    """A fixed set of daemon threads, started on first use, that run submitted calls in order."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers = workers
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is shut down")
            if not self._threads:
                for i in range(self._workers):
                    thread = threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            self._jobs.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)
            else:
                future.set_result(result)
            del job, future, call

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                thread.join(1.0)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template sees them (content parts joined by newlines)."""
    if not messages:
        raise OpenAIError("messages must contain at least one message.", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        content = msg.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise OpenAIError(
                        f"Only text content parts are supported, got type {part.type!r}.",
                        param=f"messages[{i}].content",
                    )
                if part.text is None:
                    raise OpenAIError(
                        f"messages[{i}].content[{j}].text is missing: a text content part needs its text.",
                        param=f"messages[{i}].content[{j}].text",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": msg.role, "content": content if content is not None else ""}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            if msg.role != "assistant":
                raise OpenAIError(
                    "tool_calls is only allowed on assistant messages.", param=f"messages[{i}].tool_calls"
                )
            entry["tool_calls"] = [
                _template_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(msg.tool_calls)
            ]
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        if msg.role == "tool" and msg.tool_call_id is None:
            raise OpenAIError("A tool message needs tool_call_id.", param=f"messages[{i}].tool_call_id")
        if msg.reasoning_content is not None:
            entry["reasoning_content"] = msg.reasoning_content
        out.append(entry)
    return out


def _template_tool_call(call: Any, param: str) -> dict[str, Any]:
    """A history tool call as chat templates take it: ``arguments`` decoded to a dict (templates
    serialise it themselves)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise OpenAIError("function.arguments must be a JSON object string.", param=param) from None
    if not isinstance(arguments, dict):
        raise OpenAIError("function.arguments must be a JSON object string.", param=param)
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.function.name, "arguments": arguments},
    }


class Preprocessor:
    """Turns prompts and conversations into token ids off the event loop, within ``limits``."""

    def __init__(self, tokenizer: Any, limits: RequestLimits, *, trust_request_chat_template: bool) -> None:
        self.limits = limits
        self.trust_request_chat_template = trust_request_chat_template
        self._tokenizer = private_tokenizer(tokenizer)
        self._special_tokens = {
            k: v
            for k, v in dict(getattr(tokenizer, "special_tokens_map", None) or {}).items()
            if v is not None
        }
        self._tokenize_thread = WorkerThreads(1, "pagedllm-tokenize")
        self._template_threads = WorkerThreads(TEMPLATE_THREADS, "pagedllm-template")
        self._env: GuardedEnvironment | None = None

    def shutdown(self) -> None:
        self._tokenize_thread.shutdown(wait=False)
        self._template_threads.shutdown(wait=False)

    async def _on(self, threads: WorkerThreads, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(threads.submit(fn))

    # ------------------------------------------------------------------ prompts

    async def encode(self, texts: list[str], *, add_special_tokens: bool, param: str) -> list[list[int]]:
        """Token ids of each text; each must be at most ``max_prompt_bytes`` (checked first)."""
        for text in texts:
            self.limits.check_prompt_text(text, param)
        return await self._on(
            self._tokenize_thread, lambda: self._encode_all(texts, add_special_tokens, param)
        )

    async def decode(self, token_ids: list[int], vocab_size: int) -> str:
        """The text of ``token_ids`` (each checked against the vocabulary) for ``/detokenize``."""

        def decode() -> str:
            bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise OpenAIError(
                    f"tokens contains out-of-vocab token id {bad} (vocab size {vocab_size}).", param="tokens"
                )
            return str(self._tokenizer.decode(token_ids))

        return await self._on(self._tokenize_thread, decode)

    def _encode_all(self, texts: list[str], add_special_tokens: bool, param: str) -> list[list[int]]:
        return [self._encode(text, add_special_tokens, param) for text in texts]

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates the tokenizer cannot take
            raise OpenAIError(f"The {param} could not be tokenized: {exc}", param=param) from None

    # ------------------------------------------------------------------ conversations

    async def encode_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        chat_template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render the conversation with the model's (or the request's) chat template and tokenize it.

        ``tools`` (OpenAI tool objects) are passed to the template's ``tools`` variable; a template that
        does not read it is refused then, since the model would never see the tools."""
        self.limits.check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(
                "continue_final_message and add_generation_prompt cannot both be true; set "
                "add_generation_prompt to false to continue the final message.",
                param="continue_final_message",
            )
        kwargs = dict(chat_template_kwargs or {})
        from_kwargs = kwargs.pop("chat_template", None)
        source = chat_template if chat_template is not None else from_kwargs
        if source is not None and not self.trust_request_chat_template:
            raise OpenAIError(
                UNTRUSTED_TEMPLATE_MESSAGE,
                param="chat_template" if chat_template is not None else "chat_template_kwargs",
            )
        if source is not None and not isinstance(source, str):
            raise OpenAIError("chat_template must be a string.", param="chat_template_kwargs")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise OpenAIError(
                f"chat_template_kwargs must not set {', '.join(reserved)}.", param="chat_template_kwargs"
            )
        convo = conversation(messages)
        # The model's own template without a tools section: pagedllm's shipped one for it, if any.
        shipped = shipped_template_for(self._tokenizer, convo, tools) if source is None else None
        if shipped is not None:
            kwargs["chat_template"] = shipped
        if tools:
            template = source if source is not None else getattr(self._tokenizer, "chat_template", None)
            if shipped is None and not template_handles_tools(template):
                raise OpenAIError(
                    "tools: the chat template does not render tools, so the model would not see them. "
                    "Start the server with --chat-template FILE naming a template with a tools section, "
                    'or send tool_choice "none".',
                    param="tools",
                )
            kwargs["tools"] = tools
        if source is None:
            if getattr(self._tokenizer, "chat_template", None) is None:
                raise OpenAIError("This model has no chat template; use /v1/completions.", param="messages")
            return await self._on(
                self._tokenize_thread,
                lambda: self._render_own_and_encode(
                    convo, add_generation_prompt, continue_final_message, kwargs, add_special_tokens
                ),
            )
        text = await self._render_request_template(
            source, convo, add_generation_prompt, continue_final_message, kwargs
        )
        return await self._on(
            self._tokenize_thread, lambda: self._encode(text, add_special_tokens, "messages")
        )

    def _render_own_and_encode(
        self,
        convo: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any],
        add_special_tokens: bool,
    ) -> list[int]:
        if continue_final_message:
            kwargs = {**kwargs, "continue_final_message": True}

        def render() -> str:
            return str(
                self._tokenizer.apply_chat_template(
                    convo, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
                )
            )

        text = self._guard_template(
            lambda: run_with_deadline(render, self.limits.chat_template_timeout, all_frames=False)
        )
        return self._encode(text, add_special_tokens, "messages")

    async def _render_request_template(
        self,
        source: str,
        convo: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any],
    ) -> str:
        if self._env is None:
            self._env = GuardedEnvironment(self.limits.prompt_bytes)
        env, timeout = self._env, self.limits.chat_template_timeout
        variables = {**self._special_tokens, **kwargs}

        def render() -> str:
            return env.render_chat(
                source,
                convo,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                variables=variables,
            )

        job = self._template_threads.submit(
            lambda: self._guard_template(lambda: run_with_deadline(render, timeout, all_frames=True))
        )
        try:
            # The deadline stops the template's code in its thread; this bound is for a stuck C call.
            return await asyncio.wait_for(asyncio.wrap_future(job), 2 * timeout + 1.0)
        except TimeoutError:
            raise OpenAIError(
                f"Could not apply the chat template: it took longer than {timeout:g} s.", param="messages"
            ) from None

    def _guard_template(self, render: Callable[[], str]) -> str:
        """Run ``render`` (on a worker thread); any failure is the request's 400, output is bounded."""
        try:
            text = render()
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the request's fault
            raise OpenAIError(f"Could not apply the chat template: {exc}", param="messages") from None
        if len(text) > self.limits.prompt_bytes:
            raise OpenAIError(
                f"Could not apply the chat template: it rendered {len(text)} characters, more than the "
                f"{self.limits.prompt_bytes} accepted.",
                param="messages",
                code="context_length_exceeded",
            )
        return text


def private_tokenizer(tokenizer: Any) -> Any:
    """A private copy of a tokenizer for one thread.

    The engine thread detokenizes with its own tokenizer, the event loop decodes response tokens and
    the tokenizer thread encodes requests; a fast tokenizer must not be used by two threads at once.
    """
    try:
        return copy.deepcopy(tokenizer)
    except Exception as exc:  # noqa: BLE001 - an uncopyable tokenizer is shared instead
        logger.warning("Could not copy the tokenizer (%s); sharing the engine's.", exc)
        return tokenizer
