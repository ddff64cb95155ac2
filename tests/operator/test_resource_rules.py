"""api/resource_rules.py's `effective` is what the builders render, and its rule refuses exactly the specs whose
pods would carry a request above its limit (hypothesis over every layer: spec.resources, a pool's resources,
spec.pod.resources, the pool's pod.resources, router.resources). The CEL side of the same rule is checked
against a real API server in tests/controlplane/test_cp_crd.py."""

from __future__ import annotations

from typing import Any

from api_cases_resources import layered
from hypothesis import given, settings
from test_builders import build, pod_specs

from tidepool.operator.api import InferenceServiceSpec, validate_spec
from tidepool.operator.api.quantity import canonical_quantity
from tidepool.operator.api.resource_rules import effective, not_above, router_effective
from tidepool.operator.builders import SpecError


def canonical(values: dict[str, Any]) -> dict[str, str]:
    return {k: canonical_quantity(v) for k, v in values.items()}


def rendered(children: list[dict[str, Any]], pool: str) -> tuple[dict[str, str], dict[str, str]]:
    (template,) = [t for t in pod_specs(children) if t["metadata"]["labels"]["tidepool.dev/pool"] == pool][:1]
    resources = template["spec"]["containers"][0]["resources"]
    strip = lambda d: {k: v for k, v in d.items() if k != "nvidia.com/gpu"}  # noqa: E731  (never overridden)
    return strip(resources.get("requests", {})), strip(resources.get("limits", {}))


@settings(max_examples=300, deadline=None)
@given(layered())
def test_effective_is_what_the_builders_render_and_the_rule_refuses_exactly_what_pods_could_not_take(
    body: dict[str, Any],
) -> None:
    body = body["spec"]
    spec = InferenceServiceSpec.model_validate(body)
    expected = {pool: effective(spec, pool) for pool in body["pools"]}
    expected["router"] = router_effective(spec.router)
    is_valid = all(not_above(*requests_limits) for requests_limits in expected.values())
    refused = [m for m in validate_spec(spec) if "above its limit" in m]
    assert (not refused) == is_valid, (refused, expected)
    if not is_valid:
        try:
            build(spec.to_wire())
        except SpecError as exc:
            assert "above its limit" in str(exc)
        else:
            raise AssertionError("a spec the rule refuses must not build")
        return
    children = build(spec.to_wire())
    for pool, (requests, limits) in expected.items():
        assert rendered(children, pool) == (canonical(requests), canonical(limits)), pool
