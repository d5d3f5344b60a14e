"""``StructuredOutputsParams.after``: the grammar constrains only the tokens generated after a marker
(a reasoning model's ``</think>``); before it sampling is free and the matcher is not advanced."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.request import GatedGrammar, Request

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "What is 2 + 2? Reply in JSON."}]
MAX_TOKENS = 40


def ids(llm: Any, text: str) -> list[int]:
    return list(llm.get_tokenizer().encode(text, add_special_tokens=False))


def json_after(text: str, marker_text: str) -> Any:
    assert text.startswith(marker_text), (text, marker_text)
    value = json.loads(text[len(marker_text) :])
    jsonschema.validate(value, SCHEMA)
    return value


# -- the gate on its own ---------------------------------------------------------------------------


def test_gate_waits_for_the_whole_marker(default_llm: Any) -> None:
    engine = default_llm.llm_engine
    manager = engine.structured_output_manager
    compiled = manager.compile(StructuredOutputsParams(choice=["yes", "no"]))
    letter_a = ids(default_llm, "a")[0]
    yes = ids(default_llm, "yes")

    gate = GatedGrammar(manager.new_state(compiled), [5, 6])
    for token in (letter_a, 5, 5):  # anything goes; "5 5" is not yet "5 6"
        assert gate.accept_token(token)
        assert not gate.is_active and not gate.is_completed and not gate.is_terminated
    assert gate.accept_token(6) and gate.is_active
    assert not gate.accept_token(letter_a)  # now the grammar decides, from its start
    for token in yes:
        assert gate.accept_token(token)
    assert gate.is_completed
    assert gate.accept_token(engine.eos_token_ids[0]) and gate.is_terminated

    broken = GatedGrammar(manager.new_state(compiled), [5, 6])
    for token in (5, letter_a, 6):  # the marker's tokens, not contiguous
        assert broken.accept_token(token)
    assert not broken.is_active


def test_request_wraps_its_grammar_only_with_a_marker(default_llm: Any) -> None:
    manager = default_llm.llm_engine.structured_output_manager
    so = StructuredOutputsParams(regex=r"\d+")
    state = manager.new_state(manager.compile(so))
    plain = Request("a", [1, 2], SamplingParams(structured_outputs=so), 4, [0], grammar=state)
    assert plain.grammar is state and plain.grammar.is_active
    gated_so = StructuredOutputsParams(regex=r"\d+", after=[7, 8])
    gated = Request("b", [1, 2], SamplingParams(structured_outputs=gated_so), 4, [0], grammar=state)
    assert isinstance(gated.grammar, GatedGrammar) and gated.grammar.after == [7, 8]
    assert not gated.grammar.is_active


@pytest.mark.parametrize(
    ("after", "match"),
    [
        ([], "structured_outputs.after must be a non-empty list"),
        ([3, -1], "structured_outputs.after must contain non-negative integers, got -1"),
        ([True], "structured_outputs.after must contain non-negative integers, got True"),
        ("</think>", "structured_outputs.after must be a non-empty list"),
    ],
)
def test_bad_markers_name_the_field(after: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(json=SCHEMA, after=after)


def test_out_of_vocab_marker_is_refused_and_changes_nothing(default_llm: Any) -> None:
    engine = default_llm.llm_engine
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json=SCHEMA, after=[engine.vocab_size])
    )
    with pytest.raises(ValueError, match="structured_outputs.after contains out-of-vocab token id"):
        default_llm.generate("Hi", params, use_tqdm=False)
    engine.check_idle()


# -- in the engine ---------------------------------------------------------------------------------


def test_constraint_starts_after_the_marker(default_llm: Any) -> None:
    """One batch: a marker forced by logit_bias (a token the grammar never allows), a three-token
    marker the model generates on its own, a marker that never comes, and a plain grammar."""
    engine = default_llm.llm_engine
    prompt = engine.apply_chat_template(QUESTION)
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    unconstrained = default_llm.generate(prompt, free, use_tqdm=False)[0].outputs[0]
    # The first three tokens greedy decoding picks without a grammar: with the grammar delayed until
    # they have appeared, it picks them again, then the grammar takes over.
    own_marker = list(unconstrained.token_ids[:3])
    forced = ids(default_llm, "Answer")
    assert len(forced) == 1
    never = next(t for t in ids(default_llm, " Never seen marker") if t not in unconstrained.token_ids)

    def params(after: list[int] | None, **extra: Any) -> SamplingParams:
        so = StructuredOutputsParams(json=SCHEMA, after=after)
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so, **extra)

    outs = default_llm.generate(
        [prompt] * 4,
        [
            params(forced, logit_bias={forced[0]: 100}),
            params(own_marker),
            params([never]),
            params(None, logit_bias={forced[0]: 100}),
        ],
        use_tqdm=False,
    )
    forced_out, own_out, never_out, plain_out = (o.outputs[0] for o in outs)

    # The marker is generated unconstrained (the grammar allows no letter first), then valid JSON.
    assert forced_out.token_ids[0] == forced[0]
    json_after(forced_out.text, "Answer")
    assert forced_out.finish_reason == "stop"
    # Without the marker the same bias cannot win: the grammar holds from the first token.
    assert plain_out.token_ids[0] != forced[0]
    json_after(plain_out.text, "")

    marker_text = default_llm.get_tokenizer().decode(own_marker)
    assert list(own_out.token_ids[:3]) == own_marker
    json_after(own_out.text, marker_text)
    assert own_out.finish_reason == "stop"

    # A marker that never appears leaves the whole output unconstrained.
    assert never_out.token_ids == unconstrained.token_ids
    assert never_out.finish_reason == unconstrained.finish_reason
    engine.check_idle()
