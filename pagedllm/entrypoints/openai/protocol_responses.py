"""Request and response models of ``/v1/responses`` (OpenAI's Responses API).

A request is served as a view over a chat completion (see
:mod:`pagedllm.entrypoints.openai.serving_responses`), so its fields are typed as strictly as the chat
request's (JSON types only: ``true`` is not 1, ``"5"`` is not a number). Unknown fields are kept aside
at parse time (``extra="allow"``) and refused by the handler with a 400 naming each with its path
(:mod:`pagedllm.entrypoints.openai.field_checks`; a ``null`` one inside an item is accepted, as output
items sent back carry OpenAI's null fields).

Input items: messages (``{"role", "content"}`` with or without ``"type": "message"``; content a string
or ``input_text``/``output_text`` parts), ``function_call`` and ``function_call_output`` items, and
``reasoning`` items (this server's own output fed back). Items of other types (images, files, item
references, built-in tool calls) and built-in tools are refused here, naming the item.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator

from pagedllm.entrypoints.openai.protocol import (
    FUNCTION_NAME_PATTERN,
    INT64_MAX,
    INT64_MIN,
    MIN_REPETITION_PENALTY,
    JsonSchemaSpec,
    Number,
    OpenAIBaseModel,
    Text,
)
from pagedllm.sampling_params import MAX_TEMPERATURE

# The input item types served, and the content part types of a message.
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text")


# ---------------------------------------------------------------------------------------------- input


class InputTextPart(OpenAIBaseModel):
    """A text part of a message. ``annotations`` and ``logprobs`` ride along when a response's output
    is fed back as input; they do not reach the model."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(OpenAIBaseModel):
    """A message; ``id`` and ``status`` (set on output items fed back) do not reach the model."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made: ``arguments`` is a JSON object string."""

    type: Literal["function_call"]
    call_id: Text = Field(min_length=1)
    name: Text = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of the call ``call_id`` (which an earlier ``function_call`` item must carry)."""

    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1)
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningTextPart(OpenAIBaseModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(OpenAIBaseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(OpenAIBaseModel):
    """Reasoning fed back: it becomes the ``reasoning_content`` of the assistant turn that follows."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> Any:
    """The tag of an input item: its ``type``, ``message`` when it has none (the short form)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


# ---------------------------------------------------------------------------------------------- tools


class FunctionTool(OpenAIBaseModel):
    """A function the model may call (the Responses form: no nested ``function`` object)."""

    type: Literal["function"]
    name: Text = Field(min_length=1, max_length=64, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIBaseModel):
    """``tool_choice`` naming one function: the reply is a call to it."""

    type: Literal["function"]
    name: Text


# ---------------------------------------------------------------------------------------------- text


class TextFormatText(OpenAIBaseModel):
    type: Literal["text"]


class TextFormatJsonObject(OpenAIBaseModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(JsonSchemaSpec):
    """The reply is JSON valid under ``schema`` (enforced by a grammar, whatever ``strict`` says)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")  # required here


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # refused unless null


class ReasoningConfig(OpenAIBaseModel):
    """Accepted only with every field null: this server cannot set a reasoning effort or summarize."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


# ---------------------------------------------------------------------------------------------- request


def _supported_items(value: Any) -> Any:
    """Refuse input items and content parts of types this server does not serve, naming the item."""
    if not isinstance(value, list):
        return value
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if isinstance(kind, str) and kind not in INPUT_ITEM_TYPES:
            raise ValueError(
                f"input[{i}] is an item of type {kind!r}, which this server does not take (it takes "
                f"{', '.join(INPUT_ITEM_TYPES)} items, text only; to continue a stored response send "
                "previous_response_id)"
            )
        parts = item.get("content") if kind == "message" else item.get("output")
        if not isinstance(parts, list):
            continue
        field = "content" if kind == "message" else "output"
        for j, part in enumerate(parts):
            part_type = part.get("type") if isinstance(part, dict) else None
            if isinstance(part_type, str) and part_type not in TEXT_PART_TYPES:
                raise ValueError(
                    f"input[{i}].{field}[{j}] is a part of type {part_type!r}; only text parts "
                    f"({', '.join(TEXT_PART_TYPES)}) are supported"
                )
    return value


def _function_tools_only(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(
                f"tools[{i}] is a built-in tool of type {kind!r}, which this server does not have; only "
                "function tools are supported"
            )
    return value


class ResponsesRequest(OpenAIBaseModel):
    """A ``POST /v1/responses`` body. The fields typed but refused unless left out or null
    (``conversation``, ``include``, ``reasoning.effort``, ``max_tool_calls``, ``text.verbosity``) are
    declared so that their 400 says why; see the handler."""

    model: Text | None = None
    input: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("items")],
        Discriminator(lambda v: "text" if isinstance(v, str) else "items"),
    ]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: Number | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: Number | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Kept unless false (OpenAI's default); a stored response can be read, continued and deleted.
    store: bool | None = None
    # A stored response whose input and output come before this request's input.
    previous_response_id: Text | None = None
    # Answered at once with a queued response that is generated in the background (needs store).
    background: bool | None = None
    # Refused unless left out (or the one value that matches what this server does).
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    # vLLM extras, passed to the chat request as they are
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = Field(None, ge=MIN_REPETITION_PENALTY)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # as in chat completions

    @field_validator("input", mode="before")
    @classmethod
    def check_input_types(cls, value: Any) -> Any:
        if value == "" or value == []:  # as an empty prompt on /v1/completions
            raise ValueError("input must not be empty: send the text (or items) to answer")
        return _supported_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def check_tool_types(cls, value: Any) -> Any:
        return _function_tools_only(value)


# ---------------------------------------------------------------------------------------------- response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]


OutputItem = Annotated[OutputMessage | OutputFunctionCall | OutputReasoning, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    # Not counted apart from the output tokens: always 0.
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


ResponseStatus = Literal["completed", "incomplete", "in_progress", "queued", "cancelled", "failed"]


class ResponseObject(BaseModel):
    """OpenAI's Response object. ``status`` is ``in_progress`` in the first events of a stream and
    while a background response runs (``queued`` before it starts); ``incomplete`` when the reply was
    cut at ``max_output_tokens`` (or the end of the context); ``cancelled`` and ``failed`` (with
    ``error``) only for background responses."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    temperature: float
    top_p: float
    text: TextConfig
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    tools: list[FunctionTool]
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItemList(BaseModel):
    """A page of a stored response's input items (each with its ``id``)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
