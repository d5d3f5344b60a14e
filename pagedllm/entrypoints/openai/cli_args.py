"""Flags of ``pagedllm serve`` that are not engine arguments, and the settings they make."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field

from pagedllm.config import EngineConfig
from pagedllm.engine.proc.liveness import DEFAULT_LIVENESS_TIMEOUT_S, MIN_LIVENESS_TIMEOUT_S
from pagedllm.entrypoints.openai.limits import (
    DEFAULT_CHAT_TEMPLATE_TIMEOUT,
    DEFAULT_MAX_BAD_WORDS,
    DEFAULT_MAX_EMBEDDING_INPUTS,
    DEFAULT_MAX_LOGIT_BIAS,
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    PROMPT_BYTES_PER_TOKEN,
    RequestLimits,
)
from pagedllm.entrypoints.openai.lora_modules import parse_lora_modules
from pagedllm.entrypoints.openai.response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, StoreLimits
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.lora_request import LoRARequest

API_KEY_ENV = "PAGEDLLM_API_KEY"
# The reasoning parsers' names (listed here so that ``--help`` does not import them).
REASONING_PARSER_NAMES = ["deepseek_r1", "qwen3"]
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# A request head, then its body (up to 16 MiB: about 4.5 Mbit/s), must come within this many seconds.
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
# Idle seconds before a kept-alive connection is closed (uvicorn's default).
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5


@dataclass
class ServerSettings:
    """Server options that are not engine arguments."""

    served_model_names: list[str]
    # LoRA adapters by the name requests give (--lora-modules).
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--enable-runtime-lora-updating).
    runtime_lora_updating: bool = False
    max_lora_rank: int = 16  # the engine's (adapters loaded at run time are checked against it)
    # Any of these keys is accepted ('Authorization: Bearer KEY'); none: no key is asked for.
    api_keys: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Seconds a request's body may take to arrive after its head (408 after that).
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    shutdown_timeout: float = 30.0
    max_logprobs: int = 20
    # With an API key, /metrics needs it too unless this is set (for Prometheus scrapers).
    metrics_without_auth: bool = False
    # No /docs, /redoc or /openapi.json.
    disable_fastapi_docs: bool = False
    # Render chat templates sent by clients (template code of the client's choosing).
    trust_request_chat_template: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Finds tool calls in replies to tool_choice "auto" (a name of TOOL_PARSERS).
    tool_call_parser: str | None = None
    # Serve tool_choice "auto" (it needs tool_call_parser).
    enable_auto_tool_choice: bool = False
    # Splits <think> reasoning from content (a name of REASONING_PARSERS).
    reasoning_parser: str | None = None
    # No /dashboard, /v1/engine/state or /v1/engine/events.
    disable_dashboard: bool = False
    # Bounds of the stored responses, and the directory of their file (shared by the front-ends of
    # one server; None: the app makes its own and removes it when it stops).
    responses_store: StoreLimits = field(default_factory=StoreLimits)
    responses_store_dir: str | None = None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``pagedllm serve``: the server's own and every engine argument."""
    parser.add_argument(
        "model", nargs="?", default=None, help="Model path or name (default: the default model)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000).")
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health (repeat the flag to accept "
        f"several keys; default: ${API_KEY_ENV} if set). Stored responses are seen only with the key that "
        "made them.",
    )
    parser.add_argument(
        "--responses-store-max",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        metavar="N",
        help="Stored responses (/v1/responses with store true) kept at most, the least recently used "
        f"evicted first (default {DEFAULT_MAX_ENTRIES}).",
    )
    parser.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        metavar="BYTES",
        help=f"Bytes of stored responses kept at most (default {DEFAULT_MAX_BYTES}).",
    )
    parser.add_argument(
        "--metrics-without-auth",
        action="store_true",
        help="Serve /metrics without the API key (for Prometheus scrapers).",
    )
    parser.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="Do not serve /docs, /redoc or /openapi.json.",
    )
    parser.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="Do not serve the live dashboard (/dashboard) or its data (/v1/engine/state, /v1/engine/events).",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept chat templates sent in requests (chat_template, chat_template_kwargs.chat_template). "
        "Clients then run template code of their choosing on the server (sandboxed and bounded in time "
        "and size, but able to cost CPU time); refused with 400 by default.",
    )
    parser.add_argument(
        "--chat-template-timeout",
        type=float,
        default=DEFAULT_CHAT_TEMPLATE_TIMEOUT,
        help="Seconds a chat template may take to render before the request is refused with 400 "
        f"(default {DEFAULT_CHAT_TEMPLATE_TIMEOUT:g}).",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="Refuse a request with 503 when its n sequences would make more than this many wait to be "
        "scheduled, and one with n above it with 400 (default: no limit).",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds to let in-flight requests finish after SIGTERM before aborting them (default 30).",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Refuse larger request bodies with 413 (default 16 MiB).",
    )
    parser.add_argument(
        "--request-read-timeout",
        type=float,
        default=DEFAULT_REQUEST_READ_TIMEOUT_S,
        help="Seconds a request's head may take to arrive (from the connection's opening, or the head's "
        "first byte), and its body after it; slower requests get 408 and their connection is closed "
        f"(default {DEFAULT_REQUEST_READ_TIMEOUT_S:g}).",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        help="Seconds an idle kept-alive connection stays open between requests "
        f"(default {DEFAULT_TIMEOUT_KEEP_ALIVE_S}).",
    )
    parser.add_argument(
        "--engine-liveness-timeout",
        type=float,
        default=None,
        help="Seconds of silence (no heartbeat; cores send one every 0.2 s) after which an engine core is "
        "taken for dead: its requests fail, a core of this machine is killed, and with no core left the "
        "server exits 1. /health says 503 after 2 s of silence already (half the timeout if that is "
        f"shorter) (default {DEFAULT_LIVENESS_TIMEOUT_S:g}; at least {MIN_LIVENESS_TIMEOUT_S:g}).",
    )
    parser.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help="Refuse a text prompt, or a chat's messages, longer than this many UTF-8 bytes with 400 before "
        f"tokenizing it; also bounds a rendered chat template (default {PROMPT_BYTES_PER_TOKEN} x max_model_len).",
    )
    parser.add_argument(
        "--max-stop-strings",
        type=int,
        default=DEFAULT_MAX_STOP_STRINGS,
        help=f"Most entries of stop, and of stop_token_ids, per request (default {DEFAULT_MAX_STOP_STRINGS}).",
    )
    parser.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=DEFAULT_MAX_STOP_STRING_CHARS,
        help="Longest stop string, and longest bad word, in characters "
        f"(default {DEFAULT_MAX_STOP_STRING_CHARS}).",
    )
    parser.add_argument(
        "--max-logit-bias",
        type=int,
        default=DEFAULT_MAX_LOGIT_BIAS,
        help=f"Most logit_bias entries per request (default {DEFAULT_MAX_LOGIT_BIAS}).",
    )
    parser.add_argument(
        "--max-allowed-token-ids",
        type=int,
        default=None,
        help="Most allowed_token_ids per request (default: the vocabulary size).",
    )
    parser.add_argument(
        "--max-bad-words",
        type=int,
        default=DEFAULT_MAX_BAD_WORDS,
        help=f"Most bad_words per request (default {DEFAULT_MAX_BAD_WORDS}).",
    )
    parser.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=DEFAULT_MAX_EMBEDDING_INPUTS,
        help="Most entries of an embeddings request's input; more are refused with 400 naming input "
        f"(default {DEFAULT_MAX_EMBEDDING_INPUTS}, OpenAI's limit).",
    )
    add_output_parser_args(parser)
    parser.add_argument(
        "--multiprocess",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the engine in core processes of its own (default); --no-multiprocess steps it on a "
        "thread of the server process.",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="HTTP front-end processes sharing the port, all talking to every engine core (default 1).",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="Engine cores in all, each with its own KV cache; requests go to the core that caches the "
        "longest prefix of their prompt, else to the least loaded (default 1).",
    )
    parser.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="Engine cores this machine runs (default: all of them; fewer when others join with --headless).",
    )
    parser.add_argument(
        "--data-parallel-start-rank",
        type=int,
        default=0,
        help="Rank of this machine's first engine core (--headless machines; default 0).",
    )
    parser.add_argument(
        "--data-parallel-address",
        default=None,
        help="Address the front-ends listen on for engine cores, and --headless cores connect to "
        "(default 127.0.0.1).",
    )
    parser.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=None,
        help="First port of the front-ends' sockets for engine cores (front-end i uses this + i; "
        "default: free ports).",
    )
    parser.add_argument(
        "--data-parallel-routing",
        default="prefix",
        choices=["prefix", "round_robin"],
        help="How the front-end picks a core: the longest cached prefix, else the least loaded "
        "(prefix, default), or in turn (round_robin).",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="Run only engine cores (ranks --data-parallel-start-rank ...) that join the front-end at "
        "--data-parallel-address:--data-parallel-rpc-port; no HTTP server.",
    )
    parser.add_argument(
        "--engine-start-timeout",
        type=float,
        default=900.0,
        help="Seconds to wait for every engine core to load and join (default 900).",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Log level of the server and the engine (default info).",
    )
    EngineConfig.add_cli_args(parser, with_model=False)


