"""`pagedllm run-batch`: answer a file of OpenAI Batch requests offline.

Each line of the input file is one request in OpenAI's Batch input format::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings`` or ``/v1/responses``.
Every line is answered by the OpenAI server's own app, built in this process and called without a
network (``httpx.ASGITransport``), so a line's result or error is exactly what ``pagedllm serve``
with the same engine flags (and ``--tool-call-parser``, ``--enable-auto-tool-choice``,
``--reasoning-parser``, ``--chat-template``) would answer (request limits are the server's defaults). Up to ``max_num_seqs``
lines are in flight at once, so the engine batches them.

Invariants: the output has exactly one line per input line, in input order (a blank line, too, is
answered with an error). A line the handler answered carries its HTTP status and body in
``response`` (an error status included) and ``"error": null``; a line that never reached the handler
(not a JSON object, a missing or invalid field, a method other than POST, another url, a repeated
``custom_id``, ``stream: true``) has ``"response": null`` and ``error`` with a code and a message
naming the problem.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.openai.cli_args import (
    add_output_parser_args,
    check_output_parser_args,
    configure_logging,
    engine_config_from_args,
)
from pagedllm.entrypoints.openai.limits import DEFAULT_CHAT_TEMPLATE_TIMEOUT

logger = logging.getLogger("pagedllm.entrypoints.run_batch")

BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses")
_LINE_FIELDS = ("custom_id", "method", "url", "body")


@dataclass(frozen=True)
class BatchRequest:
    """A well-formed input line: what is sent to ``url``."""

    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    """An input line refused before it reached the server's handler (``custom_id`` None when the line
    names none)."""

    code: str
    message: str
    custom_id: str | None = None


BatchLine = BatchRequest | LineError


@dataclass
class BatchSummary:
    """Counts of one run: lines answered 2xx, answered with an HTTP error, refused as malformed."""

    succeeded: int = 0
    http_errors: int = 0
    invalid: int = 0

    @property
    def total(self) -> int:
        return self.succeeded + self.http_errors + self.invalid


def parse_line(raw: bytes, line_number: int, seen_ids: set[str]) -> BatchLine:
    """Validate one input line (``line_number`` counts from 1, for messages); a valid line's
    ``custom_id`` is added to ``seen_ids``."""
    where = f"line {line_number}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return LineError("invalid_json_line", f"{where} is not UTF-8 text: {exc}.")
    if not text.strip():
        return LineError("invalid_json_line", f"{where} is empty; every line must be a JSON object.")
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return LineError("invalid_json_line", f"{where} is not valid JSON: {exc}.")
    if not isinstance(item, dict):
        return LineError("invalid_json_line", f"{where} must be a JSON object, got {type(item).__name__}.")
    raw_id = item.get("custom_id")
    custom_id = raw_id if isinstance(raw_id, str) else None
    missing = [name for name in _LINE_FIELDS if name not in item]
    if missing:
        return LineError(
            "missing_required_parameter",
            f"{where} lacks {', '.join(missing)} (a line has {', '.join(_LINE_FIELDS)}).",
            custom_id,
        )
    unknown = sorted(set(item) - set(_LINE_FIELDS))
    if unknown:
        return LineError(
            "invalid_parameter",
            f"{where} has unknown field(s) {', '.join(unknown)} (a line has {', '.join(_LINE_FIELDS)}).",
            custom_id,
        )
    if custom_id is None:
        return LineError("invalid_parameter", f"{where}: custom_id must be a string, got {raw_id!r}.")
    method, url, body = item["method"], item["url"], item["body"]
    if method != "POST":
        return LineError("invalid_method", f"{where}: method must be POST, got {method!r}.", custom_id)
    if url not in BATCH_URLS:
        return LineError(
            "invalid_url", f"{where}: url must be one of {', '.join(BATCH_URLS)}, got {url!r}.", custom_id
        )
    if not isinstance(body, dict):
        return LineError(
            "invalid_parameter", f"{where}: body must be a JSON object, got {type(body).__name__}.", custom_id
        )
    if body.get("stream") is True:
        return LineError(
            "stream_not_supported", f"{where}: body.stream must not be true in a batch.", custom_id
        )
    if custom_id in seen_ids:
        return LineError(
            "duplicate_custom_id", f"{where}: custom_id {custom_id!r} is used by an earlier line.", custom_id
        )
    seen_ids.add(custom_id)
    return BatchRequest(custom_id, url, body)


def parse_lines(lines: Iterable[bytes]) -> list[BatchLine]:
    """Every input line validated, in order (see :func:`parse_line`)."""
    seen: set[str] = set()
    return [parse_line(raw, number, seen) for number, raw in enumerate(lines, start=1)]


def output_line(
    custom_id: str | None, response: dict[str, Any] | None = None, error: LineError | None = None
) -> dict[str, Any]:
    """One line of OpenAI's Batch output format."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": None if error is None else {"code": error.code, "message": error.message},
    }


