"""``pagedllm bench make-model``: a GGUF file of a real model's shape with random weights.

Speed on the CPU depends on a model's shape and quantization, not on its trained values, so a file of
Llama 3.2 1B's shape behaves like Llama 3.2 1B for every speed figure. The file is written as
llama.cpp's converter writes a model (the llama architecture's q/k rows in its order), with:

* the shape of :data:`SHAPES` (``llama-1b``, ``llama-3b``, ``llama-8b``, ``qwen3-4b``; ``tiny`` for
  tests) and its tied or separate LM head;
* the default model's tokenizer (SmolLM2's 49152-token BPE, every ``tokenizer.*`` key of its GGUF
  file copied), so the vocabulary, and the embedding and LM-head matrices, are SmolLM2's size;
* random weights from a fixed seed (each tensor drawn from its own stream of ``(seed, index)``):
  normal with standard deviation ``1/sqrt(fan_in)`` for the projections (the output and down
  projections scaled by ``1/sqrt(2 * layers)`` so the residual stream stays of order one), 0.02 for
  the embedding, norms of one. Activations stay finite and the logits are of order one.

The float16 file is written tensor by tensor (one tensor in memory at a time: an 8B-shaped file is
15 GiB), then quantized by the native ``llama-quantize`` (:mod:`pagedllm_bench.native`), so the blocks
are exactly those llama.cpp users have. Files are cached by (shape, quantization, seed) in
``<cache root>/models/random/`` and published atomically (written under a temporary name, then
renamed); the float16 intermediate is removed after quantizing unless ``--keep-f16``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.utils import cache_root

logger = logging.getLogger("pagedllm_bench")

QUANTS = ("F16", "Q8_0", "Q4_0", "Q4_K_M")
CONTEXT_LENGTH = 8192
RMS_EPS = 1e-5


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape (the vocabulary is the default model's)."""

    arch: str  # "llama" or "qwen3" (per-head RMSNorm on queries and keys)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool  # the LM head is the embedding matrix
    rope_theta: float


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape("llama", 128, 2, 4, 2, 32, 256, True, 10000.0),
    "llama-1b": ModelShape("llama", 2048, 16, 32, 8, 64, 8192, True, 500000.0),
    "llama-3b": ModelShape("llama", 3072, 28, 24, 8, 128, 8192, True, 500000.0),
    "llama-8b": ModelShape("llama", 4096, 32, 32, 8, 128, 14336, False, 500000.0),
    "qwen3-4b": ModelShape("qwen3", 2560, 36, 32, 8, 128, 9728, True, 1000000.0),
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its GGUF name, NumPy shape (out, in) or (n,), and the normal
    distribution's standard deviation (0: a norm weight of ones)."""

    name: str
    shape: tuple[int, ...]
    std: float


def tensor_specs(shape: ModelShape, vocab: int) -> list[TensorSpec]:
    """The file's tensors, in the order llama.cpp's converter writes them."""
    h, d = shape.hidden, shape.head_dim
    out_scale = 1.0 / math.sqrt(2 * shape.layers)
    specs = [TensorSpec("token_embd.weight", (vocab, h), 0.02)]
    for i in range(shape.layers):
        b = f"blk.{i}"
        specs += [
            TensorSpec(f"{b}.attn_norm.weight", (h,), 0.0),
            TensorSpec(f"{b}.attn_q.weight", (shape.heads * d, h), 1 / math.sqrt(h)),
            TensorSpec(f"{b}.attn_k.weight", (shape.kv_heads * d, h), 1 / math.sqrt(h)),
            TensorSpec(f"{b}.attn_v.weight", (shape.kv_heads * d, h), 1 / math.sqrt(h)),
            TensorSpec(
                f"{b}.attn_output.weight", (h, shape.heads * d), out_scale / math.sqrt(shape.heads * d)
            ),
        ]
        if shape.arch == "qwen3":
            specs += [
                TensorSpec(f"{b}.attn_q_norm.weight", (d,), 0.0),
                TensorSpec(f"{b}.attn_k_norm.weight", (d,), 0.0),
            ]
        specs += [
            TensorSpec(f"{b}.ffn_norm.weight", (h,), 0.0),
            TensorSpec(f"{b}.ffn_gate.weight", (shape.ffn, h), 1 / math.sqrt(h)),
            TensorSpec(f"{b}.ffn_up.weight", (shape.ffn, h), 1 / math.sqrt(h)),
            TensorSpec(f"{b}.ffn_down.weight", (h, shape.ffn), out_scale / math.sqrt(shape.ffn)),
        ]
    specs.append(TensorSpec("output_norm.weight", (h,), 0.0))
    if not shape.tied:
        specs.append(TensorSpec("output.weight", (vocab, h), 1 / math.sqrt(h)))
    return specs


