"""Applying `spec.pod`, `pools.<name>.pod` and the router's fields to the pod templates the builders render.

What lands where is documented in api/pod.py (the API's own description); this module is its one
implementation:
- `pool_pod(view, pool)`: spec.pod with the pool's `pod` merged over it. Maps merge (the pool's key wins);
  lists append, except lists of named entries (env, volumes, imagePullSecrets by name; volumeMounts by
  mountPath), where the pool's entry replaces the global one of the same key in place; scalars replace;
  affinity merges per kind (the pool's nodeAffinity, podAffinity or podAntiAffinity replaces the global one);
  resources merge per key (requests and limits are maps).
- `apply_engine_pod(spec, container, pod, selector)`: the overrides the builders do not place themselves
  (scheduling, schedulerName, DRA resourceClaims; identity, labels and annotations they read from `pool_pod`).
- `container_resources(base, override)`: requests/limits per resource name, canonical quantities, and the DRA
  claims of the engine container.

Invariants: pure. An override never reaches the security contexts (the API has no field for them) nor
the operator's own env, volumes and mounts: rules.py refuses those names at admission, and `ServiceView`
refuses them again before any builder runs; explicit env (the operator's included) wins over envFrom.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tidepool.operator.api.pod import ContainerResources, EngineResources, PodOverrides, PoolPodOverrides
from tidepool.operator.api.quantity import canonical_quantity
from tidepool.operator.api.scheduling import Affinity
from tidepool.operator.api.view import ServiceView

# Lists of named entries: merged by this key (snake_case attribute), the rest append.
KEYED_LISTS: dict[str, str] = {
    "env": "name",
    "volumes": "name",
    "image_pull_secrets": "name",
    "volume_mounts": "mount_path",
    "resource_claims": "name",
}


def _prune(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _prune(v) for k, v in node.items() if v is not False and v != ""}
    if isinstance(node, list):
        return [_prune(v) for v in node]
    return node


def wire(model: BaseModel) -> dict[str, Any]:
    """A Kubernetes-shaped model as the API server stores it, so that what the operator applies and what it
    reads back compare equal: unset fields, empty lists and maps, `false` and `""` left out (Kubernetes
    omits them: each means the same as unset); an empty volume source stays `{}`."""
    return _prune(model.model_dump(by_alias=True, exclude_defaults=True, mode="json"))


def _merge_keyed(base: list[Any], over: list[Any], key: str) -> list[Any]:
    out = list(base)
    index = {getattr(item, key): i for i, item in enumerate(out)}
    for item in over:
        at = index.get(getattr(item, key))
        if at is None:
            index[getattr(item, key)] = len(out)
            out.append(item)
        else:
            out[at] = item
    return out


def _merge_resources(base: EngineResources | None, over: EngineResources) -> EngineResources:
    if base is None:
        return over
    return EngineResources(
        requests={**base.requests, **over.requests},
        limits={**base.limits, **over.limits},
        claims=_merge_keyed(base.claims, over.claims, "name"),
    )


def _merge_affinity(base: Affinity | None, over: Affinity) -> Affinity:
    if base is None:
        return over
    return base.model_copy(update={n: getattr(over, n) for n in Affinity.model_fields if getattr(over, n)})


def merge_pod(base: PodOverrides, over: PoolPodOverrides | None) -> PodOverrides:
    """`over` (a pool's overrides, or any PodOverrides) merged over `base` (see the module docstring); neither is
    changed. A field `over` has not (a pool declares no volumes) keeps `base`'s value."""
    if over is None:
        return base
    update: dict[str, Any] = {}
    for name in type(over).model_fields:
        mine, theirs = getattr(base, name), getattr(over, name)
        if theirs is None or theirs == [] or theirs == {}:
            continue
        if isinstance(theirs, dict):
            update[name] = {**mine, **theirs}
        elif name in KEYED_LISTS:
            update[name] = _merge_keyed(mine, theirs, KEYED_LISTS[name])
        elif isinstance(theirs, list):
            update[name] = [*mine, *theirs]
        elif isinstance(theirs, EngineResources):
            update[name] = _merge_resources(mine, theirs)
        elif isinstance(theirs, Affinity):
            update[name] = _merge_affinity(mine, theirs)
        else:
            update[name] = theirs
    return PodOverrides.model_validate({**base.model_dump(), **update})


def pool_pod(view: ServiceView, pool: str) -> PodOverrides:
    """The pod overrides of one pool: spec.pod with pools.<pool>.pod merged over it."""
    return merge_pod(view.pod, view.spec.pool(pool).pod)


def container_resources(base: dict[str, dict[str, str]], override: ContainerResources | None) -> dict[str, Any]:
    """`base` ({"requests": ..., "limits": ...}) with the override's entries replacing it per resource name, and
    the engine's DRA `claims` (sorted by name) when it names any. A request above its limit never gets here:
    api/resource_rules.py refuses the spec (at admission, and in the validation every ServiceView runs)."""
    requests, limits = dict(base.get("requests", {})), dict(base.get("limits", {}))
    out: dict[str, Any] = {}
    if override is not None:
        requests.update({k: canonical_quantity(v) for k, v in override.requests.items()})
        limits.update({k: canonical_quantity(v) for k, v in override.limits.items()})
        if isinstance(override, EngineResources) and override.claims:
            out["claims"] = sorted((wire(c) for c in override.claims), key=lambda c: (c["name"], c.get("request", "")))
    return {"requests": dict(sorted(requests.items())), "limits": dict(sorted(limits.items())), **out}


def _spread(constraint: dict[str, Any], selector: dict[str, str]) -> dict[str, Any]:
    if "labelSelector" not in constraint:  # unset: spread this pool's own pods
        constraint = {**constraint, "labelSelector": {"matchLabels": dict(sorted(selector.items()))}}
    return constraint


def apply_engine_pod(spec: dict[str, Any], container: dict[str, Any], pod: PodOverrides, selector: dict[str, str]):
    """Add the overrides to an engine pod `spec` and its engine `container` (both changed in place). env,
    envFrom and volumeMounts reach the model-download init containers too (a proxy, a CA bundle), except
    env names an init container sets itself (its credentials).

    `selector`: the pool's selector labels (the default labelSelector of a topology spread constraint).
    """
    if pod.env:  # after the operator's (sorted) env, in the user's order: $(VAR) may name an earlier entry
        container["env"] = [*container.get("env", []), *(wire(e) for e in pod.env)]
    if pod.env_from:
        container["envFrom"] = [*container.get("envFrom", []), *(wire(e) for e in pod.env_from)]
    if pod.volume_mounts:
        mounts = [*container.get("volumeMounts", []), *(wire(m) for m in pod.volume_mounts)]
        container["volumeMounts"] = sorted(mounts, key=lambda m: m["mountPath"])
    for init in spec.get("initContainers", []):  # the model download needs a proxy or a CA bundle too
        own = {e["name"] for e in init.get("env", [])}  # its credentials (secretKeyRef) stay as they are
        if env := [wire(e) for e in pod.env if e.name not in own]:
            init["env"] = [*init.get("env", []), *env]
        if pod.env_from:
            init["envFrom"] = [*init.get("envFrom", []), *(wire(e) for e in pod.env_from)]
        if pod.volume_mounts:
            mounts = [*init.get("volumeMounts", []), *(wire(m) for m in pod.volume_mounts)]
            init["volumeMounts"] = sorted(mounts, key=lambda m: m["mountPath"])
    if pod.volumes:
        volumes = [*spec.get("volumes", []), *(wire(v) for v in pod.volumes)]
        spec["volumes"] = sorted(volumes, key=lambda v: v["name"])
    if pod.image_pull_secrets:
        have = spec.get("imagePullSecrets", [])  # the builders' own (if any) first, no name twice
        spec["imagePullSecrets"] = have + [wire(s) for s in pod.image_pull_secrets if wire(s) not in have]
    if pod.runtime_class_name:
        spec["runtimeClassName"] = pod.runtime_class_name
    if pod.scheduler_name:
        spec["schedulerName"] = pod.scheduler_name
    if pod.resource_claims:
        spec["resourceClaims"] = sorted((wire(c) for c in pod.resource_claims), key=lambda c: c["name"])
    if pod.affinity is not None and wire(pod.affinity):
        spec["affinity"] = wire(pod.affinity)
    if pod.topology_spread_constraints:
        spec["topologySpreadConstraints"] = [_spread(wire(c), selector) for c in pod.topology_spread_constraints]
