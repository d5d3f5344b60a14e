"""``POST /v1/chat/completions``: messages rendered with the model's chat template."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.chat_output import ChoiceDelta, ChoiceOutput
from pagedllm.entrypoints.openai.field_checks import CHAT_FIELDS
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    PromptTokenUsageInfo,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, error_from_exception
from pagedllm.entrypoints.openai.serving_generate import GenerationServing, StreamUsage
from pagedllm.entrypoints.openai.streaming import (
    SSE_DONE,
    TextChunkEvents,
    run_until_disconnected,
    sse_error,
    sse_event,
)
from pagedllm.entrypoints.openai.tool_calls import ToolPlan, plan_tools
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def _usage(out: RequestOutput) -> UsageInfo:
    """The usage of a final output."""
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    prompt_tokens = len(out.prompt_token_ids)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=out.num_cached_tokens),
    )


class OpenAIServingChat(GenerationServing):
    """Handles the chat completions endpoint.

    ``tool_parser`` and ``enable_auto_tool_choice`` serve ``tool_choice="auto"``;
    ``reasoning_parser`` splits every reply's reasoning from its content."""

    def __init__(
        self,
        *args: Any,
        tool_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_cls: type[ReasoningParser] | None = None
        self.reasoning_end_ids: list[int] = []
        if reasoning_parser is not None:
            from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

            self.reasoning_cls = get_reasoning_parser(reasoning_parser)
            self.reasoning_end_ids = list(
                self.tokenizer.encode(self.reasoning_cls.end, add_special_tokens=False)
            )

    def _reasoning_for(self, prompt_ids: list[int]) -> Callable[[], ReasoningParser] | None:
        """The reasoning parser factory for replies to ``prompt_ids`` (None without a reasoning parser)."""
        cls = self.reasoning_cls
        if cls is None:
            return None
        tail = str(self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False))
        return functools.partial(cls, tail.rstrip().endswith(cls.start))

    def _gate_constraint(
        self, params: SamplingParams, reasoning: Callable[[], ReasoningParser] | None
    ) -> SamplingParams:
        """A reply that starts in its reasoning is constrained only after the reasoning's end tag."""
        structured = params.structured_outputs
        if structured is None or reasoning is None or not reasoning().starts_in_reasoning:
            return params
        return dataclasses.replace(
            params, structured_outputs=dataclasses.replace(structured, after=self.reasoning_end_ids)
        )

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_fields(request, CHAT_FIELDS)
        self.check_engine()
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        self.check_request_modes(request)
        self.check_priority(request)
        self.check_limits(request)
        aliases = self.param_aliases(request, {"logprobs": "top_logprobs", "prompt": "messages"})
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            max_tokens = request.max_completion_tokens
            aliases["max_tokens"] = "max_completion_tokens"

        plan = plan_tools(
            request, tool_parser=self.tool_parser, enable_auto_tool_choice=self.enable_auto_tool_choice
        )
        if plan.constraint is not None:
            aliases["structured_outputs"] = "tools"
        prompt_ids = await self.preprocessor.encode_chat(
            request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=plan.template_tools,
        )
        prompt_ids = self.truncated(prompt_ids, self.truncation(request.truncate_prompt_tokens))
        max_tokens = self.check_prompt_length(len(prompt_ids), max_tokens, "messages")
        # The response echoes the client's id; the engine keys the request by one of its own, so two
        # clients sending the same id never collide.
        request_id = request.request_id or random_id("chatcmpl")
        engine_id = random_id("chatcmpl")
        if request.use_beam_search:
            if plan.mode != "none":
                raise OpenAIError(
                    "use_beam_search cannot be combined with tool calls.", param="use_beam_search"
                )
            return await self._beam_search(request, raw_request, request_id, prompt_ids, max_tokens, aliases)
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(
            request,
            max_tokens=max_tokens,
            logprobs=num_top,
            prompt_logprobs=request.prompt_logprobs,
            aliases=aliases,
        )
        if plan.constraint is not None:
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
        reasoning = self._reasoning_for(prompt_ids)
        params = self._gate_constraint(params, reasoning)

        created = int(time.time())
        return await self.generate_response(
            raw_request,
            [(engine_id, prompt_ids, params)],
            priority=request.priority,
            aliases=aliases,
            lora_request=self.lora_for(request.model),
            stream=(
                lambda outputs: self._stream(
                    request, request_id, created, len(prompt_ids), outputs[0], plan, reasoning
                )
            )
            if request.stream
            else None,
            respond=lambda finals: self._response(request, request_id, created, finals[0], plan, reasoning),
        )

    async def _beam_search(
        self,
        request: ChatCompletionRequest,
        raw_request: Request,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        aliases: dict[str, str],
    ) -> Response:
        """Beam search with ``n`` beams: ``n`` choices, best first."""
        if request.logprobs:
            raise OpenAIError("logprobs cannot be combined with use_beam_search.", param="logprobs")
        created = int(time.time())
        search = self.beam_search(
            request,
            [(None, prompt_ids)],
            max_tokens=max_tokens,
            request_id=random_id("chatcmpl"),
            aliases=aliases,
        )
        completed, outputs = await run_until_disconnected(raw_request, search)
        if not completed or outputs is None:
            return Response(status_code=499)
        sequences = outputs[0].sequences
        choices = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatResponseMessage(role="assistant", content=seq.text),
                finish_reason=seq.finish_reason,
            )
            for i, seq in enumerate(sequences)
        ]
        completion_tokens = sum(len(seq.output_token_ids) for seq in sequences)
        usage = UsageInfo(
            prompt_tokens=len(prompt_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(prompt_ids) + completion_tokens,
        )
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.reported_model(request.model),
            choices=choices,
            usage=usage,
        )
        return JSONResponse(response.model_dump())

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        final: RequestOutput,
        plan: ToolPlan,
        reasoning: Callable[[], ReasoningParser] | None,
    ) -> ChatCompletionResponse:
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            splitter = ChoiceOutput(plan.new_parser(), reasoning, parallel=plan.parallel)
            message = splitter.complete(c.text, truncated=c.finish_reason == "length")
            logprobs = None
            if request.logprobs:
                logprobs = ChatCompletionLogProbs(
                    content=self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0)
                )
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatResponseMessage(
                        role="assistant",
                        content=message.content,
                        reasoning_content=message.reasoning_content,
                        tool_calls=message.tool_calls,
                    ),
                    logprobs=logprobs,
                    # (a reply cut by max_tokens says so, with the calls completed before the cut)
                    finish_reason="tool_calls"
                    if message.tool_calls and c.finish_reason != "length"
                    else c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.reported_model(request.model),
            choices=choices,
            usage=_usage(final),
            prompt_logprobs=(
                self.prompt_logprobs(final.prompt_logprobs) if request.prompt_logprobs is not None else None
            ),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        prompt_len: int,
        outputs: AsyncIterator[RequestOutput],
        plan: ToolPlan,
        reasoning: Callable[[], ReasoningParser] | None,
    ) -> AsyncIterator[str]:
        """The events of the request's delta outputs: each choice's role first, then its new text
        (split by the tool and reasoning parsers, which keep the text they have seen), with its
        logprobs, and its finish in its last chunk."""
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(
            request.stream_options and request.stream_options.continuous_usage_stats
        )
        usage = StreamUsage([prompt_len])

        def chunk(choice: ChatCompletionResponseStreamChoice) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.reported_model(request.model),
                choices=[choice],
                usage=usage.info() if continuous else None,
            )
            return sse_event(body.model_dump_json())

        text_events = TextChunkEvents(
            lambda index, text: ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.reported_model(request.model),
                choices=[ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=text))],
            )
        )
        try:
            for i in range(request.n):
                yield chunk(
                    ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role="assistant", content="")
                    )
                )
            # Plain text streams as it is; with a tool or reasoning parser it is split first.
            splitters = (
                [ChoiceOutput(plan.new_parser(), reasoning, parallel=plan.parallel) for _ in range(request.n)]
                if plan.parser_factory is not None or reasoning is not None
                else None
            )
            async for out in outputs:
                usage.add(0, out)
                for c in out.outputs:
                    finished = c.finish_reason is not None
                    logprobs = None
                    if request.logprobs and c.token_ids:
                        logprobs = ChatCompletionLogProbs(
                            content=self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0)
                        )
                    if not (c.text or finished or logprobs is not None):
                        continue
                    finish_reason = c.finish_reason
                    if splitters is not None:
                        splitter = splitters[c.index]
                        piece = splitter.feed(c.text) if c.text else ChoiceDelta()
                        if finished:
                            last = splitter.finish(truncated=c.finish_reason == "length")
                            piece.content += last.content
                            piece.reasoning_content += last.reasoning_content
                            piece.tool_calls += last.tool_calls
                            if splitter.called_tools and c.finish_reason != "length":
                                finish_reason = "tool_calls"
                        if not (piece or finished or logprobs is not None):
                            continue
                        yield chunk(
                            ChatCompletionResponseStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(
                                    content=piece.content or None,
                                    reasoning_content=piece.reasoning_content or None,
                                    tool_calls=piece.tool_calls or None,
                                ),
                                logprobs=logprobs,
                                finish_reason=finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                        continue
                    if not (finished or continuous or logprobs is not None):
                        yield text_events.event(c.index, c.text)
                        continue
                    yield chunk(
                        ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text),
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
            if include_usage:
                final = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.reported_model(request.model),
                    choices=[],
                    usage=usage.info(),
                )
                yield sse_event(final.model_dump_json())
        except Exception as exc:  # noqa: BLE001 - reported in-band once the stream has started
            yield sse_error(error_from_exception(exc))
        yield SSE_DONE
