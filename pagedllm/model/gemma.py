"""Gemma 2 and Gemma 3 (text) decoders over the engine's flat paged batch.

They differ from the Llama stack (:mod:`pagedllm.model.llama`, whose fused q/k/v and gate/up
projections, weight loading and quantized-layer installation they reuse) in:

* RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from one), computed in float32;
* each sub-block is normalised before *and* after: ``input_layernorm`` -> attention ->
  ``post_attention_layernorm`` -> residual add -> ``pre_feedforward_layernorm`` -> MLP ->
  ``post_feedforward_layernorm`` -> residual add;
* a GeGLU MLP (``gelu_tanh(gate) * up``);
* embeddings multiplied by ``sqrt(hidden_size)``, rounded to the model dtype as transformers does;
* attention scores scaled by ``query_pre_attn_scalar ** -0.5``;
* interleaved sliding-window and full-attention layers (``ModelConfig.layer_sliding_window``);
  Gemma 3's sliding layers rotate with their own RoPE base (``rope_local_base_freq``), its full
  layers with ``rope_theta`` and any ``rope_scaling``;
* Gemma 2 soft-caps attention scores (``attn_logit_softcapping``, applied by the attention backend)
  and the output logits (``final_logit_softcapping``, in :meth:`GemmaForCausalLM.compute_logits`);
  Gemma 3 normalises queries and keys per head (``q_norm`` / ``k_norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels.triton import elementwise as triton_elementwise
from pagedllm.model.config import ModelConfig
from pagedllm.model.layers import RMSNorm, RotaryEmbedding, RotaryTables
from pagedllm.model.llama import MLP, Attention, DecoderLayer, ForwardContext, LlamaForCausalLM

GEMMA_ARCHITECTURES: tuple[str, ...] = ("gemma2", "gemma3")


class GemmaRMSNorm(RMSNorm):
    """RMSNorm computing ``x / rms(x) * (1 + weight)`` in float32, then cast back to ``x``'s dtype.

    ``weight`` holds the checkpoint's value (zero means the identity scale). ``1 + weight`` is
    computed in float32 once per weight version and device, and float32 inputs run through the
    fused kernels with it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)
        self._scale_key: tuple[int, int, torch.device] | None = None
        self._scale: torch.Tensor | None = None

    def scale(self) -> torch.Tensor:
        """``1 + weight`` in float32 (cached until the weight changes or moves)."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.device)
        if self._scale is None or self._scale_key != key:
            self._scale = (1.0 + w.detach().float()).contiguous()
            self._scale_key = key
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return triton_elementwise.rms_norm(x, self.scale(), self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale()).to(x.dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""
        if x.dtype == torch.float32:
            return triton_elementwise.fused_add_rms_norm(x, residual, self.scale(), self.eps)
        summed = x + residual
        return self.forward(summed), summed


class GemmaAttention(Attention):
    """Llama's fused q/k/v attention with Gemma's scale, q/k norms, window and score soft-cap."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        if cfg.query_pre_attn_scalar is not None:
            self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.logits_soft_cap = cfg.attn_logit_softcapping

    def forward(self, x: torch.Tensor, rope: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(q), rope.apply(k)
        else:
            # q and k heads are adjacent in the fused projection: rotate them in one pass.
            qk = rope.apply(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta.slot_mapping)
        o = ctx.backend.forward(
            q,
            k_cache,
            v_cache,
            ctx.meta,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )
        return self.o_proj(o.reshape(t, self.q_size))


class GemmaMLP(MLP):
    """GeGLU: ``down(gelu_tanh(gate) * up)`` over the fused gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        d = gate_up.shape[-1] // 2
        return self.down_proj(F.gelu(gate_up[..., :d], approximate="tanh") * gate_up[..., d:])


class GemmaDecoderLayer(DecoderLayer):
    """Attention and MLP each wrapped in a pre- and a post-norm.

    ``forward(x, residual)`` returns ``(delta, residual)`` with the residual add of ``delta`` left
    to the next norm (fused with it), as in the Llama layer.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        eps = cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.mlp = GemmaMLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.is_sliding = cfg.layer_sliding_window(layer_idx) is not None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTables, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, ctx))
        h, residual = self.pre_feedforward_layernorm.forward_residual(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text model; checkpoints use Hugging Face names (``model.layers.N....``).

    Weight loading (:meth:`LlamaForCausalLM.load_weights`) and GGUF block installation are Llama's:
    the projections have the same fused layout.
    """

    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        if cfg.architecture not in GEMMA_ARCHITECTURES:
            raise ValueError(f"GemmaForCausalLM runs {GEMMA_ARCHITECTURES}, not {cfg.architecture!r}.")
        super().__init__(cfg, max_position)
        self.layers = nn.ModuleList([GemmaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_local = self._local_rotary(max_position)

    def _local_rotary(self, max_position: int) -> RotaryEmbedding | None:
        """The sliding layers' rotary tables when they differ from the full layers' (Gemma 3)."""
        cfg = self.config
        local = cfg.rope_local_base_freq
        if local is None or (local == cfg.rope_theta and cfg.rope_scaling is None):
            return None
        return RotaryEmbedding(cfg.head_dim, max_position, local)

    def init_rotary(self, max_position: int) -> None:
        super().init_rotary(max_position)
        self.rotary_local = self._local_rotary(max_position)

    def embed_scale(self, dtype: torch.dtype) -> float:
        """``sqrt(hidden_size)`` rounded to ``dtype`` (transformers multiplies in the model dtype)."""
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale(x.dtype)
        rope_full = self.rotary.tables(positions)
        rope_local = rope_full if self.rotary_local is None else self.rotary_local.tables(positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            x, residual = layer(x, residual, rope_local if layer.is_sliding else rope_full, ctx)
        assert residual is not None
        x, _ = self.norm.forward_residual(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits, soft-capped to ``(-cap, cap)`` when ``final_logit_softcapping`` is set."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if out is None:
            return logits.float()
        return out.copy_(logits)
