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

MODEL_NAME = "tiny"
CONTROLLED = Path(__file__).with_name("controlled_serve.py")
_START_TIMEOUT_S = 120.0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str = MODEL_NAME
    control_dir: Path | None = None

    def pause(self, paused: bool = True) -> None:
        """Stop (or resume) all engine progress; needs a server started with `control_dir`."""
        self._control("pause", paused)

    def hold(self, held: bool = True) -> None:
        """Let the engine run until every request has started generating, then hold it there (or release
        it); needs a server started with `control_dir`. A new hold first clears the last one's count, which
        the engine writes only while the `hold` file exists, so `num_held` never reads a previous hold."""
        if held:
            assert self.control_dir is not None, "start the server with control_dir to hold it"
            (self.control_dir / "holding").unlink(missing_ok=True)
        self._control("hold", held)

    def num_held(self) -> int:
        """Requests the held engine holds mid-generation (0 when not holding)."""
        assert self.control_dir is not None
        text = (self.control_dir / "holding").read_text() if (self.control_dir / "holding").exists() else ""
        return int(text) if text.strip() else 0

    def _control(self, name: str, on: bool) -> None:
        assert self.control_dir is not None, f"start the server with control_dir to {name} it"
        flag = self.control_dir / name
        if on:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def poison_seed(self, seed: int) -> None:
        """Make the sampler fail every request with this seed (a per-request fault); needs `control_dir`."""
        assert self.control_dir is not None, "start the server with control_dir to poison requests"
        (self.control_dir / "poison").write_text(str(seed))

    def crash_engine(self) -> None:
        """Make the engine's next step raise (the engine thread dies); needs `control_dir`."""
        assert self.control_dir is not None, "start the server with control_dir to crash its engine"
        (self.control_dir / "crash").touch()

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


def start_server(model: Path, log_dir: Path, *flags: str, control_dir: Path | None = None) -> Server:
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    launcher = _command() if control_dir is None else [sys.executable, str(CONTROLLED), str(control_dir)]
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
