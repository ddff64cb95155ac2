"""Fixtures for the router tests: fake engines and routers served in-process (threads), stopped at the end;
and two real `tidepool serve` processes on the tiny model, shared by the real-engine modules.

Each real engine loads torch (5-10 s here), so `engine_fleet` is session-scoped and started in parallel.
Tests that kill one (`engine_fleet.b`) restart it on the same port before they end (`engine_fleet.restart_b`);
b runs under controlled_serve.py, so a test can hold its requests in flight before it kills it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from router_helpers import ENGINE_FLAGS, Engines, Servers, spawn, wait_ready


@pytest.fixture
def servers() -> Iterator[Servers]:
    servers = Servers()
    yield servers
    for server in reversed(servers.started):
        server.stop()


@pytest.fixture(scope="session")
def engine_fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    log_dir = tmp_path_factory.mktemp("router-logs")
    args = ["serve", "--model", str(tiny_model_dir), *ENGINE_FLAGS]
    fleet = Engines(tiny_model_dir, log_dir, spawn(log_dir, "a", args), spawn(log_dir, "b", args, controlled=True))
    try:
        wait_ready(fleet.a, fleet.b)
        yield fleet
    finally:
        for proc in [fleet.a, fleet.b, *fleet.others]:
            proc.stop()
