"""The process groups of one model's ranks and the collectives the parallel layers use.

Every rank calls :func:`init_groups` with the same arguments but its own rank. The world group uses
NCCL between GPUs and gloo on CPUs; a second gloo group over the same ranks carries the driver's
collectives on host tensors whatever the device, and a third carries the driver's commands and step
inputs (:mod:`pagedllm.distributed.step_channel`). Each pipeline stage's ranks form a
tensor-parallel group. Every collective fails after ``timeout_s`` instead of waiting forever on a
rank that died or hangs, except a rank's wait for the driver's next command, which lasts as long as
the engine is idle (the command group's timeout is a year).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm.distributed.placement import RankPlacement
from pagedllm.utils import free_port_range

# A rank waits this long for the driver's next command: an idle engine must not time its ranks out.
COMMAND_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class ParallelGroups:
    """One rank's view of the groups (see the module docstring)."""

    placement: RankPlacement
    device: torch.device
    control: dist.ProcessGroup  # gloo over every rank: the driver's bounded collectives (KV block count)
    commands: dist.ProcessGroup  # gloo over every rank, no timeout: the driver's step channel
    tp_group: dist.ProcessGroup | None  # this stage's ranks; None when tp_size == 1
    timeout_s: float

    @property
    def tp_leader(self) -> int:
        """Global rank of this stage's first tensor-parallel rank."""
        return self.placement.stage_ranks(self.placement.pp_rank)[0]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over this stage's tensor-parallel ranks, in place."""
        if self.tp_group is not None:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """This stage's ranks' ``x`` side by side (``[rows, tp * cols]``) on the stage leader; None on
        the others."""
        if self.tp_group is None:
            return x
        leader = self.placement.tp_rank == 0
        parts = [torch.empty_like(x) for _ in range(self.placement.tp_size)] if leader else None
        dist.gather(x.contiguous(), parts, dst=self.tp_leader, group=self.tp_group)
        return torch.cat(parts, dim=1) if parts is not None else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, outside the ephemeral range (for a single machine's
    rendezvous)."""
    return free_port_range(host, 1)


def init_groups(
    placement: RankPlacement, master_addr: str, master_port: int, device: torch.device, timeout_s: float
) -> ParallelGroups:
    """Join the world of ``placement.world_size`` ranks at ``master_addr:master_port`` (TCP
    rendezvous; blocks until every rank has joined or ``timeout_s`` passes) and build the groups."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # Group names come from a per-process counter that a failed earlier meeting leaves advanced;
        # fresh ranks start at 0, so start there too (destroy_process_group resets it the same way).
        dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=placement.rank,
        world_size=placement.world_size,
        timeout=timeout,
    )
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    assert control is not None
    commands = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    tp_group = None
    for stage in range(placement.pp_size):
        # Every rank creates every group, in the same order (torch.distributed requires it).
        group = dist.new_group(placement.stage_ranks(stage), timeout=timeout)
        if stage == placement.pp_rank and placement.tp_size > 1:
            tp_group = group
    return ParallelGroups(placement, device, control, commands, tp_group, timeout_s)


def close_groups() -> None:
    """Leave the process groups (nothing when none were made)."""
    if dist.is_initialized():
        dist.destroy_process_group()
