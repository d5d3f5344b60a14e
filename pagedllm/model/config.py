"""Model architecture configuration shared by every checkpoint format.

``ModelConfig`` describes a decoder-only transformer of the Llama family (Llama, Mistral, Qwen2,
Qwen3). It is built either from a Hugging Face ``config.json`` (:meth:`ModelConfig.from_hf_config`)
or from GGUF metadata (:mod:`pagedllm.model.gguf_loader`). Weight tensors always use Hugging Face
parameter names; :meth:`ModelConfig.weight_shapes` lists the exact set a checkpoint must provide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.model.moe_config import MoeConfig, moe_config_from_hf

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")

# Hugging Face ``architectures`` entries -> internal architecture name.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}

# Hugging Face ``model_type`` values, used when ``architectures`` is missing.
HF_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}

# Defaults of the transformers config classes for keys a ``config.json`` may omit.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 128},
}


# Mixture-of-experts families (experts run by :mod:`pagedllm.model.moe`). Their router auxiliary-loss
# keys (``output_router_logits``, ``router_aux_loss_coef``) and Mixtral's ``router_jitter_noise`` only
# act in training, so inference ignores them.
MOE_ARCHITECTURES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")  # Hugging Face checkpoints only
SUPPORTED_ARCHITECTURES += MOE_ARCHITECTURES
HF_ARCHITECTURES.update(
    {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
)
HF_MODEL_TYPES.update({"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"})
_HF_DEFAULTS.update(
    {
        "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5},
        "qwen2_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
        "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    }
)

# Phi-3 (mini / medium, 4k and 128k): a Llama-shaped decoder whose checkpoints hold q/k/v and gate/up
# already fused (``self_attn.qkv_proj``, ``mlp.gate_up_proj``), with LongRoPE for long contexts and
# ``original_max_position_embeddings`` at the top level of its config.
SUPPORTED_ARCHITECTURES += ("phi3",)
HF_ARCHITECTURES["Phi3ForCausalLM"] = "phi3"
HF_MODEL_TYPES["phi3"] = "phi3"
_HF_DEFAULTS["phi3"] = {
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}


# Hugging Face ``layer_types`` values this engine runs.
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


def unsupported_architecture_error(name: str) -> ValueError:
    """The error raised for a checkpoint whose architecture this engine cannot run."""
    gguf = [a for a in SUPPORTED_ARCHITECTURES if a not in MOE_ARCHITECTURES]
    supported = ", ".join([*HF_ARCHITECTURES, *(f"GGUF '{a}'" for a in gguf)])
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


def hf_rope_scaling(
    hf: dict[str, Any], arch: str, max_position_embeddings: int, head_dim: int
) -> dict[str, Any] | None:
    """The rope scaling of a Hugging Face config, with the values transformers derives filled in.

    As transformers does: ``original_max_position_embeddings`` of llama3 / yarn / longrope comes from
    the top level of the config when it is there (Phi-3 always has one, 4096 by default), else from the
    scaling dict, else it is ``max_position_embeddings``; a missing yarn / longrope ``factor`` is
    ``max_position_embeddings / original_max_position_embeddings``; Phi-3's legacy "su" and "yarn"
    types mean longrope. "dynamic" NTK scaling starts past ``max_position_embeddings``, stored as its
    ``original_max_position_embeddings``. A ``partial_rotary_factor`` other than 1 and anything
    :func:`pagedllm.model.rope.validate_rope_scaling` refuses are a ValueError naming them.
    """
    from pagedllm.model.rope import validate_rope_scaling  # torch code

    rope_parameters = hf.get("rope_parameters") or {}
    partial = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"{arch}: partial_rotary_factor {partial} (rotating part of each head) is not supported."
        )
    scaling = normalize_rope_scaling(rope_parameters or hf.get("rope_scaling"))
    if scaling is None:
        return None
    scaling.pop("partial_rotary_factor", None)
    if arch == "phi3" and scaling["rope_type"] in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    rope_type = scaling["rope_type"]
    if rope_type in ("llama3", "yarn", "longrope"):
        top_level = hf.get("original_max_position_embeddings")
        if arch == "phi3" and top_level is None:
            top_level = _HF_DEFAULTS["phi3"]["original_max_position_embeddings"]
        if top_level is not None:
            scaling["original_max_position_embeddings"] = int(top_level)
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        if rope_type in ("yarn", "longrope") and scaling.get("factor") is None:
            scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    elif rope_type == "dynamic":
        scaling["original_max_position_embeddings"] = max_position_embeddings
    validate_rope_scaling(scaling, head_dim)
    return scaling


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
    "linear", "yarn", ...) and that scheme's parameters, as in Hugging Face configs, with the values
    transformers derives filled in (:func:`hf_rope_scaling`; the schemes: :mod:`pagedllm.model.rope`).
    "phi3" is Llama-shaped with q/k/v and gate/up fused in the checkpoint (see :meth:`weight_shapes`).
    ``sliding_window`` is the attention window of models trained with one (Mistral v0.1), else None.
    ``layer_types`` is Hugging Face's per-layer list of "full_attention" / "sliding_attention"; when
    None, every layer is sliding if ``sliding_window`` is set (Mistral) and full otherwise. Read a
    layer's window with :meth:`layer_sliding_window`.
    ``eos_token_ids`` are every token id that ends generation.
    ``rope_interleaved``: the q/k projections' rows keep llama.cpp's GGUF order, in which each head's
    rotary pairs are rows (2i, 2i + 1) rather than HF's (i, i + head_dim / 2); rotary embedding then
    rotates those pairs. Queries and keys carry the same reordering of each head's dimensions, so
    attention scores are HF's (the KV cache holds keys in that order); it saves copying the rows.
    Gemma only: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (None: by
    ``head_dim ** -0.5``); ``attn_logit_softcapping`` / ``final_logit_softcapping`` soft-cap the
    attention scores / the output logits (``cap * tanh(x / cap)``; None: no cap);
    ``rope_local_base_freq`` is the RoPE base of sliding layers (None: ``rope_theta``).
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
    rope_interleaved: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Mixtral / Qwen2-MoE / Qwen3-MoE sparse MLP layers (see pagedllm.model.moe); None: dense MLPs.
    moe: MoeConfig | None = None
    # Gemma 2 / 3 (see pagedllm.model.gemma); the defaults leave other families unchanged.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_base_freq: float | None = None

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
        self._check_layer_types()

    def _check_layer_types(self) -> None:
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window!r}."
            )
        if self.layer_types is None:
            return
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers."
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"Unsupported layer_types {unknown}; supported: {list(LAYER_TYPES)}.")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError(
                "layer_types has sliding_attention layers but the config sets no sliding_window."
            )
        if self.sliding_window is None:
            self.layer_types = None  # every layer full: one canonical form (configs compare equal)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (a query at position p sees keys in
        ``(p - window, p]``), or None for full causal attention."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def scaled_context_length(self) -> int:
        """The context a rope-scaled model is meant to reach (vLLM's rule), at least
        ``max_position_embeddings``: ``factor`` times the original length for "yarn" (whose configs
        often keep the original length as ``max_position_embeddings``), ``factor`` times
        ``max_position_embeddings`` for "linear"; "llama3" and "longrope" configs already state their
        scaled length. "dynamic" stays at ``max_position_embeddings``: its base depends on the
        sequence's current length, which K/V rotated earlier in a paged cache cannot follow."""
        scaling = self.rope_scaling or {}
        rope_type, factor = scaling.get("rope_type"), scaling.get("factor")
        if factor is None or rope_type not in ("yarn", "linear"):
            return self.max_position_embeddings
        base = self.max_position_embeddings
        if rope_type == "yarn":
            base = scaling["original_max_position_embeddings"]
        return max(self.max_position_embeddings, int(base * float(factor)))

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
        if arch in ("gemma2", "gemma3"):
            return gemma_config_from_hf(hf, arch)
        family = "mistral" if model_type == "mistral" or "MistralForCausalLM" in archs else arch
        defaults = _HF_DEFAULTS[family]

        def get(key: str, default: Any = None) -> Any:
            value = hf.get(key)
            return defaults.get(key, default) if value is None else value

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"Unsupported hidden_act {hidden_act!r} for {arch}; only 'silu' is supported.")
        if arch in ("llama", "qwen3", "mixtral", "qwen3_moe") and get("attention_bias", False):
            raise ValueError(f"{arch} checkpoints with attention_bias=true are not supported.")
        if get("mlp_bias", False):
            raise ValueError("Checkpoints with mlp_bias=true are not supported.")

        sliding_window: int | None = None
        if family == "mistral" or arch in ("mixtral", "phi3"):
            sliding_window = hf.get("sliding_window")
        elif get("use_sliding_window", False):
            raise ValueError(f"{arch} checkpoints with use_sliding_window=true are not supported.")

        rope_parameters = hf.get("rope_parameters") or {}
        rope_theta = rope_parameters.get("rope_theta", hf.get("rope_theta", 10000.0))

        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        head_dim = get("head_dim") or hidden_size // num_heads
        rope_scaling = hf_rope_scaling(hf, arch, int(get("max_position_embeddings", 2048)), int(head_dim))
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
            attention_bias=arch == "qwen2" or (arch == "qwen2_moe" and bool(get("qkv_bias", True))),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_list(hf.get("eos_token_id")),
            sliding_window=int(sliding_window) if sliding_window else None,
            layer_types=hf.get("layer_types"),
            moe=moe_config_from_hf(arch, hf),
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
            if self.moe is not None and self.moe.is_sparse_layer(i):
                shapes.update(self.moe.expert_weight_shapes(p, h))
                continue
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            if self.architecture in ("gemma2", "gemma3"):
                shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
                shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        if self.architecture == "phi3":
            _fuse_phi3_shapes(self, shapes)
        return shapes

    def check_weights(self, weights: dict[str, Any], source: str) -> None:
        """Raise ValueError unless ``weights`` has exactly the names and shapes of :meth:`weight_shapes`.

        ``source`` (a path) is named in the error message. A MoE checkpoint's fused expert tensors
        (``experts.gate_up_proj`` / ``experts.down_proj``) are first split, in ``weights``, into the
        per-expert names that :meth:`weight_shapes` lists.
        """
        if self.moe is not None:
            self.moe.split_fused_experts(self.num_hidden_layers, weights)
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


