"""The one view of a validated InferenceService spec that the builders and the autoscaler read.

`ServiceView.from_spec(spec)` takes an `InferenceServiceSpec`, or a wire dict that it validates
into one first, so every default comes from the pydantic models (and, for engine settings, from
the engine's flag table behind them) and from nowhere else. It refuses a spec that breaks a
cross-field rule (`validate_spec`, the CRD's CEL mirror) with `SpecError`. `ServiceView.from_body(body)`
does the same for an API object, its metadata.name checked too: the controller parses each
InferenceService once per sync this way and hands the view to the autoscaler and the builders.

The view keeps the spec's own models (`view.engine`, `view.pod`, `view.autoscaling`, ...), so a
field added to the API is visible to every reader without being copied, and derives once what
several readers need: per pool the declared replicas under the scale contract (`spec.replicas`
wins for the scaled pool), the autoscaler bounds, and `spec.resources` with the pool's overrides
applied.

Invariants: no defaults of its own; pure (no client, no clock, no I/O); the view owns a deep copy
of the spec, which nobody mutates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidepool.operator.api.gateway import InferencePoolSpec
from tidepool.operator.api.lora import LoraSpec
from tidepool.operator.api.model import ModelCache, ModelSource
from tidepool.operator.api.pod import PodOverrides
from tidepool.operator.api.rules import validate_spec
from tidepool.operator.api.spec import (
    AutoscalingSpec,
    EngineSpec,
    InferenceServiceSpec,
    Parallelism,
    Resources,
    RolloutSpec,
    RouterSpec,
)


class SpecError(ValueError):
    """A spec that can never be reconciled; the message says which field to change."""


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool as every reader sees it."""

    name: str  # "unified" | "prefill" | "decode"
    replicas: int  # declared replicas (before any autoscaler decision); spec.replicas wins for the scaled pool
    min_replicas: int
    max_replicas: int
    resources: Resources  # spec.resources with this pool's overrides applied
    is_scaled: bool  # the pool the scale subresource (spec.replicas, HPA, KEDA) controls


@dataclass(frozen=True, slots=True)
class ServiceView:
    """A validated spec plus what is derived from it; see the module docstring."""

    spec: InferenceServiceSpec
    pools: Mapping[str, PoolView]  # in `pool_names` order

    @staticmethod
    def from_body(body: Mapping[str, Any]) -> ServiceView:
        """The view of an InferenceService object's spec, its name checked too (the reconcile's parse)."""
        return ServiceView.from_spec(body.get("spec") or {}, name=body["metadata"]["name"])

    @staticmethod
    def from_spec(spec: InferenceServiceSpec | Mapping[str, Any] | ServiceView, name: str | None = None) -> ServiceView:
        """The view of a spec; raises pydantic.ValidationError (shapes) or SpecError (cross-field rules, and the
        length of `name` when given)."""
        if isinstance(spec, ServiceView):
            return spec
        if isinstance(spec, InferenceServiceSpec):
            model = spec.model_copy(deep=True)
        else:
            model = InferenceServiceSpec.model_validate(dict(spec))
        problems = validate_spec(model, name)
        if problems:
            raise SpecError("; ".join(problems))
        pools = {}
        for name in model.pool_names():
            pool = model.pool(name)
            pools[name] = PoolView(
                name=name,
                replicas=model.pool_replicas(name),
                min_replicas=pool.min_replicas,
                max_replicas=pool.max_replicas,
                resources=model.pool_resources(name),
                is_scaled=name == model.scaled_pool(),
            )
        return ServiceView(spec=model, pools=pools)

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def pool_names(self) -> tuple[str, ...]:
        return self.spec.pool_names()

    @property
    def scaled_pool(self) -> str:
        return self.spec.scaled_pool()

    @property
    def model(self) -> ModelSource:
        return self.spec.model

    @property
    def engine(self) -> EngineSpec:
        return self.spec.engine

    @property
    def parallelism(self) -> Parallelism:
        return self.spec.parallelism

    @property
    def resources(self) -> Resources:
        return self.spec.resources

    @property
    def router(self) -> RouterSpec:
        return self.spec.router

    @property
    def autoscaling(self) -> AutoscalingSpec:
        return self.spec.autoscaling

    @property
    def rollout(self) -> RolloutSpec:
        return self.spec.rollout

    @property
    def pod(self) -> PodOverrides:
        return self.spec.pod

    @property
    def model_cache(self) -> ModelCache | None:
        return self.spec.model_cache

    @property
    def inference_pool(self) -> InferencePoolSpec | None:
        return self.spec.inference_pool

    @property
    def lora(self) -> LoraSpec | None:
        return self.spec.lora

    @property
    def quantization(self) -> str | None:
        """The engine's --quantization: None for "none"."""
        return None if self.spec.model.quantization == "none" else self.spec.model.quantization

    @property
    def sparsity(self) -> str | None:
        """The engine's --sparsity: None for "none"."""
        return None if self.spec.model.sparsity == "none" else self.spec.model.sparsity

    @property
    def is_autoscaled(self) -> bool:
        """Tidepool's autoscaler ticks for it: autoscaling enabled in active or advisory mode (in external
        mode HPA/KEDA drive the scale subresource)."""
        return self.spec.autoscaling.enabled and self.spec.autoscaling.mode != "external"

    @property
    def declared_replicas(self) -> dict[str, int]:
        """Replicas per pool as the spec declares them (the scale contract applied)."""
        return {name: pool.replicas for name, pool in self.pools.items()}
