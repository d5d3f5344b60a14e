"""What the generating endpoints (chat and completions) share: submitting their requests to the engine,
and answering with a stream of their delta outputs or with their final outputs.

A streamed response asks the engine for ``DELTA`` outputs (each holds only what is new, text held back
for a possible stop string included, see :class:`~pagedllm.sampling_params.RequestOutputKind`) and
writes each as it comes; a response that is not streamed asks for the final output only. However the
response ends (finished, failed, or the client gone), its requests are aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedllm.entrypoints.openai.protocol import PromptTokenUsageInfo, UsageInfo
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, error_from_exception
from pagedllm.entrypoints.openai.streaming import SSEResponse, merge_async_iterators, run_until_disconnected
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

Outputs = list[AsyncIterator[RequestOutput]]


class StreamUsage:
    """The token counts of a streamed response, added up from its requests' delta outputs: each
    request's prompt (``prompt_tokens``: as known before its first output) and cached prompt tokens,
    and the tokens generated so far."""

    def __init__(self, prompt_tokens: Sequence[int]) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.cached_tokens = [0] * len(self.prompt_tokens)
        self.completion_tokens = 0

    def add(self, index: int, out: RequestOutput) -> None:
        """Count request ``index``'s delta output ``out``."""
        self.prompt_tokens[index] = len(out.prompt_token_ids)
        self.cached_tokens[index] = out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=self.completion_tokens,
            total_tokens=prompt + self.completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=sum(self.cached_tokens)),
        )


async def final_outputs(iterators: Outputs) -> list[RequestOutput]:
    """The last (final) output of each request."""
    finals: list[RequestOutput | None] = [None] * len(iterators)
    async for i, out in merge_async_iterators(*iterators):
        finals[i] = out
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


class GenerationServing(OpenAIServing):
    """The base of the chat and completions handlers."""

    async def generate_response(
        self,
        raw_request: Request,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        *,
        priority: int,
        aliases: dict[str, str],
        lora_request: LoRARequest | None = None,
        stream: Callable[[Outputs], AsyncIterator[str]] | None,
        respond: Callable[[list[RequestOutput]], BaseModel],
    ) -> Response:
        """Submit ``requests`` (engine request id, prompt token ids, parameters) and answer: with
        ``stream`` given, the server-sent events it makes of the requests' outputs; else, once every
        request has finished, the JSON of ``respond`` (their final outputs), or 499 when the client
        left first. A request the engine refuses aborts those submitted and raises its error."""
        ids = [rid for rid, _, _ in requests]
        iterators: Outputs = []
        try:
            for rid, prompt_ids, params in requests:
                iterators.append(
                    await self.engine.add_request(rid, prompt_ids, params, priority, lora_request)
                )
        except Exception as exc:
            self.engine.abort(ids)
            raise error_from_exception(exc, aliases) from None
        except BaseException:
            self.engine.abort(ids)
            raise
        if stream is not None:
            return SSEResponse(stream(iterators), on_close=lambda: self.engine.abort(ids))
        try:
            completed, finals = await run_until_disconnected(raw_request, final_outputs(iterators))
        except Exception as exc:
            raise error_from_exception(exc, aliases) from None
        finally:
            self.engine.abort(ids)
        if not completed or finals is None:
            return Response(status_code=499)
        return JSONResponse(respond(finals).model_dump())


__all__ = ["GenerationServing", "Outputs", "StreamUsage", "final_outputs"]
