"""The Triton kernels compile for an H200 (sm_90) as the engine launches them, without a GPU.

``benchmarks/gpu/compile_check.py`` runs the forward of a Qwen3-0.6B-shaped model and of the default
model on the meta device inside ``triton_aot.compile_for(H200)``: every launch is specialised and
compiled by Triton's JIT for sm_90 down to the cubin, with the tilings the engine picks on that GPU
(CUDA-graph buckets 1..256 with their fixed split-K, and an eager mixed step). This covers what the
interpreter tests cannot: the GPU compiler's own rules, shared memory per block and register spills.
The decode forward on meta tensors also shows it never reads device data on the host (a meta
tensor's ``.item()``/``.tolist()`` raises), which CUDA graph capture requires.

Compiling needs a process that imported triton without ``TRITON_INTERPRET=1`` (which the interpreter
tests of this suite set), so both tests run in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_write_kv_kernel",
    "_paged_attention_kernel",
    "_merge_splits_kernel",
    "_rms_norm_kernel",
    "_silu_and_mul_kernel",
}


def run_python(args: list[str], interpret: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_engine_kernels_compile_for_h200(tmp_path: Path) -> None:
    report_path = tmp_path / "compile_check.json"
    proc = run_python(["benchmarks/gpu/compile_check.py", "--output-json", str(report_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["target"]["compute_capability"] == 90
    max_shared = report["target"]["max_shared_bytes"]
    cases = {(case["model"], case["dtype"]): case for case in report["cases"]}
    # Sampling's kernel: top-p rows the first candidate set leaves open are settled on the device.
    sampler = cases.pop(("sampler", "float32"))
    assert [v["kernel"] for v in sampler["variants"]] == ["_settle_thresholds_kernel"]
    assert [x["grid"] for x in sampler["launches"]] == [[192]]  # a program per filtered row (3 in 4)
    assert all(v["local_bytes"] == 0 for v in sampler["variants"] if "local_bytes" in v)
    assert set(cases) == {(m, d) for m in ("qwen3-0.6b", "default") for d in ("bfloat16", "float32")}
    assert all(kernel in proc.stdout for kernel in KERNELS)  # the printed table

    for (model, dtype), case in cases.items():
        group = case["num_attention_heads"] // case["num_key_value_heads"]
        variants: list[dict[str, Any]] = case["variants"]
        assert {v["kernel"] for v in variants} == KERNELS, (model, dtype)
        for v in variants:
            # Within the H200's shared memory, and no register spills to local memory.
            assert 0 <= v["shared_bytes"] <= max_shared
            if "local_bytes" in v:
                assert v["local_bytes"] == 0 and v["registers"] <= 255, v
            # The compiled form of the kernels, not the interpreter's (which upcasts dot operands).
            assert v["constants"].get("UPCAST_DOT", False) is False
            if v["kernel"] == "_paged_attention_kernel":
                # K and V tiles are software-pipelined: asynchronous copies ahead of their use.
                assert v["async_copies"] >= 2, v
                # 16-bit prefill tiles of 64 rows use Hopper's warp-group MMA.
                if dtype == "bfloat16" and v["constants"]["BLOCK_M"] >= 64:
                    assert v["dot"] == "wgmma", v

        # Every bucket launches attention with one program per sequence and a split-K fixed for any
        # context up to max_model_len; more splits where the bucket alone cannot fill the SMs.
        splits = {}
        for bucket, launches in case["buckets"].items():
            b = int(bucket)
            attention = [x for x in launches if x["kernel"] == "_paged_attention_kernel"]
            assert len(attention) == 1  # one layer
            c = attention[0]["constants"]
            assert c["DECODE_ONLY"] is True and c["QUERIES_PER_KV"] == group
            assert c["IEEE_DOT"] is (dtype == "float32")
            assert attention[0]["grid"] == [b, case["num_key_value_heads"], c["NUM_SPLITS"]]
            merges = [x for x in launches if x["kernel"] == "_merge_splits_kernel"]
            assert len(merges) == (1 if c["NUM_SPLITS"] > 1 else 0)
            writes = [x for x in launches if x["kernel"] == "_write_kv_kernel"]
            assert len(writes) == 1
            splits[b] = c["NUM_SPLITS"]
        sizes = sorted(splits)
        assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
        assert splits[1] >= 4 and splits[256] == 1
        assert all(splits[a] >= splits[b] for a, b in zip(sizes, sizes[1:], strict=False))

        prefill = [x for x in case["mixed"] if x["kernel"] == "_paged_attention_kernel"]
        assert len(prefill) == 1 and prefill[0]["constants"]["DECODE_ONLY"] is False
        # Several query tokens per program share each K/V tile.
        assert prefill[0]["constants"]["BLOCK_Q"] >= 8


def test_compile_for_checks_shared_memory_and_leaves_no_trace() -> None:
    """A tiling needing more shared memory than the GPU has fails, naming the kernel; outside a
    scope a meta launch runs nothing; the scope restores Triton's driver and JIT caches; and a
    process in interpreter mode is refused with a clear message."""
    code = textwrap.dedent(
        """
        import torch, triton
        from pagedllm.kernels.triton import aot as triton_aot, attention as triton_kernels
        from pagedllm.attention.base import AttentionMetadata

        meta_dev = torch.device("meta")
        lens = [64, 1]
        meta = AttentionMetadata(
            slot_mapping=torch.empty(65, dtype=torch.int64, device=meta_dev),
            query_start_loc=torch.tensor([0, 64, 65], dtype=torch.int32, device=meta_dev),
            seq_lens=torch.empty(2, dtype=torch.int32, device=meta_dev),
            block_tables=torch.empty(2, 8, dtype=torch.int32, device=meta_dev),
            max_query_len=64, max_seq_len=100, query_lens_cpu=lens, seq_lens_cpu=[64, 100],
        )
        cache = torch.empty(16, 16, 8, 128, dtype=torch.bfloat16, device=meta_dev)
        query = torch.empty(65, 16, 128, dtype=torch.bfloat16, device=meta_dev)
        kernel = triton_kernels._paged_attention_kernel
        caches_before, driver_before = kernel.device_caches, triton.runtime.driver._active

        small = triton_aot.GPUSpec("small GPU", compute_capability=90, num_sms=8, max_shared_bytes=16384)
        with triton_aot.compile_for(small) as launches:
            assert triton_aot.current_spec() is small
            try:
                triton_kernels.paged_attention(query, cache, cache, meta, 0.1)
            except RuntimeError as exc:
                assert "_paged_attention_kernel" in str(exc) and "shared memory" in str(exc), exc
            else:
                raise AssertionError("a 16 KiB GPU accepted the prefill tiling")
        assert launches == [] and triton_aot.current_spec() is None

        with triton_aot.compile_for() as launches:
            triton_kernels.paged_attention(query, cache, cache, meta, 0.1)
        assert [x.kernel for x in launches] == ["_paged_attention_kernel"]
        assert launches[0].shared_bytes <= triton_aot.H200.max_shared_bytes
        assert b"sm_90" in launches[0].asm["ptx"].encode() and launches[0].asm["cubin"]

        out = triton_kernels.paged_attention(query, cache, cache, meta, 0.1)  # no scope: runs nothing
        assert out.device == meta_dev and out.shape == query.shape
        assert kernel.device_caches is caches_before
        assert triton.runtime.driver._active is driver_before
        print("ok")
        """
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]

    refused = run_python(
        ["-c", "from pagedllm.kernels.triton import aot as triton_aot\nwith triton_aot.compile_for(): pass"],
        interpret=True,
    )
    assert refused.returncode != 0 and "TRITON_INTERPRET=1" in refused.stderr


def test_step_sizes_compile_one_variant() -> None:
    """Batches of 1, 7 and 16 sequences (as many tokens, block tables 1, 7 and 16 entries wide)
    launch the same compiled attention and KV-write kernels: the sizes that change from step to step
    are not specialised on, so a run does not stop to compile a variant the first time one of them
    is 1 or a multiple of 16."""
    code = textwrap.dedent(
        """
        import torch
        from pagedllm.kernels.triton import aot as triton_aot, attention as tk
        from pagedllm.kernels.triton.kv_write import write_kv
        from pagedllm.attention.base import AttentionMetadata

        dev = torch.device("meta")
        cache = torch.empty(64, 16, 8, 128, dtype=torch.bfloat16, device=dev)
        config = tk.AttentionLaunchConfig(block_m=64, tile_n=64, num_splits=1)
        with triton_aot.compile_for() as launches:
            for n in (1, 7, 16):
                tokens = 40 * n
                meta = AttentionMetadata(
                    slot_mapping=torch.empty(tokens, dtype=torch.int64, device=dev),
                    query_start_loc=torch.empty(n + 1, dtype=torch.int32, device=dev),
                    seq_lens=torch.empty(n, dtype=torch.int32, device=dev),
                    block_tables=torch.empty(n, n, dtype=torch.int32, device=dev),
                    max_query_len=40, max_seq_len=2048, query_lens_cpu=[40] * n, seq_lens_cpu=[2048] * n,
                )
                query = torch.empty(tokens, 16, 128, dtype=torch.bfloat16, device=dev)
                tk.paged_attention(query, cache, cache, meta, 0.1, config=config)
                kv = query[:, :8]
                write_kv(kv, kv, cache, cache, meta.slot_mapping)
        for name in ("_paged_attention_kernel", "_write_kv_kernel"):
            ptx = [x.asm["ptx"] for x in launches if x.kernel == name]
            assert len(ptx) == 3 and len(set(ptx)) == 1, (name, len(set(ptx)))
        print("ok")
        """
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
