"""How a prompt's final hidden states become one embedding: the pooling configuration and its math.

A model's :class:`PoolingConfig` comes from a sentence-transformers folder when it has one
(``modules.json`` naming a ``Pooling`` module whose ``config.json`` picks the mode, and a ``Normalize``
module or not), else from defaults: CLS pooling for encoders and the last token for decoders (the
defaults of vLLM for such models), L2-normalised. Engine arguments may override the type and the
normalisation. A request's :class:`~pagedllm.pooling_params.PoolingParams` may ask for fewer dimensions
(models trained for it only) and override the normalisation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.config import POOLING_TYPES
from pagedllm.pooling_params import PoolingParams
from pagedllm.utils import read_json

# sentence-transformers Pooling modes -> pooling types; the other modes (max, mean_sqrt_len,
# weightedmean) are not implemented and are refused.
_ST_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# Modules of a sentence-transformers pipeline this engine runs (the transformer itself, pooling and
# normalisation); any other (Dense projections, ...) would change the embedding, so it is refused.
_ST_KNOWN = ("sentence_transformers.models.Transformer", _ST_POOLING, _ST_NORMALIZE)


@dataclass(frozen=True)
class PoolingConfig:
    """A model's pooling: ``pooling_type`` (``mean`` over the prompt's tokens, the first token
    ``cls``, or the ``last``), whether the result is L2-normalised, the size of the full embedding
    (``hidden_size``), and the sizes it may be truncated to (``matryoshka_dimensions``: None when
    truncation is not allowed, ``()`` when any size is)."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}."
            )

    def check(self, params: PoolingParams) -> None:
        """Raise ValueError naming ``dimensions`` when ``params`` asks for a size the model cannot give."""
        d = params.dimensions
        if d is None or d == self.hidden_size:
            return
        allowed = self.matryoshka_dimensions
        if allowed is None:
            raise ValueError(
                f"dimensions: this model does not support other embedding sizes (it was not trained for "
                f"truncation); leave dimensions out or set it to {self.hidden_size}, got {d}."
            )
        if d > self.hidden_size or (allowed and d not in allowed):
            sizes = ", ".join(str(x) for x in allowed) if allowed else f"1 to {self.hidden_size}"
            raise ValueError(f"dimensions must be one of the model's embedding sizes ({sizes}), got {d}.")


def sentence_transformers_pooling(model_dir: str) -> tuple[str, bool] | None:
    """``(pooling_type, normalize)`` of a sentence-transformers folder, or None when ``model_dir`` has
    no ``modules.json``. Raises ValueError for modules or pooling modes this engine does not run."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = read_json(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} does not contain a list of modules.")
    types = [str(m.get("type")) for m in modules if isinstance(m, dict)]
    unknown = [t for t in types if t not in _ST_KNOWN]
    if unknown:
        raise ValueError(f"{modules_path}: sentence-transformers modules {unknown} are not supported.")
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        raise ValueError(f"{modules_path} names no Pooling module.")
    config = read_json(os.path.join(model_dir, str(pooling.get("path", "")), "config.json"))
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{model_dir}: pooling modes {modes} are not supported (exactly one of {', '.join(_ST_MODES)})."
        )
    return _ST_MODES[modes[0]], _ST_NORMALIZE in types


def resolve_pooling_config(
    model_dir: str | None,
    *,
    encoder: bool,
    hidden_size: int,
    matryoshka_dimensions: tuple[int, ...] | None = None,
    pooling_type: str | None = None,
    normalize: bool | None = None,
) -> PoolingConfig:
    """The pooling of the model in ``model_dir`` (None for a single-file checkpoint): its
    sentence-transformers configuration, else CLS (``encoder``) or last-token pooling, normalised;
    ``pooling_type`` and ``normalize`` (engine arguments) override either."""
    found = sentence_transformers_pooling(model_dir) if model_dir is not None else None
    default_type, default_normalize = found if found is not None else ("cls" if encoder else "last", True)
    return PoolingConfig(
        pooling_type=pooling_type or default_type,
        normalize=default_normalize if normalize is None else normalize,
        hidden_size=hidden_size,
        matryoshka_dimensions=matryoshka_dimensions,
    )


def pool_hidden(hidden: torch.Tensor, seq_lens: Sequence[int], pooling_type: str) -> torch.Tensor:
    """One float32 row per sequence of a packed ``[T, H]`` batch (``seq_lens`` rows each, in order)."""
    lens = torch.tensor(list(seq_lens), device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if pooling_type == "last":
        return hidden[ends - 1].float()
    if pooling_type == "cls":
        return hidden[ends - lens].float()
    if pooling_type == "mean":
        seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
        sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq, hidden.float())
        return sums / lens[:, None].to(torch.float32)
    raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling_type!r}.")


def finish_embeddings(
    pooled: torch.Tensor, params: Sequence[PoolingParams], config: PoolingConfig
) -> list[list[float]]:
    """Each pooled row truncated to its request's ``dimensions`` and, as configured or asked,
    L2-normalised (after the truncation), as a list of floats."""
    out: list[list[float]] = []
    pooled = pooled.float().cpu()
    for row, p in zip(pooled, params, strict=True):
        vec = row[: p.dimensions] if p.dimensions is not None else row
        if config.normalize if p.normalize is None else p.normalize:
            vec = F.normalize(vec, dim=0)
        out.append(vec.tolist())
    return out
