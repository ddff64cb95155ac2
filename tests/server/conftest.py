"""Fixtures for the server tests: real `tidepool serve` processes on loopback, on the tiny test model.

`serve(*flags)` starts one and stops it (SIGTERM, then a kill if it hangs) at the end of the
session. `server` is one shared instance; tests that read its counters work with deltas,
since other tests use it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serve_proc import Server, start_server


@pytest.fixture(scope="session")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("serve-logs")

    def start(*flags: str) -> Server:
        server = start_server(tiny_model_dir, log_dir, *flags)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(serve: Callable[..., Server]) -> Server:
    return serve()
