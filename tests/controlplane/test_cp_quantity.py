"""What the builders emit for a quantity is what a real API server stores, and means what the user wrote.

For each case of tests/operator/test_quantity.py, PersistentVolumeClaims go through a server-side
dry run (validated, defaulted, serialised, never stored): the builders' `canonical_quantity` comes
back unchanged (so a desired child and the stored one compare equal as strings), and the amount the
server keeps for the user's own spelling equals `quantity_value` of it (the same resource).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tidepool.operator.api import canonical_quantity, quantity_value

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def _load_cases() -> list[tuple[str | int, str]]:
    name = "tidepool_test_quantity"
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "operator" / "test_quantity.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.CANONICAL_CASES


CASES = [(written, canonical) for written, canonical in _load_cases() if quantity_value(written) > 0]


@pytest.fixture(scope="module")
def namespace(control_plane) -> Iterator[str]:
    name = f"quantity-{uuid.uuid4().hex[:6]}"
    control_plane.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _stored(control_plane, namespace: str, quantity: str) -> str:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"q-{uuid.uuid4().hex[:8]}"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": quantity}}},
    }
    api = client.CoreV1Api(control_plane.api_client())
    answer = api.create_namespaced_persistent_volume_claim(namespace, claim, dry_run="All", _preload_content=False)
    return json.loads(answer.data)["spec"]["resources"]["requests"]["storage"]


@pytest.mark.parametrize(("written", "canonical"), CASES, ids=[str(w) for w, _ in CASES])
def test_api_server_keeps_what_the_builders_emit(control_plane, namespace, written, canonical):
    assert canonical_quantity(written) == canonical
    assert _stored(control_plane, namespace, canonical) == canonical
    assert quantity_value(_stored(control_plane, namespace, str(written))) == quantity_value(written)
