"""Request and response models of the OpenAI-compatible API (OpenAI fields plus vLLM's extras).

Request models accept unknown fields at parse time (``extra="allow"``); the handlers then refuse
each one with a 400 naming it, unless it is an OpenAI field whose documented meaning holds here
(:mod:`pagedllm.entrypoints.openai.field_checks`). The fields they declare are typed strictly, as JSON types: ``true`` is not the integer 1, ``"5"`` is not a
number and ``"yes"`` is not a boolean.

Numbers are checked before a request reaches the engine: every float of a request must be finite
(JSON's ``1e999``, ``NaN`` and ``Infinity`` are refused) and not a boolean; token ids are strict
integers (``true`` is not token 1); ``temperature`` is at most ``MAX_TEMPERATURE`` (100, as in
``SamplingParams``), ``seed`` a 64-bit integer, ``repetition_penalty`` at least
``MIN_REPETITION_PENALTY`` and ``length_penalty`` within ``MAX_LENGTH_PENALTY`` of 0 (beyond those the
sampler's logits or the beam scores overflow). Strings the server echoes or tokenizes on its own
(``model``, ``request_id``, ``bad_words``) must be Unicode text. Request-size limits that depend on
the server's flags are in :mod:`pagedllm.entrypoints.openai.limits`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    model_serializer,
)

from pagedllm.sampling_params import MAX_TEMPERATURE

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A repetition penalty this small already makes a repeated token's logit a million times larger (or
# smaller); far smaller ones overflow float32 logits into infinities, which sampling cannot take.
MIN_REPETITION_PENALTY = 1e-6
# Beam scores are divided by length ** length_penalty, which overflows (or reaches 0) far beyond this.
MAX_LENGTH_PENALTY = 10.0


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _unicode(value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "must be Unicode text (it contains a lone surrogate, \\ud800 to \\udfff)"
            ) from None
    return value


# A float field of a request: finite (see ``allow_inf_nan`` below) and not a boolean.
Number = Annotated[float, BeforeValidator(_not_bool)]
# A string the server echoes or tokenizes on its own: Unicode text. JSON's "\ud800" escapes can
# name a lone surrogate, which no response can carry and no tokenizer takes.
Text = Annotated[str, AfterValidator(_unicode)]
# A token id: an integer, never a boolean, a float or a numeric string.
TokenId = StrictInt
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:  # noqa: BLE001 - not installed: running from a source tree
        return "0.0.0+unknown"


# The ``system_fingerprint`` of every completion and chunk: the serving software and its version (the
# model is named in ``model``).
SYSTEM_FINGERPRINT = f"fp_pagedllm_{_package_version()}"


class OpenAIBaseModel(BaseModel):
    """Base of every request model: unknown fields are kept aside for the handlers to refuse by name;
    declared fields take only their own JSON type (no booleans as numbers, numeric strings or 1 as
    true)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def audited_extras(self) -> dict[str, Any]:
        """The unknown fields the server must refuse (all of them, unless a model says otherwise)."""
        return dict(self.model_extra or {})


# ---------------------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# A function's or a JSON schema's name, as OpenAI allows them.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.:-]+$"


class JsonSchemaSpec(OpenAIBaseModel):
    """A named JSON schema that the reply must follow: chat's ``response_format.json_schema`` and (with
    its ``type`` beside these fields) the Responses API's ``text.format``. The one validation model of
    a schema constraint on every route: ``schema`` must be a JSON object, so that nothing the grammar
    compiler or the engine-core process cannot take gets past the front-end."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    name: Text = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` object: exactly one constraint (checked when the sampling
    parameters are built); unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_schema: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completion and chat requests."""

    model: Text | None = None
    max_tokens: int | None = None
    temperature: Number | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: Number | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = Field(None, ge=MIN_REPETITION_PENALTY)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None
    structured_outputs: StructuredOutputs | None = None
    request_id: Text | None = None
    prompt_logprobs: int | None = None
    # Keep only the prompt's last N tokens (-1: the model's context length); None keeps it whole.
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    length_penalty: Number = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    # Lower values run first on a server started with --scheduling-policy priority; an fcfs server
    # takes only 0.
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    suffix: str | None = None
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True


class TextContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None

    def audited_extras(self) -> dict[str, Any]:
        # A part of another type (an image, a file) is refused whole, by its type.
        return super().audited_extras() if self.type == "text" else {}


class FunctionDefinition(OpenAIBaseModel):
    """A declared function: ``parameters`` is its arguments' JSON schema (an object schema)."""

    name: Text = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: Text


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice`` naming one function: the reply is a call to it."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCallModel(OpenAIBaseModel):
    name: Text
    arguments: str


class ChatToolCall(OpenAIBaseModel):
    """A tool call of an assistant message, in a request's history or a response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallModel


class ChatMessage(OpenAIBaseModel):
    role: ChatRole
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # An assistant message's calls and a tool message's answer to one of them.
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" when tools are given, else "none" (as OpenAI).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless the server trusts request chat templates
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIBaseModel):
    """``prompt`` (a completion prompt) or ``messages`` (rendered with the chat template)."""

    model: Text | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Text | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------------- responses


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class PromptLogprob(BaseModel):
    """One entry of vLLM's ``prompt_logprobs``: a prompt position's log probability of a token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first is null): token id -> its log probability there.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str = SYSTEM_FINGERPRINT


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    """A reply's message; ``tool_calls`` is left out of the JSON when there are none (as OpenAI's)."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_empty_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return dict(out)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCallModel(BaseModel):
    """A streamed piece of a tool call: the first piece of a call carries ``id``, ``type`` and the
    function's ``name``; later ones carry ``arguments`` fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str = SYSTEM_FINGERPRINT
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    """A streamed message fragment; fields that are not set are left out of the JSON."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCallModel] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str = SYSTEM_FINGERPRINT


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)
    # The default sampling parameters taken from the model's generation config (--generation-config).
    generation_config: dict[str, float | int] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
