"""``POST /v1/embeddings``: one embedding per input (texts or token ids), as floats or base64.

Served by an engine whose task is ``embed`` (``--task embed``, the default for encoder models); a
generate server answers 400 saying so, as an embed server does for the generation endpoints
(:func:`wrong_task_error`). Every input is checked (at most ``--max-embedding-inputs`` of them, empty,
token ids outside the vocabulary, longer than the context, ``dimensions`` the model cannot give, fields
this server does not implement) before any reaches the engine; each becomes one pooling request, and
all are aborted if one fails or the client goes away.

Fair share: a request's inputs reach the engine through a window (:class:`EncodeWindow`) of about two
engine steps' worth, topped up as they finish, never all at once. The engine keeps busy (one step's
worth runs while the next waits), and a request arriving meanwhile queues behind at most that window
of each large request instead of behind all of its inputs, so it is served within a few steps. An
input's embedding does not depend on what else is in its step, so the results are those of computing
each input alone, in the order of ``input``.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_client import AsyncEngineClient
from pagedllm.engine.errors import RequestError
from pagedllm.engine.proc.async_mp_engine import AsyncMPEngine
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_embedding import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    context_length_error,
    error_from_exception,
)
from pagedllm.entrypoints.openai.streaming import run_until_disconnected
from pagedllm.outputs import EmbeddingRequestOutput
from pagedllm.pooling_params import PoolingParams

# Engine steps' worth of one request's inputs that the engine holds at once (see EncodeWindow).
WINDOW_STEPS = 2


@dataclass(frozen=True)
class EncodeWindow:
    """The most of one request's inputs in the engine at once (submitted and not finished): at most
    ``max_inputs`` of them and ``max_tokens`` tokens, but always at least one input."""

    max_inputs: int
    max_tokens: int

    @classmethod
    def for_engine(cls, engine: AsyncEngineClient) -> EncodeWindow:
        """``WINDOW_STEPS`` steps of the engine's budgets (``max_num_seqs`` prompts,
        ``max_num_batched_tokens`` tokens), for each engine core that serves it."""
        info = engine.info
        cores = len(engine.client.ranks) if isinstance(engine, AsyncMPEngine) else 1
        seqs = info.max_num_seqs or 256  # 0: an engine that states no limit
        tokens = info.max_num_batched_tokens or info.max_model_len
        return cls(WINDOW_STEPS * cores * seqs, WINDOW_STEPS * cores * tokens)

    def admits(self, num_inputs: int, num_tokens: int, prompt_len: int) -> bool:
        """Whether one more input of ``prompt_len`` tokens fits beside ``num_inputs`` inputs of
        ``num_tokens`` tokens in the engine."""
        if num_inputs == 0:
            return True
        return num_inputs < self.max_inputs and num_tokens + prompt_len <= self.max_tokens


def engine_task(engine: AsyncEngineClient) -> str:
    """The task the served engine runs (``generate`` for engines that do not say)."""
    return engine.info.task


def wrong_task_error(task: str, endpoint: str) -> OpenAIError:
    """The 400 of an endpoint that the server's task does not serve."""
    needed = "embed" if task == "generate" else "generate"
    return OpenAIError(
        f"This server runs task '{task}', which does not serve {endpoint}: start it with --task {needed} "
        f"(and a model that can {needed}).",
        code="wrong_task",
    )


