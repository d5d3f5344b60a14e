"""Stops, lengths, detokenization and the shape of outputs."""

from __future__ import annotations

import pytest

from pagedllm import RequestOutputKind, SamplingParams

PROMPT = "Count from one to ten in words: one, two, three,"


@pytest.fixture(scope="module")
def free_run(default_llm):
    out = default_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    return out.outputs[0]


def test_max_tokens_and_length_reason(default_llm, free_run):
    assert len(free_run.token_ids) == 30
    assert free_run.finish_reason == "length" and free_run.stop_reason is None
    tok = default_llm.get_tokenizer()
    assert free_run.text == tok.decode(free_run.token_ids, skip_special_tokens=True)


def test_stop_string_cut_or_kept(default_llm, free_run):
    stop = " six"
    assert stop in free_run.text
    out = default_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=stop))[0].outputs[
        0
    ]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free_run.text[: free_run.text.index(stop)]
    kept = default_llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == free_run.text[: free_run.text.index(stop) + len(stop)]
    default_llm.llm_engine.check_idle()


def test_stop_string_across_token_boundary(default_llm, free_run):
    # "ve, si" spans several tokens (" five", ",", " six").
    text = free_run.text
    assert "ve, si" in text
    out = default_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop="ve, si"))[0]
    assert out.outputs[0].text == text[: text.index("ve, si")]


def test_stop_token_ids_and_min_tokens(default_llm, free_run):
    target = free_run.token_ids[5]
    out = default_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[target])
    )[0].outputs[0]
    first = free_run.token_ids.index(target)
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # min_tokens forbids the stop token before it is reached, so the output differs.
    out = default_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[target], min_tokens=first + 2)
    )[0].outputs[0]
    assert target not in out.token_ids[: first + 2]


def test_eos_stops_unless_ignored(default_llm):
    tok = default_llm.get_tokenizer()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], tokenize=False, add_generation_prompt=True
    )
    out = default_llm.generate([chat], SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in default_llm.llm_engine.eos_token_ids
    assert len(out.token_ids) < 200
    ignored = default_llm.generate(
        [chat], SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5, ignore_eos=True)
    )[0].outputs[0]
    assert len(ignored.token_ids) == len(out.token_ids) + 5


def test_n_outputs_and_logprobs_shape(default_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=3, ignore_eos=True)
    out = default_llm.generate(["Tell me a word:"], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "seeded n > 1 still varies between samples"
    for o in out.outputs:
        assert len(o.logprobs) == 8
        for tok, step in zip(o.token_ids, o.logprobs, strict=True):
            assert tok in step and 3 <= len(step) <= 4
            assert all(lp.logprob <= 0 for lp in step.values())
        assert o.cumulative_logprob == pytest.approx(
            sum(s[t].logprob for t, s in zip(o.token_ids, o.logprobs, strict=True)), abs=1e-3
        )
    again = default_llm.generate(["Tell me a word:"], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    default_llm.llm_engine.check_idle()


def test_chat_and_token_prompts(default_llm):
    tok = default_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=8)
    by_chat = default_llm.chat([{"role": "user", "content": "What is 2+2?"}], params, use_tqdm=False)[0]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok.encode(text)
    by_ids = default_llm.generate([ids], params, use_tqdm=False)[0]
    assert by_chat.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_chat.outputs[0].token_ids
    assert by_ids.prompt is None and by_chat.prompt == text


def test_final_only_outputs(default_llm):
    """FINAL_ONLY requests give one output, the final one, with the cumulative request's tokens and
    text (their tokens are detokenized in one call at the end); cumulative requests give one output
    per step. The offline API uses FINAL_ONLY without touching the caller's parameters."""
    engine = default_llm.llm_engine
    cases = [
        ("Roses are red,", dict(temperature=0, max_tokens=8, n=2, seed=1)),
        ("Write a haiku about the sea.", dict(temperature=0.9, seed=3, max_tokens=48)),  # varied text
        (
            engine.apply_chat_template([{"role": "user", "content": "Hello"}]),
            # The greedy reply is 65 tokens with its EOS: room to spare, so that it ends on EOS.
            dict(temperature=0, max_tokens=128),
        ),
        ("Count: one, two,", dict(temperature=0, max_tokens=30, stop_token_ids=[28])),  # "," ends it
        ("Emoji party: ", dict(temperature=1.0, seed=9, max_tokens=40, skip_special_tokens=False)),
    ]
    seen: dict[str, list] = {}
    engine.pop_token_intervals()  # left by earlier users of the engine
    for i, (prompt, kwargs) in enumerate(cases):
        for kind in (
            RequestOutputKind.CUMULATIVE,
            RequestOutputKind.FINAL_ONLY,
        ):  # DELTA: test_output_processor
            rid = f"{kind.name}-{i}"
            seen[rid] = []
            engine.add_request(rid, prompt, SamplingParams(output_kind=kind, **kwargs))
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    engine.check_idle()
    for i in range(len(cases)):
        finals, cumulative = seen[f"FINAL_ONLY-{i}"], seen[f"CUMULATIVE-{i}"]
        assert len(finals) == 1 and finals[0].finished
        steps = len(cumulative)
        assert steps >= 1 and [o.finished for o in cumulative] == [False] * (steps - 1) + [True]
        got = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in finals[0].outputs]
        assert got == [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in cumulative[-1].outputs]
    # Token intervals (what the server's inter-token latency reports) for both kinds of output: one
    # per token after each sequence's first, then drained.
    intervals = engine.pop_token_intervals()
    finals = [c for outs in seen.values() for c in outs[-1].outputs]
    assert len(intervals) == sum(len(c.token_ids) - 1 for c in finals) and min(intervals) >= 0
    assert engine.pop_token_intervals() == []
    assert len(seen["CUMULATIVE-0"]) >= 8  # one per step (the second sequence starts a step later)
    ended = seen["FINAL_ONLY-2"][0].outputs[0]  # on EOS, which is not part of the text
    assert ended.finish_reason == "stop" and ended.token_ids[-1] in engine.eos_token_ids
    assert {c.finish_reason for i in range(len(cases)) for c in seen[f"FINAL_ONLY-{i}"][0].outputs} >= {
        "length",
        "stop",
    }

    params = SamplingParams(temperature=0, max_tokens=8)
    (out,) = default_llm.generate("Roses are red,", params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert out.finished and out.outputs[0].token_ids == seen["CUMULATIVE-0"][-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")
