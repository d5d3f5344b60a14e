"""Which rank holds which part of the model, Megatron-style.

Ranks are numbered ``rank = pp_rank * tp_size + tp_rank``: the ranks of one pipeline stage are
consecutive (a tensor-parallel group, whose all-reduces should stay within a machine), stage after
stage. Rank 0 is the driver: it lives in the engine's process, builds every step's inputs and
samples. Within a tensor-parallel group of ``tp`` ranks, rank ``r`` holds

- query heads ``[r * H / tp, (r + 1) * H / tp)`` and the KV heads they read: ``nkv / tp`` of them when
  ``tp`` divides ``nkv``, else (``nkv`` divides ``tp``) the one KV head of its query heads, replicated
  on ``tp / nkv`` ranks: the column-parallel q/k/v rows and the row-parallel o columns;
- MLP columns ``[r * I / tp, (r + 1) * I / tp)``: gate and up rows, down columns;
- vocabulary rows ``[r * V', (r + 1) * V')`` with ``V' = ceil(V / tp)`` of the embedding and LM head,
  zero past ``V``;
- every norm weight (replicated).

Pipeline stages hold consecutive layers (:func:`pipeline_layer_counts`: as given, or balanced by
their work, the LM head's counted on the first stage); the first stage also holds the vocabulary (the
embedding and the LM head: one table when tied; the last stage sends the final hidden states back to
it); every stage the final norm's weight (a vector).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from pagedllm.model.config import ModelConfig

# Architectures whose layers the tensor/pipeline-parallel forms cover.
PARALLEL_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class RankPlacement:
    """One rank's place in a ``tp_size`` x ``pp_size`` grid."""

    rank: int
    tp_size: int
    pp_size: int
    layer_counts: tuple[int, ...] = ()  # layers of each pipeline stage; () splits them evenly

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The global ranks of pipeline stage ``pp_rank`` (its tensor-parallel group)."""
        return [pp_rank * self.tp_size + r for r in range(self.tp_size)]

    def layer_range(self, num_layers: int) -> range:
        """The global indices of this stage's layers."""
        s, pp = self.pp_rank, self.pp_size
        if not self.layer_counts:
            return range(num_layers * s // pp, num_layers * (s + 1) // pp)
        assert sum(self.layer_counts) == num_layers and len(self.layer_counts) == pp
        start = sum(self.layer_counts[:s])
        return range(start, start + self.layer_counts[s])

    def vocab_range(self, vocab_size: int) -> range:
        """The vocabulary rows this rank holds; the last shard may run past ``vocab_size`` (zero rows)."""
        per = -(-vocab_size // self.tp_size)
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)


def check_parallel(
    cfg: ModelConfig, tp: int, pp: int, *, task: str = "generate", partition: str | None = None
) -> None:
    """Raise ValueError, naming the setting, unless ``cfg`` splits into ``tp`` x ``pp`` ranks (with
    the stages' layer ``partition`` when given)."""
    if tp == 1 and pp == 1:
        return
    if task == "embed":
        raise ValueError("tensor_parallel_size / pipeline_parallel_size: task 'embed' runs on one rank.")
    if cfg.architecture not in PARALLEL_ARCHITECTURES or cfg.moe is not None:
        kind = "mixture-of-experts " + cfg.architecture if cfg.moe is not None else cfg.architecture
        raise ValueError(
            f"tensor_parallel_size / pipeline_parallel_size: {kind} models run on one rank; parallel ranks "
            f"support the {', '.join(PARALLEL_ARCHITECTURES)} architectures (Llama, Mistral, Qwen2, Qwen3)."
        )
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads.")
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {kv} KV heads: one must divide the other "
            "(KV heads are split, or replicated when there are fewer than ranks)."
        )
    if inter % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the MLP width {inter}.")
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {cfg.num_hidden_layers} layers.")
    if partition is not None:
        pipeline_layer_counts(cfg, pp, partition)


