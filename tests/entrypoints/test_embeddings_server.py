"""``/v1/embeddings`` end to end: a real ``pagedllm serve --task embed`` process on all-MiniLM-L6-v2,
the official ``openai`` client, and the task checks on both sides (a generate server refuses
embeddings, an embed server refuses generation)."""

from __future__ import annotations

import base64
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import openai
import psutil
import pytest

from helpers.processes import wait_gone
from helpers.server import SMALL_ENGINE_ARGS, RemoteServer
from pagedllm.model.packaged import MINILM_NAMES

MODEL = "minilm"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast auburn fox leaps above a sleepy hound.",
    "Stock markets fell sharply on Monday.",
]


# This server's bound on the inputs of one request (the default is 2048): the large request of the
# fair-share test has exactly that many.
MAX_INPUTS = 512
SERVER_ARGS = [MINILM_NAMES[0], "--task", "embed", "--served-model-name", MODEL, "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [*SERVER_ARGS, "--max-embedding-inputs", str(MAX_INPUTS)]
    with RemoteServer(args, startup_timeout=120) as srv:
        yield srv
        srv.wait_idle()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client(timeout=60.0)


def _vectors(response: openai.types.CreateEmbeddingResponse) -> np.ndarray:
    return np.array([d.embedding for d in response.data], dtype=np.float64)


def test_openai_client_embeddings(server: RemoteServer, client: openai.OpenAI) -> None:
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert response.object == "list" and response.model == MODEL
    assert [d.index for d in response.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in response.data)
    vectors = _vectors(response)
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # Paraphrases are closer than unrelated sentences.
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3
    counts = [server.post("/tokenize", json={"prompt": t}).json()["count"] for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(counts)
    # One at a time: the same vectors (a sequence's embedding does not depend on its batch).
    for text, vector in zip(TEXTS, vectors, strict=True):
        alone = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
        assert np.abs(_vectors(alone)[0] - vector).max() < 1e-6
    server.wait_idle()


def test_base64_and_token_ids_agree_with_floats(server: RemoteServer, client: openai.OpenAI) -> None:
    floats = _vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    # The SDK asks for base64 by default and decodes it.
    decoded = _vectors(client.embeddings.create(model=MODEL, input=TEXTS))
    assert np.array_equal(decoded, floats.astype(np.float32).astype(np.float64))
    raw = server.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    data = raw["data"][0]["embedding"]
    assert isinstance(data, str)
    assert np.array_equal(np.frombuffer(base64.b64decode(data), dtype="<f4"), floats[0].astype(np.float32))
    ids = [server.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    from_ids = _vectors(client.embeddings.create(model=MODEL, input=ids, encoding_format="float"))
    assert np.abs(from_ids - floats).max() < 1e-6
    single = _vectors(client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float"))
    assert np.abs(single[0] - floats[1]).max() < 1e-6


def test_truncate_prompt_tokens_embeds_the_last_tokens(server: RemoteServer, client: openai.OpenAI) -> None:
    ids = client.embeddings.create(model=MODEL, input=TEXTS[0])  # (the tokenizer: via /tokenize)
    tokens = server.post("/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], extra_body={"truncate_prompt_tokens": 4})
    alone = client.embeddings.create(model=MODEL, input=[tokens[-4:]])
    assert cut.usage.prompt_tokens == 4 and ids.usage.prompt_tokens == len(tokens) > 4
    assert np.allclose(_vectors(cut), _vectors(alone), atol=1e-6)
    r = server.post("/v1/embeddings", json={"input": "x", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": "x", "dimensions": 128}, "dimensions", "does not support other embedding sizes"),
        ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "empty strings"),
        ({"input": ["ok", ""]}, "input", "empty strings"),
        ({"input": [[]]}, "input", "empty"),
        ({"input": "word " * 300}, "input", "maximum context length is 256"),
        ({"input": [1, 2, 30522]}, "input", "out-of-vocab token id 30522"),
        ({"input": "x", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens", "greater than the model"),
        ({"input": "x", "normalize": False}, "normalize", "does not implement"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format", ""),
    ],
)
def test_bad_requests_are_400_naming_the_field(
    server: RemoteServer, body: dict[str, object], param: str, fragment: str
) -> None:
    response = server.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    server.wait_idle()


def test_client_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="x", dimensions=64)
    assert "dimensions" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    # The full size is allowed.
    assert len(client.embeddings.create(model=MODEL, input="x", dimensions=384).data[0].embedding) == 384


def test_embed_server_refuses_generation(server: RemoteServer) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        response = server.post(path, json=body)
        assert response.status_code == 400
        assert "runs task 'embed'" in response.json()["error"]["message"]
        assert "--task generate" in response.json()["error"]["message"]


def test_generate_server_refuses_embeddings() -> None:
    # Several served names (vLLM's flag): all listed, any of them accepted, the first one reported.
    with RemoteServer([*SMALL_ENGINE_ARGS, "--served-model-name", "alpha", "beta"]) as srv:
        client = srv.client(timeout=60.0)
        assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model="alpha", input="Hello")
        assert "runs task 'generate'" in str(info.value) and "--task embed" in str(info.value)
        # The server still generates, and holds no KV block afterwards.
        done = client.completions.create(model="beta", prompt="Hi", max_tokens=2)
        assert done.choices[0].text is not None and done.model == "alpha"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        srv.wait_idle()


# ------------------------------------------------------------------------------------------------
# Fair share: a large request's inputs do not hold up the requests that arrive after it
# ------------------------------------------------------------------------------------------------

_WORDS = (
    "the quick brown fox jumps over lazy dog while market prices rise and fall across many cities in "
    "the north river valley"
).split()
PROBE = "A cat sat on the mat."


def _passage(i: int, words: int = 40) -> str:
    """A distinct text of about ``words + 6`` tokens."""
    pick = random.Random(i).choice
    return f"Passage {i}: " + " ".join(pick(_WORDS) for _ in range(words)) + "."


def _embed_raw(server: RemoteServer, inputs: list[str], timeout: float = 900.0) -> list[bytes]:
    """The embeddings of ``inputs`` as their float32 bytes (base64 on the wire: exact), in order."""
    r = server.post("/v1/embeddings", json={"input": inputs, "encoding_format": "base64"}, timeout=timeout)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(inputs)))
    return [base64.b64decode(d["embedding"]) for d in data]


def _check_fair_share(server: RemoteServer, num_inputs: int = MAX_INPUTS) -> None:
    """A request of ``num_inputs`` inputs runs; a one-sentence request sent while it runs finishes
    long before it (before the fix it waited for every input of the large one: its latency was the
    large request's whole remaining time). Every embedding equals the input's embedding computed
    alone, bit for bit, in the order of ``input``."""
    texts = [_passage(i) for i in range(num_inputs)]
    probe_alone = _embed_raw(server, [PROBE])[0]
    sample = [*range(0, num_inputs, 64), num_inputs - 1]
    alone = [_embed_raw(server, [texts[i]])[0] for i in sample]
    done_before = server.metrics()["pagedllm:request_success_total"]
    large: dict[str, object] = {}

    def run_large() -> None:
        try:
            large["vectors"] = _embed_raw(server, texts)
        finally:
            large["end"] = time.monotonic()

    thread = threading.Thread(target=run_large, daemon=True)
    started = time.monotonic()
    thread.start()
    # Send the small request once the large one is being served (a few of its inputs are done).
    server.wait_for_metrics(
        lambda m: m["pagedllm:request_success_total"] >= done_before + 8 or not thread.is_alive(), 600
    )
    assert thread.is_alive(), "the large request ended before the small one was sent"
    sent = time.monotonic()
    small = _embed_raw(server, [PROBE])[0]
    small_done = time.monotonic()
    thread.join(900)
    assert not thread.is_alive() and "vectors" in large, "the large request did not finish"
    large_end = large["end"]
    assert isinstance(large_end, float)
    duration, latency = large_end - started, small_done - sent
    assert small_done < large_end and latency < 0.25 * duration, (latency, duration)
    assert small == probe_alone
    vectors = large["vectors"]
    assert isinstance(vectors, list) and len(vectors) == num_inputs
    assert [vectors[i] for i in sample] == alone
    server.wait_idle()


@pytest.mark.slow
def test_a_large_request_does_not_hold_up_a_small_one(server: RemoteServer) -> None:
    _check_fair_share(server)


def test_too_many_inputs_is_a_400_naming_input(server: RemoteServer) -> None:
    before = server.wait_idle()
    r = server.post("/v1/embeddings", json={"input": ["word"] * (MAX_INPUTS + 1)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input", error
    assert f"at most {MAX_INPUTS}" in error["message"] and "--max-embedding-inputs" in error["message"]
    # Nothing reached the engine (the fair-share test sends a request of exactly MAX_INPUTS inputs).
    after = server.wait_idle()
    assert after["pagedllm:prompt_tokens_total"] == before["pagedllm:prompt_tokens_total"]


@pytest.mark.slow
def test_fair_share_and_default_bound_without_core_processes() -> None:
    """The same with the engine on a thread of the server (``--no-multiprocess``) and the default
    bound of 2048 inputs (OpenAI's)."""
    # No --served-model-name: the server answers to the model as it was named on the command line.
    args = [MINILM_NAMES[0], "--task", "embed", "--max-num-seqs", "8", "--no-multiprocess"]
    with RemoteServer(args, startup_timeout=180) as srv:
        process = psutil.Process(srv.pid)
        client = srv.client(timeout=60.0)
        assert [m.id for m in client.models.list().data] == [MINILM_NAMES[0]]
        response = client.embeddings.create(model=MINILM_NAMES[0], input="Hello")
        assert response.model == MINILM_NAMES[0] and len(response.data[0].embedding) == 384
        with pytest.raises(openai.NotFoundError):
            client.embeddings.create(model=MINILM_NAMES[1], input="Hello")
        _check_fair_share(srv)
        r = srv.post("/v1/embeddings", json={"input": ["word"] * 2049})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "at most 2048" in r.json()["error"]["message"]
        srv.wait_idle()
    wait_gone([process], what="the server is still running")
