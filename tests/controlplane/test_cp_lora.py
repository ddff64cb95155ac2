"""LoRA adapters declared in an InferenceService, on the real control plane, with real engines behind the pods.

An InferenceService with spec.lora runs two KWOK replicas; each pod is backed by a real `tidepool serve` on the
tiny model (--enable-lora --allow-runtime-lora-updating) through pod_engines.py, which the operator reaches via
TIDEPOOL_POD_URL_TEMPLATE (its production pod-IP resolver has nothing to reach on KWOK). Adapters are made with
`peft`. Checked, by spec edits alone: an adapter added is loaded on both replicas and status.lora says so; one
the engine refuses (rank above spec.lora.maxRank) is Failed in status.lora with the engine's reason and Degraded
says so, while the service stays Ready; adapters removed are unloaded, status.lora follows, and a request for a
removed adapter gets the engine's OpenAI-shaped 404 (through the openai SDK); and no engine pod restarts (pod
UIDs and the Deployment's template unchanged throughout). The operator runs with its production defaults.

KWOK marks every readiness gate True itself (its pod-ready stage), so the LoRA readiness gate is covered by the
unit tests (tests/operator/test_lora_sync.py), not here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from lora.lora_helpers import AdapterSpec, make_adapter
from operator_kit import OperatorIdentity, OperatorProcess, condition, get_isvc, is_ready, pods, wait_until
from pod_engines import PodEngines, pod_engines
from serve_proc import Server, start_server

from tidepool.operator.lora.client import URL_TEMPLATE_ENV

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(600)]
NAME = "lora-svc"
SOURCES = {"sql": "hf://test-org/sql-lora", "chat": "hf://test-org/chat-lora", "big": "hf://test-org/big-lora"}
SPECS = {
    "sql": AdapterSpec(8, ("q_proj", "v_proj")),
    "chat": AdapterSpec(4, ("o_proj", "down_proj")),
    "big": AdapterSpec(32, ("q_proj",)),  # above maxRank 16: the engines refuse it
}
SELECTOR = f"tidepool.dev/inferenceservice={NAME},tidepool.dev/pool=unified"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cp-lora-adapters")
    for seed, (name, spec) in enumerate(SPECS.items(), start=1):
        make_adapter(tiny_model_dir, root / name, spec, seed)
    return {SOURCES[name]: root / name for name in SPECS}


@pytest.fixture(scope="module")
def replica_engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    flags = [
        "--served-model-name",
        NAME,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "4",
        "--allow-runtime-lora-updating",
    ]  # fmt: skip  (what the builder renders)
    logs = tmp_path_factory.mktemp("cp-lora-engines")
    servers: list[Server] = []
    try:
        for _ in range(2):
            servers.append(start_server(tiny_model_dir, logs, *flags))
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def front(replica_engines: list[Server], adapter_dirs: dict[str, Path]) -> Iterator[PodEngines]:
    with pod_engines([s.url for s in replica_engines], adapter_dirs) as engines:
        yield engines


@pytest.fixture
def lora_operator(
    cp_namespace: str, identity: OperatorIdentity, front: PodEngines, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[OperatorProcess]:
    monkeypatch.setenv(URL_TEMPLATE_ENV, front.url + "/{namespace}/{pod}")
    running = OperatorProcess(identity.kubeconfig, [cp_namespace], tmp_path / "operator.log")
    running.start()
    yield running
    running.stop()
    forbidden = running.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


def isvc(adapters: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "tidepool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "hf://org/base"},
            "resources": {"gpusPerReplica": 1, "cpu": "1", "memory": "1Gi"},
            "pools": {"unified": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}},
            "lora": _lora(adapters),
        },
    }


def _lora(adapters: list[str]) -> dict[str, Any]:
    listed = [{"name": name, "source": SOURCES[name]} for name in adapters]
    return {"maxAdapters": 2, "maxRank": 16, "maxCpuAdapters": 4, "adapters": listed}


def set_adapters(cluster, namespace: str, adapters: list[str]) -> None:
    patch = json.dumps({"spec": {"lora": _lora(adapters)}})
    cluster.kubectl("patch", "inferenceservice", NAME, "-n", namespace, "--type", "merge", "-p", patch)


def lora_states(cluster, namespace: str) -> dict[str, tuple[str, int, int]] | None:
    """status.lora as {adapter: (state, replicas holding it, serving replicas)} once status is of this generation."""
    obj = get_isvc(cluster, namespace, NAME) or {}
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj.get("metadata", {}).get("generation"):
        return None
    return {
        a["name"]: (a["state"], a["pools"][0]["readyReplicas"], a["pools"][0]["replicas"])
        for a in status.get("lora") or []
    }


def wait_for_adapters(cluster, namespace: str, want: dict[str, tuple[str, int, int]]) -> dict[str, Any]:
    seen: list[Any] = [None]

    def matches() -> bool:
        seen[0] = lora_states(cluster, namespace)
        return seen[0] == want

    try:
        wait_until(matches, 180, f"status.lora == {want}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; status.lora was {seen[0]}") from None
    return get_isvc(cluster, namespace, NAME) or {}


def pod_uids(cluster, namespace: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, namespace, SELECTOR)}


def engine_adapters(server: Server) -> set[str]:
    data = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


def complete(front: PodEngines, namespace: str, pod: str, model: str) -> None:
    client = openai.OpenAI(base_url=front.pod_url(namespace, pod) + "/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    reply = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=2, temperature=0, extra_body=extra)
    assert reply.model == model and reply.choices[0].text


def test_adapters_follow_the_spec_without_restarting_pods(
    control_plane, cp_namespace: str, lora_operator: OperatorProcess, front: PodEngines, replica_engines: list[Server]
) -> None:
    cluster, ns = control_plane, cp_namespace
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(isvc(["sql"])))
    wait_for_adapters(cluster, ns, {"sql": ("Ready", 2, 2)})
    wait_until(lambda: is_ready(get_isvc(cluster, ns, NAME)), 120, "Ready")
    uids = pod_uids(cluster, ns)
    assert len(uids) == 2 and set(front.assigned) == {f"{ns}/{pod}" for pod in uids}
    template_hash = pods(cluster, ns, SELECTOR)[0]["metadata"]["labels"]["tidepool.dev/spec-hash"]
    assert all(engine_adapters(s) == {"sql"} for s in replica_engines)
    for pod in uids:
        complete(front, ns, pod, "sql")

    # Gain an adapter, and one the engines refuse: Degraded says why, the service keeps serving.
    set_adapters(cluster, ns, ["sql", "chat", "big"])
    obj = wait_for_adapters(cluster, ns, {"sql": ("Ready", 2, 2), "chat": ("Ready", 2, 2), "big": ("Failed", 0, 2)})
    degraded = wait_until(lambda: _degraded(cluster, ns), 60, "Degraded AdapterLoadFailed")
    assert "'big'" in degraded["message"] and "rank" in degraded["message"], degraded
    assert is_ready(get_isvc(cluster, ns, NAME))
    big = next(a for a in obj["status"]["lora"] if a["name"] == "big")["pools"][0]
    assert "rank" in big["message"] and big["heldBy"] == []
    assert all(engine_adapters(s) == {"sql", "chat"} for s in replica_engines)

    # Lose adapters: unloaded everywhere, status.lora follows, Degraded clears, a request for one is a 404.
    set_adapters(cluster, ns, ["chat"])
    wait_for_adapters(cluster, ns, {"chat": ("Ready", 2, 2)})
    wait_until(
        lambda: (condition(get_isvc(cluster, ns, NAME), "Degraded") or {}).get("status") == "False", 60, "not Degraded"
    )
    assert all(engine_adapters(s) == {"chat"} for s in replica_engines)
    for pod in uids:
        complete(front, ns, pod, "chat")
        complete(front, ns, pod, NAME)  # the base model
        with pytest.raises(openai.NotFoundError) as refused:
            complete(front, ns, pod, "sql")
        error = refused.value.response.json()["error"]
        assert error["code"] == "model_not_found" and "sql" in error["message"], error

    assert pod_uids(cluster, ns) == uids  # no engine pod was replaced
    assert {p["metadata"]["labels"]["tidepool.dev/spec-hash"] for p in pods(cluster, ns, SELECTOR)} == {template_hash}
    assert is_ready(get_isvc(cluster, ns, NAME))


def _degraded(cluster, namespace: str) -> dict[str, Any] | None:
    cond = condition(get_isvc(cluster, namespace, NAME), "Degraded")
    return cond if cond and cond["status"] == "True" and cond["reason"] == "AdapterLoadFailed" else None
