"""Local `tidepool` processes for the benchmarks (engines, routers): start, wait until ready, stop.

Torch-free. Every process gets one OpenMP thread (so setups that run several engines on the same
cores compare fairly) and runs from /tmp (a repository root on sys.path would let `operator/`
shadow the standard library's module); its output goes to a log file the error messages name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tidepool_cmd() -> list[str]:
    script = Path(sys.executable).with_name("tidepool")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tidepool.cli"]


def spawn(args: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    """`tidepool <args> --host 127.0.0.1 --port <port>`, output appended to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [*tidepool_cmd(), *args, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd="/tmp",
            env=env,
        )


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; its log: {log}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout} s; its log: {log}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM (the servers drain), then a kill if it does not exit within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
