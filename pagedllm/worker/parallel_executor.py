"""The executor of a model split over ``tensor_parallel_size`` x ``pipeline_parallel_size`` ranks.

Rank 0, the driver, is this executor in the engine's process; it starts the other ranks of its
machine as processes (``distributed_executor_backend="mp"``; ``"ray"`` places them with Ray,
:mod:`pagedllm.worker.ray_ranks`). Ranks on other machines are started there by
:func:`run_worker_node` (``pagedllm serve --node-rank N``). Every rank builds a
:class:`ParallelExecutor` with the same engine configuration: it reads only its shard of the
checkpoint, builds a :class:`~pagedllm.worker.parallel_runner.ParallelModelRunner`, and the ranks
agree on one KV block count (the smallest any rank can hold). The driver's runner then runs the
engine's steps; the others serve its commands until it shuts them down.

Configurations that cannot be split are refused before any process starts
(:func:`pagedllm.distributed.placement.check_parallel`). A rank that dies or hangs fails the step
within ``distributed_timeout_s`` (the collectives' timeout); the driver then stops every rank it
started: none is left behind, and the engine reports the error.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.groups import ParallelGroups, close_groups, free_port, init_groups
from pagedllm.distributed.placement import (
    RankPlacement,
    check_parallel,
    pipeline_layer_counts,
    weight_selection,
)
from pagedllm.model.config import ModelConfig
from pagedllm.model.loader import LoadedCheckpoint, load_checkpoint, resolve_model_path
from pagedllm.sched.scheduler import SchedulerOutput
from pagedllm.utils import die_with_parent
from pagedllm.worker.devices import resolve_device
from pagedllm.worker.executor import Executor
from pagedllm.worker.parallel_runner import ParallelModelRunner
from pagedllm.worker.phase_times import StepPhaseTimes
from pagedllm.worker.runner_output import RunnerOutput

logger = logging.getLogger("pagedllm")

T = TypeVar("T")


def read_model_config(model: str | None) -> ModelConfig:
    """The model's config alone (no weights read)."""
    kind, path = resolve_model_path(model)
    if kind == "gguf":
        from pagedllm.model.gguf_loader import gguf_config
        from pagedllm.model.gguf_reader import open_gguf

        return gguf_config(open_gguf(path))
    import glob

    from safetensors import safe_open

    from pagedllm.model.hf_loader import load_hf_config

    config = load_hf_config(path)
    names: set[str] = set()
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    if "lm_head.weight" not in names:
        config.tie_word_embeddings = True  # as the loader decides
    return config


def ranks_per_node(config: EngineConfig) -> int:
    if config.world_size % config.nnodes:
        raise ValueError(
            f"nnodes {config.nnodes} does not divide the {config.world_size} ranks "
            f"(tensor_parallel_size x pipeline_parallel_size)."
        )
    return config.world_size // config.nnodes


def check_config(config: EngineConfig) -> ModelConfig:
    """Refuse a parallel configuration that cannot run, before any process starts; returns the
    model's config."""
    per_node = ranks_per_node(config)
    model_config = read_model_config(config.model)
    task = "embed" if config.task == "embed" else "generate"
    check_parallel(
        model_config,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        task=task,
        partition=config.pipeline_layer_partition,
    )
    device = resolve_device(config.device)
    if device.type == "cuda":
        present = torch.cuda.device_count()
        if per_node > present:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size / nnodes = {per_node} ranks on this machine, "
                f"but it has {present} CUDA device(s)."
            )
    if config.distributed_executor_backend == "ray" and config.nnodes > 1:
        raise ValueError("distributed_executor_backend 'ray' places every rank itself: leave nnodes at 1.")
    return model_config


def placement_of(config: EngineConfig, model_config: ModelConfig, rank: int) -> RankPlacement:
    """Rank ``rank``'s place, with the stages' layer counts (:func:`pipeline_layer_counts`)."""
    pp = config.pipeline_parallel_size
    counts = pipeline_layer_counts(model_config, pp, config.pipeline_layer_partition)
    return RankPlacement(rank, config.tensor_parallel_size, pp, counts)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, GGUF blocks of its quantized layers included, each
    storage counted once (weights in every form; no KV cache)."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    for module in model.modules():
        for part in getattr(module, "parts", None) or []:
            blocks = getattr(part, "blocks", None)
            if isinstance(blocks, torch.Tensor) and blocks.data_ptr() not in seen:
                seen.add(blocks.data_ptr())
                total += blocks.numel()
    return total


