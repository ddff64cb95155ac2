"""Helpers of the router tests: in-process fake engines and routers, polling, reading the router's state.

`Servers.engine(name, port=0)` starts a `FakeEngine`; `Servers.router(*flags)` starts a router
from command-line flags (the same parsing as `tidepool router`), both served by uvicorn in threads.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from router_fake_engine import FakeEngine, ThreadServer

from tidepool.engine.router.app import build_app
from tidepool.engine.router.cli import build_config, build_parser


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def metric_value(router_url: str, sample: str) -> float:
    """The value of one exact sample line (name plus labels) of the router's /metrics; 0 if absent."""
    for line in httpx.get(f"{router_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replica_states(router_url: str, pool: str = "unified") -> dict[str, str]:
    return {r["url"]: r["state"] for r in httpx.get(f"{router_url}/debug/replicas", timeout=5).json()[pool]}


@dataclass
class Servers:
    started: list[ThreadServer] = field(default_factory=list)

    def engine(self, name: str, port: int = 0) -> tuple[FakeEngine, ThreadServer]:
        fake = FakeEngine(name)
        server = ThreadServer(fake.app(), port)
        self.started.append(server)
        return fake, server

    def router(self, *flags: str, wait_ready: int = 0, pool: str = "unified") -> ThreadServer:
        """A router; waits until `wait_ready` replicas of `pool` are ready."""
        config = build_config(build_parser().parse_args(["--health-interval", "0.1", *flags]))
        server = ThreadServer(build_app(config))
        self.started.append(server)
        wait_for(lambda: list(replica_states(server.url, pool).values()).count("ready") >= wait_ready,
                 what=f"{wait_ready} ready replicas")  # fmt: skip
        return server
