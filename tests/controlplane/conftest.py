"""Fixtures shared by the control-plane tests that run the real operator."""

from __future__ import annotations

import pytest
from test_cp_operator_support import NodeLeaseKeeper, install_crd, operator_identity


@pytest.fixture(scope="module")
def identity(control_plane, tmp_path_factory):
    """The CRD and the chart's RBAC installed, and the operator's ServiceAccount identity (a token
    kubeconfig), once per test module; the KWOK nodes' leases are kept fresh meanwhile."""
    install_crd(control_plane)
    with NodeLeaseKeeper(control_plane):
        yield operator_identity(control_plane, tmp_path_factory.mktemp("operator-identity"))
