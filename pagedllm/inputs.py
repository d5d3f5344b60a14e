"""Prompts as the offline API takes them: a string, a list of token ids, or vLLM's prompt dicts.

:class:`TextPrompt` (``{"prompt": str}``) and :class:`TokensPrompt` (``{"prompt_token_ids": [...]}``)
carry the same prompt as a bare string or token list. :func:`parse_prompt` turns any of the four
into what the engine takes (a string or a token list) and refuses everything else with a
``ValueError`` that names the offending entry and key: other keys of vLLM's dicts
(``multi_modal_data``, ``mm_processor_kwargs``, ``cache_salt``) are refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

# Keys of vLLM's prompt dicts that pagedllm does not implement: refused by name, never dropped.
UNSUPPORTED_KEYS = {
    "multi_modal_data": "image and other multimodal input is not supported",
    "mm_processor_kwargs": "multimodal processing is not supported",
    "multi_modal_uuids": "multimodal input is not supported",
    "cache_salt": "per-request prefix-cache salts are not supported",
}


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids, taken as they are."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt


def parse_prompt(item: Any, where: str = "prompt") -> str | list[int]:
    """``item`` as the engine takes it: a string or a list of token ids.

    ``where`` names the entry in errors (``"prompts[3]"``). Raises ``ValueError`` for a dict with no
    prompt, with both keys, with an unsupported or unknown key, or with a value of the wrong type, and
    for anything that is not a string, a token list or such a dict."""
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        return _parse_dict(item, where)
    if isinstance(item, (list, tuple)):
        return _token_ids(item, where)
    raise ValueError(
        f"{where}: a prompt is a string, a list of token ids, {{'prompt': str}} or "
        f"{{'prompt_token_ids': [int, ...]}}, got {type(item).__name__}."
    )


def _parse_dict(item: Mapping[Any, Any], where: str) -> str | list[int]:
    for key in item:
        if key in UNSUPPORTED_KEYS:
            raise ValueError(f"{where}.{key}: {UNSUPPORTED_KEYS[key]}.")
        if key not in ("prompt", "prompt_token_ids"):
            raise ValueError(
                f"{where}.{key}: unknown prompt key; a prompt dict has 'prompt' (text) or "
                "'prompt_token_ids' (token ids)."
            )
    if "prompt" in item and "prompt_token_ids" in item:
        raise ValueError(f"{where}: give 'prompt' or 'prompt_token_ids', not both.")
    if "prompt_token_ids" in item:
        return _token_ids(item["prompt_token_ids"], f"{where}.prompt_token_ids")
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}.prompt: must be a string, got {type(text).__name__}.")
        return text
    raise ValueError(f"{where}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids).")


def _token_ids(ids: Any, where: str) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{where}: must be a list of token ids, got {type(ids).__name__}.")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"{where}[{i}]: token ids are integers, got {type(token).__name__}.")
    return list(ids)
