"""Compiling structured-output constraints (JSON schema, regex, choice, EBNF) with xgrammar."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from pagedllm.errors import RequestError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured.grammar import XGrammarState

# The cache key of a compiled grammar: its kind and the constraint as a string.
GrammarKey = tuple[str, str]

_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "EBNF grammar",
}

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The kind of constraint ``params`` sets and its canonical text.

    A JSON schema dict is serialised with its keys in their given order: xgrammar makes object
    properties follow the schema's order, so schemas differing only in key order are different.
    """
    if params.json is not None:
        if isinstance(params.json, str):
            return "json", params.json
        try:
            return "json", json.dumps(params.json)
        except (TypeError, ValueError) as e:
            raise RequestError(
                "structured_outputs", f"structured_outputs.json: invalid JSON schema (not serializable: {e})."
            ) from None
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(params.choice, ensure_ascii=False)
    if params.grammar is not None:
        return "grammar", params.grammar
    return "json_object", ""


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the literal strings ``choices``.

    JSON string escapes (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``) are valid in xgrammar's EBNF string
    literals, so each choice is written as its JSON string.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _describe(exc: Exception) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


class StructuredOutputManager:
    """Compiles structured-output constraints against one tokenizer and makes per-sequence matchers.

    ``vocab_size`` is the model's (the width of its logits), which may differ from the tokenizer's.
    ``stop_token_ids`` (the model's EOS ids) are what a matcher allows once its grammar is complete,
    so EOS can be sampled exactly when the output may end. Compiled grammars are kept in an LRU cache
    of ``cache_size`` entries keyed by :func:`grammar_key`, since compiling a schema costs far more
    than a decoding step.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        cache_size: int = 128,
        any_whitespace: bool = True,
        max_threads: int = 8,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}.")
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # Compiled grammars are cached here; xgrammar's own cache would keep them unboundedly.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.any_whitespace = any_whitespace
        self._cache: OrderedDict[GrammarKey, xgr.CompiledGrammar] = OrderedDict()
        # compile() is called from the engine thread and from the front end's worker threads.
        self._cache_lock = threading.Lock()
        self.num_compilations = 0

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params`` (cached). Raises ValueError naming an invalid constraint."""
        key = grammar_key(params)
        with self._cache_lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile(key)  # outside the lock: other grammars compile meanwhile
        with self._cache_lock:
            self.num_compilations += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, spec = key
        if kind == "json":
            try:
                json.loads(spec)
            except json.JSONDecodeError as e:
                raise RequestError(
                    "structured_outputs",
                    f"structured_outputs.json: invalid JSON schema (not valid JSON: {e}).",
                ) from None
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(spec, any_whitespace=self.any_whitespace)
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
            return self.compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise RequestError(
                "structured_outputs",
                f"structured_outputs.{kind}: invalid {_KIND_NAMES[kind]}: {_describe(e)}",
            ) from None

    def new_state(self, compiled: xgr.CompiledGrammar) -> XGrammarState:
        """A fresh matcher for one sequence."""
        return XGrammarState(compiled)

    def cache_info(self) -> dict[str, int]:
        return {"size": len(self._cache), "capacity": self.cache_size, "compilations": self.num_compilations}
