"""Batched multi-LoRA shrink/expand kernels (Triton, under the interpreter on CPU tensors) against a
float64 reference computed segment by segment, row by row."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedllm.kernels.triton import lora  # noqa: E402

NUM_SLOTS = 3

# Segments as (start, length, slot). Listed out of row order; slot 2 serves two non-adjacent
# segments; rows 1-2, 40, 42-44 and 50-59 are in no segment.
MIXED = (60, [(41, 1, 1), (3, 37, 0), (0, 1, 2), (45, 5, 2)])
# Decode: one row per segment, slots repeating, row 4 in no segment.
DECODE = (7, [(0, 1, 0), (1, 1, 1), (2, 1, 0), (3, 1, 2), (5, 1, 1), (6, 1, 0)])
LAYOUTS = {"mixed": MIXED, "decode": DECODE}

# (rank, features): ranks that are and are not powers of two; feature sizes that are not multiples of
# the block sizes (72, 200) and one that is (64).
SHAPES = [(8, 72), (12, 200), (16, 64)]

# fp32: float32 accumulation only. bf16 shrink: the products of bf16 values are exact in float32, so
# only the accumulation differs from the reference. bf16 expand: y is rounded to bf16 once (the
# interpreter truncates, so up to one bf16 ulp, 2**-7 relative).
SHRINK_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 1e-4)}
EXPAND_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-3)}


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def segment_tensors(
    segments: list[tuple[int, int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    starts, lens, slots = (torch.tensor([s[i] for s in segments], dtype=torch.int32) for i in range(3))
    return starts, lens, slots, max((s[1] for s in segments), default=0)


def covered_rows(tokens: int, segments: list[tuple[int, int, int]]) -> torch.Tensor:
    covered = torch.zeros(tokens, dtype=torch.bool)
    for start, length, _ in segments:
        covered[start : start + length] = True
    return covered


def shrink_reference(
    x: torch.Tensor, lora_a: torch.Tensor, segments: list[tuple[int, int, int]]
) -> torch.Tensor:
    x64, a64 = x.double(), lora_a.double()
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for start, length, slot in segments:
        for row in range(start, start + length):
            out[row] = a64[slot] @ x64[row]
    return out


def expand_reference(
    y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, segments: list[tuple[int, int, int]]
) -> torch.Tensor:
    out, t64, b64 = y.double(), t.double(), lora_b.double()
    for start, length, slot in segments:
        for row in range(start, start + length):
            out[row] += b64[slot] @ t64[row]
    return out


def randn(
    *shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------
# Against the reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"r{s[0]}-k{s[1]}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shrink_matches_reference(layout: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    tokens, segments = LAYOUTS[layout]
    rank, in_features = shape
    gen = torch.Generator().manual_seed(rank * 1000 + in_features)
    x = randn(tokens, in_features, gen=gen, dtype=dtype)
    lora_a = randn(NUM_SLOTS, rank, in_features, gen=gen, dtype=dtype, scale=in_features**-0.5)
    starts, lens, slots, max_len = segment_tensors(segments)

    t = lora.lora_shrink(x, lora_a, starts, lens, slots, max_len)

    assert t.dtype == torch.float32 and t.shape == (tokens, rank)
    expected = shrink_reference(x, lora_a, segments)
    covered = covered_rows(tokens, segments)
    assert torch.count_nonzero(t[~covered]) == 0
    rtol, atol = SHRINK_TOL[dtype]
    torch.testing.assert_close(t.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"r{s[0]}-n{s[1]}")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expand_add_matches_reference(layout: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    tokens, segments = LAYOUTS[layout]
    rank, out_features = shape
    gen = torch.Generator().manual_seed(rank * 1000 + out_features + 1)
    y = randn(tokens, out_features, gen=gen, dtype=dtype)
    t = randn(tokens, rank, gen=gen)
    lora_b = randn(NUM_SLOTS, out_features, rank, gen=gen, dtype=dtype, scale=rank**-0.5)
    starts, lens, slots, max_len = segment_tensors(segments)
    before = y.clone()

    lora.lora_expand_add(y, t, lora_b, starts, lens, slots, max_len)

    assert y.dtype == dtype
    covered = covered_rows(tokens, segments)
    assert torch.equal(y[~covered], before[~covered])
    expected = expand_reference(before, t, lora_b, segments)
    assert not torch.allclose(expected[covered], before[covered].double(), atol=0.1)  # the update is visible
    rtol, atol = EXPAND_TOL[dtype]
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=atol)


def test_shrink_then_expand_is_the_lora_delta() -> None:
    """Both kernels chained, bf16: ``y + (x @ A^T) @ B^T`` per segment, t kept in float32."""
    tokens, segments = MIXED
    gen = torch.Generator().manual_seed(7)
    rank, hidden, out_features = 16, 72, 40
    x = randn(tokens, hidden, gen=gen, dtype=torch.bfloat16)
    lora_a = randn(NUM_SLOTS, rank, hidden, gen=gen, dtype=torch.bfloat16, scale=hidden**-0.5)
    lora_b = randn(NUM_SLOTS, out_features, rank, gen=gen, dtype=torch.bfloat16, scale=rank**-0.5)
    y = randn(tokens, out_features, gen=gen, dtype=torch.bfloat16)
    starts, lens, slots, max_len = segment_tensors(segments)
    expected = expand_reference(y, shrink_reference(x, lora_a, segments), lora_b, segments)

    t = lora.lora_shrink(x, lora_a, starts, lens, slots, max_len)
    lora.lora_expand_add(y, t, lora_b, starts, lens, slots, max_len)

    torch.testing.assert_close(y.double(), expected, rtol=1e-2, atol=1e-3)


def test_rank_above_one_tile() -> None:
    """Rank 80 > 64: the shrink takes two column blocks of the rank, the expand two rank tiles."""
    tokens, segments = 20, [(2, 17, 1), (0, 1, 0)]
    gen = torch.Generator().manual_seed(3)
    rank, features = 80, 40
    x = randn(tokens, features, gen=gen)
    lora_a = randn(2, rank, features, gen=gen)
    lora_b = randn(2, features, rank, gen=gen)
    y = randn(tokens, features, gen=gen)
    starts, lens, slots, max_len = segment_tensors(segments)

    t = lora.lora_shrink(x, lora_a, starts, lens, slots, max_len)
    torch.testing.assert_close(t.double(), shrink_reference(x, lora_a, segments), rtol=1e-5, atol=1e-4)
    expected = expand_reference(y, t, lora_b, segments)
    lora.lora_expand_add(y, t, lora_b, starts, lens, slots, max_len)
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("split_k", [2, 3, 100])
def test_shrink_split_k_sums_chunks(split_k: int) -> None:
    """The GPU's split-K path, forced: 200 features in 32-wide tiles (7 tiles) over 2, 3 or (capped)
    7 chunks, the last one ragged."""
    tokens, segments = MIXED
    gen = torch.Generator().manual_seed(11)
    x = randn(tokens, 200, gen=gen)
    lora_a = randn(NUM_SLOTS, 12, 200, gen=gen, scale=200**-0.5)
    starts, lens, slots, max_len = segment_tensors(segments)

    t = lora._shrink(x, lora_a, starts, lens, slots, max_len, split_k=split_k, block_k=32)

    assert torch.count_nonzero(t[~covered_rows(tokens, segments)]) == 0
    torch.testing.assert_close(t.double(), shrink_reference(x, lora_a, segments), rtol=1e-5, atol=1e-5)


def test_strided_views() -> None:
    """Row-strided views: x a column slice of a wider buffer, y a column slice updated in place (the
    columns around it untouched), lora_b a slice of a larger stack of slots."""
    tokens, segments = MIXED
    gen = torch.Generator().manual_seed(5)
    rank, features = 8, 72
    x_buf = randn(tokens, features + 24, gen=gen)
    x = x_buf[:, 16 : 16 + features]
    lora_a = randn(NUM_SLOTS, rank, features, gen=gen, scale=features**-0.5)
    y_buf = randn(tokens, features + 8, gen=gen)
    y = y_buf[:, 4 : 4 + features]
    lora_b = randn(NUM_SLOTS + 2, features, rank, gen=gen)[1 : 1 + NUM_SLOTS]
    starts, lens, slots, max_len = segment_tensors(segments)
    before = y_buf.clone()

    t = lora.lora_shrink(x, lora_a, starts, lens, slots, max_len)
    torch.testing.assert_close(t.double(), shrink_reference(x, lora_a, segments), rtol=1e-5, atol=1e-5)
    lora.lora_expand_add(y, t, lora_b, starts, lens, slots, max_len)
    torch.testing.assert_close(
        y.double(), expand_reference(before[:, 4 : 4 + features], t, lora_b, segments), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(y_buf[:, :4], before[:, :4]) and torch.equal(
        y_buf[:, 4 + features :], before[:, 4 + features :]
    )


# --------------------------------------------------------------------------------------------------
# Nothing to do
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing to compute, yet a kernel was launched")

    monkeypatch.setattr(lora, "launch", fail)


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("tokens", "segments"),
    [(5, []), (0, []), (5, [(0, 0, 1), (3, 0, 0)])],
    ids=["no-segments", "no-rows", "empty-segments"],
)
def test_nothing_to_compute_launches_nothing(tokens: int, segments: list[tuple[int, int, int]]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = randn(tokens, 24, gen=gen)
    lora_a = randn(2, 8, 24, gen=gen)
    y = randn(tokens, 40, gen=gen)
    lora_b = randn(2, 40, 8, gen=gen)
    starts, lens, slots, max_len = segment_tensors(segments)
    before = y.clone()

    t = lora.lora_shrink(x, lora_a, starts, lens, slots, max_len)
    lora.lora_expand_add(y, t, lora_b, starts, lens, slots, max_len)

    assert t.shape == (tokens, 8) and t.dtype == torch.float32 and torch.count_nonzero(t) == 0
    assert torch.equal(y, before)


def test_zero_length_segment_among_others() -> None:
    tokens, segments = 10, [(0, 0, 1), (2, 3, 1), (6, 0, 0)]
    gen = torch.Generator().manual_seed(2)
    x = randn(tokens, 24, gen=gen)
    lora_a = randn(2, 8, 24, gen=gen)
    starts, lens, slots, max_len = segment_tensors(segments)

    t = lora.lora_shrink(x, lora_a, starts, lens, slots, max_len)

    torch.testing.assert_close(t.double(), shrink_reference(x, lora_a, segments), rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(t[:2]) == 0 and torch.count_nonzero(t[5:]) == 0


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _shrink_args(**changes: Any) -> dict[str, Any]:
    starts, lens, slots, _ = segment_tensors([(0, 2, 0)])
    args: dict[str, Any] = {
        "x": torch.zeros(4, 24),
        "lora_a": torch.zeros(2, 8, 24),
        "seg_starts": starts,
        "seg_lens": lens,
        "seg_slots": slots,
        "max_seg_len": 2,
    }
    args.update(changes)
    return args


def _expand_args(**changes: Any) -> dict[str, Any]:
    starts, lens, slots, _ = segment_tensors([(0, 2, 0)])
    args: dict[str, Any] = {
        "y": torch.zeros(4, 40),
        "t": torch.zeros(4, 8),
        "lora_b": torch.zeros(2, 40, 8),
        "seg_starts": starts,
        "seg_lens": lens,
        "seg_slots": slots,
        "max_seg_len": 2,
    }
    args.update(changes)
    return args


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora_a": torch.zeros(2, 8, 32)}, "in_features 32 but x has 24"),
        ({"lora_a": torch.zeros(8, 24)}, "lora_a must be"),
        ({"x": torch.zeros(4, 24, dtype=torch.int32)}, "x must be float32"),
        ({"lora_a": torch.zeros(2, 8, 24, dtype=torch.bfloat16)}, "lora_a is torch.bfloat16 but x"),
        ({"seg_lens": torch.tensor([2], dtype=torch.int64)}, "seg_lens must be int32"),
        ({"seg_slots": torch.tensor([[0]], dtype=torch.int32)}, "seg_slots must be 1-D"),
        ({"seg_starts": torch.tensor([0, 1], dtype=torch.int32)}, "one per segment"),
        ({"max_seg_len": -1}, "max_seg_len"),
    ],
)
def test_shrink_rejects_bad_arguments(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lora.lora_shrink(**_shrink_args(**changes))


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lora_b": torch.zeros(2, 48, 8)}, "out_features 48 but y has 40"),
        ({"lora_b": torch.zeros(2, 40, 12)}, "lora_b has rank 12 but t has rank 8"),
        ({"t": torch.zeros(3, 8)}, "t has 3 rows but y has 4"),
        ({"t": torch.zeros(4, 8, dtype=torch.bfloat16)}, "t must be float32"),
        ({"lora_b": torch.zeros(2, 40, 8, dtype=torch.float16)}, "lora_b is torch.float16 but y"),
        ({"y": torch.zeros(40, 4).t()}, "unit stride"),
        ({"seg_slots": torch.tensor([0], dtype=torch.int64)}, "seg_slots must be int32"),
        ({"max_seg_len": 2.0}, "max_seg_len"),
    ],
)
def test_expand_rejects_bad_arguments(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lora.lora_expand_add(**_expand_args(**changes))
