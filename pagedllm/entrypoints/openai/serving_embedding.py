"""``POST /v1/embeddings``: one embedding per input (texts or token ids), as floats or base64.

Served by an engine whose task is ``embed`` (``--task embed``, the default for encoder models); a
generate server answers 400 saying so, as an embed server does for the generation endpoints
(:func:`wrong_task_error`). Every input is checked (empty, token ids outside the vocabulary, longer than
the context, ``dimensions`` the model cannot give, fields this server does not implement) before any
reaches the engine; each becomes one pooling request, all submitted together so that the engine
batches them, and all aborted if one fails or the client goes away.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import AsyncLLMEngine
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

# The most inputs one request may hold (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048


def engine_task(engine: AsyncLLMEngine) -> str:
    """The task the served engine runs (``generate`` for engines that do not say)."""
    return str(getattr(engine.engine, "task", "generate"))


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

        async def run() -> list[EmbeddingRequestOutput]:
            return list(
                await asyncio.gather(
                    *(
                        self.engine.encode(rid, ids, params)
                        for rid, ids in zip(request_ids, prompts, strict=True)
                    )
                )
            )

        try:
            completed, outputs = await run_until_disconnected(raw_request, run())
        except Exception as exc:
            raise error_from_exception(exc, {"prompt": "input"}) from None
        finally:
            self.engine.abort(request_ids)  # those still queued or running (none once all are done)
        if not completed or outputs is None:
            return Response(status_code=499)
        return JSONResponse(self._response(request, prompts, outputs))

    def _pooling_params(self, request: EmbeddingRequest) -> PoolingParams:
        """The request's pooling parameters; a ``dimensions`` the model cannot give is a 400 naming it."""
        try:
            params = PoolingParams(dimensions=request.dimensions)
            config = getattr(self.engine.engine, "pooling_config", None)
            if config is not None:
                config.check(params)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="dimensions") from None
        return params

    async def _prompts(self, request: EmbeddingRequest) -> list[list[int]]:
        """Every input as token ids (texts tokenized on the tokenizer thread), each checked."""
        items = self.prompt_items(request.input, "input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise OpenAIError(
                f"input must have at most {MAX_EMBEDDING_INPUTS} entries, got {len(items)}.", param="input"
            )
        if any(len(item) == 0 for item in items):
            raise OpenAIError("input must not contain empty strings or empty token lists.", param="input")
        prompts = await self.tokenize_items(
            items, add_special_tokens=request.add_special_tokens, param="input"
        )
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
