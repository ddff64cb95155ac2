"""The Helm chart offline: `helm lint`, `helm template`, least-privilege RBAC, restricted pod, values schema.

Needs only the helm binary that e2e/controlplane/build.sh builds (no cluster): marked `k8sbin`, so
scripts/test.sh runs it after that build, never in the first tier. Like the control-plane fixture,
a missing binary fails the test with the build command.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Histogram
from promql_kit import operator_samples, selected

from controlplane_fixture import load_devcluster
from tidepool.operator import metrics

pytestmark = pytest.mark.k8sbin

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tidepool"
ALLOWED_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


@pytest.fixture(scope="module")
def helm() -> str:
    devcluster = load_devcluster()
    try:
        return str(devcluster.find_bin_dir() / "helm")
    except devcluster.BinariesMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


def _helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {out.stderr}")
    return out


def render(helm: str, *sets: str, namespace: str = "tidepool-system") -> list[dict[str, Any]]:
    args = ["template", "tp", str(CHART), "--namespace", namespace]
    for item in sets:
        args += ["--set", item]
    return [d for d in yaml.safe_load_all(_helm(helm, *args).stdout) if d]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_lint_is_clean(helm: str) -> None:
    out = _helm(helm, "lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out.stdout


def test_template_renders_the_operator_with_standard_labels(helm: str) -> None:
    docs = render(helm)
    kinds = ["ClusterRole"] * 4  # the operator's, the routers' and the tenants' edit and view (test_chart_rbac.py)
    kinds += ["ClusterRoleBinding", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    assert sorted(d["kind"] for d in docs) == kinds
    for doc in docs:
        labels = doc["metadata"]["labels"]
        for key in ("name", "instance", "version", "managed-by", "part-of", "component"):
            assert f"app.kubernetes.io/{key}" in labels, (doc["kind"], key)
    # The CRD ships in the chart's crds/ folder (installed by helm, never templated).
    assert (CHART / "crds" / "tidepool.dev_inferenceservices.yaml").is_file()


def test_operator_pod_is_restricted_and_probed(helm: str) -> None:
    (deployment,) = _by_kind(render(helm), "Deployment")
    # Two replicas behind a Lease: upgrades roll (the new pod starts as a stand-by first).
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (single,) = _by_kind(render(helm, "leaderElection.enabled=false", "replicaCount=1"), "Deployment")
    assert single["spec"]["strategy"] == {"type": "Recreate"}  # never two unelected operators at once
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]


def test_operator_args_parse_with_the_real_cli(helm: str) -> None:
    from tidepool.cli import build_parser as tidepool_parser
    from tidepool.operator.main import build_parser as operator_parser

    for sets, namespaces in (((), []), (("watchNamespaces={team-a,team-b}",), ["team-a", "team-b"])):
        (deployment,) = _by_kind(render(helm, *sets), "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["tidepool"]
        top = tidepool_parser().parse_args(container["args"])
        assert top.command == "operator"
        args = operator_parser().parse_args(top.args)
        assert args.namespace == namespaces and args.all_namespaces == (not namespaces)
        assert args.liveness == "http://0.0.0.0:8080/healthz" and args.resync_seconds == 600
        assert args.leader_elect and args.leader_election_id == "tp-tidepool"
        assert args.leader_election_namespace == "tidepool-system"
        assert args.router_cluster_role == "tp-tidepool-router"  # the chart's ClusterRole (test_chart_rbac.py)
        assert container["args"].count(f"--log-level={args.log_level}") == 1
    (deployment,) = _by_kind(render(helm, "leaderElection.enabled=false", "replicaCount=1"), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert not operator_parser().parse_args(tidepool_parser().parse_args(container["args"]).args).leader_elect


def _rules(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {d["metadata"]["name"]: d["rules"] for d in _by_kind(docs, "ClusterRole")}


def test_leader_election_role_is_namespaced_and_names_its_lease(helm: str) -> None:
    docs = render(helm)
    (role,) = _by_kind(docs, "Role")
    (binding,) = _by_kind(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "tidepool-system"
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    by_verbs = {tuple(r["verbs"]): r for r in role["rules"]}
    assert set(by_verbs) == {("create",), ("get", "update")}
    assert all(r["apiGroups"] == ["coordination.k8s.io"] and r["resources"] == ["leases"] for r in role["rules"])
    assert by_verbs[("get", "update")]["resourceNames"] == ["tp-tidepool"]  # only its own Lease
    assert not _by_kind(render(helm, "leaderElection.enabled=false", "replicaCount=1"), "Role")


def test_rbac_is_least_privilege(helm: str) -> None:
    every = _rules(render(helm))  # the router's and the tenants' ClusterRoles: test_chart_rbac.py
    assert set(every) == {"tp-tidepool", "tp-tidepool-router", "tp-tidepool-edit", "tp-tidepool-view"}
    roles = {"tp-tidepool": every["tp-tidepool"]}
    granted: dict[tuple[str, str], set[str]] = {}
    for rules in roles.values():
        for rule in rules:
            if "resourceNames" in rule:  # the one exception: bind exactly the router's ClusterRole
                assert rule["verbs"] == ["bind"] and rule["resourceNames"] == ["tp-tidepool-router"], rule
                assert rule["resources"] == ["clusterroles"], rule
                continue
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no nonResourceURLs/resourceNames
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
            assert set(rule["verbs"]) <= ALLOWED_VERBS, rule  # never escalate, bind, impersonate
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    # Nothing cluster-scoped: kopf runs with scanning disabled (no CRD/namespace watch). Secrets: created (a
    # multi-node pool's control key) and read by name (spec.auth's Secret), never listed or watched.
    assert granted[("", "secrets")] == {"create", "get"}
    for forbidden in (
        "configmaps",  # no child is a ConfigMap
        "nodes",
        "namespaces",
        "customresourcedefinitions",
        "clusterroles",
        "clusterrolebindings",
        "mutatingwebhookconfigurations",
    ):
        assert not any(resource == forbidden for _, resource in granted), forbidden
    # What reconciliation needs (the operator's own tests prove it is enough).
    assert {"list", "watch", "patch"} <= granted[("tidepool.dev", "inferenceservices")]
    assert "patch" in granted[("tidepool.dev", "inferenceservices/status")]
    for child in (("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets")):
        assert {"create", "patch"} <= granted[child], child
    assert granted[("", "pods")] == {"list", "watch"}  # cached from a watch, never changed
    for child in (("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets")):
        assert {"list", "watch"} <= granted[child], child  # the informer caches
    assert "get" not in granted[("apps", "deployments")]  # never read one by one
    assert granted[("", "events")] == {"create", "get", "patch"}  # aggregated Events (operator/events.py)


def test_watch_namespaces_binds_the_namespaced_role_only_there(helm: str) -> None:
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    bindings = [b for b in _by_kind(docs, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"]["name"] == "tp-tidepool" for b in bindings)
    assert _by_kind(docs, "ClusterRoleBinding") == []


def test_rbac_and_service_account_can_be_brought_by_the_user(helm: str) -> None:
    docs = render(helm, "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=mine")
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service"]  # the operator and its metrics Service
    (deployment,) = _by_kind(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
    out = _helm(helm, "template", "tp", str(CHART), "--set", "serviceAccount.create=false", check=False)
    assert out.returncode != 0 and "serviceAccount.name is required" in out.stderr


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("replicaCount=2,leaderElection.enabled=false", "/replicaCount"),
        ("operator.logLevel=TRACE", "/operator/logLevel"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("replicas=1", "additional properties 'replicas' not allowed"),
        ("watchNamespaces={Team_A}", "/watchNamespaces/0"),
        ("metrics.serviceMonitor.interval=often", "/metrics/serviceMonitor/interval"),
        ("autoscaler.prometheusUrl=prometheus", "/autoscaler/prometheusUrl"),
        ("engineImage.repository=", "/engineImage/repository"),
    ],
)
def test_values_schema_refuses_bad_values(helm: str, value: str, complaint: str) -> None:
    out = _helm(helm, "template", "tp", str(CHART), "--set", value, check=False)
    assert out.returncode != 0, f"{value} was accepted"
    assert complaint in out.stderr, out.stderr


def test_keda_example_targets_the_scale_subresource_within_bounds() -> None:
    from tidepool.contract.metrics_names import NUM_REQUESTS_WAITING

    scaled = yaml.safe_load((REPO / "examples" / "keda-scaledobject.yaml").read_text())
    sample = yaml.safe_load((REPO / "examples" / "inferenceservice-disaggregated.yaml").read_text())
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == (sample["apiVersion"], sample["kind"])
    assert target["name"] == sample["metadata"]["name"]
    decode = sample["spec"]["pools"]["decode"]
    assert decode["minReplicas"] <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    assert scaled["spec"]["maxReplicaCount"] <= decode["maxReplicas"]
    assert sample["spec"]["autoscaling"]["mode"] == "advisory"  # Tidepool reports, KEDA acts
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and NUM_REQUESTS_WAITING in trigger["metadata"]["query"]


def _operator(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = _by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


COMBOS = (
    (),
    ("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kps"),
    ("metrics.enabled=false", "metrics.serviceMonitor.enabled=true"),
    ("dashboard.enabled=true", "dashboard.namespace=monitoring"),
    ("engineImage.repository=registry.local/engine", "engineImage.tag=v7", "image.tag=v8"),
    (
        "autoscaler.prometheusUrl=http://prom.monitoring:9090",
        "autoscaler.intervalSeconds=5",
        "operator.env[0].name=EXTRA",
        "operator.env[0].value=extra",
    ),
)


@pytest.mark.parametrize("sets", COMBOS, ids=lambda sets: ",".join(sets) or "defaults")
def test_lint_is_clean_for_every_values_combination(helm: str, sets: tuple[str, ...]) -> None:
    args = [a for item in sets for a in ("--set", item)]
    out = _helm(helm, "lint", str(CHART), "--strict", *args)
    assert "0 chart(s) failed" in out.stdout
    assert render(helm, *sets)  # and it renders


def test_operator_metrics_port_service_and_service_monitor(helm: str) -> None:
    docs = render(helm)
    container = _operator(docs)
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    assert _env(container)["TIDEPOOL_OPERATOR_METRICS_PORT"] == "9090"
    (service,) = _by_kind(docs, "Service")
    (deployment,) = _by_kind(docs, "Deployment")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    assert _by_kind(docs, "ServiceMonitor") == []  # off by default: its CRD may not exist

    docs = render(helm, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kps")
    (monitor,) = _by_kind(docs, "ServiceMonitor")
    (service,) = _by_kind(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True

    docs = render(helm, "metrics.enabled=false", "metrics.serviceMonitor.enabled=true")
    assert _by_kind(docs, "Service") == [] and _by_kind(docs, "ServiceMonitor") == []
    container = _operator(docs)
    assert _env(container)["TIDEPOOL_OPERATOR_METRICS_PORT"] == "0"  # the operator starts no endpoint
    assert all(p["name"] != "metrics" for p in container["ports"])


def test_alert_rules_parse_and_read_only_metrics_the_operator_exports(helm: str) -> None:
    assert _by_kind(render(helm), "PrometheusRule") == []  # off by default: its CRD may not exist
    docs = render(helm, "metrics.prometheusRule.enabled=true", "metrics.prometheusRule.labels.release=kps")
    (rule,) = _by_kind(docs, "PrometheusRule")
    (service,) = _by_kind(docs, "Service")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    alerts = [r["alert"] for r in rules]
    assert len(alerts) == len(set(alerts))
    assert {"TidepoolOperatorDown", "TidepoolOperatorNoLeader", "TidepoolInferenceServiceNotReady"} <= set(alerts)
    exported = operator_samples() | {"up"}  # `up` is Prometheus' own, per scrape target
    job = f'job="{service["metadata"]["name"]}"'  # the job a ServiceMonitor of that Service scrapes as
    for r in rules:
        names = selected(r["expr"])  # parses it: raises on what Prometheus would refuse
        assert names and names <= exported, (r["alert"], names - exported)
        assert job in r["expr"], r["alert"]  # only the operator's own series, not another job's of the same name
        assert re.fullmatch(r"[0-9]+[smh]", r["for"]) and r["labels"]["severity"] in {"warning", "critical"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    for r in rules:  # a quantile alert can fire only if the histogram has a finite bucket above its threshold
        quantile = re.search(r"histogram_quantile\(.*?(\w+)_bucket\{.*\)\s*>\s*([0-9.]+)$", r["expr"])
        if quantile:
            (histogram,) = [h for h in vars(metrics).values() if isinstance(h, Histogram) and h._name == quantile[1]]
            finite = [b for b in histogram._upper_bounds if b != float("inf")]
            assert max(finite) > float(quantile[2]), (r["alert"], finite)
    service_alerts = [r for r in rules if r["alert"].startswith("TidepoolInferenceService")]
    assert all("{{ $labels.namespace }}/{{ $labels.name }}" in r["annotations"]["summary"] for r in service_alerts)
    # Without leader election there is no Lease to alert on; the wait before "not Ready" alerts is a value.
    docs = render(helm, "metrics.prometheusRule.enabled=true", "leaderElection.enabled=false", "replicaCount=1",
                  "metrics.prometheusRule.notReadyFor=45m")  # fmt: skip
    rules = {r["alert"]: r for group in _by_kind(docs, "PrometheusRule")[0]["spec"]["groups"] for r in group["rules"]}
    assert "TidepoolOperatorNoLeader" not in rules and rules["TidepoolInferenceServiceNotReady"]["for"] == "45m"
    docs = render(helm, "metrics.enabled=false", "metrics.prometheusRule.enabled=true")
    assert _by_kind(docs, "PrometheusRule") == []  # nothing to alert on without the metrics


def test_autoscaler_environment_from_values(helm: str) -> None:
    from tidepool.operator.autoscaler import handlers

    assert not {"TIDEPOOL_PROMETHEUS_URL", "TIDEPOOL_AUTOSCALE_INTERVAL"} & set(_env(_operator(render(helm))))
    sets = (
        "autoscaler.prometheusUrl=http://prom.monitoring:9090",
        "autoscaler.intervalSeconds=5",
        "autoscaler.windowSeconds=120",
        "operator.env[0].name=EXTRA",
        "operator.env[0].value=extra",
    )
    env = _env(_operator(render(helm, *sets)))
    assert env["TIDEPOOL_PROMETHEUS_URL"] == "http://prom.monitoring:9090"
    assert (env["TIDEPOOL_AUTOSCALE_INTERVAL"], env["TIDEPOOL_AUTOSCALE_WINDOW"], env["EXTRA"]) == ("5", "120", "extra")
    source = Path(handlers.__file__).read_text()
    for name in ("TIDEPOOL_PROMETHEUS_URL", "TIDEPOOL_AUTOSCALE_INTERVAL", "TIDEPOOL_AUTOSCALE_WINDOW"):
        assert f'"{name}"' in source, name  # the variables the autoscaler really reads


def test_operator_and_engine_images_are_separate(helm: str) -> None:
    from tidepool.cli import build_parser as tidepool_parser
    from tidepool.operator.main import build_parser as operator_parser

    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]

    def images(*sets: str) -> tuple[str, str]:
        container = _operator(render(helm, *sets))
        args = operator_parser().parse_args(tidepool_parser().parse_args(container["args"]).args)
        return container["image"], args.engine_image

    assert images() == (
        f"ghcr.io/tidepool-dev/tidepool-operator:{app_version}",
        f"ghcr.io/tidepool-dev/tidepool:{app_version}",
    )
    got = images("engineImage.repository=registry.local/engine", "engineImage.tag=v7", "image.tag=v8")
    assert got == ("ghcr.io/tidepool-dev/tidepool-operator:v8", "registry.local/engine:v7")


def test_dashboard_config_map_only_when_enabled(helm: str) -> None:
    assert _by_kind(render(helm), "ConfigMap") == []
    (config_map,) = _by_kind(render(helm, "dashboard.enabled=true", "dashboard.namespace=monitoring"), "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "tidepool.json").read_text())
    assert json.loads(config_map["data"]["tidepool.json"]) == shipped
