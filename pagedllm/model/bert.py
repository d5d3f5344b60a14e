"""BERT encoder for embeddings (``BertModel`` and ``BertForMaskedLM`` checkpoints, such as
all-MiniLM-L6-v2).

embeddings (word + absolute position + token type 0, LayerNorm) -> N x post-LN layers (bidirectional
self-attention with a fused q/k/v projection, residual, LayerNorm; GELU MLP, residual, LayerNorm). The
pooler and the masked-LM head of a checkpoint are not used.

The forward runs over a packed batch: the tokens of every sequence back to back, without padding.
Linear layers and norms take all rows at once; attention runs per sequence over that sequence's own
rows (torch's ``scaled_dot_product_attention``, no mask needed). Every row is computed the same way
whatever else is in the batch, so a sequence's hidden states do not depend on its batch. No KV cache
is kept: a sequence is encoded whole in one forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.hf_loader import load_safetensors_float32
from pagedllm.utils import read_json

# Hugging Face ``architectures`` entries this module runs (their heads are dropped).
BERT_ARCHITECTURES = ("BertModel", "BertForMaskedLM")
# hidden_act values -> the ``approximate`` argument of F.gelu.
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# Checkpoint tensors that are not part of the encoder (heads, buffers).
_UNUSED_PREFIXES = ("pooler.", "cls.")
_UNUSED_NAMES = ("embeddings.position_ids",)


def is_bert_config(hf: dict[str, Any]) -> bool:
    """Whether a Hugging Face ``config.json`` describes a BERT encoder."""
    archs = hf.get("architectures") or []
    if archs:
        return str(archs[0]) in BERT_ARCHITECTURES
    return hf.get("model_type") == "bert"


def is_bert_checkpoint(model_dir: str) -> bool:
    """Whether ``model_dir`` is a model folder whose ``config.json`` describes a BERT encoder."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return False
    return is_bert_config(read_json(path))


@dataclass
class BertConfig:
    """Hyper-parameters of a BERT encoder (from its ``config.json``).

    ``architecture`` is the checkpoint's Hugging Face class name. ``matryoshka_dimensions`` lists the
    embedding sizes the model was trained to be truncated to (``()`` when any size is allowed, None when
    truncation is not allowed), from the config's ``matryoshka_dimensions`` or ``is_matryoshka``.
    ``eos_token_ids`` and ``bos_token_id`` are empty: an encoder generates nothing.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    matryoshka_dimensions: tuple[int, ...] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BertConfig.{name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if self.hidden_act not in _GELU:
            raise ValueError(
                f"Unsupported hidden_act {self.hidden_act!r} for BERT; supported: {', '.join(_GELU)}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> BertConfig:
        """Build a config from a BERT ``config.json`` dict; ValueError for variants not implemented."""
        if not is_bert_config(hf):
            raise ValueError(f"Not a BERT config: architectures {hf.get('architectures')}.")
        position_type = hf.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(
                f"BERT with position_embedding_type {position_type!r} is not supported (only absolute)."
            )
        dims = hf.get("matryoshka_dimensions")
        matryoshka: tuple[int, ...] | None = None
        if dims:
            matryoshka = tuple(sorted(int(d) for d in dims))
        elif hf.get("is_matryoshka"):
            matryoshka = ()
        archs = hf.get("architectures") or ["BertModel"]
        return cls(
            architecture=str(archs[0]),
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]),
            intermediate_size=int(hf["intermediate_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            hidden_act=str(hf.get("hidden_act", "gelu")),
            matryoshka_dimensions=matryoshka,
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The Hugging Face tensor names (without a ``bert.`` prefix) and shapes of the encoder."""
        h, inter = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            "embeddings.word_embeddings.weight": (self.vocab_size, h),
            "embeddings.position_embeddings.weight": (self.max_position_embeddings, h),
            "embeddings.token_type_embeddings.weight": (self.type_vocab_size, h),
            "embeddings.LayerNorm.weight": (h,),
            "embeddings.LayerNorm.bias": (h,),
        }
        for i in range(self.num_hidden_layers):
            p = f"encoder.layer.{i}."
            for proj in ("query", "key", "value"):
                shapes[f"{p}attention.self.{proj}.weight"] = (h, h)
                shapes[f"{p}attention.self.{proj}.bias"] = (h,)
            shapes[p + "attention.output.dense.weight"] = (h, h)
            shapes[p + "attention.output.dense.bias"] = (h,)
            shapes[p + "attention.output.LayerNorm.weight"] = (h,)
            shapes[p + "attention.output.LayerNorm.bias"] = (h,)
            shapes[p + "intermediate.dense.weight"] = (inter, h)
            shapes[p + "intermediate.dense.bias"] = (inter,)
            shapes[p + "output.dense.weight"] = (h, inter)
            shapes[p + "output.dense.bias"] = (h,)
            shapes[p + "output.LayerNorm.weight"] = (h,)
            shapes[p + "output.LayerNorm.bias"] = (h,)
        return shapes


def load_bert_config(model_dir: str) -> BertConfig:
    data = read_json(os.path.join(model_dir, "config.json"))
    if not isinstance(data, dict):
        raise ValueError(f"{model_dir}/config.json does not contain a JSON object.")
    return BertConfig.from_hf_config(data)


