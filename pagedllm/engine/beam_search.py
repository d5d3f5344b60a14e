"""Beam search on top of the engine, scored and finished as HF transformers' ``early_stopping=True``.

Every step, each live beam of every prompt becomes an engine request for one token
(``max_tokens=1``) whose prompt is the beam's tokens so far, asking for the top log probabilities of
the next token. All of them go through the engine together, so the model runs over the whole set as
one batch, and beams that share a prefix reuse its full KV blocks through the prefix cache instead of
recomputing them.

The search per prompt follows ``GenerationMixin._beam_search`` of transformers:

* candidates are the ``K = max(2, 1 + num_eos) * beam_width`` continuations with the highest
  cumulative log probability over all beams (so at least ``beam_width`` of them do not end);
* a candidate ranked among the first ``beam_width`` that ends (an EOS token, or the ``max_tokens``-th
  generated token) is a finished hypothesis with score
  ``cum_logprob / generated_len ** length_penalty``, ``generated_len`` counting the EOS token; finished
  hypotheses are kept while fewer than ``beam_width`` are held, the best ``beam_width`` of them;
* the ``beam_width`` best candidates that do not end are the next step's beams;
* the search of a prompt stops once it holds ``beam_width`` finished hypotheses or ``max_tokens``
  tokens were generated.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagedllm.errors import RequestError
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


@dataclass
class _Beam:
    tokens: list[int]
    cum_logprob: float


@dataclass
class _PromptSearch:
    """The state of one prompt's search."""

    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.beams[0].tokens) - len(self.prompt_token_ids)


class BeamSearchRun:
    """The state of a beam search over a batch of prompts, advanced one token per step by a caller.

    The caller runs the one-token requests of :meth:`step_prompts` with :attr:`step_params` through an
    engine (synchronous or asynchronous) and hands their top next-token log probabilities, in the same
    order, to :meth:`advance`, until :attr:`done`. ``prompts`` are ``(text, token_ids)`` pairs.

    Raises ValueError if a prompt is empty or too long for ``max_tokens`` more tokens, or the beam width
    needs more log probabilities than ``max_logprobs``.
    """

    def __init__(
        self,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: BeamSearchParams,
        *,
        eos_token_ids: Sequence[int],
        max_logprobs: int,
        max_model_len: int,
    ) -> None:
        if params.temperature != 0.0:
            raise RequestError(None, "beam search is deterministic; temperature must be 0.")
        width = params.beam_width
        self.params = params
        self.eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * width
        if self.num_candidates > max_logprobs:
            raise RequestError(
                "beam_width",
                f"beam_width {width} needs the top {self.num_candidates} log probabilities per step, more "
                f"than the engine's max_logprobs={max_logprobs}.",
            )
        self.searches: list[_PromptSearch] = []
        for prompt_text, prompt_ids in prompts:
            if not prompt_ids:
                raise RequestError("prompt", "prompt must not be empty.")
            if len(prompt_ids) + params.max_tokens > max_model_len:
                raise RequestError(
                    "prompt",
                    f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_tokens} is longer than "
                    f"the model's maximum context length of {max_model_len} tokens.",
                )
            self.searches.append(_PromptSearch(prompt_text, list(prompt_ids), [_Beam(list(prompt_ids), 0.0)]))
        self.step_params = SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=self.num_candidates, ignore_eos=True
        )
        self._live: list[_PromptSearch] = []

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def step_prompts(self) -> list[list[int]]:
        """The token ids of every live beam of every unfinished prompt: this step's requests."""
        self._live = [s for s in self.searches if not s.done]
        return [beam.tokens for s in self._live for beam in s.beams]

    def advance(self, tops: Sequence[dict[int, Logprob]]) -> None:
        """Advance every unfinished prompt by one token, given the results of :meth:`step_prompts`."""
        it = iter(tops)
        for search in self._live:
            _advance(search, [next(it) for _ in search.beams], self.params, self.eos_ids, self.num_candidates)
        self._live = []

    def outputs(self, tokenizer: Any = None) -> list[BeamSearchOutput]:
        """One output per prompt, in order; ``tokenizer`` (if given) decodes each hypothesis' text."""
        if tokenizer is not None:
            for search in self.searches:
                for seq in search.finished:
                    seq.text = str(tokenizer.decode(seq.output_token_ids, skip_special_tokens=True))
        return [BeamSearchOutput(s.finished, s.prompt, s.prompt_token_ids) for s in self.searches]


