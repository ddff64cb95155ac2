"""Fixtures for the server tests: real `tidepool serve` processes on loopback, on the tiny test model.

`serve(*flags)` starts one and stops it (SIGTERM, then a kill if it hangs) at the end of the
session; `serve_controlled(*flags)` starts one whose engine the test can pause or crash
(controlled_serve.py). `server` is one shared instance; tests that read its counters work with
deltas, since other tests use it too. `client` is the official `openai` client of `server`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from serve_proc import Server, start_server


@pytest.fixture(scope="session")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []
    log_dir = tmp_path_factory.mktemp("serve-logs")

    def start(*flags: str, controlled: bool = False) -> Server:
        control_dir = tmp_path_factory.mktemp("control") if controlled else None
        server = start_server(tiny_model_dir, log_dir, *flags, control_dir=control_dir)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def serve_controlled(serve: Callable[..., Server]) -> Callable[..., Server]:
    return lambda *flags: serve(*flags, controlled=True)


@pytest.fixture(scope="session")
def server(serve: Callable[..., Server]) -> Server:
    return serve()


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
