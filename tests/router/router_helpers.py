"""Helpers of the router tests: in-process fake engines and routers, polling, reading the router's state.

`Servers.engine(name, port=0)` starts a `FakeEngine`; `Servers.router(*flags)` starts a router
from command-line flags (the same parsing as `tidepool router`), both served by uvicorn in threads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from engine_control import Controllable, launcher
from router_fake_engine import FakeEngine, ThreadServer

from tidepool.router.app import build_app
from tidepool.router.cli import build_config, build_parser


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

    def engine(self, name: str, port: int = 0, host: str = "127.0.0.1") -> tuple[FakeEngine, ThreadServer]:
        fake = FakeEngine(name)
        server = ThreadServer(fake.app(), port, host)
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


@dataclass
class Proc(Controllable):
    """A `tidepool serve` or `tidepool router` subprocess on a loopback port, its output in `log_path`; an engine
    spawned with a `control_dir` can be paused or held (engine_control.py)."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    control_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _tidepool() -> list[str]:
    script = Path(sys.executable).with_name("tidepool")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tidepool.cli"]


def spawn(log_dir: Path, name: str, args: list[str], port: int | None = None, controlled: bool = False) -> Proc:
    """Start `tidepool <args> --host 127.0.0.1 --port PORT` (cwd outside the repo: operator/ must not shadow);
    `controlled`: an engine under controlled_serve.py, with a fresh control folder (no hold of an earlier process)."""
    port = port or free_port()
    log_path = log_dir / f"{name}-{port}.log"
    control_dir = Path(tempfile.mkdtemp(prefix=f"control-{name}-", dir=log_dir)) if controlled else None
    cmd = [*(_tidepool() if control_dir is None else launcher(control_dir)), *args, "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir, env=env)
    return Proc(proc, port, log_path, control_dir)


def wait_ready(*procs: Proc, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        while True:
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.log_path.name} exited with {proc.proc.returncode}:\n{proc.log()}")
            try:
                if httpx.get(f"{proc.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.log_path.name} not ready after {timeout} s:\n{proc.log()}")
            time.sleep(0.2)


def engine_counters(url: str) -> dict[str, float]:
    """Sums of an engine's prefix-cache counters (`vllm:prefix_cache_{queries,hits}_total`) from its /metrics."""
    totals = {"queries": 0.0, "hits": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        for name in totals:
            if line.startswith(f"vllm:prefix_cache_{name}_total"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


ENGINE_FLAGS = ("--served-model-name", "tiny", "--max-model-len", "1024", "--seed", "0")


@dataclass
class Engines:
    model: Path
    log_dir: Path
    a: Proc
    b: Proc
    others: list[Proc] = field(default_factory=list)  # started by tests; stopped at the end

    def serve(self, name: str, *flags: str, port: int | None = None, controlled: bool = False) -> Proc:
        args = ["serve", "--model", str(self.model), *ENGINE_FLAGS, *flags]
        proc = spawn(self.log_dir, name, args, port, controlled)
        self.others.append(proc)
        return proc

    def router(self, *flags: str) -> Proc:
        proc = spawn(self.log_dir, "router", ["router", "--health-interval", "0.2", *flags])
        self.others.append(proc)
        return proc

    def restart_b(self) -> Proc:
        """A new engine process on b's port (after a test killed b); controllable, as the first."""
        self.b = self.serve("b", port=self.b.port, controlled=True)
        return self.b
