"""JSON schemas as EBNF grammars with compact JSON (no free whitespace).

Tool calls are constrained this way: with free whitespace a small model can spend its whole token
budget on blank lines inside a call; compact JSON (``{"a": 1, "b": [2, 3]}``) leaves it only the
values to choose, in fewer tokens.
"""

from __future__ import annotations

import json
from typing import Any


def compact_json_ebnf(schema: dict[str, Any]) -> str:
    """The EBNF grammar of JSON values that validate against ``schema``, written compactly.

    Raises ValueError describing the problem when xgrammar cannot convert the schema."""
    import xgrammar as xgr  # loads slowly; only needed here

    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"invalid JSON schema: {message}") from None
    return str(grammar)
