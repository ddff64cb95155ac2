"""Worker ranks: a process that loads its model shard and runs what the driver tells it to.

Start-up: read the control address from the driver's TCPStore, connect (proving both sides hold
the control key, which comes in `WorkerArgs`, never from the store) and say hello, join
the torch.distributed group, load the model on the CPU, keep this rank's stage/shard
(`load_stage`), move it to the rank's device and report ready. Then loop on commands, typed
messages of `contract/wire.py` (no pickle):

- INIT_KV(num_blocks): allocate this rank's KV cache (its layers, its kv heads).
- FORWARD(input_ids, positions, meta, scratch_shape, scratch_blocks, lora_slots): run the stage
  (with each token's LoRA slot when the step has adapter tokens); the last stage's TP rank 0
  sends the final hidden states to the driver unless the driver is on the last stage itself (pp == 1).
- LORA_SLOT(slot, modules...): fill or clear this rank's shard of a LoRA slot (`lora_tp`).
- LOGITS(hidden): last-stage ranks send their vocabulary shard of the logits to rank 0.
- KV_SEND / KV_FILL / KV_DROP: this rank's part of a P/D hand-off (engine/kv_transfer/ranks.py); a
  decode rank announces its KV receiver (KV_LISTEN, before READY) and each complete slab (KV_STORED,
  from a receiver thread: sends on the channel are serialised by a lock).
- SHUTDOWN: leave the group and exit 0.

A worker never outlives its group: the control socket closing (the driver exited or was
killed) ends the loop, a failed collective raises, and a watchdog exits when the process that
started it disappears. An exception is reported to the driver (with its traceback) before the
worker exits 1, so the engine raises with the worker's own error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from tidepool.contract.wire import MessageType

from .. import hugepages
from ..config import ModelConfig
from ..engine_config import EngineConfig, ResolvedConfig, resolve
from ..kv_transfer.ranks import WorkerKV, address_towards, engine_layout
from ..loading.formats import read_model_config
from ..loading.loader import load_model
from . import comm
from .lora_tp import apply_slot_message, attach_rank_slots
from .parallel_state import JOIN_TIMEOUT_S, ParallelConfig, RankInfo, destroy_groups, init_groups, partition_layers
from .pp import StageModel
from .tp import check_tp, local_kv_heads

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0
_COMMANDS = (
    MessageType.FORWARD, MessageType.LOGITS, MessageType.INIT_KV, MessageType.LORA_SLOT, MessageType.SHUTDOWN,
    MessageType.KV_SEND, MessageType.KV_FILL, MessageType.KV_DROP,
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class WorkerArgs:
    rank: int
    local_rank: int
    parallel: ParallelConfig
    engine: EngineConfig
    master_addr: str
    master_port: int
    # Set once this rank has loaded and joined the driver (a worker node's health endpoint reads it).
    ready: Any = None
    # The control channel's key (comm.control_key), handed over in the spawn arguments, never via the store.
    control_key: bytes = dataclasses.field(default=b"", repr=False)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Each rank of a node takes the accelerator numbered by its local rank; CPU ranks share the CPU."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else torch.device("cpu")


def load_stage(
    config: EngineConfig,
    rc: ResolvedConfig,
    info: RankInfo,
    tp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[StageModel, ModelConfig]:
    """Load the checkpoint on the CPU, keep this rank's stage and shard, move it to `device`."""
    model, model_config = load_model(
        config.model,
        dtype=rc.dtype,
        device="cpu",
        max_positions=rc.max_model_len,
        show_progress=config.show_progress and info.rank == 0,
        quantization=config.quantization,
    )
    check_tp(model_config, info.tp_size)
    ranges = partition_layers(model_config.num_hidden_layers, info.pp_size)
    stage = StageModel(model, info, ranges[info.pp_rank], tp_group, num_micro_batches=num_micro_batches(info.pp_size))
    del model
    return stage.to(device), model_config


