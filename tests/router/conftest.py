"""Fixtures for the router tests: fake engines and routers served in-process (threads), stopped at the end.

Real-engine fixtures live in `test_router_engines.py`, module-scoped, since each engine process loads torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_helpers import Servers


@pytest.fixture
def servers() -> Iterator[Servers]:
    servers = Servers()
    yield servers
    for server in reversed(servers.started):
        server.stop()
