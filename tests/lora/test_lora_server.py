"""LoRA adapters through ``pagedllm serve`` (a real server process, the official ``openai`` client):
``--lora-modules`` in both forms, ``/v1/models`` with each adapter's parent, a request's ``model``
picking its adapter (the same greedy tokens as the offline ``LLM`` with that adapter), adapters loaded
and unloaded at run time behind the API key (a stream of an unloaded adapter finishes), unknown names
and bad flags refused, and every KV block free afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from helpers.idle_engine import IdleEngine
from helpers.server import SMALL_ENGINE_ARGS, RemoteServer, assert_serve_flags
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app

pytestmark = pytest.mark.slow

KEY = "lora-test-key"
PROMPT = "The best way to learn a language is"
MAX_TOKENS = 8
# The default model's projection sizes (SmolLM2-135M: hidden 576, 3 KV heads of 64, FFN 1536).
SHAPES = {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (192, 576), "mlp.down_proj": (576, 1536)}


def _adapter(folder: Path, seed: int) -> str:
    """A PEFT-format rank-8 adapter of random, non-zero weights on q, v and down projections."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for module, (out_f, in_f) in SHAPES.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(8, in_f, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, 8, generator=gen) * 0.2
    folder.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "tuned": _adapter(root / "a", 1),
        "tuned2": _adapter(root / "b", 2),
        "late": _adapter(root / "c", 3),
    }


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Any:
    spec = json.dumps({"name": "tuned2", "path": adapters["tuned2"], "base_model_name": "the-base"})
    flags = ["--enable-lora", "--max-loras", "2", "--enable-runtime-lora-updating"]
    flags += ["--lora-modules", f"tuned={adapters['tuned']}", spec]
    with RemoteServer([*SMALL_ENGINE_ARGS, *flags], api_key=KEY) as srv:
        yield srv


def test_models_lists_the_adapters_with_their_parent(server: RemoteServer, adapters: dict[str, str]) -> None:
    cards = {m.id: m for m in server.client().models.list().data}
    base = next(name for name in cards if name not in adapters)
    assert set(cards) == {base, "tuned", "tuned2"}
    assert cards["tuned"].parent == base and cards["tuned"].root == adapters["tuned"]  # type: ignore[attr-defined]
    assert cards["tuned2"].parent == "the-base"  # type: ignore[attr-defined]


def test_the_model_field_picks_the_adapter(server: RemoteServer, adapters: dict[str, str]) -> None:
    client = server.client()
    base = next(m.id for m in client.models.list().data if m.id not in adapters)

    def complete(model: str) -> str:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert out.model == model  # the adapter's name, as the request gave it
        return out.choices[0].text

    texts = {model: complete(model) for model in (base, "tuned", "tuned2")}
    assert len(set(texts.values())) == 3, texts  # each adapter changes the output
    llm = LLM(None, enable_lora=True, max_loras=2, num_kv_blocks=64, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    for i, name in enumerate(("tuned", "tuned2")):
        offline = llm.generate(
            [PROMPT], params, use_tqdm=False, lora_request=LoRARequest(name, i + 1, adapters[name])
        )
        assert offline[0].outputs[0].text == texts[name], name
    chat = client.chat.completions.create(
        model="tuned", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content and chat.model == "tuned"
    server.wait_idle()


def test_unknown_model_is_404(server: RemoteServer) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    server.wait_idle()


def test_bad_lora_flags_are_refused(tmp_path: Path) -> None:
    good = _adapter(tmp_path / "good", 4)
    assert_serve_flags(["--lora-modules", f"x={tmp_path}"], "--lora-modules needs --enable-lora")
    assert_serve_flags(["--enable-lora", "--lora-modules", "x"], "--lora-modules: 'x' is neither")
    assert_serve_flags(
        ["--enable-lora", "--lora-modules", "x=/no/such/path"], "--lora-modules: x=/no/such/path"
    )
    assert_serve_flags(
        ["--enable-lora", "--lora-modules", f"x={good}", f"x={good}"], "--lora-modules: the name"
    )
    assert_serve_flags(["--enable-lora", "--lora-modules", '{"name": "x"}'], "--lora-modules: ")
    assert_serve_flags(
        ["--enable-lora", "--lora-modules", f"x={tmp_path}"], "--lora-modules: LoRA adapter 'x'"
    )
    assert_serve_flags(["--enable-lora", "--lora-modules", f"x={good}"], None)
    assert_serve_flags(
        ["--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"x={good}"], "--lora-modules: "
    )
    assert_serve_flags(
        ["--enable-runtime-lora-updating"], "--enable-runtime-lora-updating needs --enable-lora"
    )
    assert_serve_flags(
        ["--enable-lora", "--enable-runtime-lora-updating", "--api-server-count", "2"],
        "--enable-runtime-lora-updating runs with one front-end",
    )


def test_adapters_load_and_unload_at_run_time(
    server: RemoteServer, adapters: dict[str, str], tmp_path: Path
) -> None:
    client = server.client()
    body = {"lora_name": "late", "lora_path": adapters["late"]}
    assert httpx.post(server.url("/v1/load_lora_adapter"), json=body).status_code == 401  # no key
    r = server.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 200 and "added" in r.text, r.text
    assert "late" in {m.id for m in client.models.list().data}
    base = client.completions.create(model="tuned2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    late = client.completions.create(model="late", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert late.model == "late" and late.choices[0].text != base.choices[0].text

    # Refusals name the field and change nothing.
    for bad, param in (
        ({"lora_name": "late", "lora_path": adapters["late"]}, "lora_name"),
        ({"lora_name": "other", "lora_path": str(tmp_path / "none")}, "lora_path"),
        ({"lora_name": "other", "lora_path": adapters["late"], "extra": 1}, "extra"),
    ):
        r = server.post("/v1/load_lora_adapter", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "late", "lora_int_id": 999})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_int_id", r.text

    # A stream of an adapter unloaded while it runs finishes; new requests naming it get a 404.
    stream = client.completions.create(
        model="late",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(stream))
    r = server.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200 and "removed" in r.text, r.text
    chunks = [first, *stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    assert "late" not in {m.id for m in client.models.list().data}
    server.wait_idle()


def test_the_update_routes_exist_only_with_the_flag() -> None:
    engine = AsyncLLMEngine(IdleEngine())  # type: ignore[arg-type]
    plain = build_app(engine, ServerSettings(served_model_names=["m"])).openapi()["paths"]
    assert "/v1/load_lora_adapter" not in plain and "/v1/unload_lora_adapter" not in plain
    updating = build_app(
        engine, ServerSettings(served_model_names=["m"], runtime_lora_updating=True)
    ).openapi()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(updating["paths"])