def _rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", rank % ranks_per_node(config))
    return device


def _set_rank_threads(config: EngineConfig) -> None:
    if resolve_device(config.device).type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node(config)))


def _run_watched(fn: Callable[[], T], processes: list[Any], timeout_s: float, what: str) -> T:
    """``fn()`` run on a thread while the ``processes`` are watched: a process that exits first, or
    ``timeout_s`` passing, raises RuntimeError (the thread is left to its own timeout)."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=target, daemon=True, name=f"pagedllm-{what}")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(0.1)
        dead = [p for p in processes if not p.is_alive()]
        if (dead or time.monotonic() > deadline) and thread.is_alive():
            # The thread waits in torch's C++ code until its own timeout: let it finish before the
            # interpreter exits (a thread waking during shutdown aborts the process).
            atexit.register(thread.join, timeout_s + 5.0)
        if dead and thread.is_alive():
            detail = getattr(dead[0], "error", "") or ""
            raise RuntimeError(f"a rank exited (status {dead[0].exitcode}) while {what}. {detail}".rstrip())
        if time.monotonic() > deadline and thread.is_alive():
            raise RuntimeError(f"{what} took longer than distributed_timeout_s ({timeout_s:g} s).")
    if error:
        raise error[0]
    return result[0]


class ParallelExecutor(Executor):
    """One rank's executor (see the module docstring); rank 0 is the driver and starts the others of
    its machine."""

    adapts_cpu_threads = False  # each rank runs a fixed share of its machine's cores

    def __init__(self, config: EngineConfig, rank: int = 0, master_port: int | None = None) -> None:
        self.model_config_checked = check_config(config)
        self.rank = rank
        self.placement = placement_of(config, self.model_config_checked, rank)
        self.processes: list[Any] = []
        self.ray_ranks: Any = None
        self._closed = False
        port = master_port or config.master_port or free_port(config.master_addr)
        _set_rank_threads(config)
        try:
            if rank == 0:
                self._start_ranks(config, port)
            self.groups: ParallelGroups = _run_watched(
                lambda: init_groups(
                    self.placement,
                    config.master_addr,
                    port,
                    _rank_device(config, rank),
                    config.distributed_timeout_s,
                ),
                self.processes,
                config.distributed_timeout_s,
                "the ranks were meeting",
            )
            super().__init__(config)
        except BaseException:
            self.shutdown()
            raise
        if rank == 0:
            atexit.register(self.shutdown)
            logger.info(
                "Model split over %d ranks (tensor parallel %d x pipeline parallel %d, %d machine(s)).",
                self.placement.world_size,
                config.tensor_parallel_size,
                config.pipeline_parallel_size,
                config.nnodes,
            )

    def _start_ranks(self, config: EngineConfig, port: int) -> None:
        """Start ranks 1 .. of this machine (node 0) as processes, or every rank with Ray."""
        if config.distributed_executor_backend == "ray":
            from pagedllm.worker.ray_ranks import start_ray_ranks

            self.ray_ranks = start_ray_ranks(config, port, serve_rank)
            self.processes = list(self.ray_ranks.ranks)  # watched like processes
            return
        self.processes = [start_rank_process(config, rank, port) for rank in range(1, ranks_per_node(config))]

    # -- Executor hooks ---------------------------------------------------------------------
    def _resolve_device(self, config: EngineConfig) -> torch.device:
        return _rank_device(config, self.rank)

    def _load_checkpoint(self, config: EngineConfig) -> LoadedCheckpoint:
        cfg, placement = self.model_config_checked, self.placement
        return load_checkpoint(
            config.model,
            config.tokenizer,
            keep_quantized=config.quantization != "none",
            select=lambda name, shape: weight_selection(cfg, placement, name),
        )

    def _make_runner(
        self, model_config: ModelConfig, weights: dict[str, Any], **kwargs: Any
    ) -> ParallelModelRunner:
        return ParallelModelRunner(model_config, weights, self.groups, **kwargs)

    def _agree_kv_blocks(self, num_blocks: int) -> int:
        count = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.groups.control)
        return int(count.item())

    def _cuda_kv_budget(self) -> int:
        # The profiling forward of one rank would wait on the others' collectives: size from what
        # the weights left instead.
        cfg = self.config
        free, total = torch.cuda.mem_get_info(self.device)
        return int(min(free, total * cfg.gpu_memory_utilization) * 0.9)

    def interleave_steps(self) -> int:
        stages = self.placement.pp_size
        self.parallel_runner.pipelined = stages > 1
        return stages

    def launch(self, scheduler_output: SchedulerOutput, times: StepPhaseTimes) -> RunnerOutput:
        """The step on every rank; if any rank fails (or a collective times out), every rank is
        stopped and the error raised: the ranks are out of step and cannot go on."""
        if self._closed:
            raise RuntimeError(
                "the tensor/pipeline-parallel ranks were stopped (after an earlier failure or shutdown)."
            )
        try:
            return super().launch(scheduler_output, times)
        except Exception as exc:
            self.shutdown(failed=True)
            raise RuntimeError(f"tensor/pipeline-parallel step failed, all ranks stopped: {exc}") from exc

    @property
    def parallel_runner(self) -> ParallelModelRunner:
        runner = self.runner
        assert isinstance(runner, ParallelModelRunner)
        return runner

    def resident_weight_bytes(self) -> int:
        """Bytes of this rank's weights (:func:`model_weight_bytes` of its model)."""
        return model_weight_bytes(self.runner.model)

    def shutdown(self, failed: bool = False) -> None:
        """Stop every rank this driver started (a SHUTDOWN command, then a bounded wait, then kill;
        after a ``failed`` step, kill at once) and leave the process groups. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        runner = getattr(self, "runner", None)
        if self.rank == 0 and isinstance(runner, ParallelModelRunner) and not failed:
            stopper = threading.Thread(target=self._send_shutdown, daemon=True)
            stopper.start()
            stopper.join(5.0)
        deadline = time.monotonic() + (0.0 if failed else 5.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5.0)
        if self.ray_ranks is not None:
            self.ray_ranks.stop()
        close_groups()

    def _send_shutdown(self) -> None:
        try:
            self.parallel_runner.shutdown_ranks()
        except Exception:  # noqa: BLE001 - ranks already gone: they are killed next
            pass


def serve_rank(config: EngineConfig, rank: int, master_port: int) -> None:
    """Build rank ``rank``'s executor and serve the driver's commands until it shuts the ranks down."""
    executor = ParallelExecutor(config, rank, master_port)
    try:
        executor.parallel_runner.serve()
    finally:
        executor.shutdown()


class RankProcess:
    """A rank started as ``python -m pagedllm.worker.parallel_executor SPEC`` (no pickling, and no
    re-import of the user's main module)."""

    def __init__(self, config: EngineConfig, rank: int, master_port: int) -> None:
        spec = msgspec.json.encode({"config": config, "rank": rank, "master_port": master_port})
        self.rank = rank
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pagedllm.worker.parallel_executor", spec.decode()],
            stdin=subprocess.DEVNULL,
        )

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()