def add_output_parser_args(parser: argparse.ArgumentParser) -> None:
    """The flags that decide how replies are read (tool calls, reasoning): the server's and
    ``run-batch``'s."""
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="How the model writes tool calls; needed for tool_choice 'auto' (with --enable-auto-tool-choice).",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="Let the model decide whether to call tools (tool_choice 'auto', the default when tools are "
        "given); needs --tool-call-parser.",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters served by name (NAME=PATH, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}); needs --enable-lora. A request\'s model field picks one.',
    )
    parser.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key); "
        "needs --enable-lora and one front-end.",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSER_NAMES,
        help="Return the model's <think> reasoning as reasoning_content, apart from the content.",
    )


def check_output_parser_args(args: argparse.Namespace) -> str | None:
    """The problem with the flags of :func:`add_output_parser_args`, or None."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        return (
            "--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model writes calls in)."
        )
    return None


def check_args(args: argparse.Namespace) -> str | None:
    """The first problem with the server's flags, or None."""
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}."
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        return f"--max-queued-requests must be non-negative, got {args.max_queued_requests}."
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be non-negative, got {args.shutdown_timeout}."
    problem = check_output_parser_args(args) or check_parallel_args(args)
    if problem is not None:
        return problem
    if args.enable_runtime_lora_updating and not args.enable_lora:
        return "--enable-runtime-lora-updating needs --enable-lora."
    if args.enable_runtime_lora_updating and args.api_server_count > 1:
        return (
            "--enable-runtime-lora-updating runs with one front-end (adapters loaded through one "
            "would be unknown to the others), not with --api-server-count above 1."
        )
    try:
        parse_lora_modules(args.lora_modules, args.enable_lora, [], args.max_lora_rank)
    except ValueError as exc:
        return str(exc)
    if not args.chat_template_timeout > 0:
        return f"--chat-template-timeout must be positive, got {args.chat_template_timeout}."
    if not args.request_read_timeout > 0:
        return f"--request-read-timeout must be positive, got {args.request_read_timeout}."
    if args.timeout_keep_alive < 1:
        return f"--timeout-keep-alive must be at least 1, got {args.timeout_keep_alive}."
    liveness = args.engine_liveness_timeout
    if liveness is not None and not liveness >= MIN_LIVENESS_TIMEOUT_S:
        return f"--engine-liveness-timeout must be at least {MIN_LIVENESS_TIMEOUT_S:g} s, got {liveness}."
    if liveness is not None and (not args.multiprocess or args.headless):
        return "--engine-liveness-timeout applies to a front-end watching engine-core processes, not with --no-multiprocess or --headless."
    for name in (
        "max_request_body_bytes",
        "max_prompt_bytes",
        "max_stop_strings",
        "max_stop_string_chars",
        "max_logit_bias",
        "max_allowed_token_ids",
        "max_bad_words",
        "max_embedding_inputs",
        "responses_store_max",
        "responses_store_max_bytes",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be positive, got {value}."
    return None


def check_parallel_args(args: argparse.Namespace) -> str | None:
    """The first problem with the process and data-parallel flags, or None."""
    size = args.data_parallel_size
    if size < 1:
        return f"--data-parallel-size must be at least 1, got {size}."
    if args.api_server_count < 1:
        return f"--api-server-count must be at least 1, got {args.api_server_count}."
    local = args.data_parallel_size_local
    if local is None:
        local = args.data_parallel_size_local = 0 if args.headless else size
    if local < 0 or (args.headless and local < 1):
        return f"--data-parallel-size-local must be at least {1 if args.headless else 0}, got {local}."
    start = args.data_parallel_start_rank
    if start < 0 or start + local > size:
        return (
            f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} goes beyond "
            f"--data-parallel-size {size} (ranks 0..{size - 1})."
        )
    if not args.headless and start != 0:
        return "--data-parallel-start-rank applies to --headless machines (the front-end's cores start at 0)."
    remote = args.headless or local < size
    if remote and (args.data_parallel_address is None or args.data_parallel_rpc_port is None):
        return (
            "--data-parallel-address and --data-parallel-rpc-port are needed when engine cores run on "
            "another machine (--headless, or --data-parallel-size-local below --data-parallel-size)."
        )
    port = args.data_parallel_rpc_port
    if port is not None and not 1 <= port <= 65535 - args.api_server_count:
        return f"--data-parallel-rpc-port must be in [1, {65535 - args.api_server_count}], got {port}."
    if not args.multiprocess and (size > 1 or args.api_server_count > 1 or args.headless):
        return "--no-multiprocess runs one engine on a thread: it cannot be combined with data parallel, --headless or --api-server-count."
    if not args.engine_start_timeout > 0:
        return f"--engine-start-timeout must be positive, got {args.engine_start_timeout}."
    return None


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of ``--api-key``, else ``$PAGEDLLM_API_KEY``'s one; empty keys are dropped."""
    given = args.api_key or [os.environ.get(API_KEY_ENV) or ""]
    return tuple(key for key in given if key)


