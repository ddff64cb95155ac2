"""A worker rank's part of the P/D hand-off (tensor/pipeline-parallel prefill or decode engines).

The driver runs the scheduler and tells its workers, over the control channel, what to do with KV
(`distributed/worker.py` calls these methods from its command loop, in command order, so a gather
happens before the next step can overwrite the blocks and a fill before the next step reads them):
- prefill rank, KV_SEND(transfer_id, block_ids, addr): copy this rank's slab of the blocks off its
  cache, then push its pieces to the decode ranks at `addr` on a sender thread (`sender.KVSender`).
- decode rank: a `RankReceiver` on `--kv-port` + rank (any free port when --kv-port is 0) assembles
  the pieces sent to it; a complete slab is announced to the driver (`notify`, KV_STORED), which
  answers the transfer's manifest once every rank has announced it. KV_FILL(transfer_id, block_ids)
  writes the slab into the blocks the driver's scheduler allocated; KV_DROP forgets it.
Invariant: a slab leaves a worker only through KV_FILL or KV_DROP (the driver sends one for every
transfer it learned of: admitted, aborted, refused or expired), or after `SAFETY_TTL_S` unclaimed.
A KV_FILL for a slab this rank does not hold raises: the worker fails loudly rather than decode from
stale KV.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import torch

from ..config import ModelConfig
from ..engine_config import EngineConfig
from . import gather_kv, rank_limits, scatter_kv
from .layout import KVLayout
from .sender import KVSender
from .tcp import RankReceiver

logger = logging.getLogger(__name__)

SAFETY_TTL_S = 900.0


def engine_layout(model_config: ModelConfig, block_size: int, dtype: torch.dtype, tp: int, pp: int) -> KVLayout:
    return KVLayout(model_config.num_hidden_layers, model_config.num_key_value_heads, model_config.head_dim,
                    block_size, str(dtype).removeprefix("torch."), tp, pp)  # fmt: skip


def rank_kv_port(kv_port: int, rank: int) -> int:
    """Where decode rank `rank` listens: --kv-port + rank (0: any free port)."""
    return kv_port + rank if kv_port else 0


def address_towards(master_addr: str) -> str:
    """This node's IP as seen on the route to the driver (a worker on another node announces it)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(master_addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(target)  # no packet is sent: this only picks the route and local address
            return sock.getsockname()[0]
    except OSError as err:
        raise ValueError(f"cannot find this node's address towards the driver at {master_addr}: {err}") from err


class WorkerKV:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        rank: int,
        layout: KVLayout,
        max_model_len: int,
        notify: Callable[[str], None],
        host: str,
    ) -> None:
        self.rank = rank
        self.host = host  # "" on the driver's node: the prefill side uses the driver's address
        self.sender = KVSender(layout, rank, config.kv_transfer_timeout) if config.role == "prefill" else None
        self.receiver = None
        if config.role == "decode":
            limits = rank_limits(layout, rank, -(-max_model_len // config.block_size), model_config.vocab_size)
            port = rank_kv_port(config.kv_port, rank)
            self.receiver = RankReceiver(limits, "0.0.0.0", port, SAFETY_TTL_S, notify)

    @property
    def listen_port(self) -> int | None:
        return self.receiver.port if self.receiver is not None else None

    def set_cache_blocks(self, num_blocks: int) -> None:
        """Unclaimed slabs may hold at most one cache's worth of blocks (known once the driver sized it)."""
        if self.receiver is not None:
            self.receiver.store.max_pending_blocks = max(num_blocks, self.receiver.limits.max_blocks)

    def send(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], transfer_id: str, block_ids: list[int],
             addr: str) -> None:  # fmt: skip
        if self.sender is None:
            raise RuntimeError("KV_SEND for a worker whose engine does not run --role prefill")
        self.sender.send(addr, transfer_id, gather_kv(kv_caches, block_ids))

    def fill(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], transfer_id: str, block_ids: list[int]) -> None:
        kv = self.receiver.store.pop(transfer_id) if self.receiver is not None else None
        if kv is None:
            raise RuntimeError(f"rank {self.rank} was told to admit KV transfer {transfer_id}, which it does not hold")
        if kv.shape[2] != len(block_ids):
            raise RuntimeError(f"KV transfer {transfer_id}: {kv.shape[2]} blocks for {len(block_ids)} allocated")
        scatter_kv(kv_caches, block_ids, kv)

    def drop(self, transfer_id: str) -> None:
        if self.receiver is not None:
            self.receiver.store.drop(transfer_id)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
