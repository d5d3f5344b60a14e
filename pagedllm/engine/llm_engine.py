"""The synchronous engine: add requests, run steps, get outputs."""

from __future__ import annotations

import atexit
import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.attention.selector import choose_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats
from pagedllm.model.loader import load_checkpoint
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request
from pagedllm.sample.sampler import DeviceSamples
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cuda_graphs import graph_memory_estimate
from pagedllm.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from pagedllm.worker.phase_times import StepPhaseTimes

if TYPE_CHECKING:
    from pagedllm.structured import StructuredOutputManager

logger = logging.getLogger("pagedllm")

_CPU_DEFAULT_KV_BYTES = 1 << 30


def _freeze_startup_objects() -> None:
    """``gc.freeze`` what exists now; unfrozen at exit, so that the interpreter's final collection
    still releases it (native bindings report objects left uncollected)."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


@dataclass
class LaunchedStep:
    """A step whose forward and sampling were launched: ``rows`` of
    ``scheduler_output.scheduled_requests`` get the tokens of ``sampled`` (still on the device until
    resolved)."""

    scheduler_output: SchedulerOutput
    rows: list[int]
    sampled: DeviceSamples | None

    @property
    def can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host."""
        return all(self.scheduler_output.scheduled_requests[r].request.can_sample_ahead for r in self.rows)