def pipeline_layer_counts(cfg: ModelConfig, pp: int, partition: str | None = None) -> tuple[int, ...]:
    """Layers of each of ``pp`` stages: ``partition`` (``"18,12"``) when given, else consecutive runs
    whose work is as even as it can be, the LM head's counted on the first stage (on a small model it
    weighs as much as several layers). Work is counted in multiply-adds per token, the LM head's at a
    quarter: it runs on one row per request and step (the layers on every prompt token as well), and
    its one large matrix product runs nearer the machine's peak; on the CPU the default model's best
    split of 2 stages measured 14 / 16 layers, which this gives."""
    layers = cfg.num_hidden_layers
    if partition is not None:
        try:
            counts = tuple(int(part) for part in partition.split(","))
        except ValueError:
            counts = ()
        if len(counts) != pp or sum(counts) != layers or min(counts) < 1:
            raise ValueError(
                f"pipeline_layer_partition {partition!r}: give {pp} positive layer counts (one per pipeline "
                f"stage, comma-separated) that add up to the model's {layers} layers."
            )
        return counts
    h, d = cfg.hidden_size, cfg.head_dim
    layer = (
        h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * cfg.intermediate_size
    )
    head = cfg.vocab_size * h / layer / 4  # the LM head, in layers
    counts_list: list[int] = []
    done = 0
    for stage in range(pp):
        left = pp - stage - 1
        extra = head if stage == 0 else 0.0
        # This stage's share of the work left (the head's included while the first stage is open).
        share = (layers - done + extra) / (left + 1) - extra
        take = layers - done if not left else max(1, min(layers - done - left, round(share)))
        counts_list.append(take)
        done += take
    return tuple(counts_list)


def local_model_config(cfg: ModelConfig, placement: RankPlacement) -> ModelConfig:
    """The config of the model a rank builds: its share of heads, MLP width and vocabulary (layers
    keep their global count and indices; :func:`stage_layers` picks the stage's)."""
    tp = placement.tp_size
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(1, cfg.num_key_value_heads // tp),
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=len(placement.vocab_range(cfg.vocab_size)),
    )


def _kv_heads(cfg: ModelConfig, placement: RankPlacement) -> range:
    tp, kv = placement.tp_size, cfg.num_key_value_heads
    if kv >= tp:
        return range(placement.tp_rank * kv // tp, (placement.tp_rank + 1) * kv // tp)
    per_rank_q = cfg.num_attention_heads // tp
    head = placement.tp_rank * per_rank_q // (cfg.num_attention_heads // kv)
    return range(head, head + 1)


def weight_selection(cfg: ModelConfig, placement: RankPlacement, name: str) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor ``name`` (Hugging Face names and layout) that ``placement``
    holds: ``()`` all of it, slices of its leading dimensions, or None (not on this rank)."""
    tp = placement.tp_size
    d = cfg.head_dim
    rows = placement.tp_rank
    match = _LAYER.match(name)
    if match is not None:
        if int(match.group(1)) not in placement.layer_range(cfg.num_hidden_layers):
            return None
        rest = match.group(2)
        q_per = cfg.num_attention_heads // tp
        i_per = cfg.intermediate_size // tp
        if rest.startswith("self_attn.q_proj."):
            return (slice(rows * q_per * d, (rows + 1) * q_per * d),)
        if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            kv = _kv_heads(cfg, placement)
            return (slice(kv.start * d, kv.stop * d),)
        if rest == "self_attn.o_proj.weight":
            return (slice(None), slice(rows * q_per * d, (rows + 1) * q_per * d))
        if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            return (slice(rows * i_per, (rows + 1) * i_per),)
        if rest == "mlp.down_proj.weight":
            return (slice(None), slice(rows * i_per, (rows + 1) * i_per))
        return ()  # norms: replicated
    vocab = placement.vocab_range(cfg.vocab_size)
    vocab_rows = (slice(vocab.start, min(vocab.stop, cfg.vocab_size)),)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return vocab_rows if placement.is_first_stage else None
    return ()  # the final norm: replicated (every stage's model has it; the last uses it)


def pad_vocab_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` with zero rows appended up to ``rows`` (the last vocabulary shard)."""
    if weight.shape[0] >= rows:
        return weight
    pad = torch.zeros(rows - weight.shape[0], *weight.shape[1:], dtype=weight.dtype)
    return torch.cat([weight, pad])
