"""Pinned model revisions on the real control plane (issue #39 item 7), with the operator as the chart's
ServiceAccount and `--resolve-revisions`.

A fake Hub on 127.0.0.1 (HF_ENDPOINT in the model's credentials Secret, as a mirror would be given) whose `main`
moves. A two-replica service on `main` with per-pod caches: the real `tidepool download` runs each pod's init
container as rendered (its args, its env), the first, then `main` moves, then the second. Both fetch the same
commit, the one `status.model.resolvedRevision` records. (Before pinning, each pod resolved `main` itself when it
started: the second pod fetched the newer commit.) A spec change then resolves again: the pods' new template
carries the new head, and status records it for the new generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from operator_kit import TIDEPOOL, OperatorProcess, get_isvc, load_example, pods, restricted_namespace, wait_until

pytestmark = [pytest.mark.controlplane, pytest.mark.timeout(300)]
REPO = "org/moving"
COMMIT_A, COMMIT_B, COMMIT_C = ("a" * 40, "b" * 40, "c" * 40)
SECRET = "hub-mirror"


def config_of(sha: str) -> bytes:
    """The one file of commit `sha`: it names the commit, so a download shows which commit it fetched."""
    return json.dumps({"commit": sha}).encode()


class MovingHub:
    """The Hub's two calls for one repository whose branch `main` points where `heads["main"]` says."""

    def __init__(self) -> None:
        self.heads = {"main": COMMIT_A}
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                info = f"/api/models/{REPO}/revision/"
                if self.path.startswith(info):
                    rev = self.path.removeprefix(info).split("?")[0]
                    with hub.lock:
                        sha = hub.heads.get(rev, rev)
                    siblings = [{"rfilename": "config.json", "size": len(config_of(sha))}]
                    body = {"id": REPO, "sha": sha, "siblings": siblings}
                    self._send(200, json.dumps(body).encode())
                elif self.path.startswith(f"/{REPO}/resolve/") and self.path.endswith("/config.json"):
                    sha = self.path.removeprefix(f"/{REPO}/resolve/").split("/")[0]
                    self._send(200, config_of(sha))
                else:
                    self._send(404, b"{}")

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def move(self, branch: str, sha: str) -> None:
        with self.lock:
            self.heads[branch] = sha


@pytest.fixture
def hub() -> Iterator[MovingHub]:
    moving = MovingHub()
    moving.thread.start()
    yield moving
    moving.server.shutdown()
    moving.server.server_close()
    moving.thread.join(10)


@pytest.fixture
def resolving_operator(control_plane, cp_namespace, identity, hub, tmp_path) -> Iterator[OperatorProcess]:
    """The Secret naming the fake Hub, then the operator with --resolve-revisions; fails on any RBAC refusal."""
    restricted_namespace(control_plane, cp_namespace)
    secret = {"metadata": {"name": SECRET}, "stringData": {"HF_ENDPOINT": hub.endpoint}, "type": "Opaque"}
    client.CoreV1Api(control_plane.api_client()).create_namespaced_secret(cp_namespace, secret)
    op = OperatorProcess(identity.kubeconfig, [cp_namespace], tmp_path / "operator.log", ("--resolve-revisions",))
    op.start()
    yield op
    op.stop()
    forbidden = op.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


def service(name: str) -> dict[str, Any]:
    obj = load_example("inferenceservice-unified.yaml")
    obj["metadata"]["name"] = name
    obj["spec"]["model"] = {"uri": f"hf://{REPO}", "credentials": {"secretName": SECRET}}  # revision: main
    obj["spec"].pop("modelCache", None)  # per-pod emptyDir caches: each pod downloads on its own
    obj["spec"].pop("replicas", None)
    obj["spec"]["pools"]["unified"].update(replicas=2, minReplicas=2)
    obj["spec"]["autoscaling"] = {"enabled": False}
    return obj


def fetch_init(pod: dict[str, Any]) -> dict[str, Any]:
    (init,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "fetch-model"]
    return init


def run_download(pod: dict[str, Any], hub: MovingHub, dest: Path) -> str:
    """The pod's download init as rendered (its args; the Secret's HF_ENDPOINT as its env): the commit fetched."""
    args = list(fetch_init(pod)["args"])
    args[args.index("--dest") + 1] = str(dest)
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    proc = subprocess.run(
        [str(TIDEPOOL), "download", *args, "--retries", "0", "--termination-log", str(dest.parent / "reason")],
        cwd="/tmp", env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads((dest / "config.json").read_text())["commit"]


def engine_pods(cluster, namespace: str, name: str, commit: str) -> list[dict[str, Any]] | None:
    """The service's two engine pods once both carry `commit` in their download init (else None)."""
    found = pods(cluster, namespace, f"tidepool.dev/inferenceservice={name},tidepool.dev/pool=unified")
    current = [p for p in found if commit in fetch_init(p)["args"] and not p["metadata"].get("deletionTimestamp")]
    return current if len(current) == 2 else None


def resolved(cluster, namespace: str, name: str) -> dict[str, Any] | None:
    obj = get_isvc(cluster, namespace, name) or {}
    model = (obj.get("status") or {}).get("model") or {}
    return model if model.get("resolvedRevision") else None


def test_every_replica_of_a_generation_downloads_the_one_resolved_commit(
    control_plane, cp_namespace, hub, resolving_operator, tmp_path
):
    ns, name = cp_namespace, "pinned"
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(service(name)))
    model = wait_until(lambda: resolved(control_plane, ns, name), 120, "status.model.resolvedRevision")
    assert model["resolvedRevision"] == COMMIT_A
    assert model["revision"] == "main" and model["repo"] == REPO
    first, second = wait_until(lambda: engine_pods(control_plane, ns, name, COMMIT_A), 120, "two pods on A")
    for pod in (first, second):
        init = fetch_init(pod)
        assert init["args"][init["args"].index("--revision") + 1] == COMMIT_A
        assert init["args"][init["args"].index("--dest") + 1].endswith(f"/{COMMIT_A}")  # the cache path names it

    got_first = run_download(first, hub, tmp_path / "pod-1" / "models")
    hub.move("main", COMMIT_B)  # upstream moves between the two pods' starts
    got_second = run_download(second, hub, tmp_path / "pod-2" / "models")
    assert got_first == got_second == COMMIT_A == resolved(control_plane, ns, name)["resolvedRevision"]

    # A new generation (a spec change) resolves again: its pods download the head of main at that time.
    hub.move("main", COMMIT_C)
    patch = {"spec": {"engine": {"maxModelLen": 1024}}}
    custom = client.CustomObjectsApi(control_plane.api_client())
    custom.patch_namespaced_custom_object("tidepool.dev", "v1alpha1", ns, "inferenceservices", name, patch)
    generation = (get_isvc(control_plane, ns, name) or {})["metadata"]["generation"]
    model = wait_until(
        lambda: (m := resolved(control_plane, ns, name)) and m["generation"] == generation and m, 120, "re-resolved"
    )
    assert model["resolvedRevision"] == COMMIT_C
    wait_until(lambda: engine_pods(control_plane, ns, name, COMMIT_C), 120, "two pods on C")
