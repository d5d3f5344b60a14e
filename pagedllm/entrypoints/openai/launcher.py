"""``pagedllm serve``: its process tree of engine cores, HTTP front-ends, and headless machines.

``run_multiprocess`` (the default) starts this machine's engine cores (``--data-parallel-size-local``
of them) and serves HTTP: in this process with one front-end, or, with ``--api-server-count N``, in N
front-end processes that share one listening socket (bound here, so the kernel spreads connections
over them). Every front-end connects to every core. This process supervises the tree: SIGTERM or
Ctrl+C drains the front-ends (each waits up to ``--shutdown-timeout``), then the cores are told to
stop; if a front-end fails, or every core dies, the tree is taken down and the exit status is 1.
Nothing of the tree outlives it: cores and front-ends die with this process (``PR_SET_PDEATHSIG``).

``run_headless`` starts only engine cores (ranks from ``--data-parallel-start-rank``) that join the
front-end at ``--data-parallel-address:--data-parallel-rpc-port``, and waits for them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from types import FrameType
from typing import NoReturn

from pagedllm.config import EngineConfig
from pagedllm.engine.observe.metrics import MULTIPROC_ENV, EngineMetrics
from pagedllm.engine.proc.launch import (
    CoreOptions,
    LocalCores,
    frontend_addresses,
    start_local_cores,
)
from pagedllm.engine.proc.liveness import DEFAULT_LIVENESS_TIMEOUT_S
from pagedllm.entrypoints.openai.cli_args import (
    add_cli_args,
    check_args,
    configure_logging,
    engine_config_from_args,
)
from pagedllm.entrypoints.openai.response_store import new_store_dir
from pagedllm.utils import die_with_parent, free_port_range

logger = logging.getLogger("pagedllm.entrypoints.openai.launcher")

DEFAULT_DP_ADDRESS = "127.0.0.1"


def run(args: argparse.Namespace) -> int:
    """``pagedllm serve``: start the server (or, with ``--headless``, engine cores only); returns the
    exit status."""
    configure_logging(args.log_level)
    problem = check_args(args)
    if problem is not None:
        logger.error(problem)
        return 2
    config = engine_config_from_args(args)
    if config is None:
        return 2
    if config.node_rank > 0:
        # Another machine of a model split over several (--nnodes): its ranks only, no engine.
        from pagedllm.worker.parallel_executor import run_worker_node

        try:
            return run_worker_node(config)
        except ValueError as exc:
            logger.error("%s", exc)
            return 2
    if args.headless:
        return run_headless(args, config)
    if args.multiprocess:
        return _exit_at_once(run_multiprocess(args, config))
    return run_in_process(args, config)


def _exit_at_once(status: int) -> NoReturn:
    """End the process now with ``status``, without the interpreter's teardown (whose native
    destructors, torch's among them, take about a second): the server has stopped and every process
    it started is reaped, so nothing is left to clean up, and a supervisor (or a test) waiting for
    the exit need not wait for that. Logs and standard streams are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def run_in_process(args: argparse.Namespace, config: EngineConfig) -> int:
    """Load the model here, step it on a thread of this process, serve until SIGTERM/SIGINT."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import serve_engine

    try:
        llm_engine = LLMEngine.from_config(config)
    except (ValueError, OSError) as exc:
        logger.error("Could not start the engine: %s", exc)
        return 1
    served_names = config.served_names(str(llm_engine.model_name))
    metrics = EngineMetrics(served_names[0])
    metrics.set_engines_alive(1)
    engine = AsyncLLMEngine(llm_engine, max_queued_requests=args.max_queued_requests, metrics=metrics)
    return serve_engine(args, engine, served_names, config.max_logprobs, metrics)


def _core_options(args: argparse.Namespace, address: str) -> CoreOptions:
    return CoreOptions(
        rank=0,
        frontend_address=address,
        max_queued_requests=args.max_queued_requests,
        report_cache_events=args.data_parallel_size > 1,
        log_level=args.log_level,
    )


def _addresses(args: argparse.Namespace) -> list[str]:
    host = args.data_parallel_address or DEFAULT_DP_ADDRESS
    port = args.data_parallel_rpc_port or free_port_range(host, args.api_server_count)
    return frontend_addresses(host, port, args.api_server_count)


def run_multiprocess(args: argparse.Namespace, config: EngineConfig) -> int:
    """Start the cores and the front-end(s); returns the exit status."""
    addresses = _addresses(args)
    local = list(range(args.data_parallel_size_local))
    cores = start_local_cores(config, local, _core_options(args, addresses[0]))
    try:
        if args.api_server_count == 1:
            return run_frontend(args, config, 0, addresses, cores.pids, cores)
        return _run_frontends(args, config, addresses, cores)
    finally:
        if args.api_server_count > 1:
            cores.terminate()  # the front-ends have stopped; a core exits cleanly on SIGTERM
        cores.stop(timeout=5.0)


def run_frontend(
    args: argparse.Namespace,
    config: EngineConfig,
    index: int,
    addresses: list[str],
    pids: dict[int, int],
    cores: LocalCores | None = None,
    sock: socket.socket | None = None,
    owns_cores: bool = True,
) -> int:
    """Front-end ``index``: wait for every core, then serve HTTP until SIGTERM or the cores' death.
    ``owns_cores``: tell the cores to stop when it stops (one front-end; with several, the launcher
    stops them once every front-end has).

    A SIGTERM/SIGINT at any point of the start-up (imports, tokenizer, the wait for the cores, the
    app's construction) is a request to stop, not a failure: the front-end exits 0 without serving."""
    stop = _StopOnSignal()  # first: the start-up below takes seconds
    # The heavy imports (torch, transformers, the HTTP app) come here, after the cores were
    # started: the cores load the model while this process imports.
    from pagedllm.engine.proc.async_mp_engine import AsyncMPEngine
    from pagedllm.engine.proc.core_client import CoreClient
    from pagedllm.entrypoints.openai.api_server import serve_engine
    from pagedllm.model.loader import load_model_tokenizer
    from pagedllm.model.tokenizer import with_chat_template

    client = CoreClient(
        index=index,
        frontend_addresses=addresses,
        ranks=range(args.data_parallel_size),
        pids=pids,
        pid_exit=cores.exitcode if cores is not None else None,
        routing=args.data_parallel_routing,
        owns_cores=owns_cores,
        liveness_timeout=args.engine_liveness_timeout or DEFAULT_LIVENESS_TIMEOUT_S,
    )
    try:
        try:
            tokenizer = with_chat_template(
                load_model_tokenizer(config.model, config.tokenizer), config.chat_template
            )
            info = client.wait_for_cores(args.engine_start_timeout, should_stop=stop.requested)
        except (ValueError, OSError, RuntimeError) as exc:
            client.close()
            if stop.requested():
                logger.info("Stopped during start-up.")
                return 0
            logger.error("Could not start the engine: %s", exc)
            return 1
        served_names = config.served_names(info.model_name)
        metrics = EngineMetrics(served_names[0])
        engine = AsyncMPEngine(
            client,
            info,
            tokenizer,
            metrics=metrics,
            records_engine_stats=index == 0,
            max_queued_requests=args.max_queued_requests,
        )
        # The server's own handlers take over from ``stop``; a signal that came first stops it.
        return serve_engine(
            args, engine, served_names, info.max_logprobs, metrics, sock, early_signal=stop.received
        )
    finally:
        stop.restore()


class _StopOnSignal:
    """While waiting for the cores, SIGTERM/SIGINT end the wait (start-up is abandoned)."""

    def __init__(self) -> None:
        self.signalled: int | None = None
        self._saved: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._saved[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signum

    def requested(self) -> bool:
        return self.signalled is not None

    def received(self) -> int | None:
        """The signal received so far, if any."""
        return self.signalled

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._saved = {}


def _frontend_main(
    args: argparse.Namespace,
    config: EngineConfig,
    index: int,
    addresses: list[str],
    pids: dict[int, int],
    sock: socket.socket,
) -> None:
    """The target of a front-end process (``--api-server-count`` > 1)."""
    die_with_parent()
    configure_logging(args.log_level)
    status = run_frontend(args, config, index, addresses, pids, sock=sock, owns_cores=False)
    _exit_at_once(status)


def _run_frontends(
    args: argparse.Namespace, config: EngineConfig, addresses: list[str], cores: LocalCores
) -> int:
    """Start ``--api-server-count`` front-end processes on one socket and supervise them."""
    sock = socket.create_server((args.host, args.port), reuse_port=False)
    sock.set_inheritable(True)
    # The front-ends share their Prometheus metrics through files (each /metrics shows them all).
    metrics_dir = tempfile.mkdtemp(prefix="pagedllm-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir
    # They keep stored responses in one file, so that any front-end finds any response.
    args.responses_store_dir = new_store_dir()
    ctx = multiprocessing.get_context("spawn")
    frontends = []
    for index in range(args.api_server_count):
        proc = ctx.Process(
            target=_frontend_main,
            args=(args, config, index, addresses, cores.pids, sock),
            name=f"pagedllm-api-{index}",
            daemon=False,
        )
        proc.start()
        frontends.append(proc)
    sock.close()
    signalled: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        first = not signalled
        signalled.append(signum)
        if first:
            logger.info("Shutting down %d front-end(s).", len(frontends))
        for proc in frontends:
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGTERM if first else signal.SIGINT)
                except ProcessLookupError:
                    pass

    saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        pending = list(frontends)
        while pending:
            multiprocessing.connection.wait([p.sentinel for p in pending], timeout=0.5)
            for proc in [p for p in pending if p.exitcode is not None]:
                pending.remove(proc)
                # A front-end killed by the SIGTERM passed on to it (before it could handle it,
                # early in its start-up) stopped as asked.
                stopped_as_asked = bool(signalled) and proc.exitcode == -signal.SIGTERM
                if proc.exitcode != 0 and not stopped_as_asked:
                    status = 1
                    if not signalled:
                        logger.error(
                            "Front-end %s exited with status %s; stopping the server.",
                            proc.name,
                            proc.exitcode,
                        )
                        forward(signal.SIGTERM, None)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for proc in frontends:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(args.responses_store_dir, ignore_errors=True)
    return status


class _DeathReporter:
    """Tells the front-end (front-end 0) that a core of this machine exited, so that its requests
    fail at once rather than after the front-end's silence timeout."""

    def __init__(self, address: str) -> None:
        import zmq

        from pagedllm.engine.proc.protocol import Codec

        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(address)
        self.codec = Codec()
        self.reported: set[int] = set()

    def report(self, rank: int, code: int) -> None:
        from pagedllm.engine.proc.core_client import describe_exit
        from pagedllm.engine.proc.protocol import CoreDead

        if rank in self.reported or code == 0:
            return
        self.reported.add(rank)
        reason = f"its process {describe_exit(code)}"
        logger.error("Engine core %d %s.", rank, describe_exit(code))
        self.sock.send(self.codec.encode(CoreDead(rank, reason)))

    def close(self) -> None:
        self.sock.close(linger=1000)
        self.ctx.term()


def run_headless(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run this machine's cores for a front-end elsewhere until they stop or SIGTERM/SIGINT."""
    address = frontend_addresses(args.data_parallel_address, args.data_parallel_rpc_port, 1)[0]
    start = args.data_parallel_start_rank
    ranks = list(range(start, start + args.data_parallel_size_local))
    logger.info("Headless: engine cores %s join the front-end at %s.", ranks, address)
    cores = start_local_cores(config, ranks, _core_options(args, address))
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    reporter = _DeathReporter(address)
    try:
        while cores.any_alive() and not stopping.wait(0.2):
            for rank in cores.processes:
                code = cores.exitcode(rank)
                if code is not None:
                    reporter.report(rank, code)
        for rank in cores.processes:
            code = cores.exitcode(rank)
            if code is not None and not stopping.is_set():
                reporter.report(rank, code)
    finally:
        reporter.close()
        cores.terminate()  # a core exits cleanly on SIGTERM
        cores.stop(timeout=args.shutdown_timeout + 5.0)
        for sig, handler in saved.items():  # after the cores: a second SIGTERM changes nothing
            signal.signal(sig, handler)
    codes = {rank: cores.exitcode(rank) for rank in cores.processes}
    bad = {rank: code for rank, code in codes.items() if code not in (0, -signal.SIGTERM)}
    if bad:
        logger.error("Engine cores failed: %s", bad)
        return 1
    return 0


__all__ = ["add_cli_args", "run", "run_frontend", "run_headless", "run_in_process", "run_multiprocess"]
