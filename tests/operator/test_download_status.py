"""A failing model download, as the kubelet reports it in the pod status, becomes an actionable condition."""

from __future__ import annotations

from typing import Any

import pytest

from tidepool.operator.api import InferenceServiceStatus
from tidepool.operator.cache import pod_info
from tidepool.operator.observe import PoolObservation, downloads_in_progress, pod_problems
from tidepool.operator.pod_problems import DOWNLOAD_FAILED, container_problems
from tidepool.operator.status import Outcome, build_status

REASON_401 = "401 Unauthorized for org/m@main at https://huggingface.co: the token in Secret hf-token key HF_TOKEN is missing or invalid"  # noqa: E501


def terminated(code: int, message: str = "", reason: str = "Error") -> dict[str, Any]:
    return {"terminated": {"exitCode": code, "reason": reason, "message": message}}


def pod(init_statuses: list[dict[str, Any]], name: str = "svc-unified-abc") -> dict[str, Any]:
    labels = {"tidepool.dev/inferenceservice": "svc", "tidepool.dev/pool": "unified", "tidepool.dev/spec-hash": "h"}
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "Ready", "status": "False"}],
            "initContainerStatuses": init_statuses,
            "containerStatuses": [{"name": "engine", "state": {"waiting": {"reason": "PodInitializing"}}}],
        },
    }


@pytest.mark.parametrize(
    ("cs", "expected"),
    [
        (  # the download step exited: its termination message is the reason
            {"name": "fetch-model", "state": terminated(1, REASON_401)},
            [(DOWNLOAD_FAILED, f"model download failed: {REASON_401}")],
        ),
        (  # waiting to be restarted: the last run's message wins over the generic CrashLoopBackOff
            {
                "name": "fetch-model",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
                "lastState": terminated(1, "404 Not Found for org/m@v2\n at x: check spec.model.revision"),
            },
            [(DOWNLOAD_FAILED, "model download failed: 404 Not Found for org/m@v2 at x: check spec.model.revision")],
        ),
        (  # running again after a failure: still reported (the pod is not ready)
            {"name": "fetch-draft", "state": {"running": {}}, "lastState": terminated(137, "", "OOMKilled")},
            [(DOWNLOAD_FAILED, "model download failed: exit code 137 (OOMKilled)")],
        ),
        (
            {"name": "setup", "state": terminated(2, "boom")},
            [("InitContainerFailed", "init container setup failed: boom")],
        ),
        (
            {"name": "fetch-model", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}},
            [("ImagePullBackOff", "no such image")],
        ),
        ({"name": "fetch-model", "state": terminated(0, "", "Completed")}, []),  # a finished download is fine
        ({"name": "fetch-model", "state": {"running": {}}}, []),  # downloading
    ],
    ids=["terminated", "crashloop-last-state", "running-after-oom", "other-init", "image-pull", "done", "running"],
)
def test_container_problems(cs, expected):
    assert container_problems({"initContainerStatuses": [cs]}) == expected


def test_a_long_message_is_bounded():
    ((_, message),) = container_problems(
        {"initContainerStatuses": [{"name": "fetch-m", "state": terminated(1, "x" * 5000)}]}
    )
    assert len(message) <= 1100 and message.endswith("…")


def test_conditions_carry_the_download_failure():
    info = pod_info(pod([{"name": "fetch-model", "state": terminated(1, REASON_401)}]))
    assert not info.is_ready and info.problems == ((DOWNLOAD_FAILED, f"model download failed: {REASON_401}"),)
    obs = PoolObservation(name="unified", desired=1, replicas=1, ready=0, updated=1, updated_ready=0)
    status = build_status(
        InferenceServiceStatus(),
        generation=1,
        pools=[obs],
        router=None,
        outcome=Outcome(pod_problems=pod_problems([info])),
        url="http://svc-router.ns.svc",
        selector=None,
        scaled_pool="unified",
        now="2026-01-01T00:00:00Z",
    )
    ready, degraded = status.condition("Ready"), status.condition("Degraded")
    assert (ready.status, ready.reason) == ("False", DOWNLOAD_FAILED)
    assert ready.message.startswith(f"pod svc-unified-abc: model download failed: {REASON_401}; unified: 0/1 ready")
    assert (degraded.status, degraded.reason) == ("True", DOWNLOAD_FAILED)
    assert f"pod svc-unified-abc (unified): {DOWNLOAD_FAILED}: model download failed: {REASON_401}" in degraded.message
    assert status.condition("Progressing").reason == "Stalled"


def test_an_unchanged_failure_gives_an_equal_pod_summary():
    """The kubelet bumps restartCount and timestamps at each retry; the summary (what wakes the controller) stays."""
    first = pod([{"name": "fetch-model", "restartCount": 1, "state": terminated(1, REASON_401)}])
    again = pod(
        [
            {
                "name": "fetch-model",
                "restartCount": 2,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
                "lastState": terminated(1, REASON_401),
            }
        ]
    )
    assert pod_info(first) == pod_info(again)


def test_a_running_download_shows_in_progressing():
    started = "2026-01-01T00:00:00Z"
    info = pod_info(pod([{"name": "fetch-model", "state": {"running": {"startedAt": started}}}]))
    assert info.downloading_since == started and info.problems == ()
    obs = PoolObservation(name="unified", desired=1, replicas=1, ready=0, updated=1, updated_ready=0)
    status = build_status(
        InferenceServiceStatus(),
        generation=1,
        pools=[obs],
        router=None,
        outcome=Outcome(pod_problems=pod_problems([info]), downloading=downloads_in_progress([info])),
        url="http://svc-router.ns.svc",
        selector=None,
        scaled_pool="unified",
        now="2026-01-01T00:01:00Z",
    )
    progressing = status.condition("Progressing")
    assert progressing.status == "True"
    assert progressing.message.endswith(f"downloading the model: pod svc-unified-abc (since {started})")
    assert status.condition("Degraded").status == "False"
    # once the download is done, the pod summary no longer carries it
    done = pod_info(pod([{"name": "fetch-model", "state": terminated(0, "", "Completed")}]))
    assert done.downloading_since is None and downloads_in_progress([done]) == []