def _fuse_phi3_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """Replace, in ``shapes``, each layer's q/k/v and gate/up entries by Phi-3's fused tensors."""
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            del shapes[f"{p}self_attn.{name}.weight"]
        del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
        shapes[p + "self_attn.qkv_proj.weight"] = (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * cfg.intermediate_size, cfg.hidden_size)


def _preview(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}] ({len(items)} in all)"


# Defaults of transformers' Gemma2Config / Gemma3TextConfig for the keys a ``config.json`` may omit.
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "gemma3": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
}


def gemma_config_from_hf(hf: dict[str, Any], arch: str) -> ModelConfig:
    """The :class:`ModelConfig` of a Gemma 2 (``arch="gemma2"``) or Gemma 3 text (``"gemma3"``)
    ``config.json``, read as transformers reads it.

    A key present with the value null keeps it (a soft cap set to null is no cap); an absent key takes
    transformers' default. Without ``layer_types``, Gemma 2 alternates sliding and full layers
    (sliding first) and Gemma 3 makes every ``sliding_window_pattern``-th layer full. RoPE comes from
    ``rope_parameters`` (transformers 5: one entry per layer type for Gemma 3) or the older
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` keys; scaling applies to full layers.
    Raises ValueError naming any option this engine does not implement.
    """
    defaults = _GEMMA_DEFAULTS[arch]

    def get(key: str) -> Any:
        return hf[key] if key in hf else defaults.get(key)

    activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"Unsupported hidden_activation {activation!r} for {arch}; only 'gelu_pytorch_tanh' is supported."
        )
    for key in ("attention_bias", "use_bidirectional_attention"):
        if hf.get(key):
            raise ValueError(f"{arch} checkpoints with {key}=true are not supported.")
    num_layers = int(get("num_hidden_layers"))
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = 2 if arch == "gemma2" else int(get("sliding_window_pattern"))
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]

    rope = hf.get("rope_parameters") or {}
    local_theta: float | None = None
    if "full_attention" in rope or "sliding_attention" in rope:
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        rope_theta = full.get("rope_theta", defaults["rope_theta"])
        rope_scaling = normalize_rope_scaling(full)
        local_theta = local.get("rope_theta", defaults.get("rope_local_base_freq"))
        if normalize_rope_scaling(local) is not None:
            raise ValueError(
                f"{arch}: RoPE scaling of sliding layers (rope_parameters['sliding_attention']) "
                "is not supported."
            )
    else:
        rope_theta = rope.get("rope_theta", get("rope_theta"))
        rope_scaling = normalize_rope_scaling(rope or hf.get("rope_scaling"))
        if arch == "gemma3":
            local_theta = get("rope_local_base_freq")

    def optional_float(key: str) -> float | None:
        value = get(key)
        return None if value is None else float(value)

    hidden_size = int(get("hidden_size"))
    num_heads = int(get("num_attention_heads"))
    sliding_window = get("sliding_window")
    bos = get("bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(get("num_key_value_heads")),
        head_dim=int(get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qk_norm=arch == "gemma3",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_as_id_list(get("eos_token_id")),
        sliding_window=None if sliding_window is None else int(sliding_window),
        layer_types=list(layer_types),
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        attn_logit_softcapping=optional_float("attn_logit_softcapping"),
        final_logit_softcapping=optional_float("final_logit_softcapping"),
        rope_local_base_freq=None if local_theta is None else float(local_theta),
    )
