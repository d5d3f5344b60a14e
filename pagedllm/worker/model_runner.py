"""Runs the model over one scheduled batch: input preparation, forward, logits, sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.base import AttentionBackend, AttentionMetadata, get_attention_backend
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model.config import ModelConfig
from pagedllm.model.layers import RotaryEmbedding
from pagedllm.model.llama import ForwardContext, LlamaForCausalLM
from pagedllm.sample.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedllm.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the flat batch whose logits are sampled
    sample_rows: list[int]  # indices into scheduler_output.scheduled of the sampled requests


class ModelRunner:
    """Owns the model weights, the KV cache tensors and the sampler on one device."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
    ) -> None:
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend: AttentionBackend = get_attention_backend(attention_backend)
        with torch.device("meta"):
            model = LlamaForCausalLM(model_config, max_model_len)
        model = model.to_empty(device="cpu")
        # Buffers are not in the checkpoint: rebuild the rotary tables for real.
        model.rotary = RotaryEmbedding(
            model_config.head_dim, max_model_len, model_config.rope_theta, model_config.rope_scaling
        )
        model.load_weights(weights)
        self.model = model.to(device=device, dtype=dtype).eval()
        # Rotary tables stay fp32 for accuracy.
        self.model.rotary.to(dtype=torch.float32)
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.block_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.config
        self.kv_cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    # -- input preparation ------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        qlens: list[int] = []
        slens: list[int] = []
        sample_rows: list[int] = []
        logits_idx: list[int] = []
        max_blocks = 1
        for row, sr in enumerate(so.scheduled):
            req = sr.request
            start = req.num_computed_tokens
            n = sr.num_tokens
            end = start + n
            ids.extend(req.all_token_ids[start:end])
            table = req.block_ids
            if n == 1:
                pos_chunks.append(np.array([start], dtype=np.int64))
                slot_chunks.append(np.array([table[start // bs] * bs + start % bs], dtype=np.int64))
            else:
                pos = np.arange(start, end, dtype=np.int64)
                pos_chunks.append(pos)
                slot_chunks.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            qlens.append(n)
            slens.append(end)
            max_blocks = max(max_blocks, len(table))
            if sr.needs_sample:
                sample_rows.append(row)
                logits_idx.append(len(ids) - 1)
        tables = np.zeros((len(so.scheduled), max_blocks), dtype=np.int32)
        for row, sr in enumerate(so.scheduled):
            t = sr.request.block_ids
            tables[row, : len(t)] = t
        qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks)).to(dev, non_blocking=True),
            query_start_loc=torch.from_numpy(qsl).to(dev, non_blocking=True),
            seq_lens=torch.tensor(slens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
        )
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
            positions=torch.from_numpy(np.concatenate(pos_chunks)).to(dev, non_blocking=True),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64).to(dev, non_blocking=True),
            sample_rows=sample_rows,
        )

    # -- execution --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> tuple[list[int], SamplerOutput | None]:
        """Run one step; returns (rows of ``so.scheduled`` that got a token, sampler output)."""
        assert self.kv_cache is not None, "KV cache not allocated"
        inputs = self.prepare_inputs(so)
        ctx = ForwardContext(inputs.meta, self.kv_cache.layers, self.backend)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not inputs.sample_rows:
            return [], None
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        reqs = [so.scheduled[r].request for r in inputs.sample_rows]
        batch = SamplingBatch(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            bad_words_token_ids=[r.bad_words_token_ids for r in reqs],
            eos_token_ids=reqs[0].eos_token_ids,
        )
        return inputs.sample_rows, self.sampler(logits, batch)
