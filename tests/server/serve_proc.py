"""A real `tidepool serve` process on loopback for the server tests (a subprocess: real signals, exit codes, uvicorn).

`start_server` waits until `/ready` says yes; `Server` has the helpers tests share: the KV
pool reading of `/debug/kv`, waiting for the pool to be fully free, stopping with SIGTERM.
With `control_dir`, the server runs under `controlled_serve.py`, whose files pause or crash
its engine (for shutdown tests that must not depend on machine speed).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from engine_control import Controllable
from engine_control import launcher as launcher_for

MODEL_NAME = "tiny"
_START_TIMEOUT_S = 120.0


@dataclass
class Server(Controllable):
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str = MODEL_NAME
    control_dir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kv(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/debug/kv", timeout=10).json()

    def wait_pool_free(self, timeout: float = 15.0) -> dict[str, int]:
        """Poll until no request is left and every KV block is free; returns the last reading."""
        deadline = time.monotonic() + timeout
        kv = self.kv()
        while time.monotonic() < deadline:
            kv = self.kv()
            if kv["num_unfinished"] == 0 and kv["num_running"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]:
                return kv
            time.sleep(0.1)
        raise AssertionError(f"KV pool not free after {timeout} s: {kv}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command() -> list[str]:
    script = Path(sys.executable).with_name("tidepool")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "tidepool.cli"]


def start_server(
    model: Path, log_dir: Path, *flags: str, control_dir: Path | None = None, launcher: list[str] | None = None
) -> Server:
    """`launcher` replaces the command prefix that runs `tidepool <args>` (default: plain, or controlled_serve.py)."""
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    launcher = launcher or (_command() if control_dir is None else launcher_for(control_dir))
    cmd = [*launcher, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL_NAME, *flags]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # cwd outside the repository: a repo-root cwd on sys.path would let operator/ shadow the stdlib module.
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir, env=env)
    server = Server(proc, port, log_path, control_dir=control_dir)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {_START_TIMEOUT_S} s:\n{server.log()}")
