"""spec.lora in the pure parts: what the pods get (and that the adapter list never reaches the template), the
lora_path of each source, the per-replica plan, status.lora, the Degraded condition and the status write."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidepool.contract.lora import LORA_DIR_ENV, parse_source_uri, source_uri
from tidepool.contract.serve_flags import render_args
from tidepool.operator.api import InferenceServiceStatus
from tidepool.operator.builders import ClusterFeatures, ServiceView, desired_state
from tidepool.operator.builders.lora import LORA_DIR, LORA_GATE, adapter_path, declared_adapters, lora_flags
from tidepool.operator.lora.plan import Attempt, ReplicaView, failure_messages, is_settled, lora_status, plan_replica
from tidepool.operator.status import Outcome, build_status
from tidepool.operator.status_write import is_routine, status_patch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BASE: dict[str, Any] = {
    "model": {"uri": "hf://org/base"},
    "resources": {"gpusPerReplica": 1},
    "pools": {"unified": {"replicas": 2}},
}
LORA: dict[str, Any] = {
    "adapters": [
        {"name": "sql", "source": "hf://org/sql", "revision": "v1"},
        {"name": "chat", "source": "hf://org/chat"},
    ],
    "maxAdapters": 2,
    "maxRank": 64,
    "maxCpuAdapters": 8,
    "credentials": {"secretName": "hub"},
}


def with_lora(lora: dict[str, Any] | None, base: dict[str, Any] = BASE) -> dict[str, Any]:
    out = copy.deepcopy(base)
    if lora is not None:
        out["lora"] = lora
    return out


def engine_pod(spec: dict[str, Any]) -> dict[str, Any]:
    children = desired_state("svc", "ns", ServiceView.from_spec(spec), ClusterFeatures()).children
    deployment = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "svc-unified")
    return deployment["spec"]["template"]


def test_the_adapter_list_never_reaches_the_pod_template() -> None:
    """Adding, removing or changing adapters leaves the template (and its spec-hash) alone: no restarts."""
    one = engine_pod(with_lora(LORA))
    for adapters in ([], LORA["adapters"][:1], [*LORA["adapters"], {"name": "new", "source": "hf://org/new"}]):
        other = engine_pod(with_lora({**LORA, "adapters": adapters}))
        assert other == one


def test_a_service_without_lora_keeps_its_template() -> None:
    plain = engine_pod(BASE)
    assert "readinessGates" not in plain["spec"]
    assert not any(a.startswith("--enable-lora") for a in plain["spec"]["containers"][0]["args"])
    assert engine_pod(with_lora(LORA)) != plain  # the settings do change it (a rollout once, when LoRA is enabled)


def test_the_pods_get_the_flags_env_and_readiness_gate() -> None:
    pod = engine_pod(with_lora(LORA))
    container = pod["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--max-loras") + 1] == "2"
    assert args[args.index("--max-lora-rank") + 1] == "64"
    assert args[args.index("--max-cpu-loras") + 1] == "8"
    assert "--enable-lora" in args and "--allow-runtime-lora-updating" in args
    assert pod["spec"]["readinessGates"] == [{"conditionType": LORA_GATE}]
    env = {e["name"]: e for e in container["env"]}
    assert env[LORA_DIR_ENV]["value"] == LORA_DIR
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hub", "key": "HF_TOKEN", "optional": True}}
    aws_key = {"name": "hub", "key": "AWS_ACCESS_KEY_ID", "optional": True}  # the engine fetches s3:// adapters
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": aws_key}
    assert not any("value" in e and e["name"].startswith(("HF_TOKEN", "AWS_SECRET")) for e in container["env"])


def test_lora_flags_are_managed_flags() -> None:
    view = ServiceView.from_spec(with_lora(LORA))
    assert render_args(lora_flags(view), managed_only=True)  # raises for a flag the table does not mark managed


@pytest.mark.parametrize(
    ("base", "source", "path"),
    [
        (BASE, {"source": "hf://org/a"}, "hf://org/a"),
        (BASE, {"source": "hf://org/a", "revision": "refs/pr/1"}, "hf://org/a@refs/pr/1"),
        (BASE, {"source": "s3://bucket/adapters/a/"}, "s3://bucket/adapters/a"),
        (
            {**BASE, "model": {"uri": "pvc://weights/base"}},
            {"source": "pvc://weights/lora/a"},
            "/models/pvc/weights/lora/a",
        ),
        (
            {**BASE, "modelCache": {"persistentVolumeClaim": {"claimName": "cache"}}},
            {"source": "pvc://cache/adapters/a/"},
            "/models/adapters/a",
        ),
    ],
)
def test_adapter_path(base: dict[str, Any], source: dict[str, str], path: str) -> None:
    view = ServiceView.from_spec(with_lora({"adapters": [{"name": "a", **source}]}, base))
    assert view.lora is not None
    assert adapter_path(view, view.lora.adapters[0]) == path
    assert declared_adapters(view) == {"a": path}


@pytest.mark.parametrize(("uri", "revision"), [("hf://org/a", None), ("hf://org/a", "v2"), ("s3://bucket/p/q", None)])
def test_source_uri_round_trip(uri: str, revision: str | None) -> None:
    parsed = parse_source_uri(source_uri(uri, revision))
    assert parsed is not None
    assert (f"{parsed.scheme}://{parsed.location}", parsed.revision) == (uri, revision)
    assert parse_source_uri("/models/adapters/a") is None
    with pytest.raises(ValueError, match="lora_path"):
        parse_source_uri("ftp://x/y")


DECLARED = {"a": "hf://org/a", "b": "/models/b"}
PLAN_CASES = [
    # (held, attempts, now, expected unloads, expected loads)
    ({}, {}, 0.0, (), (("a", "hf://org/a"), ("b", "/models/b"))),
    ({"a": "hf://org/a", "b": "/models/b"}, {}, 0.0, (), ()),
    ({"a": "/cache/a", "b": "/models/b", "gone": "/x"}, {}, 0.0, ("gone",), ()),  # a fetched copy's root differs
    ({"a": "hf://org/a", "b": "/models/old-b"}, {}, 0.0, ("b",), (("b", "/models/b"),)),  # a folder: compared
    ({"b": "/models/b"}, {"a": Attempt("hf://org/a", "Loading")}, 0.0, (), ()),
    ({"b": "/models/b"}, {"a": Attempt("hf://org/a", "Failed", "bad rank", 10.0)}, 60.0, (), ()),
    ({"b": "/models/b"}, {"a": Attempt("hf://org/a", "Failed", "bad rank", 10.0)}, 200.0, (), (("a", "hf://org/a"),)),
    ({"b": "/models/b"}, {"a": Attempt("hf://org/old", "Failed", "x", 10.0)}, 11.0, (), (("a", "hf://org/a"),)),
    ({"a": "/c/a", "b": "/models/b"}, {"a": Attempt("hf://org/old", "Ready")}, 0.0, ("a",), (("a", "hf://org/a"),)),
]


@pytest.mark.parametrize(("held", "attempts", "now", "unloads", "loads"), PLAN_CASES)
def test_plan_replica(held, attempts, now, unloads, loads) -> None:  # type: ignore[no-untyped-def]
    plan = plan_replica(DECLARED, held, attempts, now, retry_s=120.0)
    assert (plan.unloads, plan.loads) == (unloads, loads)


def test_a_list_older_than_a_finished_load_does_not_reload_it() -> None:
    attempts = {"a": Attempt("hf://org/a", "Ready", "", at=5.0)}
    held = {"b": "/models/b"}  # "a" missing
    assert plan_replica(DECLARED, held, attempts, 9.0, 120.0, listed_at=3.0).loads == ()  # asked before it ended
    assert plan_replica(DECLARED, held, attempts, 9.0, 120.0, listed_at=6.0).loads == (("a", "hf://org/a"),)


def test_a_replica_settles_when_every_adapter_was_tried() -> None:
    assert not is_settled(DECLARED, {"b": "/models/b"}, {"a": Attempt("hf://org/a", "Loading")})
    assert is_settled(DECLARED, {"b": "/models/b"}, {"a": Attempt("hf://org/a", "Failed", "rank 64 > 16")})
    assert not is_settled(DECLARED, {"b": "/models/b"}, {"a": Attempt("hf://org/old", "Failed", "x")})
    assert is_settled(DECLARED, {"a": "x", "b": "/models/b"}, {})


def test_status_per_pool() -> None:
    replicas = [
        ReplicaView("p0", "prefill", {"a": "hf://org/a"}),
        ReplicaView("d0", "decode", {"a": "hf://org/a"}),
        ReplicaView("d1", "decode", {}, {"a": Attempt("hf://org/a", "Loading")}),
        ReplicaView("d2", "decode", None),  # did not answer its list
    ]
    (a,) = lora_status({"a": "hf://org/a"}, ("prefill", "decode"), replicas)
    assert a.state == "Loading"
    prefill, decode = a.pools
    assert (prefill.state, prefill.ready_replicas, prefill.replicas, prefill.held_by) == ("Ready", 1, 1, ["p0"])
    assert (decode.state, decode.ready_replicas, decode.replicas, decode.held_by) == ("Loading", 1, 3, ["d0"])
    assert decode.message == "loading on 2 of 3 replicas; not answering: d2"
    assert failure_messages([a]) == []


def test_a_failed_adapter_degrades_the_service_but_not_its_readiness() -> None:
    replicas = [ReplicaView("u0", "unified", {}, {"a": Attempt("hf://org/a", "Failed", "rank 64 > max 16")})]
    adapters = lora_status({"a": "hf://org/a", "b": "/m/b"}, ("unified",), replicas)
    assert [x.state for x in adapters] == ["Failed", "Loading"]
    failures = failure_messages(adapters)
    assert failures == ["LoRA adapter 'a' failed to load (unified): pod u0: rank 64 > max 16"]
    previous = InferenceServiceStatus()
    status = build_status(previous, 1, [], None, Outcome(adapter_failures=failures), "http://x", None, None, "now")
    degraded, ready = status.condition("Degraded"), status.condition("Ready")
    assert degraded is not None and ready is not None
    assert (degraded.status, degraded.reason) == ("True", "AdapterLoadFailed")
    assert "rank 64 > max 16" in degraded.message
    assert ready.status == "True"  # no pools to wait for here: the failure alone does not take it down
    assert lora_status({"a": "x"}, ("unified",), [])[0].state == "Pending"


def test_status_lora_is_written_and_an_adapter_state_change_is_a_transition() -> None:
    loading = lora_status({"a": "p"}, ("unified",), [ReplicaView("u0", "unified", {})])
    ready = lora_status({"a": "p"}, ("unified",), [ReplicaView("u0", "unified", {"a": "p"})])
    before = InferenceServiceStatus(lora=loading)
    after = InferenceServiceStatus(lora=ready)
    patch = status_patch(before, after)
    assert patch is not None and patch["lora"][0]["state"] == "Ready"
    assert not is_routine(before, after)
    cleared = status_patch(after, InferenceServiceStatus())  # spec.lora removed
    assert cleared is not None and cleared["lora"] is None


def test_the_example_is_valid_and_builds() -> None:
    body = yaml.safe_load((EXAMPLES / "inferenceservice-lora.yaml").read_text())
    view = ServiceView.from_body(body)
    assert view.lora is not None and len(view.lora.adapters) == 2
    assert declared_adapters(view) == {
        "sql-assistant": "hf://my-org/smollm2-sql-lora@v1",
        "support-bot": "hf://my-org/smollm2-support-lora",
    }
    assert desired_state(body["metadata"]["name"], "ns", view, ClusterFeatures()).children
