"""Instruments of test_rp_autoscale.py: the host's load, a timeline of what the autoscaler, the
Deployment and the pods said, the engine pods' followed logs and exit codes, and a request held on
a pod across its SIGTERM.

Role: kept apart from the test so the test reads as its scenario. Invariants: every instrument
observes (kubectl, the API, HTTP) and never changes what it observes, except `hold_a_request_across_sigterm`,
which freezes and thaws the one engine it holds a request on; threads it starts stop on `close()`.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client, watch
from rp_support import (
    get_isvc,
    pod_is_ready,
    set_paused,
    sigterm_pending,
    wait_until,
)

NAME = "auto"
SELECTOR = f"tidepool.dev/inferenceservice={NAME},tidepool.dev/pool=unified"
HEAVY_CLIENTS = 16
LIGHT_CLIENTS = 1
QUEUE_DEPTH_TARGET = 4  # the API's default, written out: the invariants above are computed from it
DOWN_SECONDS = 30
HELD_TOKENS = 900  # the served maxModelLen is 1024
POLL_S = 2.0
SUCCESS_SAMPLE = re.compile(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.eE+-]+)$", re.MULTILINE)
DRAINING_LOG = re.compile(r"draining: (\d+) in-flight request")


class Load:
    """`clients` threads, each sending one completion after another through `url` until stopped; every
    answer is counted, and anything but a 200 is an error (a lost request)."""

    def __init__(self, url: str, clients: int, max_tokens: int, vary_prompt: bool) -> None:
        self.url, self.max_tokens, self.vary_prompt = url, max_tokens, vary_prompt
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.num_sent = self.num_ok = 0
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=300) as http:
            n = 0
            while not self.stop.is_set():
                # Distinct prompts spread over the replicas (the router hashes the prompt's prefix).
                prompt = f"Client {index} request {n}: count" if self.vary_prompt else "Count:"
                body = {"model": NAME, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                        "temperature": 0}  # fmt: skip
                n += 1
                with self.lock:
                    self.num_sent += 1
                start = time.monotonic()
                try:
                    resp = http.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.errors.append(repr(exc))
                    continue
                with self.lock:
                    if resp.status_code == 200:
                        self.num_ok += 1
                        self.latencies.append(time.monotonic() - start)
                    else:
                        self.errors.append(f"{resp.status_code} {resp.text[:200]}")

    def close(self) -> None:
        """Stop sending and wait for every request in flight to be answered."""
        self.stop.set()
        for t in self.threads:
            t.join(300)
        stuck = [t.name for t in self.threads if t.is_alive()]
        assert not stuck, f"load clients still waiting for an answer after 300 s: {stuck}"

    def summary(self) -> str:
        lat = sorted(self.latencies)
        median = f"{lat[len(lat) // 2]:.2f}s" if lat else "-"
        return f"sent {self.num_sent}, 200 OK {self.num_ok}, errors {len(self.errors)}, median latency {median}"


@dataclass(frozen=True)
class Row:
    """What the cluster showed at one poll (only changes are kept)."""

    t: float  # seconds since the timeline started
    desired: int | None  # status.autoscaling.pools.unified.desiredReplicas (the operator's decision)
    workload: int | None  # the pool Deployment's spec.replicas (the decision applied)
    live: int  # engine pods without a deletionTimestamp
    ready: int  # of those, Ready
    terminating: int  # engine pods with a deletionTimestamp
    pods: tuple[str, ...]  # names of the live ones

    def key(self) -> tuple[Any, ...]:
        return (self.desired, self.workload, self.live, self.ready, self.terminating, self.pods)


@dataclass
class Timeline:
    """Polls the InferenceService, the pool's Deployment and its pods; keeps each change and each decision."""

    cluster: Any
    namespace: str
    t0: float = field(default_factory=time.monotonic)
    rows: list[Row] = field(default_factory=list)
    decisions: list[tuple[float, int | None, str, dict[str, Any]]] = field(default_factory=list)
    last_auto: dict[str, Any] = field(default_factory=dict)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def observe(self) -> Row:
        isvc = get_isvc(self.cluster, self.namespace, NAME) or {}
        auto = (isvc.get("status") or {}).get("autoscaling") or {}
        pool = (auto.get("pools") or {}).get("unified") or {}
        out = self.cluster.kubectl("get", "deployments,pods", "-n", self.namespace, "-l", SELECTOR, "-o", "json")
        items = json.loads(out.stdout)["items"]
        deployments = [i for i in items if i["kind"] == "Deployment"]
        found = [i for i in items if i["kind"] == "Pod"]
        live = [p for p in found if not p["metadata"].get("deletionTimestamp")]
        row = Row(
            t=self.now(),
            desired=pool.get("desiredReplicas"),
            workload=deployments[0]["spec"].get("replicas") if deployments else None,
            live=len(live),
            ready=sum(pod_is_ready(p) for p in live),
            terminating=len(found) - len(live),
            pods=tuple(sorted(p["metadata"]["name"] for p in live)),
        )
        if not self.rows or self.rows[-1].key() != row.key():
            self.rows.append(row)
        decision = auto.get("lastDecision")
        if decision and (not self.decisions or self.decisions[-1][2] != decision):
            self.decisions.append((row.t, pool.get("desiredReplicas"), decision, pool.get("inputs") or {}))
        self.last_auto = auto
        return row

    def wait(self, predicate: Any, timeout_s: float, what: str) -> Row:
        return wait_until(
            lambda: (row := self.observe()) and predicate(row) and row, timeout_s, what, interval_s=POLL_S
        )

    def directions(self, name: str) -> list[int]:
        """The successive distinct values of one column (unknown values left out)."""
        out: list[int] = []
        for row in self.rows:
            value = getattr(row, name)
            if value is not None and (not out or out[-1] != value):
                out.append(value)
        return out

    def text(self) -> str:
        lines = ["t(s)    desired workload live ready terminating pods"]
        for r in self.rows:
            pods = " ".join(r.pods)
            lines.append(
                f"{r.t:6.1f}  {r.desired!s:>7} {r.workload!s:>8} {r.live:4} {r.ready:5} {r.terminating:11} {pods}"
            )
        lines.append("status.autoscaling decisions (t, desiredReplicas, lastDecision, inputs):")
        lines += [
            f"  {t:6.1f}  {d}  {text}  {json.dumps(inputs, sort_keys=True)}" for t, d, text, inputs in self.decisions
        ]
        return "\n".join(lines)


