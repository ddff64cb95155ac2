"""One spec view for every reader: a spec that sets nothing gets the API's defaults in the view, in every child the
builders render and in the autoscaler's config; spec.replicas means the same to all of them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tidepool.contract.serve_flags import FLAGS
from tidepool.engine.server.cli import build_parser
from tidepool.operator.api import (
    DEFAULT_ENGINE_IMAGE,
    AutoscalingSpec,
    EngineSpec,
    InferenceServiceSpec,
    PoolSpec,
    RolloutSpec,
    RouterSpec,
    ServiceView,
    SpecError,
    serve_flag_fields,
)
from tidepool.operator.api.spec import Resources
from tidepool.operator.autoscaler import handlers
from tidepool.operator.autoscaler.config import config_from_view
from tidepool.operator.autoscaler.policy_types import AutoscaleConfig, PoolBounds
from tidepool.operator.builders import ClusterFeatures, desired_state
from tidepool.operator.builders.engine import DRAIN_MARGIN_S, PRESTOP_SLEEP_S

MINIMAL: dict[str, Any] = {"model": {"uri": "hf://org/model"}}  # the one required field


def by_name(children: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == kind and c["metadata"]["name"] == name)


def test_the_wire_dict_and_the_model_give_one_view() -> None:
    from_dict = ServiceView.from_spec(MINIMAL)
    from_model = ServiceView.from_spec(InferenceServiceSpec.model_validate(MINIMAL))
    assert from_dict == from_model
    assert ServiceView.from_spec(from_dict) is from_dict


def test_every_field_omitted_yields_the_documented_defaults_in_the_view() -> None:
    """The defaults the CRD documents, written out by hand: a changed default must be a deliberate edit here."""
    view = ServiceView.from_spec(MINIMAL)
    (pool,) = view.pools.values()
    assert (view.mode, view.scaled_pool, view.pool_names) == ("unified", "unified", ("unified",))
    assert (pool.name, pool.is_scaled) == ("unified", True)
    assert (pool.replicas, pool.min_replicas, pool.max_replicas) == (1, 1, 4)
    assert pool.resources == Resources(gpus_per_replica=1, gpu_product=None, cpu=None, memory=None)
    assert (view.parallelism.tensor, view.parallelism.pipeline) == (1, 1)
    assert (view.router.enabled, view.router.replicas, view.router.policy) == (True, None, "prefix-aware")
    assert view.spec.router_replicas() == 1  # automatic: one pool replica and no autoscaler
    assert (view.rollout.max_surge, view.rollout.max_unavailable) == (1, 0)
    assert (view.quantization, view.model.revision, view.engine.image) == (None, None, None)
    assert (view.engine.max_num_seqs, view.engine.drain_timeout_seconds) == (256, 30)
    assert (view.autoscaling.enabled, view.autoscaling.mode, view.is_autoscaled) == (False, "active", False)
    assert view.declared_replicas == {"unified": 1}


@pytest.mark.parametrize(
    ("autoscaling", "ticks"),
    [
        ({"enabled": True}, True),
        ({"enabled": True, "mode": "advisory"}, True),
        ({"mode": "active"}, False),
        ({"enabled": True, "mode": "external"}, False),
    ],
    ids=["enabled", "advisory", "disabled", "external"],
)
def test_the_autoscaler_ticks_only_when_enabled_and_not_external(autoscaling: dict[str, Any], ticks: bool) -> None:
    assert ServiceView.from_spec({**MINIMAL, "replicas": 1, "autoscaling": autoscaling}).is_autoscaled is ticks


def test_the_name_is_checked_when_the_view_comes_from_an_object() -> None:
    body = {"metadata": {"name": "x" * 60}, "spec": MINIMAL}
    ServiceView.from_spec(MINIMAL)  # the spec alone is fine
    with pytest.raises(SpecError):
        ServiceView.from_body(body)


def test_every_field_omitted_yields_the_api_defaults_in_every_child() -> None:
    children = desired_state("svc", "ns", ServiceView.from_spec(MINIMAL)).children
    engine = by_name(children, "Deployment", "svc-unified")
    router = by_name(children, "Deployment", "svc-router")
    pod = engine["spec"]["template"]["spec"]
    assert engine["spec"]["replicas"] == PoolSpec().replicas
    rollout = RolloutSpec()
    assert engine["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": rollout.max_surge,
        "maxUnavailable": rollout.max_unavailable,
    }
    parsed = build_parser().parse_args(pod["containers"][0]["args"])
    defaults = EngineSpec()
    for field, flag in serve_flag_fields().items():
        # The API's default, rendered by the builder and read back by the engine, is the engine's own default.
        assert getattr(parsed, FLAGS[flag].dest) == getattr(defaults, field) == FLAGS[flag].default, flag
    grace = PRESTOP_SLEEP_S + defaults.drain_timeout_seconds + DRAIN_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] == grace
    assert defaults.image is None  # the operator's default engine image applies
    assert pod["containers"][0]["image"] == ClusterFeatures().engine_image == DEFAULT_ENGINE_IMAGE
    assert RouterSpec().replicas is None and router["spec"]["replicas"] == 1  # automatic (spec.router_replicas)
    router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router_args[router_args.index("--policy") + 1] == RouterSpec().policy


def test_every_field_omitted_yields_the_api_defaults_in_the_autoscaler() -> None:
    config = config_from_view(ServiceView.from_spec(MINIMAL))
    api = AutoscalingSpec()
    assert config.pools == {"unified": PoolBounds(PoolSpec().min_replicas, PoolSpec().max_replicas)}
    assert config.is_advisory == (api.mode == "advisory")
    assert (config.ttft_p95_s, config.itl_p95_s) == (None, None)
    assert config.kv_cache_target == api.kv_cache_target
    assert config.queue_depth_target == api.queue_depth_target
    assert (config.scale_to_zero, config.idle_seconds) == (api.scale_to_zero.enabled, api.scale_to_zero.idle_seconds)
    assert (config.up_seconds, config.down_seconds) == (api.stabilization.up_seconds, api.stabilization.down_seconds)
    assert config.max_step_percent == api.max_step_percent
    assert (config.pd_ratio_min, config.pd_ratio_max) == (api.prefill_decode_ratio.min, api.prefill_decode_ratio.max)
    # The policy's own defaults (the simulator uses them) are the API's too: nothing was copied by hand.
    assert AutoscaleConfig(pools=config.pools) == config
    assert ServiceView.from_spec(MINIMAL).is_autoscaled is api.enabled


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({**MINIMAL, "pools": {"unified": {"replicas": 2, "maxReplicas": 6}}}, {"unified": 2}),
        ({**MINIMAL, "replicas": 3, "pools": {"unified": {"replicas": 2, "maxReplicas": 6}}}, {"unified": 3}),
        (
            {**MINIMAL, "mode": "disaggregated", "replicas": 4, "pools": {"prefill": {}, "decode": {"maxReplicas": 8}}},
            {"prefill": 1, "decode": 4},
        ),
    ],
    ids=["pool-replicas", "spec-replicas-wins", "spec-replicas-is-decodes"],
)
def test_spec_replicas_means_the_same_to_every_reader(spec: dict[str, Any], expected: dict[str, int]) -> None:
    view = ServiceView.from_spec(spec)
    assert view.declared_replicas == expected
    desired = desired_state("svc", "ns", view)
    children = desired.children
    assert {pool: by_name(children, "Deployment", f"svc-{pool}")["spec"]["replicas"] for pool in expected} == expected
    assert {layout.name: layout.desired for layout in desired.pools} == expected

    body = {"metadata": {"namespace": "ns", "name": "svc"}, "spec": spec, "status": {}}
    autoscaler = handlers.Autoscaler(None, lambda namespace, name: [], None, None, interval_s=15, window_s=60)
    states = autoscaler._current(("ns", "svc"), view, body)
    assert {pool: state.replicas for pool, state in states.items()} == expected  # the autoscaler's starting point


def test_a_spec_breaking_a_rule_is_a_spec_error_and_a_bad_shape_a_validation_error() -> None:
    with pytest.raises(SpecError, match="minReplicas must not exceed maxReplicas"):
        ServiceView.from_spec({**MINIMAL, "pools": {"unified": {"minReplicas": 5, "replicas": 5, "maxReplicas": 4}}})
    with pytest.raises(ValidationError):
        ServiceView.from_spec({**MINIMAL, "engine": {"maxNumSeqs": 0}})


def test_the_view_owns_its_copy() -> None:
    spec = InferenceServiceSpec.model_validate({**MINIMAL, "engine": {"maxNumSeqs": 8}})
    view = ServiceView.from_spec(spec)
    spec.engine.max_num_seqs = 64
    assert view.engine.max_num_seqs == 8


def test_pool_resources_apply_the_pools_overrides() -> None:
    spec = {
        **MINIMAL,
        "mode": "disaggregated",
        "resources": {"gpusPerReplica": 1, "cpu": "4", "memory": "16Gi", "gpuProduct": "A"},
        "pools": {"prefill": {"resources": {"cpu": "8", "gpuProduct": "B"}}, "decode": {}},
    }
    view = ServiceView.from_spec(spec)
    assert (view.pools["prefill"].resources.cpu, view.pools["prefill"].resources.gpu_product) == ("8", "B")
    assert view.pools["prefill"].resources.memory == "16Gi"
    assert (view.pools["decode"].resources.cpu, view.pools["decode"].resources.gpu_product) == ("4", "A")
