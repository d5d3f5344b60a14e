"""The Triton kernel that scatters new key/value rows into the paged KV caches at their slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.launch import last_dim_contiguous, launch


# Arguments that change from step to step are not specialised on (Triton otherwise compiles a
# variant for values equal to 1 and for multiples of 16, the first time each kind comes up mid-run).
@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, BLOCK_T), cdiv(NUM_KV_HEADS * HEAD_DIM, BLOCK_C))``.

    Each program copies a ``[BLOCK_T tokens, BLOCK_C (head, dim) columns]`` tile; tokens whose slot is
    negative are skipped.
    """
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    head = col // HEAD_DIM
    dim = col % HEAD_DIM

    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (col < NUM_KV_HEADS * HEAD_DIM)[None, :]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    tok64 = tok.to(tl.int64)

    key = tl.load(
        key_ptr + tok64[:, None] * stride_key_tok + head[None, :] * stride_key_head + dim[None, :],
        mask=mask,
    )
    tl.store(
        k_cache_ptr
        + block[:, None] * stride_kc_block
        + offset[:, None] * stride_kc_slot
        + head[None, :] * stride_kc_head
        + dim[None, :],
        key,
        mask=mask,
    )
    value = tl.load(
        value_ptr + tok64[:, None] * stride_value_tok + head[None, :] * stride_value_head + dim[None, :],
        mask=mask,
    )
    tl.store(
        v_cache_ptr
        + block[:, None] * stride_vc_block
        + offset[:, None] * stride_vc_slot
        + head[None, :] * stride_vc_head
        + dim[None, :],
        value,
        mask=mask,
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` (-1 skips)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value of shape {tuple(key.shape)}/{tuple(value.shape)} do not match a cache with "
            f"{num_kv_heads} KV heads of dim {head_dim}."
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous along head_dim.")
    # Casting here (round-to-nearest-even in torch) keeps the stored values identical on every
    # platform; the interpreter truncates in-kernel fp32 -> bf16 casts.
    key = last_dim_contiguous(key.to(k_cache.dtype))
    value = last_dim_contiguous(value.to(v_cache.dtype))
    cols = num_kv_heads * head_dim
    if key.device.type == "cpu":
        # Interpreter: few, large programs.
        block_c = triton.next_power_of_2(cols)
        block_t = max(1, min(64, 16384 // block_c))
    else:
        block_c = min(triton.next_power_of_2(cols), 512)
        block_t = 8
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(cols, block_c))
    launch(
        _write_kv_kernel,
        grid,
        key.device,
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=4,
    )
