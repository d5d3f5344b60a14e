"""Mixture-of-experts expert products (native CPU kernel on panel-packed experts, torch fallback,
Triton grouped GEMM under the interpreter) and routing, against a per-expert float64 reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.kernels.cpu import moe as cpu_moe  # noqa: E402
from pagedllm.model.moe import experts_torch, route  # noqa: E402

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, choice by choice, in float64."""
    x, gate_up, down, weights = (t.double() for t in (x, gate_up, down, weights))
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, j] * (down[e] @ a)
    return out


def make_case(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, gate_up, down, weights, ids


def native(*args: torch.Tensor) -> torch.Tensor:
    if not cpu_moe.usable(args[0]):
        pytest.skip("native CPU kernels unavailable")
    return cpu_moe.moe_experts(*args)


def triton_interpreted(*args: torch.Tensor) -> torch.Tensor:
    pytest.importorskip("triton")
    from pagedllm.kernels.triton import fused_moe

    return fused_moe.fused_experts(*args)


IMPLEMENTATIONS: dict[str, Experts] = {"native": native, "torch": experts_torch, "triton": triton_interpreted}

# (tokens, hidden, intermediate, experts, top_k): one token; many tokens; top-k 1, 2 and 8 (all
# experts); widths that are not multiples of the kernels' vector and block sizes.
CASES = [(1, 64, 32, 4, 2), (37, 48, 40, 8, 2), (200, 64, 32, 8, 1), (9, 40, 24, 8, 8), (3, 64, 32, 16, 2)]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_experts_match_float64_reference(impl: str, case: tuple[int, ...]) -> None:
    args = make_case(*case)
    if impl == "triton" and case[0] > 40:
        args = make_case(40, *case[1:])  # the interpreter is slow
    expected = reference(*args)
    actual = IMPLEMENTATIONS[impl](*args)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_experts_with_no_tokens_and_empty_batches(impl: str) -> None:
    """Every token routed to experts 5 and 2 (of 8): the others get nothing; an empty batch gives an
    empty result."""
    x, gate_up, down, weights, _ = make_case(6, 32, 16, 8, 2)
    ids = torch.tensor([[5, 2]] * 6)
    torch.testing.assert_close(
        IMPLEMENTATIONS[impl](x, gate_up, down, weights, ids).double(),
        reference(x, gate_up, down, weights, ids),
        rtol=1e-5,
        atol=1e-5,
    )
    empty = IMPLEMENTATIONS[impl](x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


def test_routing_ties_and_renormalisation() -> None:
    """Equal router logits tie: top-k still picks k distinct experts with equal weights; the kernels
    agree on such routings. Without renormalisation the weights are the softmax probabilities."""
    logits = torch.zeros(3, 8)
    logits[1, [1, 6]] = 2.0  # a two-way tie at the top
    weights, ids = route(logits, 2, renormalize=True)
    assert all(len(set(row.tolist())) == 2 for row in ids)
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))
    assert set(ids[1].tolist()) == {1, 6}
    raw, raw_ids = route(logits, 2, renormalize=False)
    assert torch.equal(raw_ids, ids)
    torch.testing.assert_close(raw[0], torch.full((2,), 1 / 8))
    x, gate_up, down, _, _ = make_case(3, 32, 16, 8, 2)
    expected = reference(x, gate_up, down, weights, ids)
    for impl in ("native", "torch"):
        actual = IMPLEMENTATIONS[impl](x, gate_up, down, weights, ids).double()
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_native_rows_do_not_depend_on_the_batch() -> None:
    """A token's result is the same alone and among others (prefix caching and chunked prefill rely
    on it)."""
    x, gate_up, down, weights, ids = make_case(50, 64, 48, 8, 2)
    full = native(x, gate_up, down, weights, ids)
    for t in (0, 17, 49):
        alone = native(x[t : t + 1], gate_up, down, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], full[t])


def test_native_prompt_chunk_spans_several_cache_chunks() -> None:
    """An expert with more packed rows than the kernel keeps in cache per pass (1 MiB) runs its
    rows in several chunks over the same panels; the result is still the reference's."""
    x, gate_up, down, weights, ids = make_case(600, 1024, 256, 2, 2)
    expected = experts_torch(x.double(), gate_up.double(), down.double(), weights.double(), ids)
    torch.testing.assert_close(
        native(x, gate_up, down, weights, ids).double(), expected, rtol=1e-5, atol=1e-5
    )


def test_native_rejects_bad_expert_ids() -> None:
    x, gate_up, down, weights, ids = make_case(4, 32, 16, 4, 2)
    ids[2, 1] = 4
    with pytest.raises(ValueError, match="expert ids"):
        native(x, gate_up, down, weights, ids)


