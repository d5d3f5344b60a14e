"""``generation_config`` (``--generation-config auto|vllm|FOLDER``): default temperature, top_p, top_k,
min_p and repetition_penalty from the model's generation config (an HF folder's
``generation_config.json`` or a GGUF file's ``general.sampling.*`` metadata), offline and in the
server, where a request's own values win; ``vllm`` takes none; a bad setting is an error naming the
field before anything loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import pytest

from helpers.model_factory import make_tiny_hf_model
from helpers.server import RemoteServer
from pagedllm import SamplingParams
from pagedllm.model.generation_config import load_generation_defaults, read_gguf_metadata
from pagedllm.model.gguf_reader import open_gguf, read_metadata
from pagedllm.model.loader import default_model_path

# temperature 0: outputs with the defaults are greedy, which a random-weight model shows plainly.
GENERATION = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
PROMPT = "The quick brown fox"
ENGINE = {"max_model_len": 256, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama folder whose generation_config.json holds :data:`GENERATION` (next to the token
    ids transformers writes there)."""
    path = make_tiny_hf_model(tmp_path_factory.mktemp("gen"), "llama")
    config_file = Path(path) / "generation_config.json"
    config = json.loads(config_file.read_text())
    config.update(GENERATION, do_sample=True, max_new_tokens=99)
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny_llm(make_llm: Any, tiny_dir: str) -> Any:
    return make_llm(tiny_dir, **ENGINE)


def greedy_output(llm: Any, max_tokens: int, **extra: Any) -> Any:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=1.1, **extra)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def greedy(llm: Any, max_tokens: int, **extra: Any) -> list[int]:
    return list(greedy_output(llm, max_tokens, **extra).token_ids)


def test_offline_defaults_apply_and_a_given_params_wins(tiny_llm: Any) -> None:
    assert tiny_llm.llm_engine.default_sampling == GENERATION
    params = tiny_llm.get_default_sampling_params()
    assert {name: getattr(params, name) for name in GENERATION} == GENERATION
    assert params.max_tokens == SamplingParams().max_tokens  # max_new_tokens is not a sampling default
    # No sampling parameters: greedy (temperature 0 from the config), as an explicit greedy request
    # with another seed.
    default_tokens = list(tiny_llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids)
    assert len(default_tokens) == params.max_tokens
    assert default_tokens == greedy(tiny_llm, params.max_tokens, seed=1234)
    # Parameters given by the caller are used as they are: temperature 1 samples.
    sampled = tiny_llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=7), use_tqdm=False)
    assert list(sampled[0].outputs[0].token_ids) != default_tokens
    tiny_llm.llm_engine.check_idle()


def test_vllm_takes_no_defaults(make_llm: Any, tiny_dir: str) -> None:
    llm = make_llm(tiny_dir, generation_config="vllm", **ENGINE)
    assert llm.llm_engine.default_sampling == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    # temperature 1 by default: the output is sampled, not greedy.
    out = list(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids)
    assert out != greedy(llm, len(out))
    llm.llm_engine.check_idle()


def test_folder_replaces_the_models_config(make_llm: Any, tiny_dir: str, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.3, "top_k": 5, "top_p": None})
    )
    llm = make_llm(tiny_dir, generation_config=str(tmp_path), **ENGINE)
    assert llm.llm_engine.default_sampling == {"temperature": 0.3, "top_k": 5}
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.3, 5, 1.0, 1.0)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "no such folder"),
        ("", "has no generation_config.json"),
        ("{not json", "generation_config: Could not read"),
        ("[1]", "does not contain a JSON object"),
        ('{"temperature": -1}', "temperature must be in"),
        ('{"top_p": 0}', "top_p must be in"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"min_p": "low"}', "min_p must be a number"),
        ('{"repetition_penalty": true}', "repetition_penalty must be a number"),
    ],
)
def test_bad_folders_are_errors_naming_the_field(
    make_llm: Any, tiny_dir: str, tmp_path: Path, content: str | None, match: str
) -> None:
    folder = tmp_path / "cfg"
    if content is not None:
        folder.mkdir()
        if content:
            (folder / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match="generation_config") as info:
        make_llm(tiny_dir, generation_config=str(folder), **ENGINE)
    assert match in str(info.value)


def test_empty_setting_is_refused(make_llm: Any) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        make_llm(generation_config="")


# -- GGUF metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_gguf_sampling_metadata(tmp_path: Path, endian: gguf.GGUFEndian) -> None:
    path = str(tmp_path / "sampling.gguf")
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    writer.add_token_list([f"tok{i}" for i in range(300)])  # stepped over: an array of strings
    writer.add_array("test.numbers", [1.5, 2.5, 3.5])
    writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.6)
    writer.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.95)
    writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 20)
    writer.add_float32(gguf.Keys.General.SAMPLING_PENALTY_REPEAT, 1.05)
    writer.add_float32(gguf.Keys.General.SAMPLING_XTC_PROBABILITY, 0.5)  # not a SamplingParams field
    writer.add_string("test.after", "still found")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = read_gguf_metadata(path, lambda key: key.startswith("test."))
    assert found == {"test.numbers": [1.5, 2.5, 3.5], "test.after": "still found"}
    defaults = load_generation_defaults("auto", path)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    assert load_generation_defaults("vllm", path).values == {}


def test_gguf_scan_reads_what_the_gguf_reader_reads() -> None:
    """Every metadata value of the default model, as ``GGUFReader`` decodes it (the vocabulary and
    merges included); the default model's file has no sampling defaults, so its model card's apply."""
    path = default_model_path()
    scanned = read_gguf_metadata(path, lambda key: True)
    reader = open_gguf(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(scanned) == sorted(keys)
    assert all(scanned[k] == read_metadata(reader, k) for k in keys)
    assert not any(k.startswith("general.sampling.") for k in scanned)
    assert load_generation_defaults("auto", None).values == {"temperature": 0.2, "top_p": 0.9}
    assert load_generation_defaults("vllm", None).values == {}


# -- the server ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_server_defaults_and_request_values(tiny_dir: str, tiny_llm: Any) -> None:
    args = [tiny_dir, "--max-model-len", "256", "--num-kv-blocks", "64"]
    with RemoteServer(args) as srv:
        card = srv.get("/v1/models").json()["data"][0]
        assert card["generation_config"] == GENERATION
        client = srv.client()
        model = card["id"]
        plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=8)
        explicit = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, seed=99)
        own = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=99)
        want = greedy_output(tiny_llm, 8).text
        assert plain.choices[0].text == explicit.choices[0].text == want
        assert own.choices[0].text != want
        srv.wait_idle()
