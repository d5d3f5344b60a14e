"""Llama-family decoder (Llama 2/3, SmolLM, Mistral; Qwen2 with qkv bias; Qwen3 with q/k RMSNorm).

The forward runs over a flat batch of tokens from many requests. Attention layers write the new K/V
into the paged cache and read history through block tables (see ``pagedllm.attention.base``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, AttentionMetadata
from pagedllm.model.config import ModelConfig
from pagedllm.model.layers import RMSNorm, RotaryEmbedding, RotaryTables, silu_and_mul


class ForwardContext:
    """What attention layers need for one forward: batch metadata, caches and the backend."""

    def __init__(
        self,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> None:
        self.meta = meta
        self.kv_caches = kv_caches
        self.backend = backend


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Linear layers are nn.Linear as built; loading may swap in quantized or panel forms.
        self.qkv_proj: nn.Module = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj: nn.Module = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.sliding_window = cfg.layer_sliding_window(layer_idx)

    def forward(self, x: torch.Tensor, rope: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rope.apply(self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)))
            k = rope.apply(
                self.k_norm(qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, self.head_dim))
            )
        else:
            # q and k heads are adjacent in the fused projection: rotate them in one pass.
            qk = rope.apply(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.meta.slot_mapping)
        o = ctx.backend.forward(q, k_cache, v_cache, ctx.meta, self.scale, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryTables, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(h, rope, ctx)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens: nn.Module = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, interleaved=cfg.rope_interleaved
        )
        self.lm_head: nn.Module = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_rotary(self, max_position: int) -> None:
        """(Re)build the float32 rotary tables (on the CPU; the runner moves the model afterwards)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, interleaved=cfg.rope_interleaved
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        x, residual = self.forward_layers(input_ids, positions, ctx)
        x, _ = self.norm.forward_residual(x, residual)
        return x

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        carried: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` after this model's layers, before the final norm. The layers start from
        the embedding of ``input_ids``, or (a later pipeline stage) from ``carried``, the ``(x,
        residual)`` the stage before returned."""
        residual: torch.Tensor | None
        if carried is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = carried
        rope = self.rotary.tables(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        assert residual is not None
        return x, residual

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits of ``hidden`` rows; written into ``out`` (``[rows, vocab]`` float32) when given."""
        logits = self.lm_head(hidden)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up projections.

        Layers already holding their weights (quantized layers installed from GGUF blocks) have no
        ``weight`` parameter, so none is expected for them."""
        params = dict(self.named_parameters())
        seen: set[str] = set()

        def put(name: str, tensor: torch.Tensor, offset: int | None = None) -> None:
            p = params[name]
            if offset is None:
                if p.shape != tensor.shape:
                    raise ValueError(
                        f"weight {name}: expected shape {tuple(p.shape)}, got {tuple(tensor.shape)}"
                    )
                p.copy_(tensor)
            else:
                p[offset : offset + tensor.shape[0]].copy_(tensor)
            seen.add(name)

        cfg = self.config
        if (
            cfg.tie_word_embeddings
            and isinstance(self.lm_head, nn.Linear)
            and isinstance(self.embed_tokens, nn.Embedding)
        ):
            # Re-tie: moving the module between devices may have split the shared parameter.
            self.lm_head.weight = self.embed_tokens.weight
            params = dict(self.named_parameters())
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q_size),
            "v_proj": ("qkv_proj", q_size + kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", cfg.intermediate_size),
        }
        for hf_name, tensor in weights.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, offset = fused[parts[-2]]
                put(".".join(parts[:-2] + [target, parts[-1]]), tensor, offset)
            elif name in params:
                put(name, tensor)
            else:
                raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
        missing = set(params) - seen
        if cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
