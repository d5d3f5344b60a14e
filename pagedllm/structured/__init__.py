"""Structured outputs: constraining generation to a JSON schema, a regex, a choice or an EBNF grammar.

Constraints are compiled with xgrammar (:class:`StructuredOutputManager`); each constrained sequence
carries an :class:`XGrammarState` that the output processor advances with every token, and the model
runner masks the tokens its grammar does not allow (:func:`apply_grammar_bitmask`) before sampling.
"""

from pagedllm.structured.grammar import XGrammarState, apply_grammar_bitmask
from pagedllm.structured.manager import StructuredOutputManager, choice_grammar, grammar_key

__all__ = [
    "XGrammarState",
    "StructuredOutputManager",
    "apply_grammar_bitmask",
    "choice_grammar",
    "grammar_key",
]
