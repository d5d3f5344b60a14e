"""``LLM.generate`` takes vLLM's prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``) as
it takes a string or a token list, and refuses any other dict naming the entry and the key, before
anything reaches the engine."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm import SamplingParams
from pagedllm.inputs import TextPrompt, TokensPrompt, parse_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TEXT = "The capital of France is"


def tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_prompt_dicts_give_what_strings_and_token_lists_give(default_llm: Any) -> None:
    ids = default_llm.get_tokenizer().encode(TEXT)
    bare = default_llm.generate([TEXT, ids], GREEDY, use_tqdm=False)
    text_prompt: TextPrompt = {"prompt": TEXT}
    tokens_prompt: TokensPrompt = {"prompt_token_ids": ids}
    dicts = default_llm.generate([text_prompt, tokens_prompt], GREEDY, use_tqdm=False)
    assert [tokens(o) for o in dicts] == [tokens(o) for o in bare]
    assert dicts[1].prompt_token_ids == ids and dicts[0].prompt == TEXT
    # One dict passed bare is one prompt; a mixed list keeps its order.
    (single,) = default_llm.generate(tokens_prompt, GREEDY, use_tqdm=False)
    assert tokens(single) == tokens(bare[1])
    mixed = default_llm.generate([tokens_prompt, TEXT, text_prompt], GREEDY, use_tqdm=False)
    assert [tokens(o) for o in mixed] == [tokens(bare[1]), tokens(bare[0]), tokens(bare[0])]
    default_llm.llm_engine.check_idle()


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([TEXT, {"prompt_token_ids": [1, 2], "foo": 1}], r"prompts\[1\]\.foo: unknown prompt key"),
        ([{"prompt": TEXT, "multi_modal_data": {"image": None}}], r"prompts\[0\]\.multi_modal_data: image"),
        ([{"prompt": TEXT, "cache_salt": "x"}], r"prompts\[0\]\.cache_salt"),
        ({"prompt": TEXT, "prompt_token_ids": [1]}, r"prompt: give 'prompt' or 'prompt_token_ids', not both"),
        ([{}], r"prompts\[0\]: a prompt dict needs 'prompt'"),
        ([{"prompt": 5}], r"prompts\[0\]\.prompt: must be a string"),
        ([{"prompt_token_ids": "1 2 3"}], r"prompts\[0\]\.prompt_token_ids: must be a list"),
        ([{"prompt_token_ids": [1, 2.5]}], r"prompts\[0\]\.prompt_token_ids\[1\]: token ids are integers"),
        ([TEXT, 3.5], r"prompts\[1\]: a prompt is a string"),
    ],
)
def test_other_dicts_are_refused_naming_the_key(default_llm: Any, prompts: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        default_llm.generate(prompts, GREEDY, use_tqdm=False)
    default_llm.llm_engine.check_idle()  # nothing was added: the first, valid prompt was not run either


def test_parse_prompt_keeps_strings_and_copies_token_lists() -> None:
    ids = (5, 6, 7)
    assert parse_prompt("hi") == "hi"
    assert parse_prompt(ids) == [5, 6, 7] and parse_prompt({"prompt_token_ids": ids}) == [5, 6, 7]
    with pytest.raises(ValueError, match=r"prompt\[0\]: token ids are integers, got bool"):
        parse_prompt([True, 2])


def test_served_names_follow_the_flag_then_the_model_as_given() -> None:
    from pagedllm.config import EngineConfig

    assert EngineConfig(served_model_name=["a", "b", "a"]).served_names("x") == ["a", "b"]
    assert EngineConfig(served_model_name="a").served_names("x") == ["a"]
    assert EngineConfig(model="org/repo").served_names("repo") == ["org/repo"]
    assert EngineConfig().served_names("SmolLM2-135M-Instruct") == ["SmolLM2-135M-Instruct"]
    for bad in ([], [""], ["a", 3], 5):
        with pytest.raises(ValueError, match="served_model_name"):
            EngineConfig(served_model_name=bad)  # type: ignore[arg-type]
