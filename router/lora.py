"""LoRA affinity: which replicas hold which adapters, and which of them may serve a request. Pure code.

The health checker reads each ready replica's `GET /v1/models` on every probe (the same loop that
scrapes its load) and keeps a `ReplicaModels`: the base model ids (entries without a `parent`) and
the adapters (entries whose `parent` is set, vLLM's shape). `/v1/models` is the engine's registry,
so it is the source: `vllm:lora_requests_info` lists only the adapters of running and waiting
requests (not the idle ones a replica holds), and still lists an adapter unloaded while its last
requests finish.

A request is an adapter request when its `model` is set, at least one replica of the pool has told
its models, and no replica of the pool lists that name as a base model. For such a request
`adapter_holders` gives the replicas that list the adapter; the pool then chooses among the ready
ones (an affinity hit, by the usual prefix/load rules) or, when none holds it, among all ready ones
by load (a miss). The router never answers 404 for a name itself: the engine is the authority (an
adapter loaded a moment ago is served, one unloaded a moment ago is refused with its own
OpenAI-shaped 404 `model_not_found`, relayed), whatever the age of the router's view.

Invariants: a replica whose models are unknown (`None`: not scraped yet, or `/v1/models` failed)
holds no adapter and makes no name a base model; a base-model request (or one without `model`)
is routed exactly as without LoRA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class ReplicaModels:
    base_ids: frozenset[str]  # ids of /v1/models entries without a parent: the served base model(s)
    adapters: frozenset[str]  # ids of entries with a parent: the LoRA adapters the replica holds


def parse_models(body: Any) -> ReplicaModels | None:
    """A replica's models from its `/v1/models` JSON (OpenAI's list, vLLM's `parent`); None if not that shape."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return None
    base_ids: set[str] = set()
    adapters: set[str] = set()
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        (adapters if entry.get("parent") else base_ids).add(entry["id"])
    return ReplicaModels(frozenset(base_ids), frozenset(adapters))


def adapter_holders(model: Any, known: Mapping[str, ReplicaModels | None]) -> frozenset[str] | None:
    """The replicas (URL keys of `known`) holding adapter `model`; None when `model` is not an adapter request."""
    if not isinstance(model, str) or not model:
        return None
    told = [models for models in known.values() if models is not None]
    if not told or any(model in models.base_ids for models in told):
        return None
    return frozenset(url for url, models in known.items() if models is not None and model in models.adapters)


def merge_model_lists(bodies: list[Any]) -> dict[str, Any] | None:
    """One `/v1/models` answer from several replicas': every id once, in first-seen order; None if none parsed."""
    merged: dict[str, Any] = {}
    is_parsed = False
    for body in bodies:
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list):
            continue
        is_parsed = True
        for entry in data:
            if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                merged.setdefault(entry["id"], entry)
    return {"object": "list", "data": list(merged.values())} if is_parsed else None