async def answer(client: Any, request: BatchRequest) -> dict[str, Any]:
    """Send one request to the app; its output line's ``response``."""
    content = json.dumps(request.body, ensure_ascii=False).encode("utf-8")
    reply = await client.post(request.url, content=content, headers={"content-type": "application/json"})
    try:
        body = reply.json()
    except ValueError:
        body = {
            "error": {
                "message": reply.text or reply.reason_phrase,
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "status_code": reply.status_code,
        "request_id": request_id if isinstance(request_id, str) else f"batch-{uuid.uuid4().hex}",
        "body": body,
    }


async def run_batch(
    app: Any,
    lines: list[BatchLine],
    out: IO[str],
    max_concurrency: int,
    on_line_done: Callable[[], None] | None = None,
) -> BatchSummary:
    """Answer ``lines`` with ``app`` (its lifespan run around them), ``max_concurrency`` at a time,
    writing one output line per input line to ``out`` in input order."""
    import httpx

    summary = BatchSummary()
    limit = asyncio.Semaphore(max_concurrency)

    async def one(line: BatchLine, client: httpx.AsyncClient) -> dict[str, Any]:
        try:
            if isinstance(line, LineError):
                return output_line(line.custom_id, error=line)
            async with limit:
                return output_line(line.custom_id, response=await answer(client, line))
        finally:
            if on_line_done is not None:
                on_line_done()

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://pagedllm", timeout=None) as client:
            tasks = [asyncio.ensure_future(one(line, client)) for line in lines]
            try:
                for task in tasks:
                    result = await task
                    out.write(json.dumps(result, ensure_ascii=False) + "\n")
                    response = result["response"]
                    if response is None:
                        summary.invalid += 1
                    elif 200 <= response["status_code"] < 300:
                        summary.succeeded += 1
                    else:
                        summary.http_errors += 1
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    return summary


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="Model path or name (default: the default model)."
    )
    parser.add_argument(
        "-i", "--input-file", required=True, help="The OpenAI Batch input file (JSON lines) to answer."
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="Where to write the results (JSON lines, one per input line).",
    )
    parser.add_argument(
        "--disable-progress-bar",
        action="store_true",
        help="No progress bar (it is shown on stderr when stderr is a terminal).",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept chat templates sent in request bodies (as `pagedllm serve` does with this flag).",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=float,
        default=DEFAULT_CHAT_TEMPLATE_TIMEOUT,
        help=f"Seconds a chat template may take to render (default {DEFAULT_CHAT_TEMPLATE_TIMEOUT:g}).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Log level (default info).",
    )
    add_output_parser_args(parser)
    EngineConfig.add_cli_args(parser, with_model=False)


def check_files(input_file: str, output_file: str) -> str | None:
    """The first problem with the input and output paths, or None."""
    if input_file == "-":
        return "--input-file: reading from stdin is not supported; give the path of a file."
    if not os.path.isfile(input_file):
        return f"--input-file: no such file: {input_file!r}."
    if output_file == "-":
        return "--output-file: writing to stdout is not supported; give the path of a file."
    folder = os.path.dirname(os.path.abspath(output_file))
    if not os.path.isdir(folder):
        return f"--output-file: the folder {folder!r} does not exist."
    if os.path.isdir(output_file):
        return f"--output-file: {output_file!r} is a directory."
    if os.path.abspath(output_file) == os.path.abspath(input_file):
        return "--output-file must not be the input file."
    return None


def run(args: argparse.Namespace) -> int:
    """Answer the input file; 0 when every line was answered, 1 when the engine failed, 2 on bad
    arguments."""
    configure_logging(args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    problem = check_files(args.input_file, args.output_file)
    if problem is None and not args.chat_template_timeout > 0:
        problem = f"--chat-template-timeout must be positive, got {args.chat_template_timeout}."
    if problem is None:
        problem = check_output_parser_args(args)
    if problem is not None:
        logger.error(problem)
        return 2
    config = engine_config_from_args(args)
    if config is None:
        return 2
    with open(args.input_file, "rb") as f:
        lines = parse_lines(f.read().splitlines())

    from tqdm.auto import tqdm

    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import ServerSettings
    from pagedllm.entrypoints.openai.limits import RequestLimits

    try:
        llm_engine = LLMEngine.from_config(config)
    except (ValueError, OSError) as exc:
        logger.error("Could not start the engine: %s", exc)
        return 1
    served_names = config.served_names(str(llm_engine.model_name))
    engine = AsyncLLMEngine(llm_engine, log_stats_interval=None)
    settings = ServerSettings(
        served_model_names=served_names,
        max_logprobs=config.max_logprobs,
        trust_request_chat_template=args.trust_request_chat_template,
        limits=RequestLimits(chat_template_timeout=args.chat_template_timeout),
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
    )
    app = build_app(engine, settings)
    started = time.perf_counter()
    bar = tqdm(
        total=len(lines),
        desc="Batch lines",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=True if args.disable_progress_bar else None,
    )
    try:
        with open(args.output_file, "w", encoding="utf-8") as out:
            summary = asyncio.run(
                run_batch(app, lines, out, config.max_num_seqs, on_line_done=lambda: bar.update(1))
            )
    finally:
        bar.close()
    stats = llm_engine.get_stats()
    logger.info(
        "Answered %d lines in %.1f s: %d succeeded, %d HTTP errors, %d invalid lines; wrote %s. "
        "KV cache: %d of %d blocks free.",
        summary.total,
        time.perf_counter() - started,
        summary.succeeded,
        summary.http_errors,
        summary.invalid,
        args.output_file,
        stats.num_free_blocks,
        stats.num_kv_blocks,
    )
    if engine.failure is not None:
        logger.error("The engine failed while answering the batch: %r", engine.failure)
        return 1
    return 0
