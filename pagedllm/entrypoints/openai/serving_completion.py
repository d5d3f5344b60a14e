"""``POST /v1/completions``: one or several prompts (text or token ids), streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    PromptTokenUsageInfo,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    context_length_error,
    error_from_exception,
)
from pagedllm.entrypoints.openai.serving_generate import GenerationServing, StreamUsage
from pagedllm.entrypoints.openai.streaming import (
    SSE_DONE,
    TextChunkEvents,
    merge_async_iterators,
    run_until_disconnected,
    sse_error,
    sse_event,
)
from pagedllm.outputs import Logprob, PromptLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class _ChoiceState:
    """What a streamed choice has sent: its echoed prompt, and its text's length (logprob offsets)."""

    text_offset: int = 0
    echoed: bool = False


class OpenAIServingCompletion(GenerationServing):
    """Handles the legacy completions endpoint."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_fields(request)
        self.check_engine()
        if request.suffix:
            raise OpenAIError("suffix is not supported.", param="suffix")
        self.check_request_modes(request)
        self.check_priority(request)
        self.check_limits(request)
        prompts = await self._prompts(request)
        aliases = self.param_aliases(request)
        base_id = request.request_id or random_id("cmpl")
        if request.use_beam_search:
            return await self._beam_search(request, raw_request, base_id, prompts, aliases)
        # Echoed prompt tokens get their log probabilities from the prompt logprobs.
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        params: list[SamplingParams] = []
        for p in prompts:
            max_tokens = self.check_prompt_length(len(p.token_ids), request.max_tokens, "prompt")
            params.append(
                self.sampling_params(
                    request,
                    max_tokens=max_tokens,
                    logprobs=request.logprobs,
                    prompt_logprobs=prompt_logprobs,
                    aliases=aliases,
                )
            )

        # The response echoes the client's id; the engine keys each prompt by an id of its own.
        engine_base = random_id("cmpl")
        requests = [
            (f"{engine_base}-{i}", p.token_ids, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        created = int(time.time())
        return await self.generate_response(
            raw_request,
            requests,
            priority=request.priority,
            aliases=aliases,
            lora_request=self.lora_for(request.model),
            stream=(lambda outputs: self._stream(request, base_id, created, prompts, outputs))
            if request.stream
            else None,
            respond=lambda finals: self._response(request, base_id, created, prompts, finals),
        )

    async def _beam_search(
        self,
        request: CompletionRequest,
        raw_request: Request,
        request_id: str,
        prompts: list[_Prompt],
        aliases: dict[str, str],
    ) -> Response:
        """Beam search with ``n`` beams per prompt: ``n`` choices per prompt, best first."""
        if request.logprobs is not None:
            raise OpenAIError("logprobs cannot be combined with use_beam_search.", param="logprobs")
        max_tokens = max(
            self.check_prompt_length(len(p.token_ids), request.max_tokens, "prompt") for p in prompts
        )
        created = int(time.time())
        search = self.beam_search(
            request,
            [(p.text, p.token_ids) for p in prompts],
            max_tokens=max_tokens,
            request_id=random_id("cmpl"),
            aliases=aliases,
        )
        completed, outputs = await run_until_disconnected(raw_request, search)
        if not completed or outputs is None:
            return Response(status_code=499)
        choices: list[CompletionResponseChoice] = []
        completion_tokens = 0
        for pi, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            prefix = self._prompt_text(prompt) if request.echo else ""
            for i, seq in enumerate(out.sequences):
                completion_tokens += len(seq.output_token_ids)
                choices.append(
                    CompletionResponseChoice(
                        index=pi * request.n + i, text=prefix + seq.text, finish_reason=seq.finish_reason
                    )
                )
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        usage = UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        response = CompletionResponse(
            id=request_id,
            created=created,
            model=self.reported_model(request.model),
            choices=choices,
            usage=usage,
        )
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------ prompts

    async def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        """The prompts as token ids; text prompts are tokenized on the tokenizer thread."""
        items = self.prompt_items(request.prompt, "prompt")
        keep = self.truncation(request.truncate_prompt_tokens)
        for item in items:
            if keep is None and not isinstance(item, str) and len(item) > self.max_model_len:
                raise context_length_error(self.max_model_len, len(item), None, "prompt")
        ids = await self.tokenize_items(items, add_special_tokens=request.add_special_tokens, param="prompt")
        prompts = []
        for item, tokens in zip(items, ids, strict=True):
            kept = self.truncated(tokens, keep)
            # A cut prompt's text is that of the tokens kept (echo shows what the model read).
            prompts.append(_Prompt(item if isinstance(item, str) and kept is tokens else None, kept))
        return prompts

    def _prompt_text(self, prompt: _Prompt, output: RequestOutput | None = None) -> str:
        if prompt.text is not None:
            return prompt.text
        if output is not None and output.prompt is not None:
            return output.prompt
        return str(self.tokenizer.decode(prompt.token_ids))

    # ------------------------------------------------------------------ full response

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: list[_Prompt],
        finals: list[RequestOutput],
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        for pi, (prompt, out) in enumerate(zip(prompts, finals, strict=True)):
            prompt_text = self._prompt_text(prompt, out) if request.echo else ""
            prompt_logprobs = (
                self.prompt_logprobs(out.prompt_logprobs) if request.prompt_logprobs is not None else None
            )
            for c in out.outputs:
                logprobs = None
                if request.logprobs is not None:
                    token_ids, steps = self._logprob_steps(
                        request, prompt, out.prompt_logprobs, c.token_ids, c.logprobs, True
                    )
                    logprobs = self.completion_logprobs(token_ids, steps, request.logprobs, 0)
                choices.append(
                    CompletionResponseChoice(
                        index=pi * request.n + c.index,
                        text=prompt_text + c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.reported_model(request.model),
            choices=choices,
            usage=self._usage(finals),
        )

    @staticmethod
    def _logprob_steps(
        request: CompletionRequest,
        prompt: _Prompt,
        prompt_logprobs: PromptLogprobs | None,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]] | None,
        with_prompt: bool,
    ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        steps: list[dict[int, Logprob] | None] = list(logprobs or [])
        if not (request.echo and with_prompt):
            return token_ids, steps
        prompt_steps: list[dict[int, Logprob] | None] = list(prompt_logprobs or [])
        prompt_steps += [None] * (len(prompt.token_ids) - len(prompt_steps))
        return prompt.token_ids + token_ids, prompt_steps[: len(prompt.token_ids)] + steps

    @staticmethod
    def _usage(outputs: list[RequestOutput]) -> UsageInfo:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(
                cached_tokens=sum(o.num_cached_tokens for o in outputs)
            ),
        )

    # ------------------------------------------------------------------ streaming

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: list[_Prompt],
        outputs: list[AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[str]:
        """The events of the requests' delta outputs: each choice's new text (after its echoed
        prompt, first), with its logprobs, and its finish in its last chunk."""
        states: dict[int, _ChoiceState] = {}
        # Each prompt's logprobs, which its first output carries (for echoed choices' logprobs).
        prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        usage = StreamUsage([0] * len(prompts))
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        continuous = include_usage and bool(
            request.stream_options and request.stream_options.continuous_usage_stats
        )
        text_events = TextChunkEvents(
            lambda index, text: CompletionStreamResponse(
                id=request_id,
                created=created,
                model=self.reported_model(request.model),
                choices=[CompletionResponseChoice(index=index, text=text)],
            )
        )
        try:
            async for pi, out in merge_async_iterators(*outputs):
                usage.add(pi, out)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[pi] = out.prompt_logprobs
                prompt = prompts[pi]
                for c in out.outputs:
                    index = pi * request.n + c.index
                    st = states.setdefault(index, _ChoiceState())
                    finished = c.finish_reason is not None
                    echo_text = ""
                    if request.echo and not st.echoed:
                        echo_text = self._prompt_text(prompt, out)
                    logprobs: CompletionLogProbs | None = None
                    if request.logprobs is not None and (c.token_ids or not st.echoed):
                        token_ids, steps = self._logprob_steps(
                            request, prompt, prompt_logprobs[pi], c.token_ids, c.logprobs, not st.echoed
                        )
                        logprobs = self.completion_logprobs(
                            token_ids, steps, request.logprobs, st.text_offset
                        )
                        if logprobs.tokens:
                            st.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                    st.echoed = True
                    if not (c.text or echo_text or finished or (logprobs is not None and logprobs.tokens)):
                        continue
                    if not (finished or continuous or logprobs is not None or echo_text):
                        yield text_events.event(index, c.text)
                        continue
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.reported_model(request.model),
                        choices=[
                            CompletionResponseChoice(
                                index=index,
                                text=echo_text + c.text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                        usage=usage.info() if continuous else None,
                    )
                    yield sse_event(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(
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
