"""Tokenizer loading for Hugging Face directories and GGUF files.

Converting a GGUF file's embedded vocabulary into a fast tokenizer takes transformers several
seconds, so the converted tokenizer is saved (``save_pretrained``) under a per-user cache directory
and reloaded from there afterwards. The cache key covers the file's absolute path, size and
modification time plus the transformers version; entries are published atomically (written to a
temporary directory, then renamed), so concurrent processes never see a half-written entry.

The cache root is ``$PAGEDLLM_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/pagedllm`` (default
``~/.cache/pagedllm``); tokenizers live in its ``tokenizers/`` subdirectory.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedllm.utils import cache_root

logger = logging.getLogger(__name__)

# Written last into a cache entry; an entry without it is ignored.
_COMPLETE_MARKER = "pagedllm_cache.json"

# Gemma's turn format, for GGUF files of Gemma models that carry no chat template: system messages
# are put before the first user message, "assistant" turns are the "model" role. The BOS token is
# not written: prompts are tokenized with the tokenizer's special tokens, which add it.
GEMMA_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = ns.system + content | trim + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + content | trim"
    " + '<end_of_turn>\n' -}}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
_GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


def gguf_tokenizer_cache_dir(gguf_path: str) -> Path:
    """Where the converted tokenizer of ``gguf_path`` is (or would be) cached."""
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key_src = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    return cache_root() / "tokenizers" / key


def convert_gguf_tokenizer(gguf_path: str) -> PreTrainedTokenizerBase:
    """Build a tokenizer from a GGUF file's metadata with transformers (slow: several seconds)."""
    path = os.path.abspath(gguf_path)
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _load_cached(entry: Path) -> PreTrainedTokenizerBase | None:
    if not (entry / _COMPLETE_MARKER).is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(entry))
    except Exception as exc:  # a corrupt entry is rebuilt rather than fatal
        logger.warning("Ignoring unreadable tokenizer cache entry %s: %s", entry, exc)
        return None