def start_rank_process(config: EngineConfig, rank: int, master_port: int) -> RankProcess:
    return RankProcess(config, rank, master_port)


def run_worker_node(config: EngineConfig) -> int:
    """``pagedllm serve --node-rank N`` (N > 0): this machine's ranks, until the driver shuts them
    down; returns the exit status (1 if a rank failed)."""
    per_node = ranks_per_node(config)
    check_config(config)
    first = config.node_rank * per_node
    processes = [
        start_rank_process(config, rank, config.master_port) for rank in range(first + 1, first + per_node)
    ]
    status = 0
    try:
        serve_rank(config, first, config.master_port)
    except Exception as exc:  # noqa: BLE001 - reported, then the exit status says it
        logger.error("Rank %d stopped: %s", first, exc)
        status = 1
    for process in processes:
        process.join(config.distributed_timeout_s)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        if process.exitcode:
            status = 1
    return status


def main(argv: list[str]) -> None:
    """A rank process: ``python -m pagedllm.worker.parallel_executor SPEC`` (JSON ``{"config":
    EngineConfig, "rank": int, "master_port": int}``); exits with its parent."""
    die_with_parent()
    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s rank{json.loads(argv[0])['rank']} %(message)s"
    )
    spec = msgspec.json.decode(argv[0])
    serve_rank(msgspec.convert(spec["config"], EngineConfig), int(spec["rank"]), int(spec["master_port"]))


if __name__ == "__main__":
    main(sys.argv[1:])
