"""Request and response models of ``POST /v1/embeddings`` (OpenAI's fields plus vLLM's
``add_special_tokens``).

Unlike the generation models, whose unknown fields are logged and ignored, an embedding request with a
field this server does not implement is refused with a 400 naming it (see
:meth:`pagedllm.entrypoints.openai.serving_embedding.OpenAIServingEmbedding.create_embedding`). Fields
are typed strictly, as JSON types, like every request model here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, Text, TokenId

EncodingFormat = Literal["float", "base64"]


class EmbeddingRequest(OpenAIBaseModel):
    """``input`` is one text, a list of texts, one list of token ids, or a list of them; each gives
    one embedding, in order. ``encoding_format`` ``base64`` sends each vector as the base64 of its
    little-endian float32 bytes. ``dimensions`` asks for a shorter embedding (models trained for it
    only). ``user`` is accepted and not used."""

    model: Text | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    user: Text | None = None
    # vLLM extras
    add_special_tokens: bool = True
    # Keep only each input's last N tokens (-1: the model's context length); None keeps it whole.
    truncate_prompt_tokens: int | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
