"""The offline API: ``LLM(model=None, **engine_args).generate(prompts, sampling_params)``."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchOutput, beam_search
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import RequestError
from pagedllm.inputs import PromptType, parse_prompt
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Prompt = PromptType
Message = dict[str, Any]


class LLM:
    """Offline batched generation on top of :class:`LLMEngine`.

    ``model`` None loads the default model (SmolLM2-135M-Instruct). Keyword arguments are engine
    arguments (see :class:`pagedllm.config.EngineConfig`). With ``multiprocess=True`` the model runs
    in engine-core processes (``data_parallel_size`` of them, requests routed by cached prefix, or in
    turn with ``data_parallel_routing="round_robin"``) and
    this process only tokenizes, sends and collects; outputs are the same. Their processes stop with
    :meth:`shutdown`, when the ``LLM`` is garbage collected, or at exit.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        multiprocess: bool = False,
        data_parallel_size: int = 1,
        data_parallel_routing: str = "prefix",
        **engine_args: Any,
    ) -> None:
        config = EngineConfig(model=model, **engine_args)
        self.llm_engine: LLMEngine
        if multiprocess:
            from pagedllm.engine.proc.mp_llm_engine import MPLLMEngine

            # It offers the part of LLMEngine's interface that LLM and beam search use.
            self.llm_engine = cast(LLMEngine, MPLLMEngine(config, data_parallel_size, data_parallel_routing))
        elif data_parallel_size != 1:
            raise ValueError("data_parallel_size: more than one engine core needs multiprocess=True.")
        else:
            self.llm_engine = LLMEngine.from_config(config)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine-core processes (``multiprocess=True``; nothing to do otherwise)."""
        stop = getattr(self.llm_engine, "shutdown", None)
        if stop is not None:
            stop()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters used when none are given: the built-in defaults with the model's
        generation-config defaults (see the ``generation_config`` engine argument) applied."""
        defaults: dict[str, Any] = dict(self.llm_engine.default_sampling)
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of ``prompts``.

        ``prompts`` are strings, token-id lists or vLLM's prompt dicts (``{"prompt": text}``,
        ``{"prompt_token_ids": ids}``; :mod:`pagedllm.inputs`); a single one may be passed bare.
        ``sampling_params`` is one for all prompts or one per prompt; None means
        :meth:`get_default_sampling_params`. ``priority``: one integer per prompt, for an engine
        with ``scheduling_policy="priority"`` (lower values run first). ``lora_request``: the adapter
        every prompt runs with, or one per prompt (None entries: the base model), for an engine with
        ``enable_lora=True``.
        """
        self._require_task("generate", "LLM.generate")
        prompt_list = _as_prompt_list(prompts)
        loras = _per_prompt(lora_request, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(
                f"priority has {len(priorities)} entries but there are {len(prompt_list)} prompts."
            )
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts."
                )
        # Only final outputs are returned, so no per-step snapshots are built (the caller's objects
        # are left as they are).
        final_only: dict[int, SamplingParams] = {}
        for params in params_list:
            if isinstance(params, SamplingParams) and id(params) not in final_only:
                final_only[id(params)] = copy.copy(params)
                final_only[id(params)].output_kind = RequestOutputKind.FINAL_ONLY
        params_list = [final_only.get(id(params), params) for params in params_list]
        ids = []
        try:
            for prompt, params, urgency, lora in zip(
                prompt_list, params_list, priorities, loras, strict=True
            ):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, params, priority=urgency, lora_request=lora)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (chat template applied).

        ``tools`` (OpenAI tool objects) are rendered by the chat template, which must have a tool
        section; the replies are the model's text (parse calls with
        :func:`pagedllm.entrypoints.openai.tool_parsers.get_tool_parser`)."""
        conversations: list[list[Message]]
        if messages and isinstance(messages[0], dict):
            conversations = [messages]  # type: ignore[list-item]
        else:
            conversations = messages  # type: ignore[assignment]
        prompts: list[Prompt] = [
            self.llm_engine.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tools=tools
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """Beam search (scored as HF transformers with ``early_stopping=True``), one output per prompt.

        Each output's ``sequences`` are its ``beam_width`` finished hypotheses, best first; see
        :mod:`pagedllm.engine.beam_search`.
        """
        return beam_search(self.llm_engine, _as_prompt_list(prompts), params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``output.outputs.embedding``), in the order of ``prompts``.

        Needs an engine with ``task="embed"`` (the default for encoder models such as
        all-MiniLM-L6-v2). ``pooling_params`` is one for all prompts or one per prompt.
        """
        self._require_task("embed", "LLM.embed")
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"pooling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts."
                )
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, params)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Embedded prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while len(finished) < len(ids):
                outputs = engine.step_pooling()
                for out in outputs:
                    finished[out.request_id] = out
                bar.update(len(outputs))
                if len(finished) < len(ids) and not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(ids) - len(finished)} prompts unembedded")
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def _require_task(self, task: str, method: str) -> None:
        engine = self.llm_engine
        if engine.task != task:
            raise ValueError(
                f"{method} needs an engine with task '{task}', but this one ({engine.model_name}) runs task "
                f"'{engine.task}': create it with LLM(model, task='{task}')."
            )

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        out_tokens = 0
        start = time.perf_counter()
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"output {out_tokens / max(elapsed, 1e-9):.1f} tok/s")
                        bar.update(1)
                if pending and not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """One prompt (a string, a token list or a prompt dict) or a sequence of them, as the engine takes
    them (see :func:`pagedllm.inputs.parse_prompt`; errors name the entry)."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [parse_prompt(items)]
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(items)]


def _per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, str | bytes) or not isinstance(lora_request, Sequence):
        raise RequestError(
            "lora_request",
            f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}.",
        )
    loras = list(lora_request)
    if len(loras) != count:
        raise RequestError(
            "lora_request", f"lora_request has {len(loras)} entries but there are {count} prompts."
        )
    return loras