class LLMEngine:
    """Owns the scheduler, the KV cache manager, the model runner and the output processor.

    Not thread-safe: one thread drives ``add_request``/``step``/``abort_request``.

    With ``async_scheduling`` a step is scheduled and launched before the previous step's tokens are
    on the host (at most one step is in flight): each ``step`` launches step k + 1, then resolves
    step k (detokenization, stop checks, outputs) while the device computes. Requests in flight hold
    ``num_pending_tokens``; one that finishes on a token found at resolution (EOS, a stop string)
    has one more token computed by the step already launched, which is dropped. A step whose
    requests need their latest token on the host to sample the next (see
    ``Request.can_sample_ahead``) is resolved before the next is scheduled.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.perf_counter()
        ckpt = load_checkpoint(config.model)
        self.tokenizer = ckpt.tokenizer
        self.model_config = ckpt.config
        self.model_name = config.served_model_name or ckpt.name
        self.vocab_size = ckpt.config.vocab_size
        self.eos_token_ids = list(ckpt.config.eos_token_ids)
        model_max = ckpt.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} is larger than the model's limit of {model_max} tokens."
            )
        self.max_model_len = config.max_model_len or model_max
        self.device = resolve_device(config.device)
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        self._in_flight: LaunchedStep | None = None
        dtype = resolve_dtype(config.dtype, self.device)
        backend = choose_attention_backend(config.attention_backend, self.device, dtype)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(
            ckpt.config,
            ckpt.weights,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            device=self.device,
            dtype=dtype,
            attention_backend=backend,
        )
        del ckpt
        max_batched = config.max_num_batched_tokens or max(4096, config.max_num_seqs)
        num_blocks = self._num_kv_blocks(max_batched)
        self.runner.allocate_kv_cache(num_blocks)
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_cuda_graphs(config.max_num_seqs)
        elif self.device.type == "cpu" and not config.enforce_eager:
            self.runner.enable_native_decode()
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, max_batched), self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self._structured_output_manager: StructuredOutputManager | None = None
        self.num_prompt_tokens = 0
        self.step_times = StepPhaseTimes()
        self.num_generation_tokens = 0
        # The objects made so far (model, tokenizer, torch and transformers modules) live as long as
        # the engine: keep them out of the collector's full passes, which the per-step objects of a
        # few hundred running requests would otherwise trigger every few dozen steps.
        _freeze_startup_objects()
        tokens = num_blocks * config.block_size
        logger.info(
            "Loaded %s on %s (%s, %s attention) in %.1fs. KV cache: %d blocks x %d tokens = %d tokens "
            "(%.0f MiB); maximum concurrency for %d-token requests: %.2fx; scheduling ahead %s",
            self.model_name,
            self.device,
            str(dtype).removeprefix("torch."),
            backend,
            time.perf_counter() - t0,
            num_blocks,
            config.block_size,
            tokens,
            num_blocks * self.runner.kv_bytes_per_block / 2**20,
            self.max_model_len,
            tokens / self.max_model_len,
            "on" if self.async_scheduling else "off",
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    def _num_kv_blocks(self, max_num_batched_tokens: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget(max_num_batched_tokens)
        else:
            # Enough for max_num_seqs full-length sequences, capped at 1 GiB.
            blocks_needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
            budget = min(_CPU_DEFAULT_KV_BYTES, blocks_needed * per_block)
        num = budget // per_block
        if num < 1:
            raise ValueError(f"not enough memory for a single KV block ({per_block} bytes).")
        return int(num)

    def _cuda_kv_budget(self, max_num_batched_tokens: int) -> int:
        """KV cache bytes on a GPU, after profiling a forward at ``max_num_batched_tokens``.

        ``gpu_memory_utilization`` of the device's memory, less the profiled peak of torch's allocator
        (weights and activations), less what is held outside it (the CUDA context, other processes),
        less a margin for the decode CUDA graphs.
        """
        cfg = self.config
        peak = self.runner.profile_peak_memory(max_num_batched_tokens, cfg.max_num_seqs)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(self.device))
        graphs = 0
        if not cfg.enforce_eager and self.runner.backend.name == "triton":
            graphs = graph_memory_estimate(self.model_config, cfg.max_num_seqs, self.runner.dtype)
        budget = int(total * cfg.gpu_memory_utilization) - peak - non_torch - graphs
        per_block = self.runner.kv_bytes_per_block
        logger.info(
            "GPU memory: %.2f GiB total x %.2f utilization; peak of a %d-token forward %.2f GiB (weights "
            "%.2f GiB), outside torch %.2f GiB, CUDA graph margin %.2f GiB -> KV cache %.2f GiB = %d blocks",
            total / 2**30,
            cfg.gpu_memory_utilization,
            max_num_batched_tokens,
            peak / 2**30,
            torch.cuda.memory_allocated(self.device) / 2**30,
            non_torch / 2**30,
            graphs / 2**30,
            max(budget, 0) / 2**30,
            max(budget, 0) // per_block,
        )
        return budget

    # -- requests ---------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty.")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt contains token id {t!r} outside the vocabulary (size {self.vocab_size})."
                )
        return None, ids

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError (changing nothing) on bad input."""
        params = params or SamplingParams()
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, ids = self._tokenize(prompt)
        params.verify_vocab(self.vocab_size)
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be at most {self.config.max_logprobs}, got {params.logprobs}.")
        grammar = (
            self.structured_output_manager.compile(params.structured_outputs)
            if params.structured_outputs is not None
            else None
        )
        if params.prompt_logprobs is not None and params.prompt_logprobs > self.config.max_logprobs:
            raise ValueError(
                f"prompt_logprobs must be at most {self.config.max_logprobs}, got {params.prompt_logprobs}."
            )
        n_prompt = len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max(max_tokens, 1) > self.max_model_len or max_tokens < 1:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion."
            )
        bs = self.config.block_size
        if -(-(n_prompt + max_tokens) // bs) > self.kv_cache_manager.pool.num_blocks:
            raise ValueError(
                f"prompt of {n_prompt} tokens plus max_tokens={max_tokens} needs more KV cache than the "
                f"engine has ({self.kv_cache_manager.pool.num_blocks} blocks of {bs} tokens)."
            )
        bad_words = self._bad_words_ids(params.bad_words) if params.bad_words else []
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children: list[Request] = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(
                request_id=child_id,
                prompt_token_ids=ids,
                params=params,
                max_tokens=max_tokens,
                eos_token_ids=self.eos_token_ids,
                arrival_time=arrival,
                prompt=text,
                parent_id=request_id,
                index=i,
                bad_words_token_ids=bad_words,
                grammar=self.structured_output_manager.new_state(grammar) if grammar is not None else None,
                prefill_leader=children[0] if children else None,
            )
            children.append(req)
        self.output_processor.add_request(request_id, text, children)
        for req in children:
            self.scheduler.add_request(req)

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Grammar compilation for structured outputs, set up on first use (xgrammar loads slowly)."""
        if self._structured_output_manager is None:
            from pagedllm.structured import StructuredOutputManager

            self._structured_output_manager = StructuredOutputManager(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._structured_output_manager

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (by the id given to add_request); their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            child_ids = self.output_processor.child_ids(rid)
            self.scheduler.abort_requests(child_ids)
            self.output_processor.remove(rid)
        self._settle()

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run the model once; returns the requests that progressed.

        With ``async_scheduling`` the outputs are those of the step launched by the previous call.
        """
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if previous is not None and not previous.can_run_ahead:
            outputs = self._resolve(previous)
            previous = None
        try:
            launched = self._launch()
        except BaseException:
            self._in_flight = previous
            raise
        if previous is not None:
            outputs += self._resolve(previous)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
                self._settle()
            else:
                outputs += self._resolve(launched)
        return outputs

    def _settle(self) -> None:
        """Resolve the step in flight once every request in it has finished (all its tokens would be
        dropped), so that an engine without requests holds no step."""
        step = self._in_flight
        if step is not None and all(
            scheduled.request.is_finished for scheduled in step.scheduler_output.scheduled_requests
        ):
            self._in_flight = None
            self._resolve(step)

    def _launch(self) -> LaunchedStep | None:
        """Schedule a step and launch its forward and sampling (None when nothing is scheduled)."""
        times = self.step_times
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return None
        times.steps += 1
        times.schedule += time.perf_counter() - started
        try:
            rows, sampled = self.runner.launch(scheduler_output, times)
        except BaseException:
            self.kv_cache_manager.uncache(
                scheduler_output.newly_cached_blocks
            )  # registered for content that was never written
            raise
        for scheduled in scheduler_output.scheduled_requests:
            req = scheduled.request
            start = req.num_computed_tokens
            if start < req.num_prompt_tokens:
                self.num_prompt_tokens += min(start + scheduled.num_tokens, req.num_prompt_tokens) - start
            if scheduled.needs_sample:  # the rows that get a token
                req.num_pending_tokens += 1
        self.scheduler.update_after_step(scheduler_output)
        return LaunchedStep(scheduler_output, rows, sampled)

    def _resolve(self, step: LaunchedStep) -> list[RequestOutput]:
        """Bring a launched step's tokens to the host: stop checks, detokenization, outputs."""
        if step.sampled is None:
            return []
        started = time.perf_counter()
        sampled = step.sampled.output()  # waits for the device: counted with sampling
        self.step_times.sample += time.perf_counter() - started
        started = time.perf_counter()
        touched: dict[str, None] = {}
        scheduled = step.scheduler_output.scheduled_requests
        process_token = self.output_processor.process_token
        now = time.monotonic()
        generated = 0
        for j, row in enumerate(step.rows):
            req = scheduled[row].request
            req.num_pending_tokens -= 1
            if req.status.finished:
                continue  # finished (or aborted) while this step was in flight: its token is dropped
            generated += 1
            status = process_token(
                req, sampled.token_ids[j], sampled.sampled_logprobs[j], sampled.logprobs[j], now
            )
            if status is not None:
                self.scheduler.finish_request(req, status)
            assert req.parent_id is not None
            touched[req.parent_id] = None
        self.num_generation_tokens += generated
        outputs = []
        for pid in touched:
            parent = self.output_processor.parents.get(pid)
            if parent is None or (parent.final_only and not parent.finished):
                continue
            output = parent.output()
            outputs.append(output)
            if output.finished:
                self.output_processor.remove(pid)
        self.step_times.outputs += time.perf_counter() - started
        return outputs

    # -- introspection ----------------------------------------------------------------------
    def pop_token_intervals(self) -> list[float]:
        """Seconds between successive tokens of each sequence since the previous call (the latest
        65,536 at most), in the order the tokens came."""
        intervals = self.output_processor.token_intervals
        out = list(intervals)
        intervals.clear()
        return out

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage(),
            num_kv_blocks=self.kv_cache_manager.pool.num_blocks,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.stats.queries,
            prefix_cache_hits=self.kv_cache_manager.stats.hits,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
        )

    def check_idle(self) -> None:
        """Assert no request is left and every KV block is free (cached or not)."""
        assert not self.scheduler.has_unfinished_requests(), "requests still queued"
        assert self._in_flight is None, "a step is still in flight"
        assert not self.output_processor.parents, "request state left behind"
        self.kv_cache_manager.check_idle()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )
