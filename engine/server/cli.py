"""`tidepool serve`: the OpenAI-compatible server's command line, and graceful drain on SIGTERM.

Engine flags mirror `LLM(...)` / `EngineConfig` (vLLM's spelling: `--max-model-len`,
`--no-enable-prefix-caching`, …). The first SIGTERM or SIGINT drains (readiness false, new
API calls 503, in-flight requests finish within `--drain-timeout`, the rest are aborted and
told so) and then stops uvicorn; the process exits 0. A second signal aborts what is still in
flight at once, each request still answered (a 503, or an error event and `[DONE]` on a
stream), and exits 0. A model that fails to load, an engine thread that dies, or a port that
cannot be bound (one line on stderr) exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from .limits import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool serve", description="OpenAI-compatible server for one model")
    parser.add_argument("--model", required=True, help="local Hugging Face model folder")
    engine = parser.add_argument_group("engine (as LLM(...))")
    engine.add_argument("--tokenizer", default=None, help="tokenizer folder; default: the model folder")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda' or 'cuda:N'")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV budget on CPU")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "gptq", "awq"],
        help="check a quantized checkpoint's method, or quantize a dense folder to int8/int4 at load",
    )
    engine.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft", "draft_model": PATH, "num_speculative_tokens": 4}\'',
    )
    disagg = parser.add_argument_group("prefill/decode disaggregation")
    disagg.add_argument(
        "--role",
        default="unified",
        choices=["unified", "prefill", "decode"],
        help="'prefill' sends prompt KV to decode engines; 'decode' receives it on --kv-port",
    )
    disagg.add_argument("--kv-port", type=int, default=14579, help="TCP port of the KV receiver (decode role)")
    disagg.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds a KV transfer may take")
    parallel = parser.add_argument_group("parallelism (one replica over several ranks, optionally several nodes)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks each layer is split over")
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
    parallel.add_argument("--nnodes", type=int, default=1, help="nodes the tp x pp ranks span (tp*pp/nnodes each)")
    parallel.add_argument(
        "--node-rank", type=int, default=0, help="this node's index: 0 serves HTTP, others run worker ranks only"
    )
    parallel.add_argument("--master-addr", default=None, help="node 0's address; default $MASTER_ADDR or 127.0.0.1")
    parallel.add_argument(
        "--master-port", type=int, default=None, help="rendezvous port on node 0; default $MASTER_PORT or 29500"
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None, help="the model id clients use; default: --model")
    server.add_argument(
        "--max-queue-len", type=int, default=1024, help="engine requests allowed to wait before new requests get 429"
    )
    server.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After with a 429")
    server.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM"
    )
    server.add_argument("--access-log", action="store_true", help="log every HTTP request")
    _add_request_limit_flags(parser)
    return parser


def _add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    """Request-body limits (issue #14); kept together so the flag table can take them over as one block."""
    limits = parser.add_argument_group("request limits")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted; larger ones get 413 (default: 16 MiB)",
    )
    limits.add_argument(
        "--body-read-timeout",
        type=float,
        default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="seconds a client may pause while sending a request body before it gets 408",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("max-queue-len", args.max_queue_len), ("retry-after", args.retry_after)):
        if value < 0:
            print(f"tidepool serve: error: --{name} must be >= 0", file=sys.stderr)
            return 2
    for name, value in (("max-body-bytes", args.max_body_bytes), ("body-read-timeout", args.body_read_timeout)):
        if not value > 0:
            print(f"tidepool serve: error: --{name} must be > 0", file=sys.stderr)
            return 2
    try:
        config = _server_config(args)
        if args.node_rank != 0:  # a worker-only node: no HTTP, no scheduler; exits when the group shuts down
            return _run_worker_node(config.engine, args.node_rank)
    except ValueError as err:
        print(f"tidepool serve: error: {err}", file=sys.stderr)
        return 2
    return serve(config, args.host, args.port, access_log=args.access_log)


def _server_config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from ..engine_config import EngineConfig
    from .app import ServerConfig

    if not Path(args.model).is_dir():
        raise ValueError(f"model folder {args.model} does not exist")
    engine = EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
        show_progress=False,
        speculative=_speculative_config(args.speculative_config),
        quantization=args.quantization,
        kv_role=args.role,
        kv_port=args.kv_port,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        master_addr=args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_master_port(args),
    )
    return ServerConfig(
        engine=engine,
        model_name=args.served_model_name or args.model,
        max_queue_len=args.max_queue_len,
        retry_after_s=args.retry_after,
        drain_timeout_s=args.drain_timeout,
        max_body_bytes=args.max_body_bytes,
        body_read_timeout_s=args.body_read_timeout,
    )


def _master_port(args: argparse.Namespace) -> int | None:
    """--master-port, else $MASTER_PORT, else 29500 for a multi-node group (one node picks a free port)."""
    if args.master_port is not None:
        return args.master_port
    raw = os.environ.get("MASTER_PORT")
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"MASTER_PORT={raw!r} is not a port number") from None
    return 29500 if args.nnodes > 1 else None


def _run_worker_node(engine: Any, node_rank: int) -> int:
    from ..distributed.launch import run_worker_node
    from ..distributed.parallel_state import ParallelConfig

    return run_worker_node(engine, ParallelConfig.from_engine(engine), node_rank)


def _speculative_config(raw: str | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"--speculative-config is not valid JSON ({err}); pass a JSON object") from err
    if not isinstance(value, dict):
        raise ValueError('--speculative-config must be a JSON object, e.g. {"method": "ngram", ...}')
    return value


def serve(config: Any, host: str, port: int, access_log: bool = False) -> int:
    import uvicorn

    from .app import build_app, drain

    try:
        sock = _bind(host, port)  # before anything starts: a busy port is one clear line, not a crash
    except OSError as err:
        print(f"tidepool serve: error: cannot listen on {host}:{port}: {err.strerror or err}", file=sys.stderr)
        return 1
    app = build_app(config)
    state = app.state.tidepool

    class DrainingServer(uvicorn.Server):
        """uvicorn, except that SIGTERM/SIGINT drain before stopping and are not re-raised at exit.

        The first signal starts the drain; a second one makes it abort what is left at once (every
        request still gets its answer); one after the drain has finished stops uvicorn at once.
        """

        drain_task: asyncio.Task[None] | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Signal handlers run between bytecodes of the loop's thread: hand the work to the loop.
            loop = asyncio.get_running_loop()
            if self.drain_task is None and not self.should_exit:
                logger.info("signal %d: draining before exit", sig)
                loop.call_soon_threadsafe(self._start_drain, loop)
            elif not self.should_exit:
                logger.warning("signal %d again: aborting the requests still in flight", sig)
                loop.call_soon_threadsafe(state.hurry.set)
            else:
                self.force_exit = True

        def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
            self.drain_task = loop.create_task(self._drain())

        async def _drain(self) -> None:
            await drain(app)
            self.should_exit = True

    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = DrainingServer(uv_config)

    def on_fatal() -> None:
        server.should_exit = True

    state.on_fatal = on_fatal
    server.run(sockets=[sock])
    if state.load_error is not None or state.engine_died:
        return 1
    return 0 if server.started else 1


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, set up as uvicorn sets up its own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


if __name__ == "__main__":
    sys.exit(main())