def _tensor_values(spec: TensorSpec, seed: int, index: int) -> np.ndarray:
    """The tensor's values: float32 ones for norms, else float16 normals from stream (seed, index),
    drawn a slab of rows at a time (the float32 draw never exceeds 64 MiB)."""
    if spec.std == 0.0:
        return np.ones(spec.shape, dtype=np.float32)
    rng = np.random.default_rng([seed, index])
    out = np.empty(spec.shape, dtype=np.float16)
    rows_per_slab = max(1, (16 << 20) // spec.shape[1])
    for lo in range(0, spec.shape[0], rows_per_slab):
        hi = min(lo + rows_per_slab, spec.shape[0])
        slab = rng.standard_normal((hi - lo, spec.shape[1]), dtype=np.float32)
        slab *= spec.std
        out[lo:hi] = slab
    return out


def write_random_gguf(path: str, shape_name: str, seed: int = 0) -> None:
    """Write the float16 GGUF file of :data:`SHAPES` ``[shape_name]`` with random weights to ``path``
    (see the module docstring), streaming: one tensor in memory at a time."""
    import gguf

    from pagedllm.model.loader import default_model_path

    shape = SHAPES[shape_name]
    reader = gguf.GGUFReader(default_model_path())
    tokenizer_fields = [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_name(f"random {shape_name} (seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(shape.layers)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(vocab)
    for field in tokenizer_fields:
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, gguf.GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, field.types[0])
    del reader
    specs = tensor_specs(shape, vocab)
    for spec in specs:
        dtype = np.float32 if spec.std == 0.0 else np.float16
        nbytes = int(np.prod(spec.shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(spec.name, spec.shape, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, spec in enumerate(specs):
        writer.write_tensor_data(_tensor_values(spec, seed, index))
    writer.close()


def model_path(shape_name: str, quant: str, seed: int) -> Path:
    """The cached file of (shape, quantization, seed)."""
    return cache_root() / "models" / "random" / f"{shape_name}-seed{seed}-{quant}.gguf"


def _publish(tmp: Path, final: Path) -> None:
    os.chmod(tmp, 0o644)  # mkstemp's files are private; a model file is readable like any other
    os.replace(tmp, final)


def _temp_beside(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


def make_model(
    shape_name: str, quant: str, seed: int = 0, *, keep_f16: bool = False, threads: int | None = None
) -> Path:
    """The cached GGUF file of (shape, quantization, seed), made first when absent: the float16 file
    (see :func:`write_random_gguf`), then ``llama-quantize`` into ``quant`` (built first when the
    native tools are not cached). ValueError names a bad shape or quantization."""
    if shape_name not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape_name!r}.")
    if quant not in QUANTS:
        raise ValueError(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}.")
    final = model_path(shape_name, quant, seed)
    if final.is_file():
        return final
    f16 = model_path(shape_name, "F16", seed)
    if not f16.is_file():
        start = time.perf_counter()
        tmp = _temp_beside(f16)
        try:
            write_random_gguf(str(tmp), shape_name, seed)
            _publish(tmp, f16)
        finally:
            tmp.unlink(missing_ok=True)
        logger.warning(
            "Wrote %s (%.0f MiB) in %.0f s.", f16, f16.stat().st_size / 2**20, time.perf_counter() - start
        )
    if quant == "F16":
        return f16
    from pagedllm_bench.native import ensure_tools
    from pagedllm_bench.native_run import run_tool

    tools = ensure_tools()
    start = time.perf_counter()
    tmp = _temp_beside(final)
    try:
        cmd = [tools.path("llama-quantize"), str(f16), str(tmp), quant, str(threads or os.cpu_count() or 1)]
        run_tool(cmd, None, timeout_s=4 * 3600)
        _publish(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    logger.warning("Quantized %s in %.0f s.", final, time.perf_counter() - start)
    if not keep_f16:
        f16.unlink(missing_ok=True)
    return final


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape",
        required=True,
        choices=list(SHAPES),
        help="The model shape: llama-1b (Llama 3.2 1B), llama-3b (Llama 3.2 3B), llama-8b (Llama 3.1 8B), "
        "qwen3-4b (Qwen3 4B); tiny (tests).",
    )
    parser.add_argument(
        "--quant", default="Q4_K_M", choices=list(QUANTS), help="Weight format (default Q4_K_M)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random weights (default 0).")
    parser.add_argument(
        "-o", "--output", default=None, help="Also link (or copy) the cached file to this path."
    )
    parser.add_argument(
        "--keep-f16", action="store_true", help="Keep the float16 intermediate in the cache after quantizing."
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="llama-quantize's threads (default: the CPU count)."
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.seed < 0:
        logger.error("--seed must be non-negative, got %d.", args.seed)
        return 2
    if args.threads is not None and args.threads < 1:
        logger.error("--threads must be at least 1, got %d.", args.threads)
        return 2
    if args.output and os.path.isdir(args.output):
        logger.error("--output %s is a directory; name the file to write.", args.output)
        return 2
    try:
        path = make_model(args.shape, args.quant, args.seed, keep_f16=args.keep_f16, threads=args.threads)
    except (ValueError, RuntimeError, OSError) as exc:
        logger.error("%s", exc)
        return 2 if isinstance(exc, ValueError) else 1
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.unlink(missing_ok=True)
        try:
            os.link(path, out)
        except OSError:
            shutil.copyfile(path, out)
        print(out)
    else:
        print(path)
    return 0
