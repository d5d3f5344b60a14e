"""Pooling (embedding) requests of an engine run with ``task="embed"``: validation and outputs.

A pooling request is a prompt and :class:`~pagedllm.pooling_params.PoolingParams`. It becomes one
:class:`~pagedllm.request.Request` that the scheduler admits whole (never in chunks) under the usual
budgets; the step that computes it pools its final hidden states, and the request finishes there,
its KV blocks (a decoder's) freed at once. Nothing is sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedllm.engine.engine_checks import check_new_request_id
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.errors import RequestError, context_length_error
from pagedllm.model.pooling import PoolingConfig, finish_embeddings
from pagedllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestMetrics
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

# A pooling request samples nothing: it carries these defaults, which nothing reads.
_NO_SAMPLING = SamplingParams(max_tokens=1)


def resolve_task(requested: str, encoder: bool, model: str) -> str:
    """The engine's task: ``requested`` (``auto``, ``generate`` or ``embed``) for a model that is an
    encoder or not. ``auto`` gives ``embed`` for encoders and ``generate`` for decoders; an encoder
    cannot generate (ValueError naming ``task``)."""
    if requested == "auto":
        return "embed" if encoder else "generate"
    if requested == "generate" and encoder:
        raise ValueError(
            f"task 'generate' is not possible with {model}: it is an encoder (BERT) that only embeds; "
            "use task='embed' (--task embed)."
        )
    return requested


@dataclass(frozen=True)
class PoolingLimits:
    """What a pooled prompt must fit: the context, and (decoders) the KV pool."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int | None  # None: the model keeps no KV cache (an encoder)


class PoolingProcessor:
    """The pooling requests queued or running in the engine (``requests``, by id)."""

    def __init__(self, input_processor: InputProcessor, config: PoolingConfig, limits: PoolingLimits) -> None:
        self.input_processor = input_processor
        self.config = config
        self.limits = limits
        self.requests: dict[str, Request] = {}

    def make_request(
        self, request_id: str, prompt: str | list[int], params: PoolingParams, arrival_time: float | None
    ) -> Request:
        """Validate a pooling request and build it (registered here; the caller queues it).

        Raises ValueError naming the problem (empty prompt, token ids outside the vocabulary, a prompt
        longer than the context or the KV pool, ``dimensions`` the model cannot give), changing nothing.
        """
        check_new_request_id(request_id, self.requests)
        text, ids = self.input_processor.tokenize(prompt)
        self.config.check(params)
        limits = self.limits
        if len(ids) > limits.max_model_len:
            raise context_length_error(
                "prompt",
                f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
                f"request has {len(ids)} input tokens. Please reduce the length of the input.",
            )
        if limits.num_kv_blocks is not None and -(-len(ids) // limits.block_size) > limits.num_kv_blocks:
            raise RequestError(
                "prompt",
                f"prompt of {len(ids)} tokens needs more KV cache than the engine has ({limits.num_kv_blocks} "
                f"blocks of {limits.block_size} tokens).",
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=_NO_SAMPLING,
            max_tokens=1,
            eos_token_ids=[],
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            prompt=text,
            parent_id=request_id,
            pooling_params=params,
        )
        self.requests[request_id] = request
        return request

    def outputs(self, requests: list[Request], pooled: torch.Tensor) -> list[EmbeddingRequestOutput]:
        """The final outputs of finished ``requests`` (row i of ``pooled`` is request i's), which are
        forgotten here."""
        params = [r.pooling_params or PoolingParams() for r in requests]
        vectors = finish_embeddings(pooled, params, self.config)
        now = time.monotonic()
        outputs = []
        for request, vector in zip(requests, vectors, strict=True):
            del self.requests[request.request_id]
            metrics = RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=now,
                last_token_time=now,
                finished_time=now,
            )
            outputs.append(
                EmbeddingRequestOutput(
                    request_id=request.request_id,
                    prompt=request.prompt,
                    prompt_token_ids=request.prompt_token_ids,
                    outputs=EmbeddingOutput(vector),
                    finished=True,
                    metrics=metrics,
                )
            )
        return outputs
