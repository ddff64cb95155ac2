"""A container request above its limit once the layers are merged: refused at admission (resource_rules.py).

`RESOURCE_CASES` join tests/operator/test_api_cases.py's INVALID_CASES (the models refuse each one; the API
server refuses it, tests/controlplane/test_cp_crd.py); before, the API server accepted them and the operator
reported InvalidSpec. `VALID_RESOURCE_EDITS` are what Kubernetes accepts (a request below its limit, a limit
raised over the spec's request, the router's limit raised with its request): the models and the API server
accept them, and so does the API server every child built from them. The unified sample sets cpu 4 and
memory 16Gi; the disaggregated one cpu 8, memory 64Gi and 96Gi for decode. `layered()` draws samples with
requests and limits in every layer, for the property tests that compare the rule with the builders and
with the API server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api_case_kit import Case, both, rule_message, sample, set_path
from hypothesis import strategies as st

Edit = Callable[[dict[str, Any]], None]
_UNIFIED = rule_message("pools.unified: a container request is above its limit")
_PREFILL = rule_message("pools.prefill: a container request is above its limit")
_DECODE = rule_message("pools.decode: a container request is above its limit")
_ROUTER = rule_message("router.resources: a request is above its limit")

RESOURCE_CASES: tuple[Case, ...] = (
    Case("limit-below-spec-memory", set_path("spec.pod.resources", {"limits": {"memory": "8Gi"}}), _UNIFIED, "rule"),
    Case("limit-below-spec-cpu-int", set_path("spec.pod.resources", {"limits": {"cpu": 1}}), _UNIFIED, "rule"),
    Case(
        "pool-raises-request-over-pod-limit",
        both(
            set_path("spec.pools.unified.resources", {"memory": "64Gi"}),
            set_path("spec.pod.resources", {"limits": {"memory": "32Gi"}}),
        ),
        _UNIFIED,
        "rule",
    ),
    Case(
        "request-over-limit-in-one-layer",
        set_path(
            "spec.pod.resources", {"requests": {"ephemeral-storage": "2Gi"}, "limits": {"ephemeral-storage": "1G"}}
        ),
        _UNIFIED,
        "rule",
    ),
    Case(
        "pool-request-over-spec-pod-limit",
        both(
            set_path("spec.pod.resources", {"limits": {"ephemeral-storage": "1Gi"}}),
            set_path("spec.pools.unified.pod", {"resources": {"requests": {"ephemeral-storage": "1025Mi"}}}),
        ),
        _UNIFIED,
        "rule",
    ),
    Case(
        "prefill-pool-cpu-over-pod-limit",
        both(
            set_path("spec.pools.prefill.resources", {"cpu": 16}),
            set_path("spec.pod.resources", {"limits": {"cpu": "8"}}),
        ),
        _PREFILL,
        "rule",
        base="disaggregated",
    ),
    Case(
        "decode-limit-below-its-memory",
        set_path("spec.pools.decode.pod", {"resources": {"limits": {"memory": "64Gi"}}}),  # decode requests 96Gi
        _DECODE,
        "rule",
        base="disaggregated",
    ),
    Case(
        "router-request-over-default-limit",
        set_path("spec.router.resources", {"requests": {"memory": "2Gi"}}),
        _ROUTER,
        "rule",
    ),
    Case(
        "router-limit-below-default-request",
        set_path("spec.router.resources", {"limits": {"cpu": "100m"}}),  # the router requests 250m
        _ROUTER,
        "rule",
    ),
)

VALID_RESOURCE_EDITS: tuple[tuple[str, Edit], ...] = (
    ("limit-above-memory", set_path("spec.pod.resources", {"limits": {"memory": "32Gi"}})),
    ("request-below-limit", set_path("spec.pod.resources", {"requests": {"cpu": "500m", "memory": 8589934592}})),
    (
        "pool-request-under-limit",
        both(
            set_path("spec.pod.resources", {"limits": {"memory": "12Gi"}}),
            set_path("spec.pools.unified.resources", {"memory": "12Gi"}),
        ),
    ),
    ("equal-in-other-units", set_path("spec.pod.resources", {"requests": {"cpu": "4000m"}, "limits": {"cpu": 4}})),
    (
        "router-limit-raised",
        set_path("spec.router.resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": "2Gi"}}),
    ),
)

# ---- random layers: tests/operator/test_resource_rules.py (against the builders) and
# tests/controlplane/test_cp_crd.py (against the API server's CEL) ----------------------------------------
VALUES = {
    "cpu": st.sampled_from(["250m", "500m", "1", "2", 3, "4000m", "8"]),
    "memory": st.sampled_from(["256Mi", "512Mi", "1Gi", 1073741824, "2Gi", "16Gi", "2G"]),
    "ephemeral-storage": st.sampled_from(["1Gi", "1025Mi", "2Gi"]),
}


def resource_list(keys: tuple[str, ...] = tuple(VALUES)) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={key: VALUES[key] for key in keys})


def container() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional={"requests": resource_list(), "limits": resource_list()})


@st.composite
def layered(draw: st.DrawFn) -> dict[str, Any]:
    """A sample InferenceService with requests and limits drawn for every layer (about one in ten is refused)."""
    whole = sample(draw(st.sampled_from(["unified", "disaggregated"])))
    whole["metadata"]["name"] = f"layers-{draw(st.integers(0, 10**9))}"
    body = whole["spec"]
    body["resources"] = {**body["resources"], **draw(resource_list(("cpu", "memory")))}
    for key in ("cpu", "memory"):
        if key not in body["resources"] or draw(st.booleans()):
            body["resources"].pop(key, None)
    if draw(st.booleans()):
        body["pod"] = {"resources": draw(container())}
    for pool in body["pools"]:
        if draw(st.booleans()):
            body["pools"][pool]["resources"] = draw(resource_list(("cpu", "memory")))
        if draw(st.booleans()):
            body["pools"][pool]["pod"] = {"resources": draw(container())}
    if draw(st.booleans()):
        body["router"] = {**body.get("router", {}), "resources": draw(container())}
    return whole
