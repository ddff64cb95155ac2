"""Prefill/decode disaggregation: engine roles, the KV connector, and copying KV in and out of blocks.

Roles (`EngineConfig.role`, `--role`): `unified` (no transfers), `prefill` (a request carrying
`ProducerParams` is prefilled, its first token sampled, and its prompt KV + first token sent to
the decode engine at `decode_kv_addr`), `decode` (a request carrying a received `KVPayload`
is admitted with that KV in freshly allocated blocks and continues from the first token).
The router drives the hand-off (see `tidepool.router`): it generates the transfer id,
sends the request to a prefill replica with `max_tokens=1`, then to a decode replica, whose
response goes to the client. `KVConnector` is the driver's transport (`sender.py` on prefill,
`tcp.py` on decode). With tensor/pipeline parallelism each rank holds a slab of the KV and each
prefill rank pushes its own pieces to the decode ranks that cache them (layout.py, ranks.py); the
decode driver's `--kv-port` answers for the engine and its rank r listens on `--kv-port` + r.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .layout import KVLayout
from .protocol import DTYPES, FrameLimits, KVPayload, KVTransferError, Manifest
from .sender import KVSender
from .tcp import KVReceiver, parse_addr

KVRole = Literal["unified", "prefill", "decode"]

__all__ = [
    "ConsumerParams",
    "KVConnector",
    "KVLayout",
    "KVPayload",
    "KVRole",
    "KVTransferError",
    "Manifest",
    "ProducerParams",
    "check_handoff_config",
    "gather_kv",
    "parse_kv_transfer_params",
    "rank_limits",
    "scatter_kv",
]


@dataclass(slots=True, frozen=True)
class ProducerParams:
    """On a prefill engine: send this request's prompt KV and first token to `decode_kv_addr`."""

    transfer_id: str
    decode_kv_addr: str  # host:port of the decode engine's KV receiver


@dataclass(slots=True, frozen=True)
class ConsumerParams:
    """On a decode engine: continue the request whose KV arrives (or arrived) under `transfer_id`."""

    transfer_id: str


def parse_kv_transfer_params(raw: Any) -> ProducerParams | ConsumerParams:
    """The `kv_transfer_params` object of an API request; ValueError says what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError("kv_transfer_params must be an object with role and transfer_id")
    role, transfer_id = raw.get("role"), raw.get("transfer_id")
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= 128:
        raise ValueError("kv_transfer_params.transfer_id must be a non-empty string of at most 128 characters")
    if role == "producer":
        addr = raw.get("decode_kv_addr")
        if not isinstance(addr, str):
            raise ValueError("kv_transfer_params.decode_kv_addr (host:port) is required when role is 'producer'")
        parse_addr(addr)
        return ProducerParams(transfer_id, addr)
    if role == "consumer":
        return ConsumerParams(transfer_id)
    raise ValueError(f"kv_transfer_params.role must be 'producer' or 'consumer', got {role!r}")


def gather_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]) -> torch.Tensor:
    """Copy the given blocks of every layer into one tensor [layers, 2, blocks, block_size, heads, dim] on CPU."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    out = torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in kv_caches])
    return out.cpu()


def scatter_kv(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], kv: torch.Tensor) -> None:
    """Write a gathered tensor (as from `gather_kv`) into the given blocks of every layer."""
    device = kv_caches[0][0].device
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    kv = kv.to(device, non_blocking=True)
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        k_cache.index_copy_(0, index, kv[layer, 0])
        v_cache.index_copy_(0, index, kv[layer, 1])


def check_handoff_config(role: str, kv_port: int, world_size: int) -> None:
    """What a P/D engine refuses before loading anything (the examples test runs it on the operator's args)."""
    if role == "unified":
        return
    if kv_port and kv_port + world_size - 1 > 65535:
        raise ValueError(
            f"kv_port={kv_port} with {world_size} ranks: rank r listens on kv_port + r, past 65535; lower --kv-port"
        )


def rank_limits(layout: KVLayout, rank: int, max_blocks: int, vocab_size: int) -> FrameLimits:
    """What decode rank `rank` accepts: its slab, its geometry, at most `max_blocks` blocks per transfer."""
    if layout.dtype not in DTYPES:
        raise ValueError(f"KV transfers support dtypes {sorted(DTYPES)}, not {layout.dtype}")
    return FrameLimits(layout.layers_of(rank), layout.heads_of(rank), layout.block_size, layout.head_dim,
                       DTYPES[layout.dtype], max_blocks, vocab_size, accepts_manifest=rank == 0)  # fmt: skip


class KVConnector:
    """The driver's side of the hand-off for its role: a sender on prefill, a receiver on decode.

    `rank_addrs` (decode): each worker rank's receiver (host "" = this engine's address); `on_drop` tells
    the workers to forget a transfer's pieces."""

    def __init__(
        self,
        role: KVRole,
        layout: KVLayout,
        limits: FrameLimits,
        port: int = 14579,
        host: str = "0.0.0.0",
        timeout_s: float = 30.0,
        rank_addrs: list[tuple[str, int]] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.role = role
        self.timeout_s = timeout_s
        self.sender = KVSender(layout, 0, timeout_s) if role == "prefill" else None
        self.receiver = (
            KVReceiver(limits, layout, rank_addrs or [], host=host, port=port, ttl_s=2 * timeout_s, on_drop=on_drop)
            if role == "decode"
            else None
        )

    @property
    def port(self) -> int | None:
        return self.receiver.port if self.receiver else None

    def close(self) -> None:
        if self.sender:
            self.sender.close()
        if self.receiver:
            self.receiver.close()
