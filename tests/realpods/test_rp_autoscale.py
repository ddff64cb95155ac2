"""The autoscaler on real pods: it scrapes the engines' real `/metrics` (pod IPs from EndpointSlices) and
scales the pool up under a load the test sends through the router's Service, then back down once that
load stops, the removed engine draining what it holds, without one request lost.

Role: the one end-to-end check that the operator's own scrape-decide-act loop moves a pool both ways on
real engines. The numbers (times to scale, requests served, the decisions and their inputs) are the
test's output (printed; `pytest -s` shows them, and every failed assertion carries them); the
assertions are on direction and on no request lost, never on how fast this machine is.

Invariants the test relies on (the arithmetic of operator/autoscaler/policy.py):
- The engine runs one sequence at a time (`maxNumSeqs: 1`), so HEAVY_CLIENTS concurrent requests queue
  HEAVY_CLIENTS - 1 deep on one replica whatever the machine's speed; that queue's utilization over the
  target's ((15/16) / (4/5)) is above the tolerance band, so the pool grows to its maximum, 2.
- The light load during the scale-down is one client sending one request after another: it never
  queues (a request waits only until the engine's next step), and a 100-token request holds about a
  tenth of a replica's KV cache (sized for maxModelLen 1024), far below kvCacheTarget 0.8, so every
  signal says 1 replica and the light load never holds the pool at 2. (Even a request caught waiting
  at a scrape is 0.5 per replica, a utilization ratio of (1/3) / (4/5) < 1/2: still 1 replica.)
- `stabilization.downSeconds` is the user's (short here so the test does not wait the API's 5 min
  default); the operator runs with its production defaults (autoscaler interval 15 s, metrics window
  60 s). Every wait is for an observed state with a bound of minutes.
- The removed pod drains. Router traffic leaves it during its preStop (it stays out of the Service from
  its deletion on), so the test also holds one request of its own on it across its SIGTERM, as
  test_rp_serve.py does for a manual scale-down: sent straight to the pod as soon as a watch sees its
  deletionTimestamp (preStop keeps the engine serving for 5 s, many times what sending takes), its
  engine frozen after the first streamed chunk (900 tokens take many times a process start) and
  thawed once the kubelet's SIGTERM is pending. Its own log must then say it drained that request
  ("draining: N in-flight request(s)", N >= 1, no abort), the request ends with all its tokens, and
  the pod exits 0. The autoscaler never sees that request: it scrapes only pods not terminating.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from rp_autoscale_kit import (
    DOWN_SECONDS,
    DRAINING_LOG,
    HEAVY_CLIENTS,
    HELD_TOKENS,
    LIGHT_CLIENTS,
    NAME,
    POLL_S,
    QUEUE_DEPTH_TARGET,
    FollowedLogs,
    Load,
    PoolPods,
    Timeline,
    hold_a_request_across_sigterm,
    requests_served,
    scaled_events,
    since,
)
from rp_support import (
    Operator,
    apply,
    container_pid,
    cpu_service,
    describe,
    engine_pods,
    install_crd,
    operator_identity,
    service_url,
    wait_ready,
    wait_until,
)

pytestmark = [pytest.mark.realpods, pytest.mark.timeout(900)]


def test_autoscaler_scales_a_real_pool_up_under_load_and_back_down_without_losing_a_request(
    real_cluster, rp_namespace, tmp_path
):
    ns = rp_namespace
    install_crd(real_cluster)
    identity = operator_identity(real_cluster, tmp_path)
    op = Operator(identity.kubeconfig, [ns], tmp_path / "operator.log")
    timeline = Timeline(real_cluster, ns)
    numbers: dict[str, Any] = {}
    heavy: Load | None = None
    light: Load | None = None
    logs: FollowedLogs | None = None
    pool_pods: PoolPods | None = None

    def report() -> str:
        lines = [f"{k}: {v}" for k, v in numbers.items()]
        lines += [
            f"heavy load: {heavy.summary() if heavy else '-'}",
            f"light load: {light.summary() if light else '-'}",
        ]
        return "\n".join([*lines, timeline.text()])

    try:
        autoscaling = {
            "enabled": True, "queueDepthTarget": QUEUE_DEPTH_TARGET,
            "stabilization": {"upSeconds": 0, "downSeconds": DOWN_SECONDS},
        }  # fmt: skip
        obj = cpu_service(
            NAME, real_cluster.dev_image, engine={"maxNumSeqs": 1}, autoscaling=autoscaling,
            pools={"unified": {"replicas": 1, "minReplicas": 1, "maxReplicas": 2}},
        )  # fmt: skip
        out = apply(real_cluster, ns, obj)
        assert out.returncode == 0, out.stderr
        wait_ready(real_cluster, ns, NAME)
        first = timeline.observe()
        assert first.live == 1 and first.ready == 1, timeline.text()
        router = service_url(real_cluster, ns, f"{NAME}-router")

        try:
            # Up: a queue on the one replica, until the operator has added the second and it serves.
            heavy = Load(router, HEAVY_CLIENTS, max_tokens=200, vary_prompt=False)
            t_up, wall_up = timeline.now(), time.time()
            row = timeline.wait(lambda r: r.desired == 2, 600, "the autoscaler to ask for 2 replicas")
            up_auto = dict(timeline.last_auto)
            numbers["scale-up decided after load start (s, status.autoscaling.lastScaleTime)"] = since(up_auto, wall_up)
            row = timeline.wait(lambda r: r.live == 2 and r.ready == 2, 600, "the second engine pod Ready")
            numbers["second replica Ready after load start (s)"] = round(row.t - t_up, 1)
            both = {p["metadata"]["name"]: p for p in engine_pods(real_cluster, ns, NAME)}
            (new_name,) = set(both) - set(first.pods)
            served = wait_until(lambda: requests_served(both[new_name]), 600, f"{new_name} to serve", POLL_S)
            numbers["second replica served a request after load start (s)"] = round(timeline.now() - t_up, 1)
            numbers["requests served by the second replica by then"] = int(served)
            containers = {name: container_pid(real_cluster, pod) for name, pod in both.items()}
            logs = FollowedLogs(real_cluster, ns, list(both), tmp_path)
            pool_pods = PoolPods(real_cluster, ns)

            # Down: the load stops; a light client keeps requests in flight through the scale-down.
            heavy.stop.set()
            light = Load(router, LIGHT_CLIENTS, max_tokens=100, vary_prompt=True)
            heavy.close()
            t_down, wall_down = timeline.now(), time.time()
            while not pool_pods.removing.wait(POLL_S):  # an explicit event: the watch sees the deletion at once
                timeline.observe()
                assert timeline.now() - t_down < 600, "no engine pod removed 600 s after the load stopped"
            numbers["engine pod removed after load stop (s)"] = round(timeline.now() - t_down, 1)
            assert pool_pods.removed is not None
            removed = pool_pods.removed["metadata"]["name"]
            held = hold_a_request_across_sigterm(
                real_cluster, pool_pods.removed, *containers[removed], pool_pods.removing_seen_at
            )
            row = timeline.wait(lambda r: r.desired == 1, 120, "status.autoscaling to show 1 replica")
            down_auto = dict(timeline.last_auto)
            numbers["scale-down decided after load stop (s, status.autoscaling.lastScaleTime)"] = since(
                down_auto, wall_down
            )
            row = timeline.wait(
                lambda r: r.workload == 1 and r.live == 1 and r.ready == 1 and r.terminating == 0, 600,
                "the removed engine pod gone, 1 Ready",
            )  # fmt: skip
            numbers["removed pod gone after load stop (s)"] = round(row.t - t_down, 1)
            light.close()
            wait_until(lambda: removed in pool_pods.gone, 120, f"the watch to see {removed} deleted")
        except (AssertionError, httpx.HTTPError) as exc:
            raise AssertionError(
                f"{exc}\n{report()}\noperator errors:\n{op.errors()}\n{describe(real_cluster, ns)}"
            ) from None
        finally:
            for load in (heavy, light):
                if load is not None:
                    load.stop.set()
            for load in (heavy, light):
                if load is not None:
                    load.close()

        assert logs is not None and pool_pods is not None
        assert logs.wait_ended(removed, 120), f"the log of {removed} did not end with its container\n{report()}"
        removed_log = logs.text(removed)
        drained = [int(n) for n in DRAINING_LOG.findall(removed_log)]
        events = scaled_events(real_cluster, ns)
        numbers["removed pod"] = f"{removed} ({'the new one' if removed == new_name else 'the first one'})"
        numbers["held request: first chunk / frozen after the deletion was seen (s)"] = (
            f"{held.first_chunk_s} / {held.frozen_s}"
        )
        numbers["held request: status, tokens, finish, [DONE]"] = (
            f"{held.status} {held.completion_tokens} {held.finish_reasons} {held.done} {held.body}"
        )
        numbers["in flight when the removed engine's drain began"] = drained[-1] if drained else None
        numbers["removed engine's exit code"] = pool_pods.exit_code(removed)
        numbers["Scaled events"] = events
        print(f"\n--- autoscaling on real pods ---\n{report()}")

        # Direction, as the operator decided it, as the workload applied it, and as pods.
        assert timeline.directions("desired") == [1, 2, 1], report()
        assert timeline.directions("workload") == [1, 2, 1], report()
        assert timeline.directions("live") == [1, 2, 1], report()
        assert [m for m in events if "unified 1->2" in m] and [m for m in events if "unified 2->1" in m], report()
        # The decisions came from the real engines' /metrics: a real queue up, none down, every pod answering.
        up_inputs = up_auto["pools"]["unified"]["inputs"]
        assert up_inputs["podsScraped"] >= 1 and up_inputs["queueDepth"] > 1, report()
        down_inputs = down_auto["pools"]["unified"]["inputs"]
        # podsScraped is 2 at the decision itself, but status is polled: on a loaded machine the poll can read the
        # next tick, where the pod being removed (terminating) is no longer scraped. Either way a real engine answered.
        assert down_inputs["podsScraped"] >= 1 and down_inputs.get("queueDepth", 0) <= 1, report()
        assert up_auto["mode"] == "active" and down_auto["lastScaleTime"] > up_auto["lastScaleTime"], report()
        # No request lost: every one the load sent, up and down, was answered 200.
        assert heavy is not None and light is not None
        assert heavy.num_ok == heavy.num_sent > 0 and not heavy.errors, f"{heavy.errors[:5]}\n{report()}"
        assert light.num_ok == light.num_sent > 0 and not light.errors, f"{light.errors[:5]}\n{report()}"
        # The removed engine drained the request it held at its SIGTERM, aborted nothing, and exited 0. (A 503
        # `draining` here would mean the request reached the engine after its SIGTERM, > 5 s after the deletion.)
        assert held.status == 200 and held.done, report()
        assert held.completion_tokens == HELD_TOKENS and held.finish_reasons == ["length"], report()
        assert drained and drained[-1] >= 1, f"the drain found no request in flight\n{removed_log[-3000:]}\n{report()}"
        assert "aborting" not in removed_log, f"{removed} aborted requests:\n{removed_log[-3000:]}\n{report()}"
        assert pool_pods.exit_code(removed) == 0, f"{pool_pods.last.get(removed)}\n{report()}"
    finally:
        for closing in (logs, pool_pods):
            if closing is not None:
                closing.close()
        op.stop()
    assert not op.forbidden_lines(), op.forbidden_lines()[:10]
