"""The output processor on its own, with a tokenizer whose every token is a fixed string: stop strings
across token boundaries, holding back a possible stop string while streaming, stop and length
reasons, ``min_tokens``, ``n > 1`` aggregation and final-only outputs. Tokens are fed as the engine
feeds them (``process_token``, then one snapshot per request that got a token), so no model is loaded.
"""

from __future__ import annotations

import functools
import time

import pytest

from pagedllm.engine.delta_outputs import OutputAccumulator, merge_deltas
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

VOCAB = [
    "<eos>",
    "<bos>",
    "Hello",
    " world",
    "EN",
    "D",
    "E",
    "ND",
    "N",
    "Xyz",
    "ST",
    "OP",
    "S",
    "TO",
    "P",
    "xST",
    "OPy",
    "ab",
    "cd",
    "ef",
    "xx",
    ".",
    "!",
]
ID = {text: i for i, text in enumerate(VOCAB)}
EOS = ID["<eos>"]
SPECIAL = {EOS, ID["<bos>"]}
PROMPT = [ID["<bos>"], ID["Hello"], ID[" world"]]


class FakeTokenizer:
    """Each token id decodes to its fixed string; no fast backend, so the detokenizer decodes windows."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))


def ids(*texts: str) -> list[int]:
    return [ID[t] for t in texts]


class Driver:
    """The engine's side of the processor: requests added as ``LLMEngine.add_request`` makes them,
    tokens resolved as ``LLMEngine._resolve`` does."""

    def __init__(self, max_model_len: int = 64) -> None:
        self.processor = OutputProcessor(FakeTokenizer(), max_model_len)

    def add(self, request_id: str, params: SamplingParams, prompt: list[int] = PROMPT) -> list[Request]:
        max_tokens = params.max_tokens if params.max_tokens is not None else 32
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{i}_{request_id}",
                prompt_token_ids=prompt,
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=[EOS],
                prompt="<prompt>",
                parent_id=request_id,
                index=i,
                status=RequestStatus.RUNNING,
            )
            for i in range(params.n)
        ]
        self.processor.add_request(request_id, "<prompt>", children)
        return children

    def step(self, tokens: list[tuple[Request, int]]) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, None] = {}
        for req, token_id in tokens:
            assert not req.is_finished, "the test fed a finished sequence"
            top = {token_id: Logprob(logprob=-0.25 * (token_id + 1), rank=1)}
            status = self.processor.process_token(req, token_id, -0.25 * (token_id + 1), top, now)
            if status is not None:
                req.status = status  # Scheduler.finish_request
            assert req.parent_id is not None
            touched[req.parent_id] = None
        outputs = []
        for pid in touched:
            parent = self.processor.parents.get(pid)
            if parent is None or (parent.final_only and not parent.finished):
                continue
            output = parent.output()
            outputs.append(output)
            if output.finished:
                self.processor.remove(pid)
        return outputs

    def run(self, params: SamplingParams, tokens: list[int]) -> list[RequestOutput]:
        """Feed one sequence ``tokens`` until it finishes; every snapshot, in order. All of
        ``tokens`` must be consumed: a test names exactly the tokens up to the end."""
        (req,) = self.add("r", params)
        outputs: list[RequestOutput] = []
        for i, token_id in enumerate(tokens):
            outputs += self.step([(req, token_id)])
            if req.is_finished:
                assert i == len(tokens) - 1, f"finished after {i + 1} of {len(tokens)} tokens"
                break
        assert req.is_finished, "the sequence did not finish"
        assert not self.processor.parents and not self.processor.sequences
        return outputs


def final(outputs: list[RequestOutput]) -> CompletionOutput:
    assert outputs and outputs[-1].finished
    assert all(not o.finished for o in outputs[:-1])
    return outputs[-1].outputs[0]


# -- stop strings ---------------------------------------------------------------------------


STOP_SPLITS = [
    pytest.param(["Hello", "ST", "OP"], "Hello", id="two-tokens"),
    pytest.param(["Hello", "S", "TO", "P"], "Hello", id="three-tokens"),
    pytest.param(["Hello", "xST", "OPy"], "Hellox", id="text-around-the-stop"),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("tokens", "before"), STOP_SPLITS)
def test_stop_string_across_token_boundaries(include: bool, tokens: list[str], before: str) -> None:
    params = SamplingParams(max_tokens=10, stop=["STOP"], include_stop_str_in_output=include)
    out = final(Driver().run(params, ids(*tokens)))
    assert out.finish_reason == "stop" and out.stop_reason == "STOP"
    # The text after the stop string (in its last token) is dropped either way.
    assert out.text == before + ("STOP" if include else "")
    assert out.token_ids == ids(*tokens)


def test_earliest_stop_string_wins() -> None:
    """Two stop strings complete with one token; the one that starts first ends the text."""
    params = SamplingParams(max_tokens=10, stop=["OP", "STOP", "Hello"])
    out = final(Driver().run(params, ids(" world", "ST", "OP")))
    assert out.text == " world" and out.stop_reason == "STOP"


def test_stop_string_inside_one_token() -> None:
    params = SamplingParams(max_tokens=10, stop=["yz"])
    out = final(Driver().run(params, ids("ab", "Xyz")))
    assert out.text == "abX" and out.stop_reason == "yz" and out.finish_reason == "stop"


def test_stop_string_in_the_prompt_does_not_stop() -> None:
    params = SamplingParams(max_tokens=2, stop=["Hello world"])
    out = final(Driver().run(params, ids(" world", "!")))
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == " world!"


# -- holding back a possible stop string while streaming -------------------------------------


def test_streaming_holds_back_a_possible_stop_string() -> None:
    params = SamplingParams(max_tokens=4, stop=["END"])
    outputs = Driver().run(params, ids("Hello", "EN", "Xyz", "!"))
    texts = [o.outputs[0].text for o in outputs]
    # After "EN" the text could still become "END": those two characters wait.
    assert texts[1] == "Hello"
    # "Xyz" proves it was not a stop string: "EN" appears (the last characters still wait).
    assert texts[2] == "HelloENX"
    # Finished (by length): nothing is held back.
    assert texts[3] == "HelloENXyz!" and outputs[3].outputs[0].finish_reason == "length"
    assert texts[0] == "Hel"  # the hold is the longest stop string's length less one, whatever the text
    for earlier, later in zip(texts, texts[1:], strict=False):
        assert later.startswith(earlier), "streamed text was taken back"


@pytest.mark.parametrize("tokens", [["Hello", "EN", "D"], ["Hello", "E", "ND"]], ids=["EN|D", "E|ND"])
def test_streaming_never_shows_part_of_a_stop_string(tokens: list[str]) -> None:
    params = SamplingParams(max_tokens=10, stop=["END"])
    outputs = Driver().run(params, ids(*tokens))
    texts = [o.outputs[0].text for o in outputs]
    assert texts[-1] == "Hello" and outputs[-1].outputs[0].stop_reason == "END"
    assert all("E" not in t for t in texts)
    for earlier, later in zip(texts, texts[1:], strict=False):
        assert later.startswith(earlier)


def test_no_hold_back_when_the_stop_string_is_kept() -> None:
    params = SamplingParams(max_tokens=10, stop=["END"], include_stop_str_in_output=True)
    outputs = Driver().run(params, ids("Hello", "EN", "D"))
    assert [o.outputs[0].text for o in outputs] == ["Hello", "HelloEN", "HelloEND"]


def test_max_tokens_releases_the_held_text() -> None:
    params = SamplingParams(max_tokens=2, stop=["END"])
    out = final(Driver().run(params, ids("Hello", "EN")))
    assert out.text == "HelloEN" and out.finish_reason == "length" and out.stop_reason is None


# -- EOS, stop token ids, lengths, min_tokens ------------------------------------------------


def test_eos_stops_and_stays_out_of_the_text() -> None:
    params = SamplingParams(max_tokens=10, skip_special_tokens=False)
    out = final(Driver().run(params, ids("Hello", "<eos>")))
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == ids("Hello", "<eos>")
    assert out.text == "Hello"  # not "Hello<eos>", though special tokens are kept


def test_ignore_eos_runs_to_max_tokens() -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, skip_special_tokens=False)
    out = final(Driver().run(params, ids("Hello", "<eos>", " world", "<eos>")))
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == ids("Hello", "<eos>", " world", "<eos>")
    assert out.text == "Hello<eos> world<eos>"


def test_stop_token_id_stops_with_it_as_the_reason() -> None:
    params = SamplingParams(max_tokens=10, stop_token_ids=[ID["."]])
    out = final(Driver().run(params, ids("Hello", "!", ".")))
    assert out.finish_reason == "stop" and out.stop_reason == ID["."]
    assert out.token_ids == ids("Hello", "!", ".")
    assert out.text == "Hello!"


def test_max_tokens_and_context_length() -> None:
    out = final(Driver().run(SamplingParams(max_tokens=3), ids("Hello", " world", "!")))
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == "Hello world!" and len(out.token_ids) == 3
    # The context ends first: 3 prompt tokens + 2 output tokens reach max_model_len = 5.
    out = final(Driver(max_model_len=5).run(SamplingParams(max_tokens=10), ids("ab", "cd")))
    assert out.finish_reason == "length" and out.text == "abcd"


@pytest.mark.parametrize(
    ("params", "tokens", "text", "stop_reason"),
    [
        pytest.param(SamplingParams(min_tokens=3), ["Hello", "<eos>", "<eos>"], "Hello", None, id="eos"),
        pytest.param(
            SamplingParams(min_tokens=3, stop_token_ids=[ID["."]]),
            ["Hello", ".", "."],
            "Hello.",
            ID["."],
            id="stop-token-id",
        ),
        pytest.param(
            SamplingParams(min_tokens=3, stop=["!"]), ["Hello", "!", "!"], "Hello!", "!", id="stop-string"
        ),
    ],
)
def test_min_tokens_defers_stops(
    params: SamplingParams, tokens: list[str], text: str, stop_reason: int | str | None
) -> None:
    """A stop before the ``min_tokens``-th token does not stop; the same stop at it does."""
    out = final(Driver().run(params, ids(*tokens)))
    assert out.finish_reason == "stop" and out.stop_reason == stop_reason
    assert out.token_ids == ids(*tokens) and out.text == text


@pytest.mark.parametrize(
    "stops",
    [
        pytest.param(["ab"], id="alone"),
        pytest.param(["ab", "wxyz"], id="with-a-longer-stop-string"),
    ],
)
def test_stop_string_completed_before_min_tokens_does_not_stop_later(stops: list[str]) -> None:
    params = SamplingParams(max_tokens=4, min_tokens=3, stop=stops)
    out = final(Driver().run(params, ids("xx", "ab", "cd", "ef")))
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.text == "xxabcdef"


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_collected_only_when_asked() -> None:
    tokens = ids("Hello", " world", "!")
    out = final(Driver().run(SamplingParams(max_tokens=3, logprobs=1), tokens))
    assert out.cumulative_logprob == pytest.approx(sum(-0.25 * (t + 1) for t in tokens))
    assert out.logprobs is not None and [list(step) for step in out.logprobs] == [[t] for t in tokens]
    out = final(Driver().run(SamplingParams(max_tokens=3), tokens))
    assert out.cumulative_logprob is None and out.logprobs is None


# -- n > 1 and final-only outputs -----------------------------------------------------------


def test_n_siblings_make_one_output() -> None:
    driver = Driver()
    c0, c1 = driver.add("r", SamplingParams(n=2, max_tokens=3))
    assert driver.processor.child_ids("r") == ["0_r", "1_r"]

    (out,) = driver.step([(c1, ID["Hello"]), (c0, ID["ab"])])  # fed out of index order
    assert out.request_id == "r" and not out.finished
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [(0, "ab", None), (1, "Hello", None)]

    (out,) = driver.step([(c0, ID["cd"]), (c1, EOS)])
    assert not out.finished, "one sibling is still running"
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [
        (0, "abcd", None),
        (1, "Hello", "stop"),
    ]

    (out,) = driver.step([(c0, ID["ef"])])
    assert out.finished
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in out.outputs] == [
        (0, "abcdef", ids("ab", "cd", "ef"), "length"),
        (1, "Hello", ids("Hello", "<eos>"), "stop"),
    ]
    assert out.metrics is not None and out.metrics.finished_time is not None
    assert not driver.processor.parents and not driver.processor.sequences


SCRIPTS = [
    pytest.param(dict(max_tokens=4), [["Hello", " world", "!", "."]], id="length"),
    pytest.param(dict(max_tokens=10), [["Hello", " world", "<eos>"]], id="eos"),
    pytest.param(dict(max_tokens=10, stop_token_ids=[ID["!"]]), [["Hello", "!"]], id="stop-token-id"),
    pytest.param(dict(max_tokens=10, stop=["STOP"]), [["Hello", "S", "TO", "P"]], id="stop-string"),
    pytest.param(dict(max_tokens=3, stop=["END"]), [["Hello", "E", "N"]], id="held-back-then-length"),
    pytest.param(
        dict(n=2, max_tokens=3),
        [["ab", "cd", "ef"], ["Hello", "<eos>"]],
        id="n2",
    ),
    pytest.param(
        dict(n=2, max_tokens=4, stop=["OP"]),
        [["ab", "ST", "OPy"], ["Hello", "EN", "D", "!"]],
        id="n2-stop-string",
    ),
]


def run_siblings(kind: RequestOutputKind, kwargs: dict, scripts: list[list[str]]) -> list[RequestOutput]:
    """Feed each sibling its script, all siblings in one step, until every one has finished."""
    driver = Driver()
    children = driver.add("r", SamplingParams(output_kind=kind, **kwargs))
    outputs = []
    for step in range(max(map(len, scripts))):
        tokens = [(c, ID[s[step]]) for c, s in zip(children, scripts, strict=True) if step < len(s)]
        outputs += driver.step(tokens)
    assert all(c.is_finished for c in children), "a script did not end its sequence"
    assert not driver.processor.parents
    return outputs


@pytest.mark.parametrize(("kwargs", "scripts"), SCRIPTS)
def test_final_only_gives_the_cumulative_final_output(kwargs: dict, scripts: list[list[str]]) -> None:
    cumulative = run_siblings(RequestOutputKind.CUMULATIVE, kwargs, scripts)
    finals = run_siblings(RequestOutputKind.FINAL_ONLY, kwargs, scripts)
    assert len(cumulative) == max(map(len, scripts)), "one snapshot per step"
    assert len(finals) == 1 and finals[0].finished

    def fields(out: RequestOutput) -> list[tuple]:
        return [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in out.outputs]

    assert fields(finals[0]) == fields(cumulative[-1])
    assert [o.index for o in finals[0].outputs] == list(range(len(scripts)))


@pytest.mark.parametrize(("kwargs", "scripts"), SCRIPTS)
def test_delta_outputs_add_up_to_the_cumulative_ones(kwargs: dict, scripts: list[list[str]]) -> None:
    """DELTA outputs, one per step as cumulative ones, carry only what is new: added up, every one
    gives the cumulative snapshot of its step (text held back for a stop string included, so no
    delta is ever taken back); each sequence's finish comes once, the prompt logprobs first."""
    kwargs = dict(kwargs, logprobs=1, prompt_logprobs=0)
    cumulative = run_siblings(RequestOutputKind.CUMULATIVE, kwargs, scripts)
    deltas = run_siblings(RequestOutputKind.DELTA, kwargs, scripts)
    assert len(deltas) == len(cumulative)
    acc = OutputAccumulator(len(scripts))

    def fields(out: RequestOutput) -> list[tuple]:
        # A cumulative snapshot's logprobs are the sequence's own list, which later steps extend.
        return [
            (o.index, o.text, o.token_ids, (o.logprobs or [])[: len(o.token_ids)], o.cumulative_logprob)
            + (o.finish_reason, o.stop_reason)
            for o in out.outputs
        ]

    sent_tokens = [0] * len(scripts)
    for step, (delta, want) in enumerate(zip(deltas, cumulative, strict=True)):
        assert (delta.prompt_logprobs is not None) == (step == 0)
        for c in delta.outputs:
            assert len(c.token_ids) <= 1 and c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            sent_tokens[c.index] += len(c.token_ids)
        got = acc.add(delta)
        assert fields(got) == fields(want) and got.finished == want.finished
        assert got.prompt_logprobs == want.prompt_logprobs
    finishes = [c.index for d in deltas for c in d.outputs if c.finish_reason is not None]
    assert sorted(finishes) == list(range(len(scripts))), "each sequence's finish comes once"
    assert sent_tokens == [len(c.token_ids) for c in cumulative[-1].outputs]
    # A caller that fell behind gets the deltas queued for it merged into one: the same in the end.
    merged = functools.reduce(merge_deltas, deltas)
    assert merged.prompt_logprobs == deltas[0].prompt_logprobs and merged.finished
    assert fields(OutputAccumulator(len(scripts)).add(merged)) == fields(got)
