"""The ranks of a split model placed by Ray (``distributed_executor_backend="ray"``).

The driver (rank 0) stays in the engine's process; ranks ``1 .. world_size - 1`` run as Ray actors
in one placement group (a bundle per rank: one CPU, or one GPU when the engine's device is CUDA;
packed onto as few machines as fit). Each actor calls
:func:`pagedllm.worker.parallel_executor.serve_rank` (handed in by the executor), which meets the driver at
``master_addr:port`` and serves its commands until the driver shuts the ranks down.

Ray is an optional dependency (``pip install 'pagedllm[ray]'``). If this process is not connected to
Ray yet, :func:`start_ray_ranks` connects to the cluster at ``RAY_ADDRESS`` when it is set, or
starts a local Ray instance, which :meth:`RayRanks.stop` shuts down again once no engine uses it.
Every wait is bounded: placing the ranks by ``distributed_timeout_s``, stopping them by
:data:`STOP_TIMEOUT_S`, after which the actors are killed and the placement group removed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm")

STOP_TIMEOUT_S = 10.0

# The executor's body of one rank: serve_rank(config, rank, master_port).
ServeRank = Callable[[EngineConfig, int, int], None]

# Engines of this process using a Ray instance that this module started (it is shut down with the
# last one).
_owned_lock = threading.Lock()
_owned_users = 0


def _import_ray() -> Any:
    try:
        import ray
        import ray.util.placement_group  # noqa: F401 - the submodules used below
        import ray.util.scheduling_strategies  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            "distributed_executor_backend 'ray' needs Ray, which is not installed: "
            f"pip install 'pagedllm[ray]' (or use distributed_executor_backend 'mp'). ({exc})"
        ) from exc
    return ray


class RankActor:
    """One rank in its Ray worker process (wrapped with ``ray.remote`` by :func:`start_ray_ranks`)."""

    def serve(self, serve_rank: ServeRank, config: EngineConfig, rank: int, master_port: int) -> int:
        """Run rank ``rank`` (``serve_rank``: the executor's rank body) until the driver shuts the
        ranks down; returns this process's id."""
        logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank{rank} %(message)s")
        serve_rank(config, rank, master_port)
        return os.getpid()

    def ping(self) -> bool:
        """True while the actor lives (its other calls wait for :meth:`serve` to return)."""
        return True


class RayRank:
    """One rank's actor, watched like a process (``is_alive``, ``exitcode``, ``join``, ``kill``)."""

    def __init__(self, ray: Any, rank: int, actor: Any, ref: Any) -> None:
        self._ray = ray
        self.rank = rank
        self.actor = actor
        self.ref = ref  # serve()'s result: ready once the rank has stopped (or failed)
        self._exitcode: int | None = None
        self.error: str | None = None

    @property
    def actor_id(self) -> str:
        return str(self.actor._actor_id.hex())

    def is_alive(self) -> bool:
        return self.exitcode is None

    @property
    def exitcode(self) -> int | None:
        """None while the rank runs; 0 once it returned, 1 if it failed or its actor died."""
        if self._exitcode is None:
            self.join(0)
        return self._exitcode

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the rank to stop."""
        if self._exitcode is not None:
            return
        ray = self._ray
        try:
            ready, _ = ray.wait([self.ref], timeout=max(0.0, timeout))
        except Exception as exc:  # noqa: BLE001 - Ray itself is gone: so is the rank
            self._exitcode, self.error = 1, str(exc)
            return
        if not ready:
            return
        try:
            ray.get(self.ref, timeout=5.0)
            self._exitcode = 0
        except Exception as exc:  # noqa: BLE001 - the rank's error (or its actor's death)
            self._exitcode, self.error = 1, str(exc)

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or Ray is gone
            pass


class RayRanks:
    """Ranks ``1 ..`` as Ray actors in a placement group; :meth:`stop` ends them all."""

    def __init__(self, ray: Any, placement_group: Any, owns_ray: bool) -> None:
        self._ray = ray
        self.placement_group = placement_group
        self.ranks: list[RayRank] = []
        self._owns_ray = owns_ray
        self._stopped = False

    def actor_ids(self) -> list[str]:
        return [rank.actor_id for rank in self.ranks]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait up to ``timeout_s`` for the ranks to return (the driver has told them to stop), then
        kill their actors and remove the placement group. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        ray = self._ray
        refs = [rank.ref for rank in self.ranks]
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - killed next in any case
                pass
        for rank in self.ranks:
            rank.join(0)
            if rank.exitcode:
                logger.warning("Ray rank %d stopped with an error: %s", rank.rank, rank.error)
            elif rank.exitcode is None:
                logger.warning("Ray rank %d did not stop within %g s: killed.", rank.rank, timeout_s)
            rank.kill()
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - Ray is gone, and the group with it
            pass
        if self._owns_ray:
            _release_owned_ray(ray)


def _acquire_ray(ray: Any, config: EngineConfig) -> bool:
    """Connect to Ray if this process is not yet; True when a local instance was started here."""
    global _owned_users
    with _owned_lock:
        if ray.is_initialized():
            if _owned_users:
                _owned_users += 1
                return True
            return False
        address = os.environ.get("RAY_ADDRESS")
        try:
            if address:
                ray.init(address=address, log_to_driver=True)
            else:
                # Logical CPUs: every rank gets a bundle even where the cores are fewer (the ranks
                # then share them, as the 'mp' backend's processes do).
                num_cpus = max(os.cpu_count() or 1, config.world_size - 1)
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
        except Exception as exc:
            where = f"the Ray cluster at RAY_ADDRESS={address}" if address else "a local Ray instance"
            raise RuntimeError(f"distributed_executor_backend 'ray': could not start {where}: {exc}") from exc
        if address:
            return False
        _owned_users = 1
        return True


def _release_owned_ray(ray: Any) -> None:
    global _owned_users
    with _owned_lock:
        _owned_users = max(0, _owned_users - 1)
        if _owned_users == 0 and ray.is_initialized():
            ray.shutdown()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _rank_env(config: EngineConfig, use_gpu: bool) -> dict[str, str]:
    """Environment of the ranks' worker processes."""
    if use_gpu:
        # The executor picks cuda:<rank> and checks the machine's device count: the actor sees every
        # GPU of its machine, not only the one Ray assigned it.
        return {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    # The ranks' intra-op threads, as the executor sets them (its _set_rank_threads), from the start.
    threads = max(1, (os.cpu_count() or 1) // config.world_size)
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def start_ray_ranks(config: EngineConfig, port: int, serve_rank: ServeRank) -> RayRanks:
    """Start ranks ``1 .. config.world_size - 1`` as Ray actors running ``serve_rank(config, rank,
    port)`` (:func:`pagedllm.worker.parallel_executor.serve_rank`), which meet the driver (rank 0,
    this process) at ``config.master_addr:port``; raises (with nothing left running) if they cannot be
    placed within ``config.distributed_timeout_s``."""
    ray = _import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pagedllm.worker.devices import resolve_device

    use_gpu = resolve_device(config.device).type == "cuda"
    count = config.world_size - 1
    bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    owns_ray = _acquire_ray(ray, config)
    pg = None
    ranks: RayRanks | None = None
    try:
        kind = next(iter(bundle))
        total = float(ray.cluster_resources().get(kind, 0.0))
        if total < count:
            raise RuntimeError(
                f"distributed_executor_backend 'ray': ranks 1..{count} need {count} {kind} bundle(s), "
                f"but the Ray cluster has {total:g} {kind}."
            )
        pg = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=config.distributed_timeout_s)
        if not ready:
            raise RuntimeError(
                f"distributed_executor_backend 'ray': the placement group of {count} {kind} bundle(s) "
                f"was not placed within distributed_timeout_s ({config.distributed_timeout_s:g} s); "
                f"available: {ray.available_resources()}."
            )
        ranks = RayRanks(ray, pg, owns_ray)
        rank_config = config
        if _is_loopback(config.master_addr) and _spans_other_nodes(ray, pg):
            # Ranks on other machines reach the driver at its node's address.
            rank_config = dataclasses.replace(config, master_addr=ray.util.get_node_ip_address())
        actor_class = ray.remote(RankActor)
        env = _rank_env(config, use_gpu)
        for index in range(count):
            actor = actor_class.options(
                num_cpus=0 if use_gpu else 1,
                num_gpus=1 if use_gpu else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
                runtime_env={"env_vars": env},
            ).remote()
            rank = index + 1
            ranks.ranks.append(
                RayRank(ray, rank, actor, actor.serve.remote(serve_rank, rank_config, rank, port))
            )
        return ranks
    except BaseException:
        if ranks is not None:
            ranks.stop(timeout_s=0.0)
        else:
            if pg is not None:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001 - reported by the error raised
                    pass
            if owns_ray:
                _release_owned_ray(ray)
        raise


def _spans_other_nodes(ray: Any, pg: Any) -> bool:
    """Whether any bundle of ``pg`` lies on another node than this process."""
    try:
        from ray.util.placement_group import placement_group_table

        here = ray.get_runtime_context().get_node_id()
        nodes = placement_group_table(pg).get("bundles_to_node_id", {})
        return any(node != here for node in nodes.values())
    except Exception:  # noqa: BLE001 - unknown: assume one machine
        return False