def beam_search(
    engine: LLMEngine,
    prompts: Sequence[str | list[int]],
    params: BeamSearchParams,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """Beam search over ``prompts`` (strings or token-id lists); one output per prompt, in order.

    The engine must have no other requests in flight: its outputs are consumed here. Raises ValueError
    before running anything if a prompt is invalid, too long for ``max_tokens`` more tokens, or the
    beam width needs more log probabilities than the engine reports (``max_logprobs``).
    """
    run = BeamSearchRun(
        [engine.input_processor.tokenize(prompt) for prompt in prompts],
        params,
        eos_token_ids=engine.eos_token_ids,
        max_logprobs=engine.config.max_logprobs,
        max_model_len=engine.max_model_len,
    )
    prefix = f"beam-{uuid.uuid4().hex[:12]}-"
    counter = itertools.count()
    with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True) as bar:
        while not run.done:
            step_requests = [(f"{prefix}{next(counter)}", tokens) for tokens in run.step_prompts()]
            tops = _next_token_logprobs(engine, step_requests, run.step_params)
            run.advance([tops[rid] for rid, _ in step_requests])
            bar.update(1)
    return run.outputs(engine.tokenizer)


def _next_token_logprobs(
    engine: LLMEngine, requests: list[tuple[str, list[int]]], params: SamplingParams
) -> dict[str, dict[int, Logprob]]:
    """Run one-token requests through the engine; the top log probabilities of each, by request id."""
    pending: set[str] = set()
    try:
        for rid, tokens in requests:
            engine.add_request(rid, tokens, params)
            pending.add(rid)
        tops: dict[str, dict[int, Logprob]] = {}
        while pending:
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    logprobs = out.outputs[0].logprobs
                    assert logprobs, "a beam step request returned no logprobs"
                    tops[out.request_id] = logprobs[0]
                    pending.discard(out.request_id)
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with {len(pending)} beam requests unfinished")
    except BaseException:
        engine.abort_request(list(pending))
        raise
    return tops


def _advance(
    search: _PromptSearch,
    tops: list[dict[int, Logprob]],
    params: BeamSearchParams,
    eos_ids: set[int],
    num_candidates: int,
) -> None:
    """One step of one prompt's search, given the next-token log probabilities of each live beam."""
    width = params.beam_width
    generated = search.num_generated + 1  # length of every candidate's generated part
    at_max = generated >= params.max_tokens
    candidates: list[tuple[float, int, int]] = []  # (cumulative logprob, beam index, token)
    for b, (beam, top) in enumerate(zip(search.beams, tops, strict=True)):
        best = sorted(top.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_candidates]
        candidates.extend((beam.cum_logprob + lp.logprob, b, token) for token, lp in best)
    candidates.sort(key=lambda c: c[0], reverse=True)
    candidates = candidates[:num_candidates]

    running: list[_Beam] = []
    ended: list[BeamSearchSequence] = []
    for rank, (cum, b, token) in enumerate(candidates):
        tokens = search.beams[b].tokens + [token]
        is_eos = token in eos_ids
        if at_max or is_eos:
            # Only the top beam_width candidates may become finished hypotheses.
            if rank < width:
                ended.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        cum_logprob=cum,
                        num_prompt_tokens=len(search.prompt_token_ids),
                        score=cum / (generated**params.length_penalty),
                        finish_reason="stop" if is_eos else "length",
                    )
                )
        elif len(running) < width:
            running.append(_Beam(tokens, cum))

    if len(search.finished) < width and ended:
        merged = search.finished + ended
        merged.sort(key=lambda s: s.score, reverse=True)  # stable: earlier hypotheses win ties
        search.finished = merged[:width]
    search.beams = running
    search.done = at_max or len(search.finished) == width or not running
