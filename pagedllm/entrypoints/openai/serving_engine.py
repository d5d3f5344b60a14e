"""What the OpenAI endpoints share: errors, model checks, prompt handling, sampling parameters and
logprob formatting (streaming is in :mod:`pagedllm.entrypoints.openai.streaming`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, ClassVar

from pagedllm.engine.async_client import AsyncEngineClient
from pagedllm.engine.errors import EngineDeadError, RequestAbortedError, RequestError, as_request_error
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.field_checks import FieldRule, check_fields
from pagedllm.entrypoints.openai.limits import RequestLimits
from pagedllm.entrypoints.openai.preprocess import Preprocessor
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    OpenAIBaseModel,
    PromptLogprob,
    PromptLogprobs,
    SamplingRequest,
)
from pagedllm.errors import context_length_error as engine_context_length_error
from pagedllm.lora_request import LoRARequest
from pagedllm.model.token_bytes import TokenBytes, display_token
from pagedllm.outputs import BeamSearchOutput, Logprob
from pagedllm.outputs import PromptLogprobs as EnginePromptLogprobs
from pagedllm.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

logger = logging.getLogger("pagedllm.entrypoints.openai")


def context_length_error(
    max_model_len: int, prompt_len: int, max_tokens: int | None, param: str
) -> OpenAIError:
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages."
        )
    else:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    return error_from_exception(engine_context_length_error(param, message))


def error_from_exception(exc: BaseException, param_aliases: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI error object for an exception from request validation or the engine: the one place
    where a :class:`RequestError` (its field, through ``param_aliases`` to the request's own name,
    code, HTTP status and type) and the engine's errors become what a client sees."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestError):
        param = (param_aliases or {}).get(exc.param, exc.param) if exc.param is not None else None
        return OpenAIError(
            exc.message, status_code=exc.status_code, type=exc.type, param=param, code=exc.code
        )
    if isinstance(exc, RequestAbortedError):
        return OpenAIError(str(exc), status_code=503, type="server_error", code="request_aborted")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), status_code=500, type="server_error", code="engine_dead")
    if isinstance(exc, ValueError):
        return OpenAIError(str(exc))  # an invalid request that names no field
    logger.error("Internal error while serving a request", exc_info=exc)
    return OpenAIError(
        f"Internal server error: {type(exc).__name__}: {exc}", status_code=500, type="server_error", code=None
    )


def _beam_width_as_n(exc: RequestError) -> RequestError:
    """A beam-search refusal naming ``beam_width``, as the request calls it: ``n``."""
    if exc.param != "beam_width":
        return exc
    return RequestError("n", exc.message.replace("beam_width", "n", 1), exc.code)


def _finite(x: float) -> float:
    """JSON has no infinities: clamp log probabilities as OpenAI does."""
    if math.isnan(x):
        return -9999.0
    return max(x, -9999.0)


class OpenAIServing:
    """Base of the endpoint handlers, bound to one engine and its served model names.

    ``tokenizer`` (default: the engine's) is used on the event loop's thread only, to decode the
    tokens of responses; requests are tokenized by ``preprocessor`` on its worker thread.
    """

    def __init__(
        self,
        engine: AsyncEngineClient,
        served_model_names: list[str],
        *,
        max_logprobs: int = 20,
        tokenizer: Any = None,
        preprocessor: Preprocessor | None = None,
        lora_modules: dict[str, LoRARequest] | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.lora_modules = lora_modules or {}
        self.max_logprobs = max_logprobs
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self._token_bytes: TokenBytes | None = None  # built on the first chat logprobs
        if preprocessor is None:
            limits = RequestLimits().resolve(
                max_model_len=self.max_model_len, vocab_size=engine.info.vocab_size, max_num_seqs=None
            )
            preprocessor = Preprocessor(self.tokenizer, limits, trust_request_chat_template=False)
        self.preprocessor = preprocessor
        self.limits = preprocessor.limits

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        if model is None or model in self.served_model_names or model in self.lora_modules:
            return
        raise OpenAIError(
            f"The model `{model}` does not exist.", status_code=404, param="model", code="model_not_found"
        )

    def reported_model(self, model: str | None) -> str:
        """The ``model`` a response reports: the adapter the request named, else the served name."""
        return model if model is not None and model in self.lora_modules else self.model_name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.lora_modules.get(model) if model is not None else None

    @staticmethod
    def check_fields(request: OpenAIBaseModel, documented: dict[str, FieldRule] | None = None) -> None:
        """A 400 naming the first field the server would otherwise ignore (see :mod:`.field_checks`)."""
        check_fields(request, documented)

    def check_engine(self) -> None:
        if not self.engine.is_running:
            # A new request to a dead engine is refused as unavailable (requests in flight when it died
            # fail with 500); /health answers 503 too.
            raise OpenAIError(
                self.engine.dead_message(), status_code=503, type="server_error", code="engine_dead"
            )

    def check_priority(self, request: SamplingRequest) -> None:
        """A 400 naming ``priority`` (and ``scheduling_policy``) when the engine's policy does not take
        the request's priority: any but 0 on an ``fcfs`` server."""
        try:
            self.engine.check_priority(request.priority)
        except RequestError as exc:
            raise error_from_exception(exc) from None

    def check_limits(self, request: SamplingRequest) -> None:
        """``n`` and the sizes of the request's lists, before anything is tokenized."""
        self.limits.check_sampling(request, self.engine.max_queued_requests)

    # ------------------------------------------------------------------ prompts

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens vLLM's ``truncate_prompt_tokens`` keeps (None: all):
        -1 means the model's context length; 0, other negatives and more than the context length
        are 400s naming the field."""
        value = truncate_prompt_tokens
        if value is None:
            return None
        if value == -1:
            return self.max_model_len
        if value < 1:
            raise OpenAIError(
                f"truncate_prompt_tokens must be a number of tokens >= 1, or -1 (the model's context "
                f"length), got {value}.",
                param="truncate_prompt_tokens",
            )
        if value > self.max_model_len:
            raise OpenAIError(
                f"truncate_prompt_tokens ({value}) is greater than the model's context length "
                f"({self.max_model_len}); give a smaller value, or -1 for the context length.",
                param="truncate_prompt_tokens",
            )
        return value

    @staticmethod
    def truncated(ids: list[int], keep: int | None) -> list[int]:
        """``ids`` without its first tokens beyond the last ``keep`` (None: all kept)."""
        return ids if keep is None or len(ids) <= keep else ids[len(ids) - keep :]

    def check_prompt_length(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """Resolve ``max_tokens`` (default: the rest of the context) and check the total fits."""
        if prompt_len == 0:
            raise OpenAIError("The prompt must not be empty.", param=param)
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise context_length_error(self.max_model_len, prompt_len, None, param)
            return self.max_model_len - prompt_len
        if max_tokens >= 1 and prompt_len + max_tokens > self.max_model_len:
            raise context_length_error(self.max_model_len, prompt_len, max_tokens, param)
        return max_tokens

    @staticmethod
    def prompt_items(raw: str | list[str] | list[int] | list[list[int]], param: str) -> list[str | list[int]]:
        """A prompt field (a text, texts, token ids or lists of them) as a list of texts and id lists."""
        if isinstance(raw, str):
            return [raw]
        if not raw:
            raise OpenAIError(f"{param} must not be empty.", param=param)
        if all(isinstance(x, int) for x in raw):
            return [list(raw)]  # type: ignore[arg-type]
        return list(raw)  # type: ignore[arg-type]

    async def tokenize_items(
        self, items: list[str | list[int]], *, add_special_tokens: bool, param: str
    ) -> list[list[int]]:
        """The token ids of each item, in order: id lists checked against the vocabulary, texts
        tokenized on the tokenizer thread."""
        vocab_size = self.engine.info.vocab_size
        for item in items:
            if isinstance(item, str):
                continue
            bad = next((t for t in item if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise OpenAIError(
                    f"{param} contains out-of-vocab token id {bad} (vocab size {vocab_size}).", param=param
                )
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(
            await self.preprocessor.encode(texts, add_special_tokens=add_special_tokens, param=param)
            if texts
            else []
        )
        return [next(encoded) if isinstance(item, str) else list(item) for item in items]

    # ------------------------------------------------------------------ sampling

    @staticmethod
    def param_aliases(request: SamplingRequest, aliases: dict[str, str] | None = None) -> dict[str, str]:
        """``aliases`` plus, when the constraint comes from ``response_format``, its errors' field."""
        merged = dict(aliases or {})
        if request.structured_outputs is None and request.response_format is not None:
            merged["structured_outputs"] = "response_format"
        return merged

    @staticmethod
    def check_request_modes(request: SamplingRequest) -> None:
        """Refuse combinations of streaming, beam search and prompt logprobs that are not served."""
        if request.stream and request.prompt_logprobs is not None:
            raise OpenAIError(
                "prompt_logprobs is not available when stream is true.", param="prompt_logprobs"
            )
        if not request.use_beam_search:
            return
        if request.stream:
            raise OpenAIError("use_beam_search does not support stream=true.", param="stream")
        if request.temperature not in (None, 0.0):
            raise OpenAIError(
                f"use_beam_search is deterministic; temperature must be 0 (or left out), got "
                f"{request.temperature}.",
                param="temperature",
            )
        if request.structured_outputs is not None or (
            request.response_format is not None and request.response_format.type != "text"
        ):
            raise OpenAIError(
                "use_beam_search cannot be combined with structured outputs.", param="use_beam_search"
            )
        if request.prompt_logprobs is not None:
            raise OpenAIError(
                "use_beam_search cannot be combined with prompt_logprobs.", param="prompt_logprobs"
            )

    async def beam_search(
        self,
        request: SamplingRequest,
        prompts: list[tuple[str | None, list[int]]],
        *,
        max_tokens: int,
        request_id: str,
        aliases: dict[str, str] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search with ``n`` beams per prompt; each output's hypotheses are decoded, best first."""
        try:
            params = BeamSearchParams(
                beam_width=request.n,
                max_tokens=max_tokens,
                ignore_eos=request.ignore_eos,
                length_penalty=request.length_penalty,
            )
        except RequestError as exc:  # beam_width is the request's n
            raise error_from_exception(_beam_width_as_n(exc)) from None
        try:
            outputs = await self.engine.beam_search(
                prompts,
                params,
                eos_token_ids=list(self.engine.info.eos_token_ids),
                max_logprobs=self.max_logprobs,
                request_id=request_id,
                priority=request.priority,
            )
        except Exception as exc:
            if isinstance(exc, RequestError) and exc.param == "beam_width":
                exc = _beam_width_as_n(exc)
            raise error_from_exception(exc, aliases) from None
        for output in outputs:
            for seq in output.sequences:
                seq.text = str(
                    self.tokenizer.decode(
                        seq.output_token_ids, skip_special_tokens=request.skip_special_tokens
                    )
                )
        return outputs

    def sampling_params(
        self,
        request: SamplingRequest,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        aliases: dict[str, str] | None = None,
    ) -> SamplingParams:
        """Build SamplingParams; invalid values become 400 errors naming the request field."""
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and value > self.max_logprobs:
                raise OpenAIError(
                    f"{(aliases or {}).get(name, name)} must be at most {self.max_logprobs}, got {value}.",
                    param=(aliases or {}).get(name, name),
                )
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options is only allowed when stream is true.", param="stream_options")
        defaults = self.default_sampling(request)
        try:
            structured = self._structured_outputs(request)
            return SamplingParams(
                n=request.n,
                best_of=request.best_of,
                temperature=float(defaults["temperature"]),
                top_p=float(defaults["top_p"]),
                top_k=int(defaults["top_k"]),
                min_p=float(defaults["min_p"]),
                seed=request.seed,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                include_stop_str_in_output=request.include_stop_str_in_output,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=float(defaults["repetition_penalty"]),
                logit_bias=dict(request.logit_bias) if request.logit_bias else None,  # type: ignore[arg-type]
                bad_words=request.bad_words,
                allowed_token_ids=request.allowed_token_ids,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                structured_outputs=structured,
                # A stream writes what each step adds; a response that is not streamed needs only the
                # final output.
                output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            )
        except (ValueError, TypeError) as exc:
            raise error_from_exception(as_request_error(exc), aliases) from None

    # The sampling fields a request may leave out (None) to get the model's default, with the built-in
    # value used when the model has none.
    _BUILTIN_SAMPLING: ClassVar[dict[str, float | int]] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }

    def default_sampling(self, request: SamplingRequest) -> dict[str, float | int]:
        """temperature, top_p, top_k, min_p and repetition_penalty for ``request``: its own value, else
        the model's generation-config default (``engine.info.default_sampling``), else the built-in one."""
        model_defaults = self.engine.info.default_sampling
        values: dict[str, float | int] = {}
        for name, builtin in self._BUILTIN_SAMPLING.items():
            given = getattr(request, name)
            values[name] = given if given is not None else model_defaults.get(name, builtin)
        return values

    @staticmethod
    def _structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
        so = request.structured_outputs
        fmt = request.response_format
        if so is not None and fmt is not None and fmt.type != "text":
            raise OpenAIError(
                "response_format and structured_outputs cannot both constrain the reply; send one.",
                param="response_format",
            )
        if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
            raise OpenAIError(
                f"response_format.json_schema is only taken with type json_schema (got type {fmt.type!r}).",
                param="response_format",
            )
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_schema,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
            )
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise OpenAIError(
                "response_format: json_schema.schema is required for type json_schema",
                param="response_format",
            )
        return StructuredOutputsParams(json=fmt.json_schema.json_schema)

    # ------------------------------------------------------------------ logprobs

    def prompt_logprobs(self, steps: EnginePromptLogprobs | None) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` response field: per prompt position, token id -> log probability."""
        if steps is None:
            return None
        return [
            None
            if step is None
            else {
                tid: PromptLogprob(
                    logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=self.token_text(tid, lp)
                )
                for tid, lp in step.items()
            }
            for step in steps
        ]

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return str(self.tokenizer.decode([token_id]))

    def token_and_bytes(self, token_id: int, logprob: Logprob | None = None) -> tuple[str, list[int]]:
        """The chat logprobs' ``token`` and ``bytes`` of a token: its own bytes (a token that holds
        part of a character has those, not U+FFFD's), and for such a token ``\\xNN`` escapes in its
        ``token`` string (see :mod:`pagedllm.model.token_bytes`)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        raw = self._token_bytes(token_id)
        shown = display_token(raw)
        return (self.token_text(token_id, logprob) if shown is None else shown), list(raw)

    def completion_logprobs(
        self,
        token_ids: list[int],
        step_logprobs: Iterable[dict[int, Logprob] | None],
        num_top: int,
        initial_offset: int,
    ) -> CompletionLogProbs:
        """The legacy completions logprobs object for ``token_ids`` (missing steps give nulls)."""
        out = CompletionLogProbs()
        offset = initial_offset
        steps = list(step_logprobs)
        for i, token_id in enumerate(token_ids):
            step = steps[i] if i < len(steps) else None
            sampled = step.get(token_id) if step else None
            token = self.token_text(token_id, sampled)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if step is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
            top: dict[str, float] = {}
            for tid, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0):
                if tid == token_id or (lp.rank is not None and lp.rank <= num_top):
                    top[self.token_text(tid, lp)] = _finite(lp.logprob)
            out.top_logprobs.append(top)
        return out

    def chat_logprobs(
        self, token_ids: list[int], step_logprobs: list[dict[int, Logprob]] | None, num_top: int
    ) -> list[ChatCompletionLogProbsContent]:
        """The chat logprobs ``content`` entries for ``token_ids``."""
        content: list[ChatCompletionLogProbsContent] = []
        steps = step_logprobs or []
        for i, token_id in enumerate(token_ids):
            step = steps[i] if i < len(steps) else {}
            sampled = step.get(token_id)
            top = [
                ChatCompletionLogProb(token=text, logprob=_finite(lp.logprob), bytes=raw)
                for tid, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0)
                if lp.rank is not None and 1 <= lp.rank <= num_top
                for text, raw in [self.token_and_bytes(tid, lp)]
            ][:num_top]
            token, raw = self.token_and_bytes(token_id, sampled)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=_finite(sampled.logprob) if sampled is not None else -9999.0,
                    bytes=raw,
                    top_logprobs=top,
                )
            )
        return content
