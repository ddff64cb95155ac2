"""Who is who in a parallel group: rank arithmetic, layer partition, process-group setup.

Layout (Megatron/vLLM order): global rank = pp_rank * tp + tp_rank, so the ranks of one
pipeline stage are contiguous and a node holding `tp` consecutive ranks keeps the
bandwidth-hungry tensor-parallel all-reduces inside the node. Rank 0 is the driver: it runs
the scheduler and sampler besides its own shard (stage 0, TP rank 0). Node R of N runs
global ranks [R * L, (R + 1) * L) with L = tp * pp / N local ranks.

Process groups: the default group (gloo on CPU, NCCL on CUDA) carries activations between
stages and the logits gather to rank 0; one subgroup per stage carries that stage's TP
all-reduces (the default group itself when pp == 1). Every rank creates every subgroup in
the same order, as torch.distributed requires. One parallel engine per process at a time:
the default group is process-global.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine_config import EngineConfig

DEFAULT_MASTER_PORT = 29500
# Collectives only run inside a step (idle waits happen on the control channel, which has no
# timeout), so this bounds one step's communication, not the engine's idle time.
DIST_TIMEOUT_S = float(os.environ.get("TIDEPOOL_DIST_TIMEOUT_S", "300"))
# How long ranks wait for each other to start (other nodes' pods may still be pulling images).
JOIN_TIMEOUT_S = float(os.environ.get("TIDEPOOL_DIST_JOIN_TIMEOUT_S", "1800"))


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port is picked (single node only)

    @classmethod
    def from_engine(cls, config: EngineConfig) -> ParallelConfig:
        return cls(
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.nnodes,
            config.master_addr,
            config.master_port,
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def num_local_ranks(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        """Global ranks that run on node `node_rank`."""
        return range(node_rank * self.num_local_ranks, (node_rank + 1) * self.num_local_ranks)

    def validate(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks cannot be split evenly "
                f"over nnodes={self.nnodes}; choose sizes whose product is a multiple of nnodes"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node group needs --master-port (or MASTER_PORT) and --master-addr")


@dataclass(slots=True, frozen=True)
class RankInfo:
    """One rank's place in the group."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """The same TP rank in the previous stage (sends this rank its activations)."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    def stage_ranks(self, pp_rank: int) -> list[int]:
        return list(range(pp_rank * self.tp_size, (pp_rank + 1) * self.tp_size))

    @property
    def last_stage_ranks(self) -> list[int]:
        return self.stage_ranks(self.pp_size - 1)


def partition_layers(num_layers: int, pp_size: int) -> list[range]:
    """Contiguous, balanced layer ranges per stage (earlier stages take the remainder)."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers; "
            "every stage needs at least one layer"
        )
    base, extra = divmod(num_layers, pp_size)
    ranges, start = [], 0
    for stage in range(pp_size):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_groups(store: dist.Store, info: RankInfo, device: torch.device) -> dist.ProcessGroup | None:
    """Join the default group through `store` and create the per-stage TP groups.

    Returns this rank's TP group (None: the default group, when pp == 1).
    """
    if dist.is_initialized():
        raise ValueError(
            "a torch.distributed group already exists in this process (another parallel engine?); "
            "shut it down first: one parallel engine per process"
        )
    world = info.tp_size * info.pp_size
    timeout = datetime.timedelta(seconds=DIST_TIMEOUT_S)
    dist.init_process_group(backend_for(device), store=store, rank=info.rank, world_size=world, timeout=timeout)
    if info.pp_size == 1:
        return None
    mine = None
    for stage in range(info.pp_size):
        group = dist.new_group(info.stage_ranks(stage), timeout=timeout)
        if stage == info.pp_rank:
            mine = group
    return mine


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
