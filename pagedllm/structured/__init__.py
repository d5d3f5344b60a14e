"""Structured outputs: constraining generation to a JSON schema, a regex, a choice or an EBNF grammar.

Constraints are compiled with xgrammar (:class:`StructuredOutputManager`); each constrained sequence
carries a :class:`GrammarState` that the output processor advances with every token, and the model
runner masks the tokens its grammar does not allow (:func:`apply_grammar_bitmask`) before sampling.
"""

from pagedllm.structured.benchmark import StructuredThroughput, measure_structured_throughput
from pagedllm.structured.grammar import GrammarState, apply_grammar_bitmask
from pagedllm.structured.manager import StructuredOutputManager, choice_grammar, grammar_key

__all__ = [
    "GrammarState",
    "StructuredOutputManager",
    "StructuredThroughput",
    "apply_grammar_bitmask",
    "choice_grammar",
    "grammar_key",
    "measure_structured_throughput",
]
