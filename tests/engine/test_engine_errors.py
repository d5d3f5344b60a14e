"""Bad input is rejected with a field-named error and leaves the engine unchanged and working."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {5: 200.0}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"best_of": 3}, "best_of"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_rejected_requests_change_nothing(default_llm):
    engine = default_llm.llm_engine
    engine.check_idle()
    before = engine.get_stats()
    limit = engine.max_model_len
    with pytest.raises(ValueError, match=f"maximum context length is {limit} tokens"):
        default_llm.generate(["hello"], SamplingParams(max_tokens=limit), use_tqdm=False)
    with pytest.raises(ValueError, match=f"maximum context length is {limit} tokens"):
        default_llm.generate([[1] * (limit + 1)], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        default_llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        default_llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        default_llm.generate([[1, 2, 10**7]], use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        default_llm.generate(["hi"], SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        default_llm.generate(["hi"], SamplingParams(logprobs=50), use_tqdm=False)
    # A failure in the middle of a batch rolls back the requests added before it.
    with pytest.raises(ValueError, match="prompt"):
        default_llm.generate(["fine", "also fine", ""], use_tqdm=False)
    engine.check_idle()
    after = engine.get_stats()
    assert (after.num_free_blocks, after.num_running, after.num_waiting) == (
        before.num_free_blocks,
        0,
        0,
    )
    out = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
    engine.check_idle()


def test_abort_frees_blocks_at_any_point(default_llm):
    engine = default_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", "A long story about " * 20, params)
    engine.add_request("b", "Another one", params)
    engine.abort_request("b")  # still waiting
    engine.step()
    engine.step()
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_kv_blocks
    engine.abort_request("a")  # running
    engine.abort_request("never-existed")
    assert not engine.has_unfinished_requests()
    engine.check_idle()