def max_seq_length(model_dir: str, config: BertConfig) -> int:
    """The longest input the model takes: its position table, capped by a sentence-transformers
    folder's ``max_seq_length`` (the length it was trained for).

    A folder whose ``sentence_bert_config.json`` asks for ``do_lower_case`` is refused: that lowercasing
    is sentence-transformers' own step, which this engine does not apply (a tokenizer that lowercases
    says so in its own configuration, which is honoured)."""
    limit = config.max_position_embeddings
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(path):
        st = read_json(path)
        if isinstance(st, dict):
            if st.get("do_lower_case"):
                raise ValueError(
                    f"{path} sets do_lower_case, which this engine does not apply; lowercase in the tokenizer "
                    "configuration instead."
                )
            if st.get("max_seq_length"):
                limit = min(limit, int(st["max_seq_length"]))
    return limit


def _encoder_name(stored: str) -> str | None:
    """A checkpoint tensor's name in the encoder (a ``bert.`` prefix dropped), or None for heads and
    buffers the encoder does not use."""
    name = stored.removeprefix("bert.")
    return None if name.startswith(_UNUSED_PREFIXES) or name in _UNUSED_NAMES else name


def load_bert_weights(model_dir: str, config: BertConfig) -> dict[str, torch.Tensor]:
    """The encoder's tensors from the folder's ``*.safetensors`` as float32, named as in
    :meth:`BertConfig.weight_shapes` (a ``bert.`` prefix is dropped; heads and buffers are skipped).

    Raises ValueError naming the folder when a tensor is missing, unexpected or of the wrong shape.
    """
    weights = load_safetensors_float32(model_dir, _encoder_name)
    expected = config.weight_shapes()
    missing = [n for n in expected if n not in weights]
    unexpected = [n for n in weights if n not in expected]
    wrong = [n for n, s in expected.items() if n in weights and tuple(weights[n].shape) != s]
    if missing or unexpected or wrong:
        raise ValueError(
            f"Checkpoint {model_dir} does not match its BERT config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, wrong shapes {wrong[:5]}."
        )
    return weights


class BertLayer(nn.Module):
    """One post-LN encoder layer over a packed batch."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.layer_norm_eps
        self.approximate = _GELU[cfg.hidden_act]
        # Linear layers are nn.Linear as built; on the CPU they are swapped for panel forms at load.
        self.qkv_proj: nn.Module = nn.Linear(h, 3 * h)
        self.o_proj: nn.Module = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up_proj: nn.Module = nn.Linear(h, cfg.intermediate_size)
        self.down_proj: nn.Module = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def attention(self, qkv: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Bidirectional attention of each sequence over its own rows: ``[T, 3H] -> [T, H]``.

        One ``scaled_dot_product_attention`` per sequence (no padding, no mask), the results joined
        in one copy."""
        t = qkv.shape[0]
        heads = qkv.view(t, 3, self.num_heads, self.head_dim).transpose(0, 2)  # [heads, 3, T, d]
        outs = []
        start = 0
        for n in seq_lens:
            rows = heads[:, :, start : start + n]
            outs.append(F.scaled_dot_product_attention(rows[:, 0], rows[:, 1], rows[:, 2]))  # [heads, n, d]
            start += n
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(t, self.num_heads * self.head_dim)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        a = self.o_proj(self.attention(self.qkv_proj(x), seq_lens))
        x = self.attn_norm(a.add_(x))
        f = self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
        return self.out_norm(f.add_(x))


class BertEncoder(nn.Module):
    """A BERT encoder without its heads: token ids of packed sequences -> final hidden states."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Hidden states of the last layer, one row per input token.

        ``input_ids`` and ``positions`` are flat (``[T]``): sequence i is the ``seq_lens[i]`` rows after
        the previous ones, its positions counting from 0. Every token has token type 0 (one segment).
        """
        if sum(seq_lens) != input_ids.shape[0]:
            raise ValueError(
                f"seq_lens add up to {sum(seq_lens)} tokens, but {input_ids.shape[0]} were given."
            )
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embed_norm(x.add_(self.token_type_embeddings.weight[0]))
        for layer in self.layers:
            x = layer(x, seq_lens)
        return x

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy in tensors named as :meth:`BertConfig.weight_shapes` says (q/k/v fused here)."""
        h = self.config.hidden_size
        own = {
            "embeddings.word_embeddings.weight": self.word_embeddings.weight,
            "embeddings.position_embeddings.weight": self.position_embeddings.weight,
            "embeddings.token_type_embeddings.weight": self.token_type_embeddings.weight,
            "embeddings.LayerNorm.weight": self.embed_norm.weight,
            "embeddings.LayerNorm.bias": self.embed_norm.bias,
        }
        for name, param in own.items():
            param.copy_(weights[name])
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            assert isinstance(layer, BertLayer)
            for j, proj in enumerate(("query", "key", "value")):
                _linear(layer.qkv_proj).weight[j * h : (j + 1) * h].copy_(
                    weights[f"{p}attention.self.{proj}.weight"]
                )
                _linear(layer.qkv_proj).bias[j * h : (j + 1) * h].copy_(
                    weights[f"{p}attention.self.{proj}.bias"]
                )
            pairs = {
                "attention.output.dense": layer.o_proj,
                "intermediate.dense": layer.up_proj,
                "output.dense": layer.down_proj,
            }
            for hf_name, module in pairs.items():
                _linear(module).weight.copy_(weights[f"{p}{hf_name}.weight"])
                _linear(module).bias.copy_(weights[f"{p}{hf_name}.bias"])
            for hf_name, norm in (
                ("attention.output.LayerNorm", layer.attn_norm),
                ("output.LayerNorm", layer.out_norm),
            ):
                norm.weight.copy_(weights[f"{p}{hf_name}.weight"])
                norm.bias.copy_(weights[f"{p}{hf_name}.bias"])


def _linear(module: nn.Module) -> nn.Linear:
    assert isinstance(module, nn.Linear), "weights are loaded before the linear layers are repacked"
    return module
