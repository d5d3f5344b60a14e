"""The batch metadata every paged attention kernel and backend reads.

KV cache layout (per layer): ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is block ``s // block_size``,
offset ``s % block_size``.

A batch is a flat list of ``num_tokens`` query tokens from ``B`` requests. Request ``i`` owns query
rows ``query_start_loc[i]:query_start_loc[i+1]`` and has ``seq_lens[i]`` tokens of context in
total, including its new tokens; so its new tokens sit at positions
``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` and attend causally to every earlier position
(cached prefix, earlier chunks, and earlier new tokens). A decode is a request with query_len 1,
unless ``single_prompt_seqs`` lists it: its one new token is a prompt token (a chunk's last token, a
prefix-cache hit that left one), attended as a prompt chunk so that it rounds as it would in a
longer chunk.
The K/V of the new tokens are written at ``slot_mapping`` before attention reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not write (padding)
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, total context length per request (incl. new tokens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so backends never need a device sync to read them.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Requests of query_len 1 whose token is a prompt token: attended by the prompt-chunk path.
    single_prompt_seqs: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
