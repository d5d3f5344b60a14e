"""Model architecture configuration shared by every checkpoint format.

``ModelConfig`` describes a decoder-only transformer of the Llama family (Llama, Mistral, Qwen2,
Qwen3). It is built either from a Hugging Face ``config.json`` (:meth:`ModelConfig.from_hf_config`)
or from GGUF metadata (:mod:`pagedllm.model.gguf_loader`). Weight tensors always use Hugging Face
parameter names; :meth:`ModelConfig.weight_shapes` lists the exact set a checkpoint must provide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")

# Hugging Face ``architectures`` entries -> internal architecture name.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# Hugging Face ``model_type`` values, used when ``architectures`` is missing.
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

# Defaults of the transformers config classes for keys a ``config.json`` may omit.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 128},
}


def unsupported_architecture_error(name: str) -> ValueError:
    """The error raised for a checkpoint whose architecture this engine cannot run."""
    supported = ", ".join([*HF_ARCHITECTURES, *(f"GGUF '{a}'" for a in SUPPORTED_ARCHITECTURES)])
    return ValueError(f"Unsupported model architecture '{name}'. Supported: {supported}.")


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return a copy of a rope scaling dict keyed by ``rope_type``, or None for plain RoPE.

    Accepts both the legacy ``rope_scaling`` form (``{"type": "linear", "factor": 2.0}``) and
    transformers 5's ``rope_parameters`` (which also carries ``rope_theta``; that key is dropped).
    """
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k != "rope_theta"}
    rope_type = out.pop("rope_type", None) or out.pop("type", None) or "default"
    out.pop("type", None)
    if rope_type == "default":
        return None
    return {"rope_type": rope_type, **out}


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` style values (None, an int or a list of ints) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family decoder-only model.

    ``architecture`` is one of :data:`SUPPORTED_ARCHITECTURES`: "llama" (also Mistral), "qwen2"
    (q/k/v projections with bias) or "qwen3" (per-head RMSNorm on queries and keys).
    ``attention_bias`` means the q/k/v projections have biases (the output projection never has one);
    ``qk_norm`` means ``self_attn.q_norm`` / ``self_attn.k_norm`` weights of size ``head_dim`` exist.
    ``rope_scaling`` is None for plain RoPE, otherwise a dict with a ``rope_type`` key ("llama3",
    "linear", "yarn", ...) and that scheme's parameters, as in Hugging Face configs.
    ``sliding_window`` is the attention window of models trained with one (Mistral v0.1), else None.
    ``eos_token_ids`` are every token id that ends generation.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture_error(self.architecture)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}.")
        self.eos_token_ids = _as_id_list(self.eos_token_ids)

    @property
    def q_size(self) -> int:
        """Width of the query projection output (``num_attention_heads * head_dim``)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from a Hugging Face ``config.json`` dict.

        ``eos_token_ids`` comes from the config's ``eos_token_id`` (possibly empty; the loader
        refines it from ``generation_config.json`` and the tokenizer).
        Raises ValueError naming the architecture when it is not supported, and for variants of a
        supported architecture that this engine does not implement.
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if archs:
            hf_arch = archs[0]
            if hf_arch not in HF_ARCHITECTURES:
                raise unsupported_architecture_error(hf_arch)
            arch = HF_ARCHITECTURES[hf_arch]
        elif model_type in HF_MODEL_TYPES:
            arch = HF_MODEL_TYPES[model_type]
        else:
            raise unsupported_architecture_error(str(model_type))
        family = "mistral" if model_type == "mistral" or "MistralForCausalLM" in archs else arch
        defaults = _HF_DEFAULTS[family]

        def get(key: str, default: Any = None) -> Any:
            value = hf.get(key)
            return defaults.get(key, default) if value is None else value

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"Unsupported hidden_act {hidden_act!r} for {arch}; only 'silu' is supported.")
        if arch in ("llama", "qwen3") and get("attention_bias", False):
            raise ValueError(f"{arch} checkpoints with attention_bias=true are not supported.")
        if get("mlp_bias", False):
            raise ValueError("Checkpoints with mlp_bias=true are not supported.")

        sliding_window: int | None = None
        if family == "mistral":
            sliding_window = hf.get("sliding_window")
        elif get("use_sliding_window", False):
            raise ValueError(f"{arch} checkpoints with use_sliding_window=true are not supported.")

        rope_parameters = hf.get("rope_parameters") or {}
        rope_theta = rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_scaling = normalize_rope_scaling(rope_parameters or hf.get("rope_scaling"))

        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        head_dim = get("head_dim") or hidden_size // num_heads
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("num_key_value_heads", num_heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_list(hf.get("eos_token_id")),
            sliding_window=int(sliding_window) if sliding_window else None,
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The Hugging Face parameter names and shapes a checkpoint of this model provides.

        ``lm_head.weight`` is absent when the embeddings are tied.
        """
        h, kv = self.hidden_size, self.kv_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def check_weights(self, weights: dict[str, Any], source: str) -> None:
        """Raise ValueError unless ``weights`` has exactly the names and shapes of :meth:`weight_shapes`.

        ``source`` (a path) is named in the error message.
        """
        expected = self.weight_shapes()
        missing = [n for n in expected if n not in weights]
        unexpected = [n for n in weights if n not in expected]
        wrong = [
            f"{n}: {tuple(weights[n].shape)} (expected {s})"
            for n, s in expected.items()
            if n in weights and tuple(weights[n].shape) != s
        ]
        problems = []
        if missing:
            problems.append(f"missing tensors {_preview(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors {_preview(unexpected)}")
        if wrong:
            problems.append(f"wrong shapes {_preview(wrong)}")
        if problems:
            raise ValueError(
                f"Checkpoint {source} does not match its {self.architecture} config: " + "; ".join(problems)
            )


def _preview(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"
