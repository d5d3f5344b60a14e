"""Turning a client's prompt and sampling parameters into validated engine requests.

:meth:`InputProcessor.process` tokenizes the prompt, checks every limit (vocabulary, context length,
KV cache size, logprob counts), compiles a structured-output grammar if one is asked for, and builds
the request's ``n`` sequences. It raises :class:`~pagedllm.errors.RequestError` naming the field and changes no engine
state, so a rejected request leaves nothing behind.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.errors import RequestError, context_length_error
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora_request import LoRARequest
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.structured import StructuredOutputManager


@dataclass(frozen=True)
class InputLimits:
    """What the engine can hold; requests beyond it are refused."""

    vocab_size: int
    max_model_len: int  # prompt + completion tokens of one sequence
    max_logprobs: int  # most top logprobs per token (sampled and prompt)
    block_size: int
    num_kv_blocks: int  # a sequence must fit in the whole KV pool
    max_num_seqs: int  # the most sequences that run at once: a request's n is at most this


def tokenize_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as ids) and token ids; ValueError when it is empty or has an
    id outside the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "prompt must not be empty.")
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=True))
    ids = list(prompt)
    if not ids:
        raise RequestError("prompt", "prompt must not be empty.")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise RequestError(
                "prompt", f"prompt contains token id {t!r} outside the vocabulary (size {vocab_size})."
            )
    return None, ids


@dataclass
class ProcessedRequest:
    """A validated request: its prompt text (None for token ids) and its ``n`` sequences."""

    prompt: str | None
    sequences: list[Request]


class InputProcessor:
    """Tokenization and validation of requests, before anything reaches the scheduler."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: list[int],
        limits: InputLimits,
        lora_registry: LoRARegistry | None = None,
    ) -> None:
        """``lora_registry``: where requests' adapters are read and checked (None: LoRA is off)."""
        self.lora_registry = lora_registry
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self._structured_output_manager: StructuredOutputManager | None = None
        self._manager_lock = threading.Lock()  # the manager is also used by the server's worker threads

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Grammar compilation for structured outputs, set up on first use (xgrammar loads slowly)."""
        with self._manager_lock:
            if self._structured_output_manager is None:
                from pagedllm.structured import StructuredOutputManager

                self._structured_output_manager = StructuredOutputManager(
                    self.tokenizer, self.limits.vocab_size, self.eos_token_ids
                )
            return self._structured_output_manager

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """RequestError naming the field when ``lora_request`` cannot run here."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(
                "lora_request", f"lora_request must be a LoRARequest, got {type(lora_request).__name__}."
            )
        if self.lora_registry is None:
            raise RequestError(
                "lora_request",
                f"lora_request names adapter {lora_request.lora_name!r} but LoRA is off: start the engine "
                "with enable_lora=True (--enable-lora).",
            )
        self.lora_registry.get(lora_request)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as ids) and token ids; ValueError when empty or out of
        the vocabulary."""
        return tokenize_prompt(self.tokenizer, prompt, self.limits.vocab_size)

    def bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, as written and with one leading space."""
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Validate and build the sequences of one request (ids ``request_id`` or ``{i}_{request_id}``);
        ``lora_request``'s adapter is read and checked here (first use) before anything is queued."""
        limits = self.limits
        self.check_lora(lora_request)
        if params.n > limits.max_num_seqs:
            raise RequestError(
                "n",
                f"n must be at most max_num_seqs ({limits.max_num_seqs}), the sequences that run at once; "
                f"got {params.n}.",
            )
        text, ids = self.tokenize(prompt)
        params.verify_vocab(limits.vocab_size)
        if params.logprobs is not None and params.logprobs > limits.max_logprobs:
            raise RequestError(
                "logprobs", f"logprobs must be at most {limits.max_logprobs}, got {params.logprobs}."
            )
        grammar = (
            self.structured_output_manager.compile(params.structured_outputs)
            if params.structured_outputs is not None
            else None
        )
        if params.prompt_logprobs is not None and params.prompt_logprobs > limits.max_logprobs:
            raise RequestError(
                "prompt_logprobs",
                f"prompt_logprobs must be at most {limits.max_logprobs}, got {params.prompt_logprobs}.",
            )
        n_prompt = len(ids)
        max_len = limits.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n_prompt
        if n_prompt + max(max_tokens, 1) > max_len or max_tokens < 1:
            raise context_length_error(
                "prompt",
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.",
            )
        bs = limits.block_size
        if -(-(n_prompt + max_tokens) // bs) > limits.num_kv_blocks:
            raise RequestError(
                "prompt",
                f"prompt of {n_prompt} tokens plus max_tokens={max_tokens} needs more KV cache than the "
                f"engine has ({limits.num_kv_blocks} blocks of {bs} tokens).",
            )
        bad_words = self.bad_words_ids(params.bad_words) if params.bad_words else []
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        sequences: list[Request] = []
        for i in range(params.n):
            sequences.append(
                Request(
                    request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                    prompt_token_ids=ids,
                    params=params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    prompt=text,
                    parent_id=request_id,
                    index=i,
                    bad_words_token_ids=bad_words,
                    grammar=self.structured_output_manager.new_state(grammar)
                    if grammar is not None
                    else None,
                    prefill_leader=sequences[0] if sequences else None,
                    lora_request=lora_request,
                )
            )
        return ProcessedRequest(text, sequences)
