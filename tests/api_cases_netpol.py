"""`networkPolicy` specs and what must be said about them (operator/api/netpol.py).

`NETPOL_CASES` join tests/operator/test_api_cases.py's INVALID_CASES: the models refuse each one there, and
tests/controlplane/test_cp_crd.py sends each to a real API server, which must refuse it with the same message
(every CEL rule of the peers compiles and agrees with its Python twin). `VALID_NETPOL_EDITS` pass both.
"""

from __future__ import annotations

from api_case_kit import Case, set_path

from tidepool.operator.api import netpol

_PEER_RULE, _KEY_RULE = (rule.message for rule in netpol.NETPOL_RULES)

NETPOL_CASES: tuple[Case, ...] = (
    Case("netpol-empty-peer", set_path("spec.networkPolicy", {"clients": [{}]}), _PEER_RULE, "rule"),
    Case(
        "netpol-bad-label-key",
        set_path("spec.networkPolicy", {"clients": [{"podSelector": {"matchLabels": {"not a key!": "x"}}}]}),
        _KEY_RULE,
        "rule",
    ),
    Case(
        "netpol-bad-prefixed-key",
        set_path(
            "spec.networkPolicy",
            {"clients": [{"namespaceSelector": {"matchLabels": {"Example.COM_/role": "gateway"}}}]},
        ),
        _KEY_RULE,
        "rule",
    ),
)

VALID_NETPOL_EDITS = (
    ("netpol-off", set_path("spec.networkPolicy", {"enabled": False})),
    ("netpol-nobody", set_path("spec.networkPolicy", {"clients": []})),
    (
        "netpol-gateway-client",
        set_path(
            "spec.networkPolicy",
            {
                "clients": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "envoy"}},
                    },
                    {"podSelector": {}},
                ]
            },
        ),
    ),
)