def num_micro_batches(pp_size: int) -> int:
    """Micro-batches per step: pp by default; TIDEPOOL_PP_MICRO_BATCHES overrides (the same on every node)."""
    raw = os.environ.get("TIDEPOOL_PP_MICRO_BATCHES")
    if raw is None:
        return pp_size
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"TIDEPOOL_PP_MICRO_BATCHES={raw!r} must be a positive integer")
    return int(raw)


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int, tp: int) -> tuple[int, ...]:
    return (num_blocks, block_size, local_kv_heads(model_config.num_key_value_heads, tp), model_config.head_dim)


def worker_main(args: WorkerArgs, in_process: bool = False) -> None:
    """Entry point of a worker rank: a spawned process, or (`in_process`) a worker node's launcher itself."""
    if not in_process:
        logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
        # tqdm's default lock is a multiprocessing semaphore; os._exit below would leak it (a warning at exit).
        tqdm.set_lock(threading.RLock())
    _watch_parent()
    worker = _Worker(args)
    try:
        worker.run()
    except BaseException:
        text = traceback.format_exc()
        logger.error("worker rank %d failed:\n%s", args.rank, text)
        worker.report_error(text)
        os._exit(1)  # skip interpreter teardown: a broken group's threads must not keep us alive
    if not in_process:
        logging.shutdown()
        os._exit(0)  # the group is destroyed; skipping torch's slow interpreter teardown speeds up shutdown


