"""Starting worker processes: on the driver's node (by the executor) and on other nodes (`tidepool serve
--node-rank R` with R > 0, which runs workers only, answers the kubelet's probes on its --port
(health.py), and exits when the group shuts down).

Workers are started with multiprocessing's `spawn` (a fresh interpreter: no forked torch or
CUDA state). A script that builds `LLM(..., tensor_parallel_size=N)` at import time therefore
needs the usual `if __name__ == "__main__":` guard, as with any spawn-based library.

The control channel's key (`comm.control_key`) is read once per node, before any rank starts: a
worker node without $TIDEPOOL_CONTROL_KEY_FILE fails at once with a message saying so (after
binding its health port, so a taken port is still the first error reported).
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
from collections.abc import Mapping
from http.server import ThreadingHTTPServer
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from ..engine_config import EngineConfig, resolve_model
from .comm import control_key
from .health import NodeHealth, serve_health
from .parallel_state import DEFAULT_MASTER_PORT, ParallelConfig
from .worker import WorkerArgs, worker_main

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_workers(
    config: EngineConfig,
    parallel: ParallelConfig,
    node_rank: int,
    master_addr: str,
    master_port: int,
    control_key: bytes,
    skip_rank: int = 0,
    ready_flags: Mapping[int, Any] | None = None,
) -> dict[int, BaseProcess]:
    """Start this node's ranks except `skip_rank`, which runs in the calling process (rank 0: the driver).

    `control_key` (`comm.control_key`) reaches each rank in its spawn arguments, a local pipe: never the network.
    `ready_flags` (rank -> a multiprocessing Event of the spawn context): set by each rank once loaded.
    """
    context = multiprocessing.get_context("spawn")
    ranks = parallel.node_ranks(node_rank)
    procs: dict[int, BaseProcess] = {}
    for rank in ranks:
        if rank == skip_rank:
            continue
        ready = (ready_flags or {}).get(rank)
        args = WorkerArgs(rank, rank - ranks.start, parallel, config, master_addr, master_port, ready, control_key)
        proc = context.Process(target=worker_main, args=(args,), name=f"tidepool-rank{rank}", daemon=True)
        proc.start()
        procs[rank] = proc
    return procs


def stop_processes(procs: dict[int, BaseProcess], timeout: float = _STOP_TIMEOUT_S) -> None:
    """Join, then terminate, then kill whatever is left: never leave an orphan behind."""
    for proc in procs.values():
        proc.join(timeout)
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def run_worker_node(
    config: EngineConfig,
    parallel: ParallelConfig,
    node_rank: int,
    health_address: tuple[str, int] | None = None,
) -> int:
    """Run node `node_rank`'s ranks as workers until the group shuts down; 0 when all exited cleanly.

    With `health_address` (host, port) the node answers the kubelet's /health and /ready there
    (see health.py); the port is bound before any rank starts.
    """
    parallel.validate()
    config = resolve_model(config)  # this node's own copy of a catalogue model (pulled here if needed)
    if not 0 < node_rank < parallel.nnodes:
        raise ValueError(f"node_rank={node_rank} must be in [1, nnodes={parallel.nnodes}) for a worker node")
    port = parallel.master_port or DEFAULT_MASTER_PORT
    ranks = parallel.node_ranks(node_rank)
    first = ranks.start
    context = multiprocessing.get_context("spawn")
    ready = {rank: threading.Event() if rank == first else context.Event() for rank in ranks}
    procs: dict[int, BaseProcess] = {}
    health = NodeHealth(list(ready.values()), lambda: all(proc.is_alive() for proc in procs.values()))
    server = _serve_health(health_address, health) if health_address else None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        key = control_key(parallel.nnodes)  # the same key file as the driver's, on every node
        # The node's first rank runs in this process (one torch start-up fewer); the others are spawned.
        procs.update(spawn_workers(config, parallel, node_rank, parallel.master_addr, port, key, first, ready))
        logger.info(
            "node %d: ranks %s, driver at %s:%d",
            node_rank, [first, *procs], parallel.master_addr, port,
        )  # fmt: skip
        args = WorkerArgs(first, 0, parallel, config, parallel.master_addr, port, ready[first], key)
        worker_main(args, in_process=True)
        health.stop("the group shut down (the driver closed the control channel)")
        for proc in procs.values():
            proc.join()
    finally:
        health.stop("this node is shutting down")
        signal.signal(signal.SIGTERM, previous)
        stop_processes(procs, timeout=0.0)
        if server is not None:
            server.shutdown()
            server.server_close()
    codes = {first: 0} | {rank: proc.exitcode for rank, proc in procs.items()}
    logger.info("node %d: workers exited with %s", node_rank, codes)
    return 0 if all(code == 0 for code in codes.values()) else 1


def _serve_health(address: tuple[str, int], health: NodeHealth) -> ThreadingHTTPServer:
    host, port = address
    try:
        return serve_health(host, port, health)
    except OSError as err:
        raise ValueError(f"cannot serve the worker node's health endpoint on {host}:{port}: {err}") from err
