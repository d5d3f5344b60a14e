"""``pagedllm bench make-model``, ``bench scale`` and ``bench serve --baseline llama-server``: the random
GGUF writer (a tiny shape, no native build needed) loads in the engine with finite logits, flags are
checked before any work, and (only where the native llama.cpp tools are already built) llama.cpp
runs the same files."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.model.loader import default_model_path
from pagedllm_bench import make_model, native, native_run, scale


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny-F16.gguf")
    make_model.write_random_gguf(path, "tiny", seed=3)
    return path


def test_tiny_file_has_the_shape_and_the_default_tokenizer(tiny_gguf: str) -> None:
    shape = make_model.SHAPES["tiny"]
    reader = gguf.GGUFReader(tiny_gguf)
    default = gguf.GGUFReader(default_model_path())
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == shape.layers
    assert reader.fields["llama.attention.head_count_kv"].contents() == shape.kv_heads
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert reader.fields[key].contents() == default.fields[key].contents()
    vocab = len(default.fields["tokenizer.ggml.tokens"].data)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len(make_model.tensor_specs(shape, vocab))
    assert "output.weight" not in tensors  # tied, as Llama 3.2 1B
    q = tensors["blk.1.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.F16
    values = np.asarray(q.data, dtype=np.float32)
    # Drawn at the fan-in scale from the seed's own stream: not constant, of the intended spread.
    assert 0.5 / math.sqrt(shape.hidden) < values.std() < 2 / math.sqrt(shape.hidden)
    np.testing.assert_array_equal(
        np.asarray(tensors["blk.0.ffn_norm.weight"].data), np.ones(shape.hidden, np.float32)
    )
    # What a decode step reads: every tensor (the tied embedding is the LM head), f16 K and V per layer.
    sizes = scale.decode_bytes(tiny_gguf)
    assert sizes["weight_bytes_per_step"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert sizes["kv_bytes_per_token"] == 2 * shape.layers * shape.kv_heads * shape.head_dim * 2


def test_weights_are_fixed_by_the_seed() -> None:
    spec = make_model.TensorSpec("w", (64, 32), 0.1)
    a = make_model._tensor_values(spec, seed=1, index=5)
    assert a.dtype == np.float16 and a.shape == (64, 32)
    np.testing.assert_array_equal(a, make_model._tensor_values(spec, seed=1, index=5))
    assert not np.array_equal(a, make_model._tensor_values(spec, seed=2, index=5))
    assert not np.array_equal(a, make_model._tensor_values(spec, seed=1, index=6))


def test_tiny_file_loads_in_the_engine_with_finite_logits(tiny_gguf: str) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=tiny_gguf, max_model_len=64, num_kv_blocks=16)
    out = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0, logprobs=5), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 3
    for step in completion.logprobs or []:
        assert len(step) >= 5 and all(math.isfinite(lp.logprob) for lp in step.values())


def test_scale_engine_sets_the_kv_pool_apart_from_the_memory_it_reports(
    tiny_gguf: str, tmp_path: Path
) -> None:
    import torch

    from pagedllm_bench import scale_engine

    out = tmp_path / "engine.json"
    argv = ["--model", tiny_gguf, "--threads", str(torch.get_num_threads()), "--phases", "load,decode"]
    argv += ["--decode-tokens", "4", "--prompt-tokens", "8", "--batch-sequences", "2", "--batch-prompt", "16"]
    argv += ["--batch-output", "4", "--repeats", "1", "--output-json", str(out)]
    assert scale_engine.main(argv) == 0
    import json

    data = json.loads(out.read_text())
    load = data["load"]
    assert data["config"]["num_kv_blocks"] > 0 and load["kv_pool_mib"] > 0
    assert load["rss_kv_apart_mib"] == pytest.approx(
        load["rss_after_first_request_mib"] - load["kv_pool_mib"]
    )
    assert data["decode"]["tokens_per_s"] > 0 and "prompt" not in data and "batch" not in data


def test_make_model_publishes_into_the_cache_and_links_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out" / "tiny.gguf"
    assert main(["bench", "make-model", "--shape", "tiny", "--quant", "F16", "-o", str(out)]) == 0
    cached = make_model.model_path("tiny", "F16", 0)
    assert cached.is_file() and out.is_file() and out.stat().st_size == cached.stat().st_size
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # no temporary left behind
    assert capsys.readouterr().out.strip() == str(out)
    mtime = cached.stat().st_mtime_ns
    assert make_model.make_model("tiny", "F16", 0) == cached and cached.stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["bench", "make-model", "--shape", "tiny", "--seed", "-1"], "--seed"),
        (["bench", "make-model", "--shape", "tiny", "--threads", "0"], "--threads"),
        (["bench", "scale", "--model", "missing.gguf"], "--model"),
        (["bench", "scale", "--model", "{default}", "--threads", "0"], "--threads"),
        (["bench", "scale", "--model", "{default}", "--repeats", "0"], "--repeats"),
        (["bench", "serve", "--baseline", "llama-server", "--model", "missing.gguf"], "--model"),
        (["bench", "serve", "--baseline", "llama-server", "--parallel", "0"], "--parallel"),
        (
            ["bench", "serve", "--baseline", "llama-server", "--model", "{default}", "--compare-offline"],
            "--compare-offline",
        ),
    ],
)
def test_bad_flags_are_named(
    argv: list[str],
    flag: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    argv = [default_model_path() if a == "{default}" else a for a in argv]
    with caplog.at_level(logging.ERROR, logger="pagedllm_bench"):
        assert main(argv) == 2
    assert flag in caplog.text
    assert not any(tmp_path.iterdir())  # nothing built or written


def test_unknown_shape_and_quant_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (
        (["bench", "make-model", "--shape", "llama-70b"], "--shape"),
        (["bench", "make-model", "--shape", "tiny", "--quant", "Q3_K"], "--quant"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(ValueError, match="--quant"):
        make_model.make_model("tiny", "IQ2_XS")


def test_best_variant_falls_back_and_names_its_source() -> None:
    def measure(v: native_run.Variant) -> dict[str, float | str]:
        if v.repack:
            raise native_run.ToolError("crashed")
        return {"tokens_per_s": 2.0 if v.omp_wait_policy == "passive" else 1.0, "variant": v.label}

    with pytest.raises(native_run.ToolError, match="every variant failed"):
        native_run.best_of_variants(measure, "tokens_per_s", [v for v in native_run.VARIANTS if v.repack])
    best = native_run.best_of_variants(measure, "tokens_per_s")
    assert best["tokens_per_s"] == 2.0 and best["variant"] == "repack off, OMP wait passive"
    assert best["variants"]["repack on, OMP wait default"] == {"error": "crashed"}
    assert best["variants"]["repack off, OMP wait default"] == 1.0


# ------------------------------------------------------------------------------------------------
# Native llama.cpp on the same files: only where the tools are already built (never built here).
# ------------------------------------------------------------------------------------------------

TOOLS = native.find_tools()
needs_tools = pytest.mark.skipif(TOOLS is None, reason=native.missing_tools_reason())


@needs_tools
@pytest.mark.slow
def test_llama_cpp_quantizes_and_runs_the_file_the_engine_loads(tiny_gguf: str, tmp_path: Path) -> None:
    assert TOOLS is not None
    quantized = str(tmp_path / "tiny-Q4_K_M.gguf")
    native_run.run_tool([TOOLS.path("llama-quantize"), tiny_gguf, quantized, "Q4_K_M", "2"], None, 600)
    types = {t.tensor_type for t in gguf.GGUFReader(quantized).tensors}
    assert gguf.GGMLQuantizationType.Q4_K in types or gguf.GGMLQuantizationType.Q8_0 in types
    tg = native_run.llama_bench(TOOLS, quantized, 2, n_gen=8, repetitions=1, timeout_s=600)
    assert tg["test"] == "tg8" and tg["tokens_per_s"] > 0 and tg["threads"] == 2
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=quantized, max_model_len=64, num_kv_blocks=16)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0, logprobs=2), use_tqdm=False)
    assert all(math.isfinite(lp.logprob) for step in out[0].outputs[0].logprobs or [] for lp in step.values())


@needs_tools
@pytest.mark.slow
def test_serve_against_llama_server_stops_both(tiny_gguf: str, tmp_path: Path) -> None:
    before = set(_children())
    out = tmp_path / "versus.json"
    argv = ["bench", "serve", "--baseline", "llama-server", "--model", tiny_gguf, "--num-prompts", "4"]
    argv += ["--input-len", "16", "--output-len", "8", "--parallel", "2", "--output-json", str(out)]
    assert main(argv) == 0
    import json

    data = json.loads(out.read_text())
    assert [s["server"] for s in data["servers"]] == ["pagedllm", "llama-server"]
    for s in data["servers"]:
        assert s["completed"] == 4 and s["total_output_tokens"] == 32 and s["ready_s"] > 0
    assert set(_children()) <= before  # both servers stopped and reaped


def _children() -> list[int]:
    """Live processes whose parent is this one (from /proc, so no helper process is counted)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_native_tools_build_the_pinned_binding_version() -> None:
    """The native tools and the ``llamacpp`` extra's binding run the same llama.cpp."""
    pyproject = Path(__file__).resolve().parents[2] / "benchmarks" / "pyproject.toml"
    assert f'"llama-cpp-python=={native.LLAMA_CPP_PYTHON_VERSION}"' in pyproject.read_text()
    assert native.tools_root().parts[-2:] == ("llama.cpp", native.LLAMA_CPP_PYTHON_VERSION)
