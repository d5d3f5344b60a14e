"""``pagedllm bench embed``: embedding throughput of ``LLM.embed`` against transformers, in one run.

The workload is ``--num-sentences`` sentences of mixed length, cut deterministically (``--seed``) from
the shipped public-domain text (``texts/us_constitution.txt``): each takes ``--min-words`` to
``--max-words`` consecutive words from a random place (a sentence whose tokens would pass the model's
``max_model_len`` loses words from its end until it fits; the count is reported). Both systems embed the
same sentences in the same process with the same torch thread count (``--num-threads``, else torch's
default), each after an untimed warm-up batch:

* pagedllm: ``LLM.embed`` on all sentences at once (the engine batches them under its budgets);
* transformers: ``BertModel`` from the same folder, float32, ``--batch-size`` sentences at a time in the
  given order, each batch tokenized with padding to its longest sentence, forward, then the model's
  pooling (mean over the attention mask, or CLS) and L2 normalisation as the model's configuration says.

Both timings include tokenization. Reported: sentences/s and tokens/s of each, the ratio pagedllm /
transformers, the CPU cores the process used while each ran (well below the thread count means other
processes took the cores), and the smallest cosine similarity between the two systems' embeddings of a
sentence (they run the same model, so it is about 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.config import EngineConfig
from pagedllm.model.packaged import MINILM_NAMES
from pagedllm.model.pooling import PoolingConfig
from pagedllm.worker.encoder_executor import EncoderExecutor
from pagedllm_bench.common import (
    add_run_args,
    format_table,
    machine_info,
    now_iso,
    ratio,
    run_at_log_level,
    set_num_threads,
    write_json,
)
from pagedllm_bench.latency import CpuUse

logger = logging.getLogger("pagedllm_bench")

TEXT = Path(__file__).resolve().parent / "texts" / "us_constitution.txt"
BASELINE = "transformers"


def mixed_sentences(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    """``count`` sentences of ``min_words`` to ``max_words`` consecutive words of the shipped text,
    the same for the same arguments."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= --min-words <= --max-words, got {min_words} and {max_words}.")
    words = TEXT.read_text(encoding="utf-8").split()
    if max_words > len(words):
        raise ValueError(f"--max-words must be at most {len(words)} (the words of {TEXT.name}).")
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        n = rng.randint(min_words, max_words)
        start = rng.randint(0, len(words) - n)
        sentences.append(" ".join(words[start : start + n]))
    return sentences


def fit_to_context(sentences: list[str], tokenizer: Any, max_len: int) -> tuple[list[str], int]:
    """The sentences with words dropped from the end of those longer than ``max_len`` tokens, and how
    many were shortened."""
    out = []
    shortened = 0
    for sentence in sentences:
        words = sentence.split()
        if len(tokenizer.encode(sentence)) > max_len:
            shortened += 1
            while len(words) > 1 and len(tokenizer.encode(" ".join(words))) > max_len:
                words = words[: max(1, len(words) - 8)]
        out.append(" ".join(words))
    return out, shortened


@torch.inference_mode()
def transformers_embed(
    model: Any, tokenizer: Any, sentences: list[str], batch_size: int, pooling: PoolingConfig
) -> torch.Tensor:
    """transformers' batched forward plus the model's pooling, ``batch_size`` sentences at a time."""
    out = []
    for i in range(0, len(sentences), batch_size):
        batch = tokenizer(sentences[i : i + batch_size], padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        if pooling.pooling_type == "cls":
            pooled = hidden[:, 0]
        elif pooling.pooling_type == "mean":
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
        else:
            raise ValueError(f"the transformers baseline has no {pooling.pooling_type!r} pooling.")
        out.append(F.normalize(pooled, dim=-1) if pooling.normalize else pooled)
    return torch.cat(out)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("embed")
    group.add_argument("--num-sentences", type=int, default=1000, help="Sentences to embed (default 1000).")
    group.add_argument("--min-words", type=int, default=5, help="Fewest words of a sentence (default 5).")
    group.add_argument("--max-words", type=int, default=200, help="Most words of a sentence (default 200).")
    group.add_argument(
        "--batch-size", type=int, default=32, help="Sentences per forward of the transformers baseline (32)."
    )
    group.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also measure transformers' BertModel on the same folder and sentences (default on).",
    )
    add_run_args(parser, warmup=True)
    parser.set_defaults(model=MINILM_NAMES[0])