def test_cpu_experts_pack_once_and_take_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked experts take the torch path; float32 CPU experts packed by ``pack_for_cpu`` release
    their stacked tensors and run the native kernel for decode rows and prompt chunks alike; other
    dtypes are not packed."""
    from pagedllm.model.moe import Experts

    x, gate_up, down, weights, ids = make_case(200, 32, 16, 4, 2)
    experts = Experts(4, 32, 16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    half = Experts(4, 32, 16).to(torch.bfloat16)
    with torch.no_grad():
        half.gate_up_proj.copy_(gate_up)
        half.down_proj.copy_(down)
    expected = reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(experts(x, weights, ids).double(), expected, rtol=1e-5, atol=1e-5)
    assert not half.pack_for_cpu()
    out = half(x.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)
    if not cpu_moe.usable(x):
        pytest.skip("native CPU kernels unavailable")
    calls: list[int] = []
    kernel = cpu_moe.moe_experts_packed

    def spy(rows: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(rows.shape[0])
        return kernel(rows, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_moe, "moe_experts_packed", spy)
    assert experts.pack_for_cpu() and experts.pack_for_cpu()  # packing twice is a no-op
    assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    for rows in (1, 5, 200):
        actual = experts(x[:rows], weights[:rows], ids[:rows]).double()
        torch.testing.assert_close(actual, expected[:rows], rtol=1e-5, atol=1e-5)
    assert calls == [1, 5, 200]


def test_triton_bfloat16_matches_reference() -> None:
    x, gate_up, down, weights, ids = make_case(20, 64, 32, 8, 2)
    out = triton_interpreted(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(x, gate_up, down, weights, ids), rtol=0.05, atol=0.05)


def test_align_pairs_by_expert() -> None:
    pytest.importorskip("triton")
    from pagedllm.kernels.triton.fused_moe import align_pairs_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # experts 0: pairs 1, 4; 1: pair 3; 3: pairs 0, 2, 5
    sorted_pairs, block_expert = align_pairs_by_expert(ids, 4, 2)
    p = 6  # the padding value
    assert sorted_pairs.tolist()[:8] == [1, 4, 3, p, 0, 2, 5, p]
    assert block_expert.tolist()[:4] == [0, 1, 3, 3]
    assert all(e == -1 for e in block_expert.tolist()[4:])
    assert set(sorted_pairs.tolist()[8:]) <= {p}


COMPILE_SCRIPT = """
import json, sys, torch
from pagedllm.kernels.triton import aot, fused_moe
from pagedllm.model.moe import SparseMoeBlock
from pagedllm.model.moe_config import MoeConfig

meta = torch.device("meta")
report = []
with aot.compile_for(aot.H200) as launches:
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (4, 512):  # a decode batch and a prefill chunk, Qwen3-30B-A3B's expert shapes
            experts, hidden, inter, top_k = 128, 2048, 768, 8
            x = torch.empty(tokens, hidden, dtype=dtype, device=meta)
            gate_up = torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=meta)
            down = torch.empty(experts, hidden, inter, dtype=dtype, device=meta)
            weights = torch.empty(tokens, top_k, dtype=torch.float32, device=meta)
            ids = torch.empty(tokens, top_k, dtype=torch.int64, device=meta)
            out = fused_moe.fused_experts(x, gate_up, down, weights, ids)
            assert out.shape == (tokens, hidden) and out.dtype == dtype
    # A whole sparse block (router, top-k, experts, shared expert) as the model runs it.
    moe = MoeConfig(num_experts=60, top_k=4, intermediate_size=1408, norm_topk_prob=False,
                    checkpoint_names="qwen", shared_expert_intermediate_size=5632)
    with torch.device(meta):
        block = SparseMoeBlock(moe, 2048).to(torch.bfloat16)
        assert block(torch.empty(8, 2048, dtype=torch.bfloat16)).shape == (8, 2048)
for launch in launches:
    report.append({"kernel": launch.kernel, "constants": launch.constants,
                   "shared_bytes": launch.shared_bytes, "usage": aot.resource_usage(launch)})
json.dump({"max_shared": aot.H200.max_shared_bytes, "launches": report}, sys.stdout)
"""


@pytest.mark.slow
def test_grouped_gemm_compiles_for_h200() -> None:
    """The whole fused-MoE path, and a sparse block around it, run on meta tensors (so they never read
    device data on the host, as CUDA graph capture requires) and the grouped GEMMs compile for sm_90
    at decode and prefill tilings, in bf16 and fp32, within shared memory and without register
    spills."""
    pytest.importorskip("triton")
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    gemms = [launch for launch in report["launches"] if launch["kernel"] == "_grouped_gemm_kernel"]
    assert len(gemms) == 10
    for launch in gemms:
        assert launch["constants"]["UPCAST_DOT"] is False
        assert 0 < launch["shared_bytes"] <= report["max_shared"]
        if launch["usage"] is not None:
            assert launch["usage"]["local_bytes"] == 0, launch
