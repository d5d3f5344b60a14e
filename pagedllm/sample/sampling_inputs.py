"""What the sampler is given for each row of a step's logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingInputs:
    """Per-row inputs of one sampling step; row ``i`` of the logits belongs to ``params[i]``.

    ``generators[i]`` is the request's own seeded generator (see :func:`make_generator`), or None to
    draw from the default generator. ``bad_words_token_ids[i]`` holds the token sequences row ``i``
    must never complete. ``eos_token_ids`` are the model's end-of-sequence ids; together with each
    request's ``stop_token_ids`` they are masked while the output is shorter than ``min_tokens``
    (EOS is left alone for requests with ``ignore_eos``).
    """

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]
    bad_words_token_ids: list[list[list[int]]] | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Rows whose logits the caller masked before sampling (structured-output grammars): like rows
    # with logits processors, they are checked for having any token left.
    masked_rows: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.params)

    def check(self, num_rows: int) -> None:
        """Raise ValueError unless every per-row list has ``num_rows`` entries."""
        lists: dict[str, Sequence[object] | None] = {
            "params": self.params,
            "prompt_token_ids": self.prompt_token_ids,
            "output_token_ids": self.output_token_ids,
            "generators": self.generators,
            "bad_words_token_ids": self.bad_words_token_ids,
        }
        for name, values in lists.items():
            if values is not None and len(values) != num_rows:
                raise ValueError(
                    f"SamplingInputs.{name} has {len(values)} entries for {num_rows} logits rows."
                )
