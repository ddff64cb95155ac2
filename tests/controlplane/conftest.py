"""Fixtures shared by the control-plane tests that run the real operator (`tidepool operator` as a subprocess).

- `identity` (per module): the CRD and the chart's RBAC installed, the operator's ServiceAccount identity
  (a token kubeconfig, operator_kit.operator_identity); the KWOK nodes' leases are kept fresh meanwhile.
- `operator`: the operator with that identity, watching the test's namespace (Pod Security "restricted");
  stopped after the test, which then fails if the chart's RBAC refused any of its requests.
- `feed` and `autoscaling_operator`: a synthetic `/metrics` feed (autoscale_feed.py) and an operator that
  scrapes it every second (unrestricted namespace), for the autoscaler's tests.

Each fixture is defined here only: a test module defines none of these names.

Why the first attempt at this file (4d0894e) was reverted, and why sharing the fixture was not the cause: the
tier-2 pytest process aborted at interpreter exit (SIGABRT, no message, after every test passed) in some runs (2
of 5), with or without this file. A thread a test left running did it: test_cp_operator_chaos's ReplicaRecorder
never ended its watch thread. At interpreter exit a daemon thread that returns from a blocking call (here a
kubernetes client read, GIL released) cannot take the GIL back, so CPython 3.11 ends it with pthread_exit; glibc's
forced unwind of its C stack reaches pydantic-core's Rust frames (every API method of the client is wrapped in
pydantic's validate_call), which cannot be unwound, and aborts: abort <- __pthread_unwind <- pthread_exit <-
PyThread_exit_thread <- take_gil. Reproduced outside pytest (gdb, kubernetes 37.0.2): a daemon thread calling the
live API server at exit aborts 10 of 10 runs; stopped and joined first, 0 of 10. cddd3bf fixed it at the source
(every thread a test starts is stopped and joined, its calls have timeouts) and `control_plane` fails the session
naming any thread still alive (controlplane_fixture.threads_left). The fixtures here keep that: the node-lease
keeper and the feed server are context managers, joined at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from autoscale_feed import Feed, feed_server
from operator_kit import (
    NodeLeaseKeeper,
    OperatorIdentity,
    OperatorProcess,
    free_port,
    install_crd,
    operator_identity,
    restricted_namespace,
)


@pytest.fixture(scope="module")
def identity(control_plane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorIdentity]:
    install_crd(control_plane)
    with NodeLeaseKeeper(control_plane):
        yield operator_identity(control_plane, tmp_path_factory.mktemp("operator-identity"))


def _run_operator(identity: OperatorIdentity, namespace: str, log: Path) -> Iterator[OperatorProcess]:
    """Start the operator, hand it to the test, stop it; then fail if the chart's RBAC refused it anything."""
    running = OperatorProcess(identity.kubeconfig, [namespace], log)
    running.start()
    yield running
    running.stop()
    forbidden = running.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


@pytest.fixture
def operator(control_plane, cp_namespace: str, identity: OperatorIdentity, tmp_path: Path) -> Iterator[OperatorProcess]:
    restricted_namespace(control_plane, cp_namespace)
    yield from _run_operator(identity, cp_namespace, tmp_path / "operator.log")


@pytest.fixture
def feed(control_plane) -> Iterator[Feed]:
    metrics_feed = Feed(control_plane)
    with feed_server(metrics_feed) as url:
        metrics_feed.url = url
        yield metrics_feed


@pytest.fixture
def autoscaling_operator(
    cp_namespace: str, identity: OperatorIdentity, feed: Feed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[OperatorProcess]:
    monkeypatch.setenv("TIDEPOOL_METRICS_SOURCE_URL_TEMPLATE", feed.url + "/{namespace}/{name}/{pool}")
    monkeypatch.setenv("TIDEPOOL_AUTOSCALE_INTERVAL", "1")
    monkeypatch.setenv("TIDEPOOL_AUTOSCALE_WINDOW", "5")
    monkeypatch.setenv("TIDEPOOL_OPERATOR_METRICS_PORT", str(free_port()))
    yield from _run_operator(identity, cp_namespace, tmp_path / "operator.log")
