"""No container request above its limit, once the layers the builders merge are merged: refused at admission.

A container's requests and limits come in layers, each replacing the one before per resource name
(builders/engine.py `_resources`, builders/overrides.py `merge_pod` and `container_resources`):
- an engine pool: spec.resources.cpu/memory (request and limit alike), replaced by the pool's
  `resources`, then spec.pod.resources, then pools.<pool>.pod.resources (requests and limits separately);
- the router: ROUTER_RESOURCES (api/pod.py), then router.resources.
Kubernetes refuses a pod whose request is above its limit, so such a spec would apply nothing: each rule
here states it in CEL (generated from the same layer list, the router's defaults included) and mirrors
it in Python (`effective`), so the API server refuses the InferenceService with a message that says
what to change, and the reconcile (which runs the same check) never gets that far.

Also here, the other rules on what the engine container requests: an extended resource is never overcommitted
(its request equals its limit), spec.accelerator.resourceName is an extended resource outside kubernetes.io
that no pod.resources sets (its count follows parallelism), and every DRA claim the container names is one of
the pod's resourceClaims (spec.pod's, or the pool's own), each naming a claim or a claim template.

Invariant: `effective` computes what the builders render; tests/operator/test_resource_rules.py checks
it against the built pods.
"""

from __future__ import annotations

from collections.abc import Callable

from tidepool.operator.api import pod as p
from tidepool.operator.api import scheduling as sc
from tidepool.operator.api import spec as s
from tidepool.operator.api.quantity import is_quantity, quantity_value
from tidepool.operator.api.rule import Rule

BASE_KEYS = ("cpu", "memory")  # the resources spec.resources and a pool's resources set
Layer = tuple[str, str]  # (CEL guard that the ContainerResources exists, CEL path of it)


def _pool_layers(pool: str) -> list[Layer]:
    """The pod.resources layers of one pool, highest precedence first."""
    return [
        (f"has(self.pools.{pool}.pod) && has(self.pools.{pool}.pod.resources)", f"self.pools.{pool}.pod.resources"),
        ("has(self.pod) && has(self.pod.resources)", "self.pod.resources"),
    ]


def _cel_base(pool: str, key: str) -> str:
    """spec.resources.<key> replaced by the pool's: a quantity string, or '' when neither sets it."""
    mine, spec = f"self.pools.{pool}.resources", "self.resources"
    return (
        f"(has({mine}) && has({mine}.{key}) ? string({mine}.{key}) : "
        f"has({spec}) && has({spec}.{key}) ? string({spec}.{key}) : '')"
    )


def _cel_value(layers: list[Layer], kind: str, fallback: str) -> str:
    """The value of resource `k` (a CEL variable) in requests or limits: the first layer that sets it."""
    expr = fallback
    for guard, path in reversed(layers):
        expr = f"({guard} && has({path}.{kind}) && k in {path}.{kind} ? string({path}.{kind}[k]) : {expr})"
    return expr


def _cel_keys(layers: list[Layer], base_keys: tuple[str, ...]) -> str:
    """Every resource that gets a request: the base's and those some layer requests."""
    parts = ["[" + ", ".join(f"'{key}'" for key in base_keys) + "]"]
    parts += [f"({guard} && has({path}.requests) ? {path}.requests.map(k, k) : [])" for guard, path in layers]
    return "(" + " + ".join(parts) + ")"


def _cel_not_above(layers: list[Layer], base: dict[str, dict[str, str]] | str, base_keys: tuple[str, ...]) -> str:
    """CEL: for every requested resource, the request is not above the limit (where both are set)."""

    def fallback(kind: str) -> str:
        if isinstance(base, str):  # a pool: cpu/memory from spec.resources and the pool's resources
            return " : ".join(f"k == '{key}' ? {_cel_base(base, key)}" for key in base_keys) + " : ''"
        values = base[kind]
        return " : ".join(f"k == '{key}' ? '{v}'" for key, v in values.items()) + " : ''" if values else "''"

    request = _cel_value(layers, "requests", f"({fallback('requests')})")
    limit = _cel_value(layers, "limits", f"({fallback('limits')})")
    return (
        f"{_cel_keys(layers, base_keys)}.all(k, !(isQuantity({request}) && isQuantity({limit}) && "
        f"quantity({request}).isGreaterThan(quantity({limit}))))"
    )


def _merged(base: dict[str, str], overrides: list[dict[str, str]]) -> dict[str, str]:
    out = dict(base)
    for layer in overrides:
        out.update(layer)
    return out


def effective(spec: s.InferenceServiceSpec, pool: str) -> tuple[dict[str, str], dict[str, str]]:
    """(requests, limits) of the engine container of `pool` as the builders merge them (GPUs aside: never
    overridden)."""
    mine: s.PoolSpec = getattr(spec.pools, pool)
    base = {key: value for key in BASE_KEYS if (value := getattr(spec.resources, key)) is not None}
    if mine.resources is not None:
        base |= {key: value for key in BASE_KEYS if (value := getattr(mine.resources, key)) is not None}
    layers = [o.resources for o in (spec.pod, mine.pod) if o is not None and o.resources is not None]
    return _merged(base, [r.requests for r in layers]), _merged(base, [r.limits for r in layers])


