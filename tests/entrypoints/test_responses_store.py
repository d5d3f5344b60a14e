"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``,
``input_items``, ``background`` with polling and cancel) against a real server with two API keys and
the official ``openai`` client, and the store itself (bounds, LRU order, owners, cancel races).

A second turn through ``previous_response_id`` must be exactly the chat completion of the whole
conversation (the earlier instructions left out, as OpenAI does); a background response must end
with the output of the same request answered at once; a cancelled or deleted one must stop its
generation (every KV block free again) and stay cancelled. The multi-front-end case is in
``test_multiprocess_server.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers.server import SMALL_ENGINE_ARGS, RemoteServer
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoreLimits, owner_of

KEY_A = "key-a"
KEY_B = "key-b"
STORE_MAX = 4
COUNTING = "Count from 1 to 1000, separated by commas."  # greedy: a reply of hundreds of tokens
POLL_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = [
        *SMALL_ENGINE_ARGS,
        *("--api-key", KEY_A, "--api-key", KEY_B),
        "--metrics-without-auth",
        *("--responses-store-max", str(STORE_MAX)),
    ]
    with RemoteServer(args) as srv:
        srv.api_key = KEY_A  # the key of srv.get/post/client
        yield srv
        srv.wait_idle()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def other(server: RemoteServer) -> openai.OpenAI:
    """A client with the server's other API key."""
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY_B, max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _wait_finished(client: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    found = client.responses.retrieve(response_id)
    while found.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        found = client.responses.retrieve(response_id)
    assert found.status not in ("queued", "in_progress"), found
    return found


def _wait_in_progress(client: openai.OpenAI, response_id: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while client.responses.retrieve(response_id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)


def _missing(client: openai.OpenAI, response_id: str) -> bool:
    try:
        client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return True
    return False


# ------------------------------------------------------------------------------------------ the server


def test_a_response_is_stored_by_default_and_read_back_whole(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    created = client.responses.create(model=model, input="Say hello.", max_output_tokens=8, temperature=0)
    assert created.store is True and created.status in ("completed", "incomplete")
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    unstored = client.responses.create(
        model=model, input="Say hello.", max_output_tokens=8, temperature=0, store=False
    )
    assert unstored.store is False and unstored.output_text == created.output_text
    assert _missing(client, unstored.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve(created.id, extra_query={"stream": "true"})
    assert info.value.body["param"] == "stream"  # type: ignore[index]


def test_previous_response_id_continues_the_conversation_streamed(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    """The second turn sees the first turn's input and output (not its instructions): it is the
    greedy chat completion of that conversation, streamed or not."""
    first = client.responses.create(
        model=model,
        instructions="You are terse.",
        input="What is the capital of France?",
        max_output_tokens=24,
        temperature=0,
    )
    question = "And of Italy?"
    with client.responses.stream(
        model=model, input=question, previous_response_id=first.id, max_output_tokens=24, temperature=0
    ) as stream:
        for _ in stream:
            pass
        second = stream.get_final_response()
    assert second.previous_response_id == first.id
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": question},
        ],
        max_tokens=24,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    # The stored second turn is what the stream ended with, and can be continued in turn.
    stored = client.responses.retrieve(second.id)
    assert (stored.status, stored.output_text, stored.usage) == (
        second.status,
        second.output_text,
        second.usage,
    )
    assert [item.id for item in stored.output] == [item.id for item in second.output]
    third = client.responses.create(
        model=model, input="Thanks.", previous_response_id=second.id, max_output_tokens=4, temperature=0
    )
    assert third.usage is not None and second.usage is not None
    assert third.usage.input_tokens > second.usage.input_tokens


def test_input_items_list_the_whole_conversation_in_pages(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    first = client.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Bye"}]}],
        previous_response_id=first.id,
        max_output_tokens=4,
        temperature=0,
    )
    newest_first = server.get(f"/v1/responses/{second.id}/input_items").json()
    texts = [(item["role"], item["content"][0]["text"]) for item in newest_first["data"]]
    assert texts == [("user", "Bye"), ("assistant", first.output_text), ("user", "Hi")]
    assert newest_first["data"][1]["id"] == first.output[0].id  # the output item, as it was
    assert [item["id"] for item in newest_first["data"]][0] == newest_first["first_id"]
    assert newest_first["has_more"] is False
    pages = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [item.id for item in pages.data] == [i["id"] for i in newest_first["data"][::-1][:2]]
    assert pages.has_more is True
    rest = client.responses.input_items.list(second.id, order="asc", limit=2, after=pages.data[-1].id)
    assert [item.id for item in rest.data] == [newest_first["data"][0]["id"]] and rest.has_more is False
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_x", "after")):
        r = server.get(f"/v1/responses/{second.id}/input_items?{query}")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_another_api_keys_responses_are_not_found(
    server: RemoteServer, client: openai.OpenAI, other: openai.OpenAI, model: str
) -> None:
    mine = client.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    before = server.wait_idle()
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(mine.id)
    with pytest.raises(openai.NotFoundError) as info:
        other.responses.create(model=model, input="Go on.", previous_response_id=mine.id, max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert info.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    after = server.wait_idle()
    assert after["pagedllm:prompt_tokens_total"] == before["pagedllm:prompt_tokens_total"]
    # Still the first key's.
    assert client.responses.retrieve(mine.id).id == mine.id
    theirs = other.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    assert _missing(client, theirs.id) and other.responses.retrieve(theirs.id).id == theirs.id


def test_the_least_recently_used_response_is_evicted(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    ids = [
        client.responses.create(model=model, input=f"Say {i}.", max_output_tokens=2, temperature=0).id
        for i in range(STORE_MAX)
    ]
    client.responses.retrieve(ids[0])  # a use: the second is now the least recently used
    newest = client.responses.create(model=model, input="Say 9.", max_output_tokens=2, temperature=0).id
    assert _missing(client, ids[1])
    assert all(not _missing(client, i) for i in (ids[0], *ids[2:], newest))


def test_delete_removes_a_response(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    created = client.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    r = httpx.delete(server.url(f"/v1/responses/{created.id}"), headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json() == {
        "id": created.id,
        "object": "response.deleted",
        "deleted": True,
    }
    assert _missing(client, created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Hi", previous_response_id=created.id, max_output_tokens=4)


def test_a_background_response_ends_as_the_same_request_answered_at_once(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    fields: dict[str, Any] = {"model": model, "input": COUNTING, "max_output_tokens": 40, "temperature": 0}
    queued = client.responses.create(**fields, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = _wait_finished(client, queued.id)
    at_once = client.responses.create(**fields)
    assert done.status == at_once.status == "incomplete"
    assert done.output_text == at_once.output_text
    assert done.usage is not None and at_once.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (at_once.usage.input_tokens, 40)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(at_once.id)  # not a background response
    assert "background" in info.value.message
    assert client.responses.cancel(done.id).status == "incomplete"  # finished first: unchanged
    server.wait_idle()


def test_cancel_and_delete_stop_a_background_response(
    server: RemoteServer, client: openai.OpenAI, model: str
) -> None:
    fields: dict[str, Any] = {"model": model, "input": COUNTING, "max_output_tokens": 900, "temperature": 0}
    generated = server.wait_idle()["pagedllm:generation_tokens_total"]
    running = client.responses.create(**fields, background=True)
    _wait_in_progress(client, running.id)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    # The generation stopped: no request runs, every KV block is free, long before 900 tokens.
    samples = server.wait_idle(timeout=30)
    assert samples["pagedllm:generation_tokens_total"] - generated < 900
    assert client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled"  # idempotent
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input="Go on.", previous_response_id=running.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]

    generated = samples["pagedllm:generation_tokens_total"]
    doomed = client.responses.create(**fields, background=True)
    _wait_in_progress(client, doomed.id)
    client.responses.delete(doomed.id)
    samples = server.wait_idle(timeout=30)
    assert samples["pagedllm:generation_tokens_total"] - generated < 900
    assert _missing(client, doomed.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True, "store": False}, "background"),
        ({"background": True, "stream": True}, "stream"),
        ({"conversation": "conv_1"}, "conversation"),
    ],
)
def test_background_needs_a_store_and_no_stream(
    server: RemoteServer, fields: dict[str, Any], param: str
) -> None:
    r = server.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------ the store


def _response(response_id: str, status: str = "completed", text: str = "x") -> dict[str, Any]:
    return {"id": response_id, "status": status, "output": [{"text": text}]}


def test_store_bounds_hold_after_every_write_and_running_entries_stay(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path), StoreLimits(max_entries=3, max_bytes=10_000))
    try:
        store.put("a", _response("run", "in_progress"), [])
        for i in range(10):
            store.put("a", _response(f"r{i}", text="y" * 500), [{"id": f"m{i}"}])
            count, nbytes = store.usage()
            assert count <= 3 and nbytes <= 10_000
            assert store.get("a", "run") is not None  # running: never evicted
        assert [store.get("a", f"r{i}") is not None for i in range(10)] == [False] * 8 + [True] * 2
        # Bytes bound: one big entry evicts the older ones, but not itself.
        store.put("a", _response("big", text="z" * 20_000), [])
        assert store.get("a", "big") is not None and store.get("a", "r9") is None
        assert store.get("a", "run") is not None
    finally:
        store.close()


def test_store_owners_and_the_cancel_race(tmp_path: Path) -> None:
    store = ResponseStore(str(tmp_path))
    other = ResponseStore(str(tmp_path))  # another front-end's connection to the same file
    try:
        alice, bob = owner_of("alice-key"), owner_of("bob-key")
        assert alice != bob and owner_of(None) == "" and "alice-key" not in alice
        store.put(alice, _response("r1", "in_progress"), [{"id": "m1"}])
        assert other.get(bob, "r1") is None and not other.delete(bob, "r1")
        assert other.cancel(bob, "r1") is None
        assert not store.should_stop("r1")
        cancelled = other.cancel(alice, "r1")
        assert cancelled is not None and cancelled.status == "cancelled"
        assert store.should_stop("r1")
        # The generation's final write after the cancel does not land.
        assert not store.finish(alice, _response("r1", "completed"))
        found = store.get(alice, "r1")
        assert found is not None and found.status == "cancelled" and found.context == [{"id": "m1"}]
        # A finished entry is not cancelled.
        store.put(alice, _response("r2", "in_progress"), [])
        assert store.finish(alice, _response("r2", "completed"))
        after = other.cancel(alice, "r2")
        assert after is not None and after.status == "completed"
        assert other.delete(alice, "r2") and store.should_stop("r2")
    finally:
        store.close()
        other.close()


def test_a_private_store_directory_is_made_on_first_use_and_removed(tmp_path: Path) -> None:
    store = ResponseStore()
    assert store.directory is None  # nothing on disk yet
    store.put("", _response("r1"), [])
    directory = store.directory
    assert directory is not None and Path(directory).is_dir()
    store.close()
    assert not Path(directory).exists()