class FollowedLogs:
    """`kubectl logs -f` of each engine container into a file, each ending when its container exits."""

    def __init__(self, cluster: Any, namespace: str, pod_names: list[str], folder: Path) -> None:
        self.files = {name: folder / f"{name}.log" for name in pod_names}
        self.procs: dict[str, subprocess.Popen] = {}
        for name, path in self.files.items():
            cmd = [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "logs", "-f",
                   "-n", namespace, name, "-c", "engine"]  # fmt: skip
            with open(path, "wb") as fh:
                self.procs[name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)

    def wait_ended(self, name: str, timeout_s: float) -> bool:
        try:
            self.procs[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def text(self, name: str) -> str:
        return self.files[name].read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(15)


class PoolPods:
    """A watch on the pool's engine pods (a thread, resumed every few seconds so that `close` is prompt): it
    sets `removing` as soon as one pod gets a deletionTimestamp, and keeps each pod's last state, so the
    removed pod's final container status is known once it is gone."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.core = client.CoreV1Api(cluster.api_client())
        self.namespace = namespace
        self.last: dict[str, dict[str, Any]] = {}
        self.gone: set[str] = set()
        self.removed: dict[str, Any] | None = None
        self.removing = threading.Event()
        self.removing_seen_at = 0.0  # time.monotonic() when the watch saw the deletionTimestamp
        self.version = self._list()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _list(self) -> str:
        listed = self.core.api_client.sanitize_for_serialization(
            self.core.list_namespaced_pod(self.namespace, label_selector=SELECTOR)
        )
        for pod in listed["items"]:
            self._saw(pod)
        return listed["metadata"]["resourceVersion"]

    def _saw(self, pod: dict[str, Any]) -> None:
        self.last[pod["metadata"]["name"]] = pod
        if pod["metadata"].get("deletionTimestamp") and self.removed is None:
            self.removed, self.removing_seen_at = pod, time.monotonic()
            self.removing.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream = watch.Watch().stream(
                    self.core.list_namespaced_pod, self.namespace, label_selector=SELECTOR,
                    resource_version=self.version, timeout_seconds=5, _request_timeout=30,
                )  # fmt: skip
                for event in stream:
                    pod = event["raw_object"]
                    self.version = pod["metadata"]["resourceVersion"]
                    self._saw(pod)
                    if event["type"] == "DELETED":
                        self.gone.add(pod["metadata"]["name"])
            except Exception:  # an expired resourceVersion (410) or a dropped connection: list afresh
                if not self._stop.wait(1):
                    with contextlib.suppress(Exception):  # the API server busy: try again after a second
                        self.version = self._list()

    def exit_code(self, name: str) -> int | None:
        statuses = ((self.last.get(name) or {}).get("status") or {}).get("containerStatuses") or []
        for status in statuses:
            if status["name"] == "engine" and "terminated" in (status.get("state") or {}):
                return status["state"]["terminated"]["exitCode"]
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


@dataclass
class Held:
    """The request the test holds on the removed engine across its SIGTERM (see the module docstring)."""

    status: int = 0
    first_chunk_s: float | None = None  # seconds after the watch saw the pod's deletionTimestamp
    frozen_s: float | None = None  # idem
    completion_tokens: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    done: bool = False
    body: str = ""


def hold_a_request_across_sigterm(cluster: Any, pod: dict[str, Any], cid: str, pid: int, seen_at: float) -> Held:
    """Stream a long completion straight from the removed engine; freeze it after the first chunk until the
    kubelet's SIGTERM is pending, then read the rest (see the module docstring)."""
    held, t0 = Held(), seen_at
    body = {
        "model": NAME, "prompt": "Once upon a time", "max_tokens": HELD_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    url = f"http://{pod['status']['podIP']}:8000/v1/completions"
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", url, json=body, timeout=300) as resp:
        held.status = resp.status_code
        if resp.status_code != 200:
            held.body = resp.read().decode(errors="replace")[:500]
            return held
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                break
        held.first_chunk_s = round(time.monotonic() - t0, 2)
        set_paused(cluster, cid, True)
        held.frozen_s = round(time.monotonic() - t0, 2)
        try:
            wait_until(lambda: sigterm_pending(pid), 300, "the kubelet's SIGTERM to the removed engine", 0.5)
        finally:
            set_paused(cluster, cid, False)
        for line in lines:
            if line == "data: [DONE]":
                held.done = True
            elif line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    usage = [c["usage"] for c in chunks if c.get("usage")]
    held.completion_tokens = usage[-1]["completion_tokens"] if usage else None
    held.finish_reasons = [
        ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")
    ]
    return held


def since(auto: dict[str, Any], wall: float) -> float:
    """Seconds from `wall` (time.time()) to the decision's lastScaleTime (RFC 3339, whole seconds)."""
    scaled = datetime.strptime(auto["lastScaleTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    return round(scaled - wall, 1)


def requests_served(pod: dict[str, Any]) -> float:
    """Requests the engine finished, from its own `/metrics` (all finish reasons)."""
    resp = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=30)
    return sum(float(v) for v in SUCCESS_SAMPLE.findall(resp.text)) if resp.status_code == 200 else 0.0


def scaled_events(cluster: Any, namespace: str) -> list[str]:
    """The operator's `Scaled` Events on the InferenceService, oldest first."""
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.name={NAME},involvedObject.kind=InferenceService,reason=Scaled",
    )  # fmt: skip
    events = json.loads(out.stdout)["items"]
    events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [e["message"] for e in events]
