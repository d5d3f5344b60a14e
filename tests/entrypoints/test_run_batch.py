"""``pagedllm run-batch``: an OpenAI Batch file answered offline by the server's own handlers. Every
input line gets one output line, in order; malformed lines get their error and change nothing for the
others; greedy results are the offline engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.processes import own_descendants
from helpers.server import REPO_ROOT, SMALL_ENGINE_ARGS
from pagedllm import SamplingParams
from pagedllm.entrypoints.run_batch import BatchRequest, LineError, parse_lines

MAX_TOKENS = 8
COMPLETION_PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]
CHAT_2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


TOOL = {
    "type": "function",
    "function": {"name": "get_color", "parameters": {"type": "object", "properties": {}}},
}


def line(custom_id: Any, url: str, body: Any, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def chat(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


# What each input line must get: ("ok", custom_id) for a 200, ("http", custom_id, status) for an error
# answered by the handler, ("handler", custom_id) for any answer of the handler, ("error", custom_id,
# code) for a line refused before the handler.
BATCH: list[tuple[str, tuple[Any, ...]]] = [
    (line("cmpl", "/v1/completions", completion(COMPLETION_PROMPT)), ("ok", "cmpl")),
    (line("chat", "/v1/chat/completions", chat(CHAT)), ("ok", "chat")),
    ('{"custom_id": "broken", "method": "POST", "url": ', ("error", None, "invalid_json_line")),
    (line("bad-temp", "/v1/completions", completion("Hi", temperature=-1)), ("http", "bad-temp", 400)),
    (line("cmpl", "/v1/completions", completion("Other")), ("error", "cmpl", "duplicate_custom_id")),
    (
        line("stream", "/v1/completions", completion("Hi", stream=True)),
        ("error", "stream", "stream_not_supported"),
    ),
    (line("url", "/v1/files", completion("Hi")), ("error", "url", "invalid_url")),
    (line("get", "/v1/completions", completion("Hi"), method="GET"), ("error", "get", "invalid_method")),
    (line("chat-2", "/v1/chat/completions", chat(CHAT_2)), ("ok", "chat-2")),
    # Answered by the server's embeddings route, whatever it says for a generating model.
    (line("embed", "/v1/embeddings", {"input": "Hello"}), ("handler", "embed")),
    (
        line(
            "resp",
            "/v1/responses",
            {"input": CHAT[0]["content"], "max_output_tokens": MAX_TOKENS, "temperature": 0},
        ),
        ("ok", "resp"),
    ),
    # tool_choice "auto" needs the server's tool flags, which run-batch takes too.
    (line("tools", "/v1/chat/completions", chat(CHAT, tools=[TOOL], tool_choice="auto")), ("ok", "tools")),
]


def run_cli(args: list[str], timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pagedllm", "run-batch", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_round_trip_with_bad_lines(tmp_path: Path, default_llm: Any) -> None:
    src = tmp_path / "requests.jsonl"
    dst = tmp_path / "results.jsonl"
    src.write_text("\n".join(text for text, _ in BATCH) + "\n")
    tool_flags = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    proc = run_cli(["-i", str(src), "-o", str(dst), *SMALL_ENGINE_ARGS, *tool_flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The process is gone and left no child behind.
    assert not [p for p in own_descendants() if "run-batch" in " ".join(p.cmdline())]
    assert "KV cache: 256 of 256 blocks free" in proc.stderr  # SMALL_ENGINE_ARGS: 256 blocks

    results = [json.loads(text) for text in dst.read_text().splitlines()]
    assert len(results) == len(BATCH)
    ids = set()
    for result, (_, want) in zip(results, BATCH, strict=True):
        assert result["id"].startswith("batch_req_") and result["id"] not in ids
        ids.add(result["id"])
        kind, custom_id = want[0], want[1]
        assert result["custom_id"] == custom_id
        if kind == "error":
            assert result["response"] is None
            assert result["error"]["code"] == want[2], result
            assert result["error"]["message"]
            continue
        assert result["error"] is None
        response = result["response"]
        if kind == "handler":
            assert isinstance(response["status_code"], int)
            assert ("data" if response["status_code"] == 200 else "error") in response["body"]
        elif kind == "http":
            assert response["status_code"] == want[2]
            assert response["body"]["error"]["param"] == "temperature"
        else:
            assert response["status_code"] == 200, response
            if custom_id != "resp":  # (a response's id is its own resp_ id)
                assert response["request_id"] == response["body"]["id"]
    by_id = {r["custom_id"]: r for r in results if r["error"] is None}
    assert "line 3 is not valid JSON" in results[2]["error"]["message"]

    # Greedy results are what the offline engine generates for the same prompts.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    want_completion = default_llm.generate(COMPLETION_PROMPT, params, use_tqdm=False)[0].outputs[0].text
    want_chats = [o.outputs[0].text for o in default_llm.chat([CHAT, CHAT_2], params, use_tqdm=False)]
    assert by_id["cmpl"]["response"]["body"]["choices"][0]["text"] == want_completion
    assert by_id["chat"]["response"]["body"]["choices"][0]["message"]["content"] == want_chats[0]
    assert by_id["chat-2"]["response"]["body"]["choices"][0]["message"]["content"] == want_chats[1]
    assert by_id["cmpl"]["response"]["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    # A Responses line is answered as the same chat request.
    resp = by_id["resp"]["response"]["body"]
    assert resp["object"] == "response" and resp["output"][-1]["content"][0]["text"] == want_chats[0]
    default_llm.llm_engine.check_idle()


def test_line_validation() -> None:
    raw = [
        b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
        b"",
        b"[1, 2]",
        b"\xff\xfe",
        b'{"custom_id": "b", "method": "POST", "url": "/v1/completions"}',
        b'{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}',
        b'{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": "text"}',
        b'{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}',
        b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}',
    ]
    parsed = parse_lines(raw)
    assert parsed[0] == BatchRequest("a", "/v1/embeddings", {"input": "x"})
    errors = [p for p in parsed[1:] if isinstance(p, LineError)]
    assert len(errors) == len(raw) - 1
    assert [(e.code, e.custom_id) for e in errors] == [
        ("invalid_json_line", None),
        ("invalid_json_line", None),
        ("invalid_json_line", None),
        ("missing_required_parameter", "b"),
        ("invalid_parameter", None),
        ("invalid_parameter", "c"),
        ("invalid_parameter", "d"),
        ("duplicate_custom_id", "a"),
    ]
    assert "line 2 is empty" in errors[0].message
    assert "must be a JSON object, got list" in errors[1].message
    assert "not UTF-8" in errors[2].message
    assert "lacks body" in errors[3].message
    assert "custom_id must be a string" in errors[4].message
    assert "body must be a JSON object" in errors[5].message
    assert "unknown field(s) extra" in errors[6].message


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-i", "{missing}", "-o", "{out}"], "--input-file: no such file"),
        (["-i", "{src}", "-o", "-"], "--output-file: writing to stdout is not supported"),
        (["-i", "{src}", "-o", "{tmp}/no/such/folder/out.jsonl"], "does not exist"),
        (["-i", "{src}", "-o", "{src}"], "must not be the input file"),
    ],
)
def test_bad_files_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(line("a", "/v1/completions", completion("Hi")) + "\n")
    values = {"missing": str(tmp_path / "missing.jsonl"), "out": str(tmp_path / "out.jsonl"), "src": str(src)}
    values["tmp"] = str(tmp_path)
    proc = run_cli([a.format(**values) for a in args], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert src.read_text().count("\n") == 1  # the input is untouched
    assert not (tmp_path / "out.jsonl").exists()