class OpenAIServingEmbedding(OpenAIServing):
    """Handles the embeddings endpoint."""

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        task = engine_task(self.engine)
        if task != "embed":
            raise wrong_task_error(task, "/v1/embeddings")
        unknown = request.unknown_fields
        if unknown:
            raise OpenAIError(
                f"Unknown field(s) {', '.join(unknown)}: /v1/embeddings does not implement them.",
                param=unknown[0],
            )
        self.check_engine()
        params = self._pooling_params(request)
        prompts = await self._prompts(request)
        base_id = random_id("embd")
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]

        try:
            completed, outputs = await run_until_disconnected(
                raw_request, self._encode_all(request_ids, prompts, params)
            )
        except Exception as exc:
            raise error_from_exception(exc, {"prompt": "input"}) from None
        finally:
            self.engine.abort(request_ids)  # those still queued or running (none once all are done)
        if not completed or outputs is None:
            return Response(status_code=499)
        return JSONResponse(self._response(request, prompts, outputs))

    async def _encode_all(
        self, request_ids: list[str], prompts: list[list[int]], params: PoolingParams
    ) -> list[EmbeddingRequestOutput]:
        """The embeddings of ``prompts``, in their order, with at most a window of them in the engine
        at once (submitted in order as earlier ones finish). The first failure is raised; the inputs
        still in the engine are then aborted by the caller."""
        window = EncodeWindow.for_engine(self.engine)
        results: list[EmbeddingRequestOutput | None] = [None] * len(prompts)
        running: dict[asyncio.Task[EmbeddingRequestOutput], int] = {}
        num_tokens = 0
        next_input = 0
        try:
            while next_input < len(prompts) or running:
                while next_input < len(prompts) and window.admits(
                    len(running), num_tokens, len(prompts[next_input])
                ):
                    ids = prompts[next_input]
                    task = asyncio.create_task(self.engine.encode(request_ids[next_input], ids, params))
                    running[task] = next_input
                    num_tokens += len(ids)
                    next_input += 1
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                failure: BaseException | None = None
                for finished in done:
                    i = running.pop(finished)
                    num_tokens -= len(prompts[i])
                    error = finished.exception()  # retrieved for every task, so none goes unreported
                    if error is None:
                        results[i] = finished.result()
                    elif failure is None:
                        failure = error
                if failure is not None:
                    raise failure
        finally:
            for task in running:
                task.cancel()  # its encode() aborts its request
        assert all(r is not None for r in results), "an input has no embedding"
        return [r for r in results if r is not None]

    def _pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        """The request's pooling parameters; a ``dimensions`` the model cannot give is a 400 naming it."""
        try:
            params = PoolingParams(dimensions=request.dimensions)
            config = self.engine.info.pooling_config
            if config is not None:
                config.check(params)
        except ValueError as exc:  # the model's own check of dimensions names no field
            raise error_from_exception(RequestError("dimensions", str(exc))) from None
        return params

    async def _prompts(self, request: EmbeddingRequest) -> list[list[int]]:
        """Every input as token ids (texts tokenized on the tokenizer thread), each checked."""
        items = self.prompt_items(request.input, "input")
        most = self.limits.max_embedding_inputs
        if len(items) > most:
            raise OpenAIError(
                f"input must have at most {most} entries (--max-embedding-inputs), got {len(items)}.",
                param="input",
            )
        if any(len(item) == 0 for item in items):
            raise OpenAIError("input must not contain empty strings or empty token lists.", param="input")
        keep = self.truncation(request.truncate_prompt_tokens)
        prompts = [
            self.truncated(ids, keep)
            for ids in await self.tokenize_items(
                items, add_special_tokens=request.add_special_tokens, param="input"
            )
        ]
        for ids in prompts:
            if not ids:
                raise OpenAIError("input holds a text that tokenizes to no tokens.", param="input")
            if len(ids) > self.max_model_len:
                raise context_length_error(self.max_model_len, len(ids), None, "input")
        return prompts

    def _response(
        self, request: EmbeddingRequest, prompts: list[list[int]], outputs: list[EmbeddingRequestOutput]
    ) -> dict[str, Any]:
        data = []
        for i, out in enumerate(outputs):
            vector = out.outputs.embedding
            embedding: list[float] | str = vector
            if request.encoding_format == "base64":
                embedding = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
            data.append(EmbeddingData(index=i, embedding=embedding))
        tokens = sum(len(ids) for ids in prompts)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(data=data, model=self.model_name, usage=usage).model_dump()
