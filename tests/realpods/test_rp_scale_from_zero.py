"""Scale from zero on real pods (issue #43): a request held by the router while its pool is at zero wakes the pool,
and the new pod serves it without compiling anything.

Scenario: an InferenceService with `autoscaling.scaleToZero` (idleSeconds at the API's minimum, 30: a spec field,
not a timing hack) and `minReplicas: 0` starts with one replica, goes idle, and the operator (production
defaults: autoscaler interval 15 s) scales it to zero. Once the router's own view shows no replica, the test
streams one completion through the router's Service: the router holds it, exports it as held, the autoscaler
sees that and scales the pool to one, and the request is answered by the new pod. (The operator gives a router
of a service that scales to zero a hold timeout that covers a pod start: builders/network.py.)

Reported, never asserted as times (`pytest -s` prints them, and every failure carries them): arrival -> first
streamed token, and where that went (the scale-up decision, the pod's creation, its container's start, Ready;
Kubernetes' timestamps have whole seconds), and the engine's own start-up phases log line.

Asserted: the request succeeds (200, a first token, `[DONE]`); the router held it (its held-requests gauge was
seen above zero, or it had no replica when the request arrived); and the new pod's engine log has contract/
cpu_ops.py's LOADED_LINE and no COMPILE_LINE: its CPU ops came prebuilt (the dev cluster prebuilds them on the
host and names the directory as an engine image does, e2e/controlplane/devcluster_addons.py). The first pod's
log is checked the same way.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from rp_autoscale_kit import NAME, POLL_S, Timeline, since
from rp_support import (
    Operator,
    apply,
    cpu_service,
    describe,
    engine_pods,
    install_crd,
    operator_identity,
    service_url,
    wait_ready,
    wait_until,
)

from tidepool.contract.cpu_ops import COMPILE_LINE, LOADED_LINE

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]

IDLE_SECONDS = 30  # the API's minimum
HELD_SAMPLE = re.compile(r'^tidepool_router_held_requests\{[^}]*pool="unified"[^}]*\}\s+([0-9.eE+-]+)$', re.M)


def _pod_log(cluster: Any, namespace: str, pod: str) -> str:
    return cluster.kubectl("logs", "-n", namespace, pod, "-c", "engine", check=False, timeout=120).stdout


def _assert_prebuilt(log: str, pod: str) -> None:
    compiled = [line for line in log.splitlines() if COMPILE_LINE in line]
    assert not compiled, f"{pod} compiled its CPU ops at start: {compiled}"
    loaded = [line for line in log.splitlines() if LOADED_LINE in line]
    assert len(loaded) == 1, f"{pod} did not log {LOADED_LINE!r} once:\n{log[-4000:]}"


def _router_replicas(router: str) -> list[dict[str, Any]] | None:
    try:
        return httpx.get(f"{router}/debug/replicas", timeout=10).json().get("unified", [])
    except (httpx.HTTPError, ValueError):
        return None


def _held(router: str) -> float:
    try:
        text = httpx.get(f"{router}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    return max((float(v) for v in HELD_SAMPLE.findall(text)), default=0.0)


def _wall(stamp: str | None) -> float | None:
    """An RFC 3339 timestamp of the API (whole seconds) as time.time()."""
    if not stamp:
        return None
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _pod_phases(pod: dict[str, Any], sent_wall: float) -> dict[str, float | None]:
    """Seconds from the request's arrival to the pod's creation, container start and Ready."""
    status = pod.get("status") or {}
    engine = next((c for c in status.get("containerStatuses") or [] if c["name"] == "engine"), {})
    ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    stamps = {
        "pod created": pod["metadata"].get("creationTimestamp"),
        "engine container started": ((engine.get("state") or {}).get("running") or {}).get("startedAt"),
        "pod Ready": ready.get("lastTransitionTime") if ready.get("status") == "True" else None,
    }
    return {k: None if (w := _wall(v)) is None else round(w - sent_wall, 1) for k, v in stamps.items()}


class _Stream:
    """One streamed completion through the router: when it was sent, its first token, its end."""

    def __init__(self, router: str) -> None:
        self.status: int | None = None
        self.first_token_s: float | None = None
        self.total_s: float | None = None
        self.text = ""
        self.done = False
        self.body = ""
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True}
        self.sent_wall, start = time.time(), time.monotonic()
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=600) as resp:
            self.status = resp.status_code
            if resp.status_code != 200:
                self.body = resp.read().decode(errors="replace")[:500]
                return
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    self.done = True
                    break
                chunk = json.loads(data)
                text = "".join(c.get("text", "") for c in chunk.get("choices", []))
                if text and self.first_token_s is None:
                    self.first_token_s = round(time.monotonic() - start, 2)
                self.text += text
        self.total_s = round(time.monotonic() - start, 2)


def test_a_request_held_at_zero_wakes_the_pool_and_the_new_pod_serves_it_without_compiling(
    real_cluster, rp_namespace, tmp_path
):
    ns = rp_namespace
    install_crd(real_cluster)
    identity = operator_identity(real_cluster, tmp_path)
    op = Operator(identity.kubeconfig, [ns], tmp_path / "operator.log")
    timeline = Timeline(real_cluster, ns)
    numbers: dict[str, Any] = {}

    def report() -> str:
        return "\n".join([*(f"{k}: {v}" for k, v in numbers.items()), timeline.text()])

    try:
        autoscaling = {"enabled": True, "scaleToZero": {"enabled": True, "idleSeconds": IDLE_SECONDS}}
        obj = cpu_service(
            NAME, real_cluster.dev_image, autoscaling=autoscaling,
            pools={"unified": {"replicas": 1, "minReplicas": 0, "maxReplicas": 1}},
        )  # fmt: skip
        out = apply(real_cluster, ns, obj)
        assert out.returncode == 0, out.stderr
        wait_ready(real_cluster, ns, NAME)
        (first,) = engine_pods(real_cluster, ns, NAME)
        first_name = first["metadata"]["name"]
        _assert_prebuilt(_pod_log(real_cluster, ns, first_name), first_name)
        router = service_url(real_cluster, ns, f"{NAME}-router")

        try:
            # At zero: the Deployment scaled to 0, every engine pod gone, and the router's own view empty.
            t_idle = timeline.now()
            timeline.wait(lambda r: r.workload == 0 and r.live == 0 and r.terminating == 0, 600, "scale to zero")
            numbers["at zero after the first pod was Ready (s)"] = round(timeline.now() - t_idle, 1)
            wait_until(lambda: _router_replicas(router) == [], 120, "the router to see no replica", POLL_S)

            # A request arrives: held by the router, it wakes the pool; stream it and time its first token.
            result: list[_Stream | BaseException] = []

            def send() -> None:
                try:
                    result.append(_Stream(router))
                except BaseException as exc:  # reported by the test thread
                    result.append(exc)

            sender = threading.Thread(target=send, name="scale-from-zero-request")
            sender.start()
            seen_held = 0.0
            while sender.is_alive():
                seen_held = max(seen_held, _held(router))
                timeline.observe()
                sender.join(POLL_S)
            (outcome,) = result
            if isinstance(outcome, BaseException):
                raise AssertionError(f"the request failed: {outcome!r}")
            stream = outcome
            numbers["request: status, first token (s), total (s), [DONE], text"] = (
                f"{stream.status} {stream.first_token_s} {stream.total_s} {stream.done} {stream.text!r} {stream.body}"
            )
            numbers["router held requests (highest seen)"] = seen_held
            row = timeline.wait(lambda r: r.live == 1 and r.ready == 1, 120, "the new engine pod Ready")
            (new,) = [p for p in engine_pods(real_cluster, ns, NAME) if p["metadata"]["name"] in row.pods]
            new_name = new["metadata"]["name"]
            numbers["scale-up decided after arrival (s, lastScaleTime)"] = since(timeline.last_auto, stream.sent_wall)
            numbers.update({f"{k} after arrival (s)": v for k, v in _pod_phases(new, stream.sent_wall).items()})
            new_log = _pod_log(real_cluster, ns, new_name)
            phases = [line for line in new_log.splitlines() if "start-up phases" in line]
            numbers["engine start-up phases"] = phases[-1].split("start-up phases", 1)[1] if phases else None
            ops_lines = [line for line in new_log.splitlines() if LOADED_LINE in line or COMPILE_LINE in line]
            numbers["new pod's CPU ops"] = ops_lines
            numbers["ARRIVAL -> FIRST TOKEN (s)"] = stream.first_token_s
        except (AssertionError, httpx.HTTPError) as exc:
            details = f"{report()}\noperator errors:\n{op.errors()}\n{describe(real_cluster, ns)}"
            raise AssertionError(f"{exc}\n{details}") from None
        print(f"\n--- scale from zero on real pods ---\n{report()}")

        assert stream.status == 200 and stream.done and stream.first_token_s is not None, report()
        assert new_name != first_name, report()
        # The pool woke for the held request (the decision says why), from zero to one.
        assert seen_held >= 1, report()
        assert any("router holds requests" in text for _, _, text, _ in timeline.decisions), report()
        assert timeline.directions("workload")[-2:] == [0, 1], report()
        _assert_prebuilt(new_log, new_name)
    finally:
        op.stop()
    assert not op.forbidden_lines(), op.forbidden_lines()[:10]
