"""What a pooling (embedding) request asks for, beside its prompt."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import RequestError


@dataclass(frozen=True)
class PoolingParams:
    """Options of one embedding request (``LLM.embed``, ``/v1/embeddings``).

    ``dimensions`` None means the model's full embedding; a number asks for the first ``dimensions``
    values, which only models trained for it (matryoshka representations) allow: the engine checks it
    against the model and refuses it otherwise, naming ``dimensions``. ``normalize`` None means the
    model's pooling configuration decides whether the embedding is L2-normalised; True or False
    overrides it. Truncation, when asked, comes before normalisation.
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise RequestError("dimensions", f"dimensions must be a positive integer, got {d!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise RequestError("normalize", f"normalize must be true, false or null, got {self.normalize!r}.")