def run(args: argparse.Namespace) -> int:
    return run_at_log_level(args, _run)


def _run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    try:
        set_num_threads(args.num_threads)
        for name in ("num_sentences", "batch_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}.")
        config = EngineConfig.from_cli_args(args, task="embed")
        sentences = mixed_sentences(args.num_sentences, args.min_words, args.max_words, config.seed)
        llm = LLM(**dataclasses.asdict(config))
    except (ValueError, OSError) as exc:
        logger.error("%s", exc)
        return 2
    engine = llm.llm_engine
    sentences, shortened = fit_to_context(sentences, engine.tokenizer, engine.max_model_len)
    num_tokens = sum(len(engine.tokenizer.encode(s)) for s in sentences)
    threads = torch.get_num_threads()
    print(
        f"Workload: {len(sentences)} sentences of {args.min_words}-{args.max_words} words, {num_tokens} "
        f"tokens ({shortened} shortened to fit {engine.max_model_len} tokens); {threads} torch threads"
    )
    systems: dict[str, dict[str, Any]] = {}
    if args.warmup:
        llm.embed(sentences[: args.batch_size], use_tqdm=False)
    cpu = CpuUse()
    started = time.perf_counter()
    outputs = llm.embed(sentences, use_tqdm=False)
    elapsed = time.perf_counter() - started
    systems["pagedllm"] = _figures(len(sentences), num_tokens, elapsed, cpu.cores())
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    min_cosine = None
    if args.baseline:
        from transformers import AutoTokenizer, BertModel

        folder = engine.executor.checkpoint_path
        if not isinstance(engine.executor, EncoderExecutor):
            logger.error(
                "The transformers baseline runs BERT folders only; pass --no-baseline for %s.", folder
            )
            return 2
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = BertModel.from_pretrained(folder, dtype=torch.float32).eval()
        if args.warmup:
            transformers_embed(
                model, tokenizer, sentences[: args.batch_size], args.batch_size, engine.pooling_config
            )
        cpu = CpuUse()
        started = time.perf_counter()
        theirs = transformers_embed(model, tokenizer, sentences, args.batch_size, engine.pooling_config)
        elapsed = time.perf_counter() - started
        systems[BASELINE] = _figures(len(sentences), num_tokens, elapsed, cpu.cores())
        min_cosine = float(F.cosine_similarity(ours, theirs, dim=-1).min())
    speedup = (
        ratio(systems["pagedllm"]["sentences_per_s"], systems[BASELINE]["sentences_per_s"])
        if BASELINE in systems
        else None
    )
    rows = [
        [name, s["sentences_per_s"], s["tokens_per_s"], s["elapsed_s"], s["cpu_cores_used"]]
        for name, s in systems.items()
    ]
    print(format_table(["system", "sentences/s", "tokens/s", "elapsed s", "cores used"], rows))
    if speedup is not None:
        print(
            f"pagedllm / transformers: {speedup:.2f}x; smallest cosine between their embeddings {min_cosine:.6f}"
        )
    if args.output_json:
        write_json(
            args.output_json,
            {
                "date": now_iso(),
                "machine": machine_info(),
                "model": engine.model_name,
                "engine_config": dataclasses.asdict(config),
                "workload": {
                    "num_sentences": len(sentences),
                    "min_words": args.min_words,
                    "max_words": args.max_words,
                    "seed": config.seed,
                    "num_tokens": num_tokens,
                    "shortened": shortened,
                },
                "baseline_batch_size": args.batch_size,
                "num_threads": threads,
                "systems": systems,
                "ratio": speedup,
                "min_cosine": min_cosine,
            },
        )
    return 0


def _figures(sentences: int, tokens: int, elapsed: float, cores: float) -> dict[str, float]:
    return {
        "sentences_per_s": sentences / elapsed,
        "tokens_per_s": tokens / elapsed,
        "elapsed_s": elapsed,
        "cpu_cores_used": cores,
    }