def settings_from_args(
    args: argparse.Namespace, served_model_names: list[str], max_logprobs: int
) -> ServerSettings:
    return ServerSettings(
        served_model_names=list(served_model_names),
        lora_modules=parse_lora_modules(
            args.lora_modules, args.enable_lora, list(served_model_names), args.max_lora_rank
        ),
        runtime_lora_updating=args.enable_runtime_lora_updating,
        max_lora_rank=args.max_lora_rank,
        api_keys=api_keys_from_args(args),
        max_request_body_bytes=args.max_request_body_bytes,
        request_read_timeout=args.request_read_timeout,
        shutdown_timeout=args.shutdown_timeout,
        max_logprobs=max_logprobs,
        metrics_without_auth=args.metrics_without_auth,
        disable_fastapi_docs=args.disable_fastapi_docs,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        disable_dashboard=getattr(args, "disable_dashboard", False),
        responses_store=StoreLimits(args.responses_store_max, args.responses_store_max_bytes),
        responses_store_dir=getattr(args, "responses_store_dir", None),
        limits=RequestLimits(
            max_prompt_bytes=args.max_prompt_bytes,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_logit_bias=args.max_logit_bias,
            max_allowed_token_ids=args.max_allowed_token_ids,
            max_bad_words=args.max_bad_words,
            chat_template_timeout=args.chat_template_timeout,
            max_embedding_inputs=args.max_embedding_inputs,
        ),
    )


def configure_logging(level: str) -> None:
    """The log format of the command-line tools, at ``level`` (``--log-level``)."""
    logging.basicConfig(
        level=level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s", force=True
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig | None:
    """The engine arguments of ``args``, or None (the problem logged) when they are invalid."""
    try:
        return EngineConfig.from_cli_args(args, model=args.model)
    except ValueError as exc:
        logging.getLogger("pagedllm").error("Invalid engine arguments: %s", exc)
        return None
