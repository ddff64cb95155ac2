"""The driver's side of a tensor/pipeline-parallel engine: worker processes and a stand-in model.

Design (rank 0 = driver = this process; see `parallel_state` for the rank layout):
- `MultiprocExecutor` starts this node's worker ranks (spawn), hosts the rendezvous (TCPStore
  + control channel, `comm`), waits for remote nodes' ranks, loads rank 0's own shard and
  watches every worker from a monitor thread (process exit, closed socket, reported error).
  Commands are typed frames (`contract/wire.py`, never pickle); a connection joins only after
  proving it holds the control key (`comm.control_key`: a key file, or on one node a random
  key handed to local workers at spawn), and the store holds the channel's address only.
- `DistributedModel` stands in for the model inside the unchanged `ModelRunner`: the runner
  builds the step's tensors once, as for one process, and calls `model(...)` and
  `model.compute_logits(rows)`. `forward` broadcasts the step's inputs to all workers, runs
  rank 0's stage, and (pp > 1) receives the final hidden states from the last stage;
  `compute_logits` sends the rows to the last stage's TP ranks and gathers their vocabulary
  shards on rank 0. The sampler therefore stays in one place (seeded generators, penalties,
  logprobs, anything the runner does with logits), and "what to run" is exactly what the
  single-process engine runs. With `enable_lora` the step's per-token `lora_slots` travel on FORWARD,
  and the registry's slot fills on rank 0 are mirrored to every rank (`lora_tp`).
- Failure: any worker that dies or raises makes the next (or current) step raise
  `WorkerFailedError` naming the rank and its error; the remaining workers are stopped. A
  collective with a dead peer fails fast on gloo ("connection closed by peer"); the group's
  timeout (TIDEPOOL_DIST_TIMEOUT_S) bounds anything else. Never a hang, never an orphan:
  `shutdown()` (also run at interpreter exit) joins, terminates, then kills local workers;
  remote workers exit when the control channel closes.
- P/D hand-off (engine/kv_transfer/ranks.py): decode workers announce their KV receiver (KV_LISTEN,
  collected in `kv_addrs` before READY) and each complete slab (KV_STORED, passed by the monitor thread
  to `on_kv_stored`); any other message a worker sends outside a command is its failure. Commands may
  come from the engine thread and from the KV receiver's threads (KV_DROP): `broadcast` sends each
  frame whole under a lock.
When tp == pp == 1 none of this exists: the engine loads the model in-process as before.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from tidepool.contract.wire import MessageType, WireError

from ..engine_config import EngineConfig, ResolvedConfig
from ..layers.attention_metadata import AttentionMetadata
from ..loading.formats import read_model_config
from . import comm
from .launch import free_port, spawn_workers, stop_processes
from .lora_tp import attach_rank_slots, mirror_fills
from .parallel_state import JOIN_TIMEOUT_S, ParallelConfig, RankInfo, destroy_groups, init_groups, partition_layers
from .pp import StageModel
from .tp import check_tp, check_tp_weights, local_kv_heads
from .worker import load_stage

logger = logging.getLogger(__name__)

_ATTRIBUTE_WAIT_S = 2.0  # after a failed collective, how long to wait for the monitor to name the culprit


class WorkerFailedError(RuntimeError):
    """A worker rank died or raised; the parallel engine cannot continue."""


class _Workers:
    """Processes, connections and sockets: everything `shutdown` must release (finalizer-safe, no engine refs)."""

    def __init__(self) -> None:
        self.procs: dict[int, BaseProcess] = {}
        self.conns: dict[int, Connection] = {}
        self.server: socket.socket | None = None
        self.closed = False
        self.wake_r, self.wake_w = os.pipe()

    def close(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        os.write(self.wake_w, b"x")
        payload = comm.encode(MessageType.SHUTDOWN)
        for conn in self.conns.values():
            try:
                if graceful:
                    comm.send_bytes(conn, payload)
            except OSError:
                pass  # that worker is gone already
        stop_processes(self.procs, timeout=10.0 if graceful else 0.0)
        for conn in self.conns.values():
            conn.close()
        if self.server is not None:
            self.server.close()
        destroy_groups()


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, rc: ResolvedConfig) -> None:
        parallel = ParallelConfig.from_engine(config)
        parallel.validate()
        check_tp_weights(parallel.tensor_parallel_size, config.quantization)
        self.parallel = parallel
        self.kv_addrs: list[tuple[str, int]] = []  # decode role: ranks 1.. KV receivers (host "" = this node)
        self.on_kv_stored: Callable[[int, str], None] | None = None
        self._send_lock = threading.Lock()
        self.info = RankInfo(0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        model_config = read_model_config(config.model)
        check_tp(model_config, parallel.tensor_parallel_size)
        ranges = partition_layers(model_config.num_hidden_layers, parallel.pipeline_parallel_size)
        if rc.device.type == "cuda" and rc.device.index not in (None, 0):
            raise ValueError("with tensor/pipeline parallelism rank r uses cuda:<local rank r>; pass device='cuda'")
        self.device = torch.device("cuda", 0) if rc.device.type == "cuda" else rc.device
        self.failure: WorkerFailedError | None = None
        self._failed = threading.Event()
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.close, False)
        self._monitor: threading.Thread | None = None
        try:
            tp_group = self._start(config, parallel)
            stage, self.model_config = load_stage(config, rc, self.info, tp_group, self.device)
            # Rank 0's LoRA slots; the registry's fills of them reach every rank (lora_tp.mirror_fills).
            self.lora_slots = attach_rank_slots(config, self.model_config, stage, rc.dtype, self.device)
            if self.lora_slots is not None:
                mirror_fills(self.lora_slots, self.model_config, self.info, self.command)
            self._wait_ready()
        except BaseException:
            self._workers.close(graceful=False)
            raise
        kv_heads = local_kv_heads(model_config.num_key_value_heads, parallel.tensor_parallel_size)
        # Rank 0's runner caches rank 0's layers; memory is sized for the largest stage.
        self.runner_config = dataclasses.replace(
            self.model_config, num_hidden_layers=len(ranges[0]), num_key_value_heads=kv_heads
        )
        self.sizing_config = dataclasses.replace(
            self.model_config, num_hidden_layers=max(len(r) for r in ranges), num_key_value_heads=kv_heads
        )
        self.model = DistributedModel(self, stage)
        self._monitor = threading.Thread(target=self._watch, name="tidepool-worker-monitor", daemon=True)
        self._monitor.start()
        logger.info(
            "parallel engine up: tp=%d pp=%d over %d node(s), stages %s",
            parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.nnodes,
            [f"{r.start}-{r.stop - 1}" for r in ranges],
        )  # fmt: skip

    # ---- start-up -----------------------------------------------------------------------------
    def _start(self, config: EngineConfig, parallel: ParallelConfig) -> dist.ProcessGroup | None:
        workers = self._workers
        addr = parallel.master_addr
        port = parallel.master_port or free_port()
        key = comm.control_key(parallel.nnodes)  # never published in the store: see comm's docstring
        workers.procs = spawn_workers(config, parallel, 0, addr, port, key)
        world = parallel.world_size
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        store = dist.TCPStore(addr, port, world, True, timeout, wait_for_workers=False)
        workers.server = socket.create_server(("" if parallel.nnodes > 1 else "127.0.0.1", 0))
        store.set(comm.STORE_KEY_ADDRESS, f"{addr}:{workers.server.getsockname()[1]}")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while len(workers.conns) < world - 1:
            self._check_started(deadline)
            try:
                conn = comm.accept(workers.server, key, timeout=1.0)
            except TimeoutError:
                continue
            except PermissionError as err:
                logger.warning("%s", err)
                continue
            try:
                hello = comm.recv(conn, MessageType.HELLO).fields
            except (EOFError, OSError, WireError) as err:
                conn.close()
                logger.warning("a worker closed or garbled its connection before saying hello: %s", err)
                continue
            rank = hello["rank"]
            if not 0 < rank < world or rank in workers.conns:
                conn.close()
                raise WorkerFailedError(f"a worker said it is rank {rank}: not a free rank of this {world}-rank group")
            workers.conns[rank] = conn
            logger.info("rank %d joined from %s (pid %d)", rank, hello["host"], hello["pid"])
        return init_groups(store, self.info, self.device)

    def _check_started(self, deadline: float = float("inf")) -> None:
        for rank, proc in self._workers.procs.items():
            if proc.exitcode is not None:
                raise WorkerFailedError(
                    f"worker rank {rank} exited with code {proc.exitcode} during start-up (its error is logged above)"
                )
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, self.parallel.world_size)) - set(self._workers.conns))
            raise WorkerFailedError(
                f"ranks {missing} did not join within {JOIN_TIMEOUT_S:.0f} s; check that every node runs "
                f"`tidepool serve --node-rank R` with the same --master-addr/--master-port"
            )

    def _wait_ready(self) -> None:
        # No deadline: loading a large shard takes as long as it takes; a dead rank is noticed at once.
        waiting = dict(self._workers.conns)
        kv_addrs: dict[int, tuple[str, int]] = {}
        while waiting:
            self._check_started()
            for conn in wait(list(waiting.values()), timeout=1.0):
                rank = next(r for r, c in waiting.items() if c is conn)
                try:
                    message = comm.recv(conn, MessageType.READY, MessageType.ERROR, MessageType.KV_LISTEN)
                except (EOFError, OSError, WireError) as err:
                    raise WorkerFailedError(f"worker rank {rank} closed its connection while loading: {err}") from err
                if message.type == MessageType.ERROR:
                    raise WorkerFailedError(f"worker rank {rank} failed while loading:\n{message.fields['text']}")
                if message.type == MessageType.KV_LISTEN:
                    kv_addrs[rank] = (message.fields["host"], message.fields["port"])
                    continue
                del waiting[rank]
        self.kv_addrs = [kv_addrs[rank] for rank in sorted(kv_addrs)]

    # ---- monitoring -----------------------------------------------------------------------------
    def _watch(self) -> None:
        workers = self._workers
        by_object: dict[object, int] = {conn: rank for rank, conn in workers.conns.items()}
        by_object.update({proc.sentinel: rank for rank, proc in workers.procs.items()})
        while not workers.closed:
            for obj in wait([*by_object, workers.wake_r]):
                if obj == workers.wake_r:
                    return
                rank = by_object[obj]
                if isinstance(obj, Connection):
                    detail = self._read_notice(rank, obj)
                    if detail == "":
                        continue  # a notice, handled
                    self._record_failure(rank, detail)
                else:
                    self._record_failure(rank, None)
                return

    def _read_notice(self, rank: int, conn: Connection) -> str | None:
        """Handle what a worker sent outside a command: "" for a KV notice, else its failure (None: it is gone)."""
        try:
            message = comm.recv(conn, MessageType.ERROR, MessageType.KV_STORED)
        except WireError as err:
            return f"sent a malformed control frame ({err})"
        except (EOFError, OSError):
            return None
        if message.type == MessageType.ERROR:
            return f"raised:\n{message.fields['text']}"
        if self.on_kv_stored is None:
            return "sent a KV notice to an engine that runs no P/D hand-off"
        self.on_kv_stored(rank, message.fields["transfer_id"])
        return ""

    def _record_failure(self, rank: int, detail: str | None) -> None:
        proc = self._workers.procs.get(rank)
        if detail is None and proc is not None:
            proc.join(_ATTRIBUTE_WAIT_S)
            detail = f"(pid {proc.pid}) exited with code {proc.exitcode}"
        if detail is None:
            detail = "closed its connection (its process or node is gone)"
        if not self._workers.closed:
            self.failure = WorkerFailedError(f"worker rank {rank} {detail}")
            logger.error("%s", self.failure)
        self._failed.set()

    def check(self) -> None:
        """Raise the recorded worker failure, if any (before starting a step)."""
        if self.failure is not None:
            self._workers.close(graceful=False)
            raise self.failure
        if self._workers.closed:
            raise WorkerFailedError("the parallel engine was shut down")

    def fail(self, err: BaseException) -> WorkerFailedError:
        """Turn an error inside a step into the worker failure behind it, and stop the group."""
        self._failed.wait(_ATTRIBUTE_WAIT_S)
        failure = self.failure or WorkerFailedError(f"a parallel step failed: {err}")
        self.failure = failure
        self._workers.close(graceful=False)
        return failure

    # ---- commands -------------------------------------------------------------------------------
    def broadcast(self, kind: MessageType, ranks: list[int] | None = None, **fields: Any) -> None:
        payload = comm.encode(kind, **fields)
        with self._send_lock:
            for rank, conn in self._workers.conns.items():
                if ranks is None or rank in ranks:
                    comm.send_bytes(conn, payload)

    def command(self, kind: MessageType, ranks: list[int] | None = None, **fields: Any) -> None:
        """`broadcast` outside a step: a recorded worker failure, or a send to a dead worker, raises
        `WorkerFailedError` naming it."""
        self.check()
        try:
            self.broadcast(kind, ranks, **fields)
        except OSError as err:
            raise self.fail(err) from err

    def init_kv_cache(self, num_blocks: int) -> None:
        self.check()
        self.broadcast(MessageType.INIT_KV, num_blocks=num_blocks)

    def shutdown(self) -> None:
        self._workers.close(graceful=self.failure is None)
        self._finalizer.detach()
        if self._monitor is not None:
            self._monitor.join(5.0)


class DistributedModel:
    """Rank 0's stand-in for `LlamaForCausalLM` in the model runner (same `forward`/`compute_logits`)."""

    def __init__(self, executor: MultiprocExecutor, stage: StageModel) -> None:
        self.executor = executor
        self.stage = stage
        self.config = stage.config
        self.info = executor.info
        self._main_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The runner's own cache; any other cache passed to forward is a scratch pass (prompt_logits)."""
        self._main_kv = kv_caches

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        executor, info = self.executor, self.info
        executor.check()
        scratch = meta.decode_kv_scratch
        scratch_shape = None if scratch is None else list(scratch[0].shape)
        scratch_blocks = None if kv_caches is self._main_kv else kv_caches[0][0].shape[0]
        sendable = comm.map_tensors(dataclasses.replace(meta, decode_kv_scratch=None), lambda t: t.cpu())
        try:
            executor.broadcast(
                MessageType.FORWARD,
                input_ids=input_ids.cpu(),
                positions=positions.cpu(),
                meta=sendable,
                scratch_shape=scratch_shape,
                scratch_blocks=scratch_blocks,
                lora_slots=None if lora_slots is None else lora_slots.cpu(),
            )
            hidden = self.stage(input_ids, positions, kv_caches, meta, lora_slots)
            if hidden is None:  # pp > 1: the last stage's TP rank 0 holds the result
                hidden = torch.empty(
                    input_ids.shape[0], self.config.hidden_size, dtype=self.config.torch_dtype, device=input_ids.device
                )
                dist.recv(hidden, info.last_stage_ranks[0])
        except (RuntimeError, OSError) as err:
            raise executor.fail(err) from err
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        executor, info = self.executor, self.info
        executor.check()
        others = [r for r in info.last_stage_ranks if r != 0]
        shards: list[torch.Tensor] = []
        try:
            executor.broadcast(MessageType.LOGITS, ranks=others, hidden=hidden.cpu())
            width = self.stage.vocab.width
            for rank in info.last_stage_ranks:
                if rank == 0:
                    shards.append(self.stage.shard_logits(hidden))
                    continue
                shard = torch.empty(hidden.shape[0], width, dtype=self.config.torch_dtype, device=hidden.device)
                dist.recv(shard, rank)
                shards.append(shard)
        except (RuntimeError, OSError) as err:
            raise executor.fail(err) from err
        logits = shards[0] if len(shards) == 1 else torch.cat(shards, dim=1)
        return logits[:, : self.config.vocab_size].float()