def _store_cached(entry: Path, tokenizer: PreTrainedTokenizerBase, source: str, replace: bool) -> None:
    """Publish ``tokenizer`` at ``entry`` atomically; failures only log a warning.

    An existing entry is kept (another process published it meanwhile) unless ``replace`` is set,
    which is for an entry found unusable before the conversion.
    """
    tmp: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, _COMPLETE_MARKER), "w") as f:
            json.dump({"source": source, "transformers": transformers.__version__}, f)
        if entry.exists() and replace:  # an unusable entry: move it aside, then drop it
            stale = tempfile.mkdtemp(prefix=f".{entry.name}.stale.", dir=entry.parent)
            try:
                os.replace(entry, os.path.join(stale, "old"))
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, entry)
        tmp = None
    except Exception as exc:  # caching is an optimisation; it must never break loading
        # Typically another process published the entry first, or the cache is not writable.
        if not (entry / _COMPLETE_MARKER).is_file():
            logger.warning("Could not cache tokenizer at %s: %s", entry, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_tokenizer(gguf_path: str, use_cache: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer embedded in a GGUF file, from the cache when possible.

    A file without a chat template whose vocabulary has Gemma's turn markers gets
    :data:`GEMMA_CHAT_TEMPLATE`."""
    if not use_cache:
        return _default_chat_template(convert_gguf_tokenizer(gguf_path))
    entry = gguf_tokenizer_cache_dir(gguf_path)
    cached = _load_cached(entry)
    if cached is not None:
        return _default_chat_template(cached)
    unusable = entry.exists()
    tokenizer = convert_gguf_tokenizer(gguf_path)
    _store_cached(entry, tokenizer, os.path.abspath(gguf_path), replace=unusable)
    return _default_chat_template(tokenizer)


def _default_chat_template(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if getattr(tokenizer, "chat_template", None) is None:
        vocab = tokenizer.get_vocab()
        if all(token in vocab for token in _GEMMA_TURN_TOKENS):
            tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a ``.gguf`` file or a Hugging Face tokenizer/model directory."""
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Tokenizer path {path!r} is neither a .gguf file nor a directory.")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ValueError(f"Could not load a tokenizer from {path!r}: {exc}") from exc


def tokenizer_eos_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokenizer's EOS token id as a list (empty when it has none)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(i) for i in eos]


def with_chat_template(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None
) -> PreTrainedTokenizerBase:
    """``tokenizer`` rendering chats with ``chat_template`` instead of the model's own template.

    ``chat_template`` is a Jinja chat template, or the path of a file holding one (a value naming no
    file and holding no ``{{`` or ``{%`` is taken for a missing file). The tokenizer is copied
    (shallowly: the vocabulary is shared), so the original keeps its template. Raises ``ValueError``
    naming ``chat_template`` for a missing file or a template that does not parse.
    """
    if chat_template is None:
        return tokenizer
    if os.path.isfile(chat_template):
        source = Path(chat_template).read_text(encoding="utf-8")
    elif "{{" in chat_template or "{%" in chat_template:
        source = chat_template
    else:
        raise ValueError(f"chat_template: no such file {chat_template!r} (nor is it a Jinja template).")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse: {exc} (line {exc.lineno}).") from exc
    copied = copy.copy(tokenizer)
    copied.chat_template = source
    return copied


def template_handles_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (renders the declared tools)."""
    return template is not None and re.search(r"\btools\b", template) is not None


# Chat templates shipped with pagedllm (``pagedllm/model/chat_templates/``) for models whose own
# template has no tools section, by the sha256 of that own template: SmolLM2's instruct models (the
# default model among them) get Hermes-style tool calls, which ``--tool-call-parser hermes`` reads.
CHAT_TEMPLATES_DIR = Path(__file__).resolve().parent / "chat_templates"
SMOLLM2_TOOLS_TEMPLATE = CHAT_TEMPLATES_DIR / "smollm2_hermes_tools.jinja"
_TOOLS_TEMPLATES = {
    "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788": SMOLLM2_TOOLS_TEMPLATE,
}


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation holds tool calls or tool results (which a template without a tools
    section does not render either)."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def shipped_template_for(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[Any] | None
) -> str | None:
    """The shipped template to render this conversation with: when it has tools or tool turns and the
    model's own template does not render them (see :func:`tools_template`); None otherwise."""
    if not (tools or has_tool_turns(messages)):
        return None
    if template_handles_tools(getattr(tokenizer, "chat_template", None)):
        return None
    return tools_template(tokenizer)


def tools_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The shipped template that renders a conversation with tools for this tokenizer, when its own
    chat template does not and pagedllm ships one for it (a template given with ``chat_template``
    replaces the model's own and gets none); None otherwise."""
    own = getattr(tokenizer, "chat_template", None)
    if not isinstance(own, str) or template_handles_tools(own):
        return None
    path = _TOOLS_TEMPLATES.get(hashlib.sha256(own.encode("utf-8")).hexdigest())
    return path.read_text(encoding="utf-8") if path is not None else None


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation; ``tools`` (OpenAI tool objects) need a template that
    renders them (ValueError otherwise: the model would never see them). A model whose own template
    has no tools section renders conversations with tools, or with tool calls and results in their
    history, with the template pagedllm ships for it (:func:`tools_template`), if any."""
    extra: dict[str, Any] = {}
    shipped = shipped_template_for(tokenizer, messages, tools)
    if shipped is not None:
        extra["chat_template"] = shipped
    elif tools and not template_handles_tools(getattr(tokenizer, "chat_template", None)):
        raise ValueError(
            "tools: the chat template does not render tools; load the model with chat_template= a "
            "template that does."
        )
    return str(
        tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=list[Any](tools) if tools else None,
            **extra,
        )
    )
