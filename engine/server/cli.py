"""`tidepool serve`: the OpenAI-compatible server's command line, and graceful drain on SIGTERM.

Every flag comes from the serve-flag table (tidepool.contract.serve_flags), the table `EngineConfig`
(`LLM(...)`) and `tidepool generate` are built from too (vLLM's spelling: `--max-model-len`,
`--no-enable-prefix-caching`, …); argparse enforces the table's bounds, so an out-of-range value
exits 2 before anything loads.

The first SIGTERM or SIGINT drains (readiness false, new API calls 503, in-flight requests finish
within `--drain-timeout`, the rest are aborted and told so) and then stops uvicorn; the process
exits 0. A second signal aborts what is still in flight at once, each request still answered (a
503, or an error event and `[DONE]` on a stream), and exits 0. A model that fails to load, an
engine thread that dies, or a port that cannot be bound (one line on stderr) exit 1.
(The signal handling is shared with the router: tidepool.common.graceful.)

`--api-key` (repeatable), `--api-key-file` or $TIDEPOOL_API_KEY make every path but the probes and
/metrics answer 401 without one of the keys (tidepool.common.api_key); a key file that cannot be
read, or holds no key, exits 2 before the model loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from tidepool.common.api_key import ApiKeys
from tidepool.contract import serve_flags

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The parser generated from the serve-flag table (tidepool.contract.serve_flags).

    Abbreviations are off: the operator refuses its own flags in `engine.extraArgs` by exact name,
    and `--max-num=8` must not slip past that as a prefix of `--max-num-seqs`.
    """
    parser = argparse.ArgumentParser(
        prog="tidepool serve", description="OpenAI-compatible server for one model", allow_abbrev=False
    )
    serve_flags.add_to_parser(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed flags, with `tidepool serve MODEL` folded into --model (exits with status 2 on bad input)."""
    parser = build_parser()
    return serve_flags.resolve_positionals(parser, parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _server_config(args)
        api_keys = ApiKeys.from_flags(args.api_key, args.api_key_file)  # a bad key file exits 2 before loading
        if args.node_rank != 0:  # a worker-only node: no HTTP, no scheduler; exits when the group shuts down
            return _run_worker_node(config.engine, args.node_rank, args.host, args.port)
    except ValueError as err:
        print(f"tidepool serve: error: {err}", file=sys.stderr)
        return 2
    return serve(config, args.host, args.port, access_log=args.access_log, api_keys=api_keys)


def engine_config(args: argparse.Namespace) -> Any:
    """The `EngineConfig` the parsed flags describe (what `LLM(...)` takes, from the same table); raises
    ValueError for a bad value (a flag's JSON, or $MASTER_PORT)."""
    from ..engine_config import EngineConfig

    kwargs = serve_flags.engine_kwargs(args)
    # The rendezvous may also come from the environment (torchrun's MASTER_ADDR / MASTER_PORT).
    kwargs.update(master_addr=args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1")
    kwargs.update(master_port=_master_port(args))
    return EngineConfig(**kwargs, show_progress=False)


def _server_config(args: argparse.Namespace) -> Any:
    from ..engine_config import resolve_model_path
    from .lora_modules import parse_lora_modules
    from .state import ServerConfig
    from .tools.parsers import check_tool_flags

    # What `LLM(...)` takes: a folder, a .gguf file (or a folder holding one), a catalogue name (pulled
    # when the model loads). A name that is none of these is refused here, before the port is bound.
    try:
        resolve_model_path(args.model, pull=False)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    check_tool_flags(args.enable_auto_tool_choice, args.tool_call_parser)  # a bad name exits 2 before loading
    model_name = args.served_model_name or args.model
    _check_lora_flags(args)
    if args.enable_sleep_mode and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        raise ValueError("--enable-sleep-mode: not supported with tensor or pipeline parallelism (several ranks)")
    return ServerConfig(
        engine=engine_config(args),
        model_name=model_name,
        max_queue_len=args.max_queue_len,
        retry_after_s=args.retry_after,
        drain_timeout_s=args.drain_timeout,
        max_body_bytes=args.max_body_bytes,
        body_read_timeout_s=args.body_read_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        lora_modules=parse_lora_modules(args.lora_modules, [model_name, args.model]),  # a bad one exits 2 here
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        enable_sleep_mode=args.enable_sleep_mode,
    )


def _check_lora_flags(args: argparse.Namespace) -> None:
    """The adapter flags that serve adapters need --enable-lora (vLLM's rule): a clear error, not a silent no-op."""
    if args.enable_lora:
        return
    for flag in ("lora_modules", "allow_runtime_lora_updating"):
        if getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora (serve LoRA adapters on the base model)")


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


def _run_worker_node(engine: Any, node_rank: int, host: str, port: int) -> int:
    """Worker ranks only; the kubelet probes them through a health endpoint on the same host:port as node 0's API."""
    from ..distributed.launch import run_worker_node
    from ..distributed.parallel_state import ParallelConfig

    return run_worker_node(engine, ParallelConfig.from_engine(engine), node_rank, health_address=(host, port))


def serve(config: Any, host: str, port: int, access_log: bool = False, api_keys: ApiKeys | None = None) -> int:
    import uvicorn

    from tidepool.common.graceful import DrainingServer
    from tidepool.common.tcp_tuning import http_protocol

    from .app import build_app, drain

    try:
        sock = _bind(host, port)  # before anything starts: a busy port is one clear line, not a crash
    except OSError as err:
        print(f"tidepool serve: error: cannot listen on {host}:{port}: {err.strerror or err}", file=sys.stderr)
        return 1
    app = build_app(config, api_keys)
    state = app.state.tidepool

    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=access_log,
        http=http_protocol(),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    # The first signal drains (app.drain), a second aborts what is left at once, every request still answered.
    server = DrainingServer(uv_config, lambda: drain(app), state.hurry.set)

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
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP by number too, as asyncio checks
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
