"""Wall time from process start to the first 200 of `/ready` for `tidepool serve MODEL` (issue #43's target).

Role: the plain number the issue asks for (<= 3 s for SmolLM2 on this machine), on a quiet machine; each
round is a fresh process (warm page cache after the first), the median is printed. bench/startup.py breaks an
offline start into phases, bench/serve_imports.py measures what a start costs on a loaded machine.

    python bench/serve_ready.py smollm2-135m-instruct --rounds 5
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_to_ready(model: str, timeout_s: float = 120.0) -> float:
    """Seconds from spawning `tidepool serve` to its first 200 on /ready; the server is stopped after."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        ["tidepool", "serve", model, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while time.monotonic() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"tidepool serve exited with {proc.returncode} before /ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"/ready not 200 within {timeout_s:g} s")
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="what `tidepool serve` takes: a catalogue name, a .gguf file or a folder")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times = [time_to_ready(args.model) for _ in range(args.rounds)]
    print(f"{args.model}: {[round(t, 2) for t in times]} s, median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