class _Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        self.info = RankInfo(args.rank, args.parallel.tensor_parallel_size, args.parallel.pipeline_parallel_size)
        self.conn: Connection | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv: WorkerKV | None = None
        self._send_lock = threading.Lock()  # the command loop and KV receiver threads both write to the driver

    def report_error(self, text: str) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):  # the driver may be gone already
                self._send(MessageType.ERROR, rank=self.args.rank, text=text)
        if self.kv is not None:
            self.kv.close()

    def _send(self, kind: MessageType, **fields: Any) -> None:
        if self.conn is None:
            raise RuntimeError("the control channel is not connected yet")
        with self._send_lock:
            comm.send(self.conn, kind, **fields)

    def _start_kv(self, config: EngineConfig, rc: ResolvedConfig) -> None:
        """A P/D engine's rank: a sender (prefill) or an announced receiver (decode)."""
        args, info = self.args, self.info
        layout = engine_layout(self.model_config, config.block_size, self.model_config.torch_dtype, info.tp_size,
                               info.pp_size)  # fmt: skip
        on_driver_node = args.rank < args.parallel.num_local_ranks
        host = "" if on_driver_node else address_towards(args.master_addr)

        def notify(transfer_id: str) -> None:  # from a receiver thread, once this rank holds its whole slab
            self._send(MessageType.KV_STORED, rank=args.rank, transfer_id=transfer_id)

        self.kv = WorkerKV(config, self.model_config, args.rank, layout, rc.max_model_len, notify, host)
        if self.kv.listen_port is not None:
            self._send(MessageType.KV_LISTEN, rank=args.rank, host=host, port=self.kv.listen_port)

    def run(self) -> None:
        args, info = self.args, self.info
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore(args.master_addr, args.master_port, info.tp_size * info.pp_size, False, timeout)
        address = store.get(comm.STORE_KEY_ADDRESS).decode()
        self.conn = comm.connect(address, args.control_key, JOIN_TIMEOUT_S)
        comm.send(self.conn, MessageType.HELLO, rank=args.rank, pid=os.getpid(), host=socket.gethostname())
        config = args.engine
        rc = resolve(config, read_model_config(config.model))
        self.device = rank_device(rc.device, args.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        tp_group = init_groups(store, info, self.device)
        self.stage, self.model_config = load_stage(config, rc, info, tp_group, self.device)
        self.lora_slots = attach_rank_slots(config, self.model_config, self.stage, rc.dtype, self.device)
        if config.role != "unified":
            self._start_kv(config, rc)
        logger.info(
            "rank %d ready: stage %d (%d layers), tp rank %d, %s",
            info.rank, info.pp_rank, self.stage.num_local_layers, info.tp_rank, self.device,
        )  # fmt: skip
        self._send(MessageType.READY, rank=args.rank)
        if args.ready is not None:
            args.ready.set()
        try:
            self._loop()
        finally:
            if self.kv is not None:
                self.kv.close()
        destroy_groups()

    @torch.inference_mode()
    def _loop(self) -> None:
        conn = self.conn
        while conn is not None:
            try:
                command = comm.recv(conn, *_COMMANDS)  # WireError (a garbled frame) fails this worker
            except (EOFError, OSError):
                logger.info("rank %d: the driver closed the control channel; exiting", self.info.rank)
                return
            kind, fields = command.type, command.fields
            if kind == MessageType.FORWARD:
                self._forward(**fields)
            elif kind == MessageType.LOGITS:
                shard = self.stage.shard_logits(fields["hidden"].to(self.device))
                dist.send(shard.contiguous(), 0)
            elif kind == MessageType.INIT_KV:
                self._init_kv(fields["num_blocks"])
            elif kind == MessageType.LORA_SLOT:
                if self.lora_slots is None:
                    raise RuntimeError("LORA_SLOT for a worker started without enable_lora")
                apply_slot_message(self.lora_slots, fields)
            elif kind in (MessageType.KV_SEND, MessageType.KV_FILL, MessageType.KV_DROP):
                self._kv_command(kind, fields)
            elif kind == MessageType.SHUTDOWN:
                return

    def _kv_command(self, kind: MessageType, fields: dict[str, Any]) -> None:
        if self.kv is None:
            raise RuntimeError(f"{kind.name} for a worker whose engine runs --role unified")
        if kind == MessageType.KV_SEND:
            self.kv.send(self.kv_caches, fields["transfer_id"], fields["block_ids"], fields["addr"])
        elif kind == MessageType.KV_FILL:
            self.kv.fill(self.kv_caches, fields["transfer_id"], fields["block_ids"])
        else:
            self.kv.drop(fields["transfer_id"])

    def _init_kv(self, num_blocks: int) -> None:
        shape = kv_cache_shape(self.model_config, num_blocks, self.args.engine.block_size, self.info.tp_size)
        self.kv_caches = self._zeros_cache(shape)
        if self.kv is not None:
            self.kv.set_cache_blocks(num_blocks)

    def _zeros_cache(self, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dtype = self.model_config.torch_dtype

        def zeros() -> torch.Tensor:
            if self.device.type == "cpu":  # reserved, not touched: kernel-zeroed pages fault in as used (hugepages.py)
                return hugepages.zeros(shape, dtype)
            return torch.zeros(shape, dtype=dtype, device=self.device)

        return [(zeros(), zeros()) for _ in range(self.stage.num_local_layers)]

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: object,
        scratch_shape: list[int] | None,
        scratch_blocks: int | None,
        lora_slots: torch.Tensor | None,
    ) -> None:
        device = self.device
        meta = comm.map_tensors(meta, lambda t: t.to(device))
        if scratch_shape is not None:
            dtype = self.model_config.torch_dtype
            scratch = (
                torch.empty(scratch_shape, dtype=dtype, device=device),
                torch.empty(scratch_shape, dtype=dtype, device=device),
            )
            meta = dataclasses.replace(meta, decode_kv_scratch=scratch)
        kv_caches = self.kv_caches
        if scratch_blocks is not None:  # a scoring pass on scratch KV (the runner's prompt_logits)
            shape = kv_cache_shape(self.model_config, scratch_blocks, self.args.engine.block_size, self.info.tp_size)
            kv_caches = self._zeros_cache(shape)
        slots = None if lora_slots is None else lora_slots.to(device)
        hidden = self.stage(input_ids.to(device), positions.to(device), kv_caches, meta, slots)
        info = self.info
        if hidden is not None and info.tp_rank == 0 and info.pp_size > 1:
            dist.send(hidden.contiguous(), 0)


def _watch_parent() -> None:
    """Exit when the process that started this one is gone (reparented), even if it was SIGKILLed."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        logger.error("the process that started this worker (pid %d) is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="tidepool-parent-watch", daemon=True).start()
