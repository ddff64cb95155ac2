"""Kubernetes quantities: the canonical form the API server stores (apimachinery's rules), and exact values."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tidepool.operator.api import InferenceServiceSpec, ServiceView, canonical_quantity, quantity_value
from tidepool.operator.api.quantity import is_quantity
from tidepool.operator.builders import desired_state

# Shared with tests/controlplane/test_cp_quantity.py, which sends each one through a real API server.
CANONICAL_CASES: list[tuple[str | int, str]] = [
    ("0", "0"),
    ("0.0", "0"),
    (4, "4"),
    ("4", "4"),
    ("+4", "4"),
    ("0.5", "500m"),
    (".5", "500m"),
    ("1.5", "1500m"),
    ("1000m", "1"),
    ("1500m", "1500m"),
    ("100m", "100m"),
    ("0.001", "1m"),
    ("0.0001", "1m"),  # resource lists are rounded up to milli
    ("100u", "1m"),
    ("0.1n", "1m"),
    ("1.0005", "1001m"),
    ("1000", "1k"),
    ("1500", "1500"),
    ("1000M", "1G"),
    ("100G", "100G"),
    ("1E", "1E"),
    ("1Ki", "1Ki"),
    ("0.5Ki", "512"),  # binary below 1024: decimal
    ("1.1Ki", "1126400m"),  # binary but not whole: decimal
    ("2048Ki", "2Mi"),
    ("1024Mi", "1Gi"),
    ("1536Mi", "1536Mi"),
    ("1.5Gi", "1536Mi"),
    ("16Gi", "16Gi"),
    ("1Ei", "1Ei"),
    ("1e3", "1e3"),
    ("1E3", "1e3"),
    ("1.5e3", "1500"),
    ("12e6", "12e6"),
]


@pytest.mark.parametrize(("written", "canonical"), CANONICAL_CASES)
def test_canonical_form(written: str | int, canonical: str) -> None:
    assert canonical_quantity(written) == canonical
    assert canonical_quantity(canonical) == canonical  # idempotent
    assert quantity_value(canonical) == quantity_value(written)


@pytest.mark.parametrize("bad", ["four", "", "1.5.1", "-1", "1Kb", "1 Gi", "Gi", True, None, -3, 1.5])
def test_refuses_what_is_not_a_quantity(bad: object) -> None:
    assert not is_quantity(bad)
    with pytest.raises(ValueError, match="Kubernetes quantity"):
        canonical_quantity(bad)  # type: ignore[arg-type]


def test_exact_values() -> None:
    assert quantity_value("500m") == Fraction(1, 2)
    assert quantity_value("1n") == Fraction(1, 1000)  # rounded up to 1m, as the API server stores it
    assert quantity_value("1Gi") == 2**30
    assert quantity_value("0.5") == quantity_value("500m")


def test_builders_emit_what_the_api_server_stores() -> None:
    """A drift check comparing the desired child with the stored one sees equal strings."""
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"uri": "hf://org/m"},
            "resources": {"gpusPerReplica": 1, "cpu": "0.5", "memory": "1024Mi"},
            "modelCache": {"persistentVolumeClaim": {"claimName": "weights", "size": "5120Mi"}},
        }
    )
    built = desired_state("svc", "ns", ServiceView.from_spec(spec)).children
    children = {(c["kind"], c["metadata"]["name"]): c for c in built}
    container = children[("Deployment", "svc-unified")]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "1"}
    assert container["resources"]["limits"] == container["resources"]["requests"]
    claim = children[("PersistentVolumeClaim", "weights")]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