def router_effective(router: s.RouterSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(requests, limits) of the router container: its defaults, replaced per resource name."""
    layers = [router.resources] if router.resources is not None else []
    return (
        _merged(p.ROUTER_RESOURCES["requests"], [r.requests for r in layers]),
        _merged(p.ROUTER_RESOURCES["limits"], [r.limits for r in layers]),
    )


def not_above(requests: dict[str, str], limits: dict[str, str]) -> bool:
    return all(
        not (
            k in limits and is_quantity(v) and is_quantity(limits[k]) and quantity_value(v) > quantity_value(limits[k])
        )
        for k, v in requests.items()
    )


def _pool_rule(pool: str) -> Rule:
    return Rule(
        s.InferenceServiceSpec,
        f"!has(self.pools.{pool}) || {_cel_not_above(_pool_layers(pool), pool, BASE_KEYS)}",
        f"pools.{pool}: a container request is above its limit once spec.resources (cpu and memory are "
        f"request and limit), pools.{pool}.resources, spec.pod.resources and pools.{pool}.pod.resources are "
        "merged per resource name: raise the limit in pod.resources.limits or lower the request",
        lambda x: getattr(x.pools, pool) is None or not_above(*effective(x, pool)),
        f".pools.{pool}",
    )


def _extended_pairs_ok(r: p.ContainerResources) -> bool:
    return all("/" not in n or (n in r.limits and str(r.limits[n]) == str(v)) for n, v in r.requests.items())


def _pools_pods(x: s.InferenceServiceSpec) -> list[tuple[p.PoolPodOverrides, list[str]]]:
    """spec.pod and each pool's pod, with the DRA claim names the engine container may use there."""
    own = [c.name for c in x.pod.resource_claims]
    out: list[tuple[p.PoolPodOverrides, list[str]]] = [(x.pod, own)]
    for pool in (x.pools.unified, x.pools.prefill, x.pools.decode):
        if pool is not None and pool.pod is not None:
            out.append((pool.pod, own + [c.name for c in pool.pod.resource_claims]))
    return out


def _claims_ok(x: s.InferenceServiceSpec) -> bool:
    return all(c.name in names for pod, names in _pools_pods(x) if pod.resources for c in pod.resources.claims)


def _accelerator_not_overridden(x: s.InferenceServiceSpec) -> bool:
    gpu = x.accelerator_resource()
    return all(
        gpu not in pod.resources.requests and gpu not in pod.resources.limits
        for pod, _ in _pools_pods(x)
        if pod.resources is not None
    )


def _cel_pool_pods(check: Callable[[str, str], str]) -> str:
    """`check(pod, claimed)` for spec.pod and every pool's pod: `pod` is its CEL path, `claimed` a CEL test that
    the claim named `c.name` is declared where that pod may use it (its own resourceClaims or spec.pod's)."""
    own = "self.pod.resourceClaims.exists(r, r.name == c.name)"
    parts = [f"({check('self.pod', own)})"]
    for pool in s.POOL_NAMES:
        at = f"self.pools.{pool}.pod"
        claimed = f"({at}.resourceClaims.exists(r, r.name == c.name) || {own})"
        parts.append(f"(!has(self.pools.{pool}) || !has({at}) || ({check(at, claimed)}))")
    return " && ".join(parts)


def _cel_claims(pod: str, claimed: str) -> str:
    return f"!has({pod}.resources) || {pod}.resources.claims.all(c, {claimed})"


_CEL_GPU = f"(has(self.accelerator) ? self.accelerator.resourceName : '{p.DEFAULT_ACCELERATOR}')"


def _cel_no_gpu(pod: str, _: str) -> str:
    return f"!has({pod}.resources) || !({_CEL_GPU} in {pod}.resources.requests || {_CEL_GPU} in {pod}.resources.limits)"


_ROUTER_DEFAULTS = ", ".join(
    f"{kind} {k}={v}" for kind, values in p.ROUTER_RESOURCES.items() for k, v in values.items()
)
RESOURCE_RULES: tuple[Rule, ...] = (
    *(_pool_rule(pool) for pool in s.POOL_NAMES),
    Rule(
        p.ContainerResources,
        "self.requests.all(r, !r.contains('/') || "
        "(r in self.limits && string(self.requests[r]) == string(self.limits[r])))",
        "pod.resources: an extended resource (a name with '/') cannot be overcommitted: set it in limits (the "
        "request follows), or give the same value in requests and limits",
        _extended_pairs_ok,
        ".requests",
    ),
    Rule(
        p.Accelerator,
        f"!self.resourceName.contains('{p.NATIVE_RESOURCE_DOMAIN}')",
        f"accelerator.resourceName must be an extended resource outside {p.NATIVE_RESOURCE_DOMAIN} "
        "(e.g. nvidia.com/gpu, amd.com/gpu, nvidia.com/mig-1g.10gb)",
        lambda a: p.is_extended_resource(a.resource_name),
        ".resourceName",
    ),
    Rule(
        s.InferenceServiceSpec,
        _cel_pool_pods(_cel_no_gpu),
        "pod.resources must not set spec.accelerator.resourceName: its count follows resources.gpusPerReplica and "
        "parallelism (tensor GPUs per pod)",
        _accelerator_not_overridden,
        ".pod",
    ),
    Rule(
        s.InferenceServiceSpec,
        _cel_pool_pods(_cel_claims),
        "pod.resources.claims must name a pod.resourceClaims entry (spec.pod's, or for a pool's pod, its own or "
        "spec.pod's)",
        _claims_ok,
        ".pod",
    ),
    Rule(
        sc.PodResourceClaim,
        "has(self.resourceClaimName) != has(self.resourceClaimTemplateName)",
        "pod.resourceClaims entries need exactly one of resourceClaimName, resourceClaimTemplateName",
        lambda c: (c.resource_claim_name is None) != (c.resource_claim_template_name is None),
    ),
    Rule(
        s.RouterSpec,
        _cel_not_above([("has(self.resources)", "self.resources")], p.ROUTER_RESOURCES, BASE_KEYS),
        f"router.resources: a request is above its limit (the router's defaults, replaced per resource name: "
        f"{_ROUTER_DEFAULTS}): set the limit as well, or lower the request",
        lambda r: not_above(*router_effective(r)),
        ".resources",
    ),
)
