"""Draft-model speculation: a second, smaller model that shares the target's tokenizer proposes each
request's draft tokens, greedily, from a paged KV cache of its own.

The draft runs on its own :class:`~pagedllm.worker.executor.Executor` (same device and dtype as the
target; weights as ``speculative_config.quantization`` says, by default as its checkpoint stores
them) and its own :class:`~pagedllm.sched.kv_cache_manager.KVCacheManager` (no prefix cache). Each
target request that gets drafts has a *shadow* request on the draft's pool, kept by
:class:`~pagedllm.sched.draft_shadows.ShadowRequests` (which alone writes it, and turns each draft
step into a scheduler output whose block-table changes the draft's runner applies).

:meth:`DraftModelProposer.propose_all` (after each target step, for the requests that go on; it
returns their drafts, which the engine gives them):

1. frees the state of every request that finished, was aborted or left ``running`` (preempted);
2. per request with a positive :func:`~pagedllm.spec.proposer.draft_limit` ``k_i``: rolls the draft
   KV back to the longest prefix still equal to the request's tokens (the fed drafts the target
   accepted survive, the rest is overwritten later), at most ``num_tokens - 1`` of them, and
   allocates the slots of the tokens to catch up plus ``k_i - 1`` drafts; a request the draft pool
   has no room for gets no drafts this step;
3. runs the draft over the whole batch: one step computing every request's tokens to catch up
   (chunked prefill steps first when they exceed the token budget), whose samples are the first
   drafts, then one decode step per further draft position for the requests that want it. A draft
   token is fed to the next step on the device (as a pending token, the way scheduling ahead feeds
   the latest token), so the host waits for the device once, after the last step. Drafts are the
   draft's argmax: a one-hot ``q``, which verification handles exactly (``draft_probs=None``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pagedllm.config import EngineConfig
from pagedllm.model.config import ModelConfig
from pagedllm.model.gguf_loader import gguf_config
from pagedllm.model.gguf_reader import open_gguf
from pagedllm.model.hf_loader import load_hf_config
from pagedllm.model.loader import resolve_model_path
from pagedllm.request import Request
from pagedllm.sample.sampler import NO_TOKEN, DeviceSamples
from pagedllm.sched.draft_shadows import DraftState, ShadowRequests
from pagedllm.sched.kv_cache_manager import KVCacheManager, uniform_sliding_window
from pagedllm.sched.scheduler import ScheduledRequest
from pagedllm.spec.config import SpeculativeConfig, check_draft_vocab
from pagedllm.spec.proposer import draft_limit
from pagedllm.worker.cuda_graphs import graph_memory_estimate
from pagedllm.worker.executor import Executor
from pagedllm.worker.executor_protocol import ModelExecutor
from pagedllm.worker.phase_times import StepPhaseTimes

logger = logging.getLogger("pagedllm")

# GPU memory left free beside the draft's KV cache, for its forward's activations.
CUDA_ACTIVATION_MARGIN = 512 << 20

# The host tier of KV blocks is off for the draft (its state is dropped when a request is preempted).
DRAFT_WITHOUT_HOST_TIER: dict[str, object] = {"swap_space": 0.0, "preemption_mode": "recompute"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def draft_kv_blocks(
    target_blocks: int, max_num_seqs: int, k: int, block_size: int, max_model_len: int
) -> int:
    """The draft pool's block count: what the target's pool holds plus, for each request that can
    run at once (``max_num_seqs``, and no more than the target's blocks), the blocks of ``k`` tokens
    more and one partial block; never more than ``max_num_seqs`` requests of ``max_model_len + k``
    tokens need.

    A running request's draft KV covers its tokens and ``k - 1`` drafts, while the target holds its
    computed tokens, so this is enough for every running request at once: the pool never runs short
    in steady state (it costs the target's KV bytes scaled by the draft's KV bytes per token).
    """
    per_request_extra = cdiv(k, block_size) + 1
    ceiling = max_num_seqs * cdiv(max_model_len + k, block_size)
    running = min(max_num_seqs, target_blocks)
    return max(1, min(target_blocks + running * per_request_extra, ceiling))


def read_draft_config(model: str) -> ModelConfig:
    """The draft checkpoint's architecture, read without its weights; ValueError naming
    ``speculative_config.model`` when it is not a loadable checkpoint."""
    try:
        kind, path = resolve_model_path(model)
        return gguf_config(open_gguf(path)) if kind == "gguf" else load_hf_config(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"speculative_config.model {model!r} cannot be loaded: {exc}") from exc


def check_same_tokenizer(target: object, draft: object, model: str) -> None:
    """ValueError naming ``speculative_config.model`` unless both tokenizers map the same strings to
    the same ids (skipped for tokenizers without ``get_vocab``)."""
    get_target, get_draft = getattr(target, "get_vocab", None), getattr(draft, "get_vocab", None)
    if get_target is None or get_draft is None:
        return
    target_vocab, draft_vocab = get_target(), get_draft()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
        raise ValueError(
            f"speculative_config.model {model!r} has another tokenizer than the target model "
            f"(e.g. {differing}); the draft model must share the target's tokenizer"
        )


class DraftExecutor(Executor):
    """The draft's executor: on a GPU its KV cache takes at most the memory left free by the target
    (which sized its own cache first), less a margin for the draft's activations and CUDA graphs."""

    adapts_cpu_threads = False  # runs on the target's step thread, whose team the target sizes

    def _agree_kv_blocks(self, num_blocks: int) -> int:
        if self.device.type != "cuda":
            return num_blocks
        free, _ = torch.cuda.mem_get_info(self.device)
        graphs = 0
        if not self.config.enforce_eager and self.runner.backend.supports_graph_capture:
            graphs = graph_memory_estimate(self.model_config, self.config.max_num_seqs, self.dtype)
        fits = max(1, (free - CUDA_ACTIVATION_MARGIN - graphs) // self.runner.kv_bytes_per_block)
        if fits < num_blocks:
            logger.warning(
                "Draft model KV cache: %d blocks fit in the GPU memory left by the target, not %d; "
                "requests it has no room for get no drafts.",
                fits,
                num_blocks,
            )
        return int(min(num_blocks, fits))


def draft_engine_config(
    spec: SpeculativeConfig, config: EngineConfig, target: ModelExecutor, max_model_len: int
) -> EngineConfig:
    """The draft executor's configuration: the target's device, dtype, block size and step budget,
    the draft's own checkpoint, tokenizer and KV pool (:func:`draft_kv_blocks`)."""
    assert spec.model is not None
    blocks = draft_kv_blocks(
        target.num_kv_blocks,
        config.max_num_seqs,
        spec.num_speculative_tokens,
        config.block_size,
        max_model_len,
    )
    changes: dict[str, object] = {
        "model": spec.model,
        "tokenizer": None,
        "quantization": spec.quantization or "auto",
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "max_model_len": max_model_len,
        "max_num_batched_tokens": target.max_num_batched_tokens,
        "num_kv_blocks": blocks,
        "kv_cache_memory_bytes": None,
        "speculative_config": None,
        "served_model_name": None,
        "chat_template": None,
        "async_scheduling": False,
        "task": "generate",
    }
    changes.update(DRAFT_WITHOUT_HOST_TIER)
    return replace(config, **changes)  # type: ignore[arg-type]


class DraftModelProposer:
    """Proposes drafts with a draft model that shares the target's tokenizer (see the module
    docstring). Construction loads the draft (ValueError naming ``speculative_config.model`` when
    it cannot be loaded or its vocabulary or tokenizer differ from the target's)."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelExecutor) -> None:
        assert spec.method == "draft_model" and spec.model is not None
        self.k = spec.num_speculative_tokens
        draft_arch = read_draft_config(spec.model)
        check_draft_vocab(target.model_config.vocab_size, draft_arch.vocab_size)
        self.max_model_len = min(target.max_model_len, draft_arch.scaled_context_length())
        draft_config = draft_engine_config(spec, config, target, self.max_model_len)
        try:
            self.executor = DraftExecutor(draft_config)
        except (OSError, ValueError) as exc:
            raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: {exc}") from exc
        check_draft_vocab(target.model_config.vocab_size, self.executor.model_config.vocab_size)
        check_same_tokenizer(target.tokenizer, self.executor.tokenizer, spec.model)
        self.runner = self.executor.runner
        self.max_num_batched_tokens = self.executor.max_num_batched_tokens
        kv_cache_manager = KVCacheManager(
            self.executor.num_kv_blocks,
            config.block_size,
            enable_caching=False,
            sliding_window=uniform_sliding_window(self.executor.model_config),
        )
        self.shadows = ShadowRequests(kv_cache_manager, self.max_model_len)
        self.times = StepPhaseTimes()  # the draft's forward and sampling time, for profiling
        self.num_draft_steps = 0  # draft forwards run, total
        arch = self.executor.model_config
        logger.info(
            "Draft model %s: %d layers, hidden size %d, %s weights; KV cache %d blocks x %d tokens "
            "(%.0f MiB); up to %d drafts per step.",
            self.executor.model_name,
            arch.num_hidden_layers,
            arch.hidden_size,
            draft_config.quantization,
            self.executor.num_kv_blocks,
            config.block_size,
            self.executor.kv_cache_bytes / 2**20,
            self.k,
        )

    @property
    def states(self) -> dict[str, DraftState]:
        """Draft state by target request id."""
        return self.shadows.states

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The draft pool's block tables."""
        return self.shadows.kv_cache_manager

    def check_idle(self) -> None:
        """Free what finished requests left, then assert no request holds draft state or blocks."""
        self.shadows.check_idle()

    # -- proposing --------------------------------------------------------------------------
    def propose_all(self, requests: list[Request]) -> list[list[int]]:
        """The draft tokens of each request (running, its latest token on the host), in order;
        empty for one that gets none."""
        self.shadows.sweep()
        batch: list[tuple[DraftState, int, int]] = []  # (state, tokens to catch up, drafts wanted)
        for request in requests:
            k = draft_limit(request, self.k, self.max_model_len)
            if k <= 0:
                continue
            prepared = self.shadows.prepare(request, k)
            if prepared is not None:
                batch.append((*prepared, k))
        drafts: dict[str, list[int]] = {}
        if batch:
            for (state, _, _), tokens in zip(batch, self._draft(batch), strict=True):
                drafts[state.request.request_id] = tokens
        return [drafts.get(request.request_id, []) for request in requests]

    def _launch(self, steps: list[ScheduledRequest]) -> DeviceSamples | None:
        """Run one draft step; returns its samples (one per row that reaches its end), on the device."""
        self.num_draft_steps += 1
        samples = self.runner.launch(self.shadows.step(steps), self.times).samples
        self.shadows.advance(steps)
        assert samples is None or isinstance(samples, DeviceSamples)
        return samples

    def _catch_up(self, batch: list[tuple[DraftState, int, int]]) -> DeviceSamples | None:
        """Compute every request's missing tokens; the last step samples each request's first draft.

        When all of them fit the step budget this is one step; otherwise chunks of all but each
        request's last token come first (nothing sampled), then one decode step of the last tokens.
        """
        missing = [m for _, m, _ in batch]
        budget = self.max_num_batched_tokens
        if sum(missing) > budget:
            left = [m - 1 for m in missing]
            while any(left):
                steps: list[ScheduledRequest] = []
                room = budget
                for i, (state, _, _) in enumerate(batch):
                    n = min(left[i], room)
                    if n > 0:
                        steps.append(ScheduledRequest(state.shadow, n))
                        left[i] -= n
                        room -= n
                self._launch(steps)
            missing = [1] * len(batch)
        return self._launch(
            [ScheduledRequest(s.shadow, m) for (s, _, _), m in zip(batch, missing, strict=True)]
        )

    def _draft(self, batch: list[tuple[DraftState, int, int]]) -> list[list[int]]:
        """Greedy drafts of the batch: ``k_i`` tokens for row ``i`` (fewer when the draft has no
        token to give, which never happens without constraints)."""
        first = self._catch_up(batch)
        assert first is not None
        samples: list[tuple[list[int], DeviceSamples]] = [(list(range(len(batch))), first)]
        for position in range(1, max(k for _, _, k in batch)):
            rows = [i for i, (_, _, k) in enumerate(batch) if k > position]
            # The previous draft is read on the device.
            sampled = self._launch([self.shadows.feed(batch[i][0], position) for i in rows])
            assert sampled is not None
            samples.append((rows, sampled))
        drafts: list[list[int]] = [[] for _ in batch]
        for rows, sampled in samples:
            for i, token in zip(rows, sampled.output().token_ids, strict=True):
                drafts[i].append(token)
        out = []
        for (state, _, _), tokens in zip(batch, drafts, strict=True):
            self.shadows.settle(state, tokens)
            valid = tokens.index(NO_TOKEN) if NO_TOKEN in tokens else len(tokens)
            out.append(tokens[:valid])
        return out
