"""Size limits of requests, checked before anything is tokenized or reaches the engine.

Each violation is a 400 naming the request field. The limits are server flags (see
:mod:`pagedllm.entrypoints.openai.cli_args`); :meth:`RequestLimits.resolve` fills the ones that
default to a property of the engine (``max_model_len``, the vocabulary, ``max_num_seqs``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatMessage, SamplingRequest

# A prompt may take this many bytes per token of the context (about 4 bytes a token, 8 times over).
PROMPT_BYTES_PER_TOKEN = 32
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_CHARS = 1024
DEFAULT_MAX_LOGIT_BIAS = 1024
DEFAULT_MAX_BAD_WORDS = 64
DEFAULT_CHAT_TEMPLATE_TIMEOUT = 5.0
DEFAULT_MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request

_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; None means "derive from the engine" (see :meth:`resolve`)."""

    max_prompt_bytes: int | None = None  # each prompt, and all message texts together
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS  # entries of ``stop`` and of ``stop_token_ids``
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS  # each stop string and each bad word
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_allowed_token_ids: int | None = None  # default: the vocabulary size
    max_bad_words: int = DEFAULT_MAX_BAD_WORDS
    max_n: int | None = None  # default: the engine's max_num_seqs (None: unbounded)
    chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT
    max_embedding_inputs: int = DEFAULT_MAX_EMBEDDING_INPUTS  # entries of an embeddings ``input``

    def resolve(self, *, max_model_len: int, vocab_size: int, max_num_seqs: int | None) -> RequestLimits:
        return dataclasses.replace(
            self,
            max_prompt_bytes=self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len,
            max_allowed_token_ids=self.max_allowed_token_ids or vocab_size,
            max_n=self.max_n or max_num_seqs,
        )

    @property
    def prompt_bytes(self) -> int:
        assert self.max_prompt_bytes is not None, "resolve() the limits first"
        return self.max_prompt_bytes

    # ------------------------------------------------------------------ checks

    def check_sampling(self, request: SamplingRequest, max_queued: int | None = None) -> None:
        """``n`` and the sizes of the stop, logit-bias, allowed-token and bad-word fields."""
        if self.max_n is not None and request.n > self.max_n:
            raise OpenAIError(
                f"n must be at most {self.max_n} (the engine's max_num_seqs, the sequences that run at "
                f"once), got {request.n}.",
                param="n",
            )
        if max_queued is not None and request.n > max_queued:
            raise OpenAIError(
                f"n must be at most {max_queued} (the server queues at most that many sequences, "
                f"--max-queued-requests), got {request.n}.",
                param="n",
            )
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        self._check_strings("stop", stop, self.max_stop_strings)
        self._check_count("stop_token_ids", request.stop_token_ids, self.max_stop_strings)
        self._check_count("allowed_token_ids", request.allowed_token_ids, self.max_allowed_token_ids)
        self._check_strings("bad_words", request.bad_words or [], self.max_bad_words)
        bias = request.logit_bias
        if bias:
            self._check_count("logit_bias", bias, self.max_logit_bias)
            bad = next((k for k in bias if not _TOKEN_ID_KEY.fullmatch(k)), None)
            if bad is not None:
                raise OpenAIError(
                    f"logit_bias keys must be token ids (decimal integers), got {bad[:40]!r}.",
                    param="logit_bias",
                )

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """One text prompt: at most ``max_prompt_bytes`` bytes of UTF-8."""
        size = _utf8_size(text)
        if size > self.prompt_bytes:
            raise OpenAIError(
                f"The {param} is {size} bytes long; at most {self.prompt_bytes} bytes are accepted "
                "(about 32 bytes per token of the model's context).",
                param=param,
                code="context_length_exceeded",
            )

    def check_messages(self, messages: list[ChatMessage]) -> None:
        """All message texts (content, parts and names) together: at most ``max_prompt_bytes``."""
        size = 0
        for msg in messages:
            size += len(msg.role) + _utf8_size(msg.name or "")
            content = msg.content
            if isinstance(content, str):
                size += _utf8_size(content)
            elif content is not None:
                size += sum(_utf8_size(part.text or "") + len(part.type) for part in content)
            if size > self.prompt_bytes:
                raise OpenAIError(
                    f"The messages are longer than {self.prompt_bytes} bytes, the most accepted (about 32 "
                    "bytes per token of the model's context).",
                    param="messages",
                    code="context_length_exceeded",
                )

    def _check_strings(self, name: str, values: list[str], most: int) -> None:
        self._check_count(name, values, most)
        longest = max((len(v) for v in values), default=0)
        if longest > self.max_stop_string_chars:
            raise OpenAIError(
                f"each entry of {name} must be at most {self.max_stop_string_chars} characters long, got "
                f"one of {longest}.",
                param=name,
            )

    @staticmethod
    def _check_count(name: str, values: Iterable[Any] | None, most: int | None) -> None:
        if values is None or most is None:
            return
        count = len(values) if isinstance(values, list | dict) else sum(1 for _ in values)
        if count > most:
            raise OpenAIError(f"{name} must have at most {most} entries, got {count}.", param=name)


def _utf8_size(text: str) -> int:
    """UTF-8 size of ``text`` without copying it when it is ASCII (lone surrogates count 3 bytes)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))
