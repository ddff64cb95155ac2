"""What keeps a pod from starting, read from its status the way the kubelet reports it. Pure.

`container_problems(status)` returns (reason, message) pairs for the pod summary (cache.PodInfo):
- a download init container (named `fetch-*` by builders/sources.py) that exited non-zero, in
  `state.terminated` or, while it waits to be restarted (CrashLoopBackOff) or runs again,
  `lastState.terminated`: reason `ModelDownloadFailed`, message `model download failed: <its
  termination message>` (`tidepool download` writes one actionable line there; aws-cli's log tail
  arrives through FallbackToLogsOnError), or the exit code when the message is empty;
- any other init container that exited non-zero: `InitContainerFailed`;
- a container waiting for a reason in WAITING_PROBLEMS (image pull, crash loop, bad config).

`download_started(status)`: when a running download began (progress for the Progressing condition).

Invariants: at most one problem per container (a failed download's CrashLoopBackOff is reported as
the download's failure, which says what to fix); messages are one line and bounded, and stable while
the failure repeats (no restart counts or timestamps), so an unchanged failure does not re-trigger
the controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidepool.operator.builders.sources import INIT_PREFIX

WAITING_PROBLEMS = {"ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError"}
DOWNLOAD_FAILED = "ModelDownloadFailed"
INIT_FAILED = "InitContainerFailed"
MAX_MESSAGE = 1000


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 1] + "…"


def _failed_run(cs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The container's latest non-zero exit: the current state, or the last one while it restarts."""
    for key in ("state", "lastState"):
        terminated = (cs.get(key) or {}).get("terminated")
        if terminated and int(terminated.get("exitCode", 0)) != 0:
            return terminated
    return None


def _init_problem(cs: Mapping[str, Any]) -> tuple[str, str] | None:
    terminated = _failed_run(cs)
    if terminated is None:
        return None
    name = cs.get("name", "")
    detail = _one_line(terminated.get("message") or "")
    if not detail:
        detail = f"exit code {terminated.get('exitCode')}" + (
            f" ({terminated['reason']})" if terminated.get("reason") else ""
        )
    if name.startswith(INIT_PREFIX):
        return DOWNLOAD_FAILED, f"model download failed: {detail}"
    return INIT_FAILED, f"init container {name} failed: {detail}"


def download_started(status: Mapping[str, Any]) -> str | None:
    """When the pod's model download (a `fetch-*` init container) started, while it runs; else None."""
    for cs in status.get("initContainerStatuses") or []:
        running = (cs.get("state") or {}).get("running")
        if running is not None and cs.get("name", "").startswith(INIT_PREFIX):
            return running.get("startedAt") or "?"
    return None


def container_problems(status: Mapping[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for cs in status.get("initContainerStatuses") or []:
        problem = _init_problem(cs)
        if problem is None:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in WAITING_PROBLEMS:
                problem = (waiting["reason"], _one_line(waiting.get("message", "")))
        if problem:
            out.append(problem)
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_PROBLEMS:
            out.append((waiting["reason"], _one_line(waiting.get("message", ""))))
    return out
